#!/usr/bin/env python3
"""Load on an OpenAI-compatible server: throughput and latency at several
numbers of concurrent clients.

Each client sends streamed `/v1/completions` requests back to back, each a
prompt from PROMPTS with exactly MAX_TOKENS new tokens (`ignore_eos`), and
records the time to the first token and to the end. For every concurrency
level it prints completion tokens/s over the whole level, requests/s, and
p50/p95 of both latencies, then the throughput ratio against one client.

Standard library only. Usage:
    load.py URL MODEL PROMPTS.jsonl [--clients 1,8,32] [--max-tokens 64]
            [--requests-per-client 8] [--temperature 1.0] [--json OUT.json]
"""

import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse


def percentile(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    i = (len(values) - 1) * q
    lo, hi = int(i), min(int(i) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (i - lo)


def one_request(host, port, body):
    """Sends one streamed request; returns (ttft_s, total_s, tokens)."""
    conn = http.client.HTTPConnection(host, port, timeout=600)
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first = None
    tokens = 0
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        elif first is None and any(c.get("text") for c in chunk["choices"]):
            first = time.perf_counter() - started
    conn.close()
    return first or float("nan"), time.perf_counter() - started, tokens


def run_level(url, model, prompts, clients, per_client, max_tokens, temperature):
    parsed = urllib.parse.urlparse(url)
    results, errors = [], []
    lock = threading.Lock()

    def client(c):
        for r in range(per_client):
            prompt = prompts[(c * per_client + r) % len(prompts)]
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                    "seed": c * 1000 + r}
            try:
                out = one_request(parsed.hostname, parsed.port, body)
                with lock:
                    results.append(out)
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                with lock:
                    errors.append(str(e))

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    tokens = sum(r[2] for r in results)
    return {
        "clients": clients,
        "requests": len(results),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "requests_per_s": len(results) / wall,
        "latency_p50_s": percentile([r[1] for r in results], 0.5),
        "latency_p95_s": percentile([r[1] for r in results], 0.95),
        "ttft_p50_s": percentile([r[0] for r in results], 0.5),
        "ttft_p95_s": percentile([r[0] for r in results], 0.95),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url")
    ap.add_argument("model")
    ap.add_argument("prompts", help="JSONL rows with a text `prompt`")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--requests-per-client", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    with open(args.prompts) as f:
        prompts = [p for p in (json.loads(l).get("prompt") for l in f if l.strip()) if isinstance(p, str)]
    if not prompts:
        raise SystemExit(f"{args.prompts}: no rows with a text prompt")

    # One untimed request: the server's first request pays for warm-up.
    run_level(args.url, args.model, prompts, 1, 1, args.max_tokens, args.temperature)
    levels = []
    for clients in [int(c) for c in args.clients.split(",")]:
        level = run_level(args.url, args.model, prompts, clients, args.requests_per_client, args.max_tokens,
                          args.temperature)
        levels.append(level)
        print(f"{clients:>3} clients: {level['requests']} requests ({level['errors']} failed) in {level['wall_s']:.1f} s",
              flush=True)
        if level["first_error"]:
            print(f"    first error: {level['first_error']}")
    base = levels[0]["tokens_per_s"]
    print()
    print("| clients | requests | failed | tokens/s | x one client | requests/s | latency p50 | latency p95 | first token p50 | first token p95 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for l in levels:
        print(f"| {l['clients']} | {l['requests']} | {l['errors']} | {l['tokens_per_s']:.0f} | {l['tokens_per_s'] / base:.2f}x "
              f"| {l['requests_per_s']:.2f} | {l['latency_p50_s']:.2f} s | {l['latency_p95_s']:.2f} s "
              f"| {l['ttft_p50_s'] * 1000:.0f} ms | {l['ttft_p95_s'] * 1000:.0f} ms |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(levels, f, indent=2)


if __name__ == "__main__":
    main()
