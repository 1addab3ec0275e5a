#!/usr/bin/env bash
# rloo generate vs transformers generate on the same tiny Pythia-shaped model,
# same machine, same thread count. Alternates RUNS runs of each side and prints
# tokens/s per run, the medians and the ratio of medians (rloo / transformers).
#
# Env: BENCH_PY   python with torch + transformers (default bench/.venv/bin/python)
#      MODEL_DIR  model directory (default bench/.cache/pythia-bench, made if missing)
#      RUNS       runs of each side (default 5)
#      THREADS    threads for both sides (default 2)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BENCH_PY="${BENCH_PY:-$ROOT/bench/.venv/bin/python}"
MODEL_DIR="${MODEL_DIR:-$ROOT/bench/.cache/pythia-bench}"
RUNS="${RUNS:-5}"
THREADS="${THREADS:-2}"
PROMPTS=32 K=4 NEW=64 BATCH=128

export RAYON_NUM_THREADS="$THREADS" OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS"
export TOKENIZERS_PARALLELISM=false

if [[ ! -x "$BENCH_PY" ]]; then
    echo "no python at $BENCH_PY: run bench/generate/setup.sh or set BENCH_PY" >&2
    exit 1
fi

echo "== building rloo (release)" >&2
(cd "$ROOT" && cargo build --release)
RLOO="${CARGO_TARGET_DIR:-$ROOT/target}/release/rloo"

if [[ ! -f "$MODEL_DIR/model.safetensors" || ! -f "$MODEL_DIR/prompts.jsonl" ]]; then
    echo "== making model in $MODEL_DIR" >&2
    "$BENCH_PY" "$HERE/make_model.py" "$MODEL_DIR"
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/rloo-bench.XXXXXX")"
echo "== $RUNS runs of each side, $THREADS threads, outputs in $WORK" >&2

for i in $(seq 1 "$RUNS"); do
    if ! "$BENCH_PY" "$HERE/hf_generate.py" "$MODEL_DIR" --seed "$i" --threads "$THREADS" \
        --num-return-sequences "$K" --max-new-tokens "$NEW" \
        >"$WORK/hf.$i.json" 2>"$WORK/hf.$i.err"; then
        cat "$WORK/hf.$i.err" >&2
        exit 1
    fi
    if ! "$RLOO" generate --model "$MODEL_DIR" --prompts "$MODEL_DIR/prompts.jsonl" \
        --output "$WORK/rloo.$i.jsonl" --num-return-sequences "$K" --max-new-tokens "$NEW" \
        --temperature 1.0 --batch-size "$BATCH" --ignore-eos --seed "$i" \
        2>"$WORK/rloo.$i.err"; then
        cat "$WORK/rloo.$i.err" >&2
        exit 1
    fi
    "$BENCH_PY" - "$WORK" "$i" "$((PROMPTS * K))" "$NEW" <<'PY' >&2
import json, re, sys
work, i, rows_expected, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
hf = json.load(open(f"{work}/hf.{i}.json"))
last = open(f"{work}/rloo.{i}.err").read().strip().splitlines()[-1]
m = re.match(r"generated (\d+) tokens in ([\d.]+) s \(([\d.]+) tokens/s\)", last)
if not m:
    sys.exit(f"run {i}: cannot parse rloo's timing line: {last!r}")
rows = [json.loads(l) for l in open(f"{work}/rloo.{i}.jsonl") if l.strip()]
lengths = sorted({r["completion_tokens"] for r in rows})
if len(rows) != rows_expected or lengths != [new]:
    sys.exit(f"run {i}: rloo wrote {len(rows)} rows with completion_tokens {lengths}, "
             f"expected {rows_expected} rows of {new}")
tokens = int(m.group(1))
if tokens != hf["tokens"]:
    sys.exit(f"run {i}: rloo generated {tokens} tokens, transformers {hf['tokens']}")
json.dump({"run": int(i), "tokens": tokens, "rloo_s": float(m.group(2)),
           "rloo_tps": float(m.group(3)), "hf_s": hf["seconds"], "hf_tps": hf["tokens_per_s"]},
          open(f"{work}/run.{i}.json", "w"))
import os
print(f"run {i}: rloo {float(m.group(3)):8.1f} tok/s ({m.group(2)} s) | "
      f"transformers {hf['tokens_per_s']:8.1f} tok/s ({hf['seconds']} s) | {tokens} tokens each | "
      f"load avg {os.getloadavg()[0]:.2f}")
PY
done

"$BENCH_PY" - "$WORK" "$RUNS" "$THREADS" <<'PY'
import json, statistics, sys
work, runs, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3]
res = [json.load(open(f"{work}/run.{i}.json")) for i in range(1, runs + 1)]
print()
print(f"{'run':>4} {'rloo tok/s':>12} {'transformers tok/s':>20} {'ratio':>8}")
for r in res:
    print(f"{r['run']:>4} {r['rloo_tps']:>12.1f} {r['hf_tps']:>20.1f} {r['rloo_tps'] / r['hf_tps']:>7.2f}x")
rl = statistics.median(r["rloo_tps"] for r in res)
hf = statistics.median(r["hf_tps"] for r in res)
print()
print(f"rloo {rl:.1f} tok/s | transformers {hf:.1f} tok/s | ratio {rl / hf:.2f}x "
      f"(median of {runs}; {res[0]['tokens']} tokens per run, {threads} threads)")
PY
