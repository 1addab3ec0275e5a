#!/usr/bin/env python3
"""The GPU benchmark's table, from what bench/gpu/run.sh left in OUT.

  report.py OUT

Generation: tokens/s, ms per decoding step (the whole call over the new
tokens, prefill included), the memory floor per step (the bf16 weights
once, less the input embedding a step only indexes unless the LM head is
tied to it, plus the KV cache once: each prompt's keys and values once,
and every row's completion so far) over the measured copy bandwidth, the
arithmetic floor per step (2 x the rows x those weights, plus attention's
4 x layers x heads x head_dim x the keys each row reads, at the measured
bf16 peak), and the ratio to the larger: at 256 rows an 8B model's
products take about as long as its bytes. Training: completions/s
over the steady steps, the time split per step, the peak GPU memory
allocated, and the training phase's model-FLOPs utilisation against the
measured bf16 peak: (6 for full fine-tuning, 4 for LoRA, which computes no
weight gradients of the base) x the parameters less the input embedding x
the tokens trained, plus the attention's 12 x layers x heads x head_dim x
the keys each token attends to. Medians over runs; a run that failed shows
as missing.
"""

import json
import os
import re
import statistics
import sys
from pathlib import Path

K, NEW = 4, 128
# Completions per training forward, as run.sh ran them.
MICRO = int(os.environ.get("MICRO", 64))


def load(path):
    """A JSON file (shape.json is indented), or the last line of a log that ends with one."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    for candidate in (text, text.splitlines()[-1] if text else ""):
        try:
            return json.loads(candidate)
        except ValueError:
            pass
    return None


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, spec):
    width = int(spec.split(".")[0] or 0)
    return "-".rjust(width) if value is None else format(value, spec)


def prompt_lengths(models, size):
    # The synthetic tokenizer makes one token of each word.
    rows = (Path(models) / size / "prompts.jsonl").read_text().splitlines()
    return [len(json.loads(r)["prompt"].split()) for r in rows if r.strip()]


def product_parameters(shape):
    """The parameters a token's products read: all but the input embedding,
    which a token only indexes, unless the LM head is tied to it."""
    tied = shape.get("tied", False)
    return shape["parameters"] - (0 if tied else shape["embedding_parameters"])


def generation(out, peaks, models):
    print("Generation: 64 prompts x 4 samples x 128 new tokens, bf16, batch 256")
    print(f"{'model':<10} {'side':<38} {'tokens/s':>9} {'ms/step':>8} {'mem ms':>7} {'flop ms':>7} "
          f"{'x floor':>8}  runs")
    # gen-SIZE-rloo_DECODER-RUN.log (a size may hold dashes, a decoder none)
    named = [re.match(r"^gen-(.+)-(rloo_[^-]+)-\d+\.log$", p.name) for p in out.glob("gen-*-rloo_*.log")]
    for size in sorted({m.group(1) for m in named if m}):
        shape = load(Path(models) / size / "shape.json")
        lengths = prompt_lengths(models, size)
        floor = memory = arithmetic = None
        if shape and peaks:
            per_token = shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * 2
            products = product_parameters(shape)
            weights = 2 * products
            kv = per_token * (sum(lengths) + len(lengths) * K * (NEW - 1) / 2)
            memory = (weights + kv) / (peaks["bandwidth_gbs"] * 1e9) * 1e3
            # Each row reads its prompt's keys and its own, on average half its completion.
            keys = K * sum(lengths) + len(lengths) * K * (NEW - 1) / 2
            attention = 4 * shape["layers"] * shape["attention_heads"] * shape["head_dim"] * keys
            flops = 2 * len(lengths) * K * products + attention
            arithmetic = flops / (peaks["bf16_tflops"] * 1e12) * 1e3
            floor = max(memory, arithmetic)
        rates = {}
        decoders = sorted({m.group(2) for m in named if m and m.group(1) == size})
        for side in decoders + ["transformers"]:
            if side != "transformers":
                runs = []
                for log in sorted(out.glob(f"gen-{size}-{side}-*.log")):
                    m = re.search(r"generated (\d+) tokens in ([\d.]+) s", log.read_text())
                    runs.append(m and (int(m.group(1)), float(m.group(2))))
            else:
                runs = [(r["tokens"], r["seconds"]) if r else None for r in map(load, sorted(out.glob(f"gen-{size}-hf-*.json")))]
            done = [r for r in runs if r]
            rate = median([t / s for t, s in done])
            step_ms = median([s / NEW * 1e3 for _, s in done])
            rates[side] = rate
            ratio = step_ms / floor if step_ms and floor else None
            print(f"{size:<10} {side:<38} {fmt(rate, '9.0f')} {fmt(step_ms, '8.2f')} {fmt(memory, '7.2f')} "
                  f"{fmt(arithmetic, '7.2f')} {fmt(ratio, '8.1f')}  {len(done)}/{len(runs)}")
        for side in decoders:
            if rates[side] and rates["transformers"]:
                print(f"{size:<10} {side} / transformers: {rates[side] / rates['transformers']:.2f}x")
            outputs = sorted(out.glob(f"gen-{size}-{side}-*.jsonl"))
            def tokens(path):
                rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
                return sorted((r["prompt_index"], r["sample_index"], r["completion"]) for r in rows)
            if len(outputs) >= 2:
                same = all(tokens(p) == tokens(outputs[0]) for p in outputs[1:])
                print(f"{size:<10} {side}, same seed, same completions in {len(outputs)} runs: {'yes' if same else 'NO'}")
            # Tuned products keep the default's bits: the same completions as the variant without +tuned.
            untuned = sorted(out.glob(f"gen-{size}-{side.removesuffix('+tuned')}-*.jsonl"))
            if side.endswith("+tuned") and outputs and untuned:
                same = tokens(outputs[0]) == tokens(untuned[0])
                print(f"{size:<10} {side}, the same completions as without +tuned: {'yes' if same else 'NO'}")
                # What the first run's tuning found, a line per product's shape.
                for line in (out / outputs[0].name.replace(".jsonl", ".log")).read_text().splitlines():
                    if "candidates give its bits" in line:
                        print(f"{size:<10}   {line.split('product of ', 1)[-1]}")
    vllm = (out / "vllm.txt")
    if vllm.exists():
        print("vLLM: " + ("installed, not run by this script" if vllm.read_text().strip() == "yes" else
                          "not on the GPU machine, and its wheels with their CUDA kernels (hundreds of MB) "
                          "cannot be carried there"))


STEP_TIMING = re.compile(r"decoding steps at (\d+) rows, medians of \d+: the picks ([\d.]+) ms and the forward pass "
                         r"([\d.]+) ms on the GPU, ([\d.]+) ms from the picks to the forward pass.*?; ([\d.]+) ms a step")
# What `rloo generate`'s warm-up logs once done (generate::warm_up).
WARMED_UP = "INFO warmed up: "
# What the medians leave out (binaries since 82a2441): the prefill, the first two steps, the steps' total.
STEP_EXTRAS = re.compile(r"the prefill ([\d.]+) ms, .*?the first two steps ([\d.]+) and ([\d.]+) ms.*?; "
                         r"([\d.]+) ms from the first step to the last")


def step_timing(out):
    """Where rloo's decoding steps went (RLOO_DECODE_TIMING=on in run.sh's generation runs and in the
    8B arm's rollouts): medians over runs; of a training run, its steady steps' (each step's rollout is
    one batch), the first left out as its completions/s leave it out."""
    rows, hosted = {}, []
    for kind in ("gen", "train"):
        for log in sorted(out.glob(f"{kind}-*-rloo_*.log")):
            m = re.match(rf"^{kind}-(.+)-(rloo_[^-]+)-\d+\.log$", log.name)
            if not m:
                continue
            text = log.read_text()
            # A generation's warm-up (binaries since 47576e2) logs its own steps first.
            if kind == "gen":
                text = text.split(WARMED_UP, 1)[-1]
            # A step that could not be recorded says so once a run: its steps were launched from the host.
            if "launched from the host, not recorded" in text:
                hosted.append(log.name)
            batches = [(t, STEP_EXTRAS.search(line)) for line in text.splitlines() if (t := STEP_TIMING.search(line))]
            if kind == "train":
                batches = batches[1:] or batches
            size, side = m.groups()
            side += ", RLOO step's rollouts" if kind == "train" else ""
            for timing, extras in batches:
                values = [float(x) for x in timing.groups()[1:]]
                values += [float(x) for x in extras.groups()] if extras else [float("nan")] * 4
                rows.setdefault((size, side), []).append(values)
    if not rows and not hosted:
        return
    print()
    print("Decoding steps on the GPU's clock (CUDA events), ms, medians of each run's steps, then of runs;")
    print("then what the medians leave out: the prefill, the first two steps (launched, recorded), all steps")
    print(f"{'model':<14} {'side':<58} {'picks':>6} {'forward':>8} {'host':>6} {'step':>6} "
          f"{'prefill':>8} {'first':>6} {'second':>6} {'all':>7}  runs")
    for (size, side), runs in sorted(rows.items()):
        picks, forward, host, step, prefill, first, second, total = (median([r[i] for r in runs]) for i in range(8))
        print(f"{size:<14} {side:<58} {picks:6.3f} {forward:8.3f} {host:6.3f} {step:6.3f} "
              f"{prefill:8.1f} {first:6.1f} {second:6.1f} {total:7.1f}  {len(runs)}")
    for name in hosted:
        print(f"{name}: decoding steps launched from the host, NOT recorded (its log says why)")


def long_prompts(out):
    """run.sh's `long` part: a few rows over 1,600-token prompts, keys split across blocks or not."""
    logs = sorted(out.glob("long-*-*-*.log"))
    if not logs:
        return
    print()
    print("Decoding over long prompts: 1,600 tokens x 1 sample, 256 new tokens, bf16")
    print(f"{'model':<10} {'keys split':<11} {'tokens/s':>9} {'ms/step':>8}  runs")
    named = [re.match(r"^long-(.+)-(auto|off)-\d+\.log$", p.name) for p in logs]
    for size, split in sorted({m.groups() for m in named if m}):
        runs = []
        for log in sorted(out.glob(f"long-{size}-{split}-*.log")):
            m = re.search(r"generated (\d+) tokens in ([\d.]+) s", log.read_text())
            runs.append(m and (int(m.group(1)), float(m.group(2))))
        done = [r for r in runs if r]
        rate = median([t / s for t, s in done])
        step_ms = median([s / 256 * 1e3 for _, s in done])
        print(f"{size:<10} {split:<11} {fmt(rate, '9.0f')} {fmt(step_ms, '8.2f')}  {len(done)}/{len(runs)}")


def serving(out):
    runs = sorted(out.glob("serve-*.json"))
    if not runs:
        return
    print()
    print("rloo serve: clients streaming 64 new tokens a request, bf16; steps launched from the host (shrink) "
          "or replayed (graph)")
    print(f"{'model':<10} {'steps':<7} {'clients':>7} {'tokens/s':>9} {'failed':>6} {'latency p50 s':>13} "
          f"{'first token p50 ms':>18}")
    for path in runs:
        size, step = path.stem.split("-")[1:3]
        for level in load(path) or []:
            print(f"{size:<10} {step:<7} {level['clients']:>7} {level['tokens_per_s']:9.0f} {level['errors']:>6} "
                  f"{level['latency_p50_s']:13.2f} {level['ttft_p50_s'] * 1000:18.0f}")


def train_flops(shape, lengths, kind):
    """The training phase's model FLOPs. LoRA's backward makes no weight gradients; PPO trains a
    critic beside the policy, of its shape less the LM head (make_models.py's reward model, where
    the critic starts)."""
    tokens = K * sum(n + NEW for n in lengths)
    keys = K * sum((n + NEW) * (n + NEW + 1) / 2 for n in lengths)
    dense = (4 if kind == "lora" else 6) * product_parameters(shape) * tokens
    attention = 12 * shape["layers"] * shape["attention_heads"] * shape["head_dim"] * keys
    critic = 6 * (product_parameters(shape) - shape["embedding_parameters"]) * tokens + attention
    return dense + attention + (critic if kind == "ppo" else 0)


def training(out, peaks, models):
    print()
    print("RLOO step: 64 prompts x k = 4, 128 new tokens, bf16, reward model, medians of the steady steps")
    print(f"{'arm':<14} {'side':<38} {'compl/s':>8} {'gen s':>6} {'score s':>7} {'ref s':>6} {'train s':>7} "
          f"{'peak GiB':>8} {'MFU':>6}  runs")
    named = [re.match(r"^train-(.*)-(rloo[\w+]*|trl)-\d+\.json$", p.name) for p in out.glob("train-*-*-*.json")]
    arms = sorted({m.group(1) for m in named if m})
    for arm in arms:
        size, kind = arm.rsplit("-", 1)
        shape = load(Path(models) / size / "shape.json")
        flops = train_flops(shape, prompt_lengths(models, size), kind) if shape else None
        med = {}
        # rloo with each attention variant (rloo_tensor, rloo_flash+fused, ...), then TRL.
        sides = sorted({m.group(2) for m in named if m and m.group(1) == arm and m.group(2) != "trl"}) + ["trl"]
        for side in sides:
            runs = [load(p) for p in sorted(out.glob(f"train-{arm}-{side}-*.json"))]
            done = [r for r in runs if r]
            if not runs:
                continue
            part = lambda k: median([r["breakdown"].get(k) for r in done])
            rate, peak, train = median([r["completions_per_s"] for r in done]), median([r.get("peak_gpu_gib") for r in done]), part("training")
            mfu = flops / (train * peaks["bf16_tflops"] * 1e12) if flops and train and peaks else None
            med[side] = (rate, peak)
            print(f"{arm:<14} {side:<38} {fmt(rate, '8.1f')} {fmt(part('generation'), '6.2f')} {fmt(part('scoring'), '7.2f')} "
                  f"{fmt(part('reference'), '6.2f')} {fmt(train, '7.2f')} {fmt(peak, '8.1f')} "
                  f"{fmt(mfu and 100 * mfu, '5.1f')}%  {len(done)}/{len(runs)}")
        for side in [s for s in med if s != "trl"]:
            if "trl" in med and med["trl"][0] and med[side][0]:
                memory = med[side][1] / med["trl"][1] if med[side][1] and med["trl"][1] else None
                print(f"{arm:<14} {side} / TRL: {med[side][0] / med['trl'][0]:.2f}x completions/s, "
                      f"{fmt(memory, '.2f')}x peak memory")
    if flops is not None:
        print("(rloo's scoring and reference run side by side: 'ref s' is both together when they overlap)")
    print()
    print("rloo's training phase by part (s per step): forward and loss, backward, update; "
          "of the first two, the host's queuing")
    for p in sorted(out.glob("train-*-rloo*-*.json")):
        b = (load(p) or {}).get("breakdown", {})
        if b.get("training_forward") is not None:
            print(f"{p.stem:<30} {b['training_forward']:7.2f} {b.get('training_backward', 0):7.2f} "
                  f"{b.get('training_update', 0):7.2f} {b.get('training_forward_queued', 0):7.2f} "
                  f"{b.get('training_backward_queued', 0):7.2f}")
            peaks = {k.removeprefix("peak_").removesuffix("_gib"): v for k, v in b.items() if k.startswith("peak_")}
            if peaks:
                print(" " * 31 + "most GPU memory held (GiB): "
                      + ", ".join(f"{k} {v:.1f}" for k, v in sorted(peaks.items())))
            phases = ("generation", "scoring_and_reference", "advantages", "training", "metrics")
            if all(k in b for k in phases + ("step",)):
                rest = b["step"] - sum(b[k] for k in phases)
                print(" " * 31 + f"the step's other parts (s): advantages {b['advantages']:.2f}, "
                      f"metrics {b['metrics']:.2f}, the rest {rest:.2f}")
            held = [b.get(f"held_{k}_gib") for k in ("before_training", "after_forward")]
            if None not in held:
                print(" " * 31 + f"training held {held[0]:.1f} GiB as it began, "
                      f"{held[1]:.1f} after a micro-batch's forward")
            kept = b.get("activations_gib")
            arm = re.match(r"^train-(.*)-rloo", p.stem)
            shape = arm and load(Path(models) / arm.group(1).rsplit("-", 1)[0] / "shape.json")
            if kept is not None and shape:
                # A micro-batch packs MICRO / K prompts, each followed by its K completions.
                lengths = prompt_lengths(models, arm.group(1).rsplit("-", 1)[0])
                slots = MICRO // K * (sum(lengths) / len(lengths) + K * NEW)
                hidden = shape["attention_heads"] * shape["head_dim"]
                units = kept * 2**30 / (slots * shape["layers"] * hidden * 2)
                # The start-up plan's count (src/train/memory.rs), from the run's log.
                log = Path(f"{p}.stderr")
                planned = log.exists() and re.search(r"activations: ([\d.]+) tensors of the hidden size", log.read_text())
                both = " (the policy's and the critic's)" if arm.group(1).endswith("-ppo") else ""
                print(" " * 31 + f"the first micro-batch's forward kept {kept:.2f} GiB: about {units:.1f} "
                      f"bf16 tensors of the hidden size per layer and token{both}"
                      + (f" (planned: {planned.group(1)} a layer, 3 more outside them)" if planned else ""))


def nccl(out):
    alone, job = out / "nccl-alone" / "metrics.jsonl", out / "nccl-job" / "metrics.jsonl"
    if not (out / "nccl-job.log").exists():
        return
    print()
    if not (alone.exists() and job.exists()):
        print("NCCL, one rank through whole RLOO steps: FAILED (see nccl-*.log)")
        return
    rows = lambda p: [{k: v for k, v in json.loads(l).items() if not k.startswith(("time/", "memory/")) and k != "eps"}
                      for l in p.read_text().splitlines() if l.strip()]
    a, b = rows(alone), rows(job)
    diff = max((abs(x[k] - y[k]) / max(abs(x[k]), 1.0) for x, y in zip(a, b) for k in x
                if isinstance(x.get(k), (int, float)) and isinstance(y.get(k), (int, float))), default=None)
    joined = "NCCL on" in (out / "nccl-job.log").read_text()
    print(f"NCCL, one rank through {len(b)} RLOO steps ({'NCCL joined' if joined else 'NCCL NOT seen in the log'}): "
          f"{len(a)} vs {len(b)} steps, largest relative metric difference to the run alone {fmt(diff, '.2e')}")


def main():
    out = Path(sys.argv[1])
    models = Path(__import__("os").environ.get("MODELS", "/tmp/rloo-gpu-models"))
    peaks = load(out / "peaks.json")
    gpu = (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").exists() else "?"
    print(f"\n{gpu}; measured: " + (f"{peaks['bf16_tflops']} TFLOP/s bf16, {peaks['bandwidth_gbs']} GB/s copy"
                                    if peaks else "no peaks"))
    if list(out.glob("gen-*")):
        generation(out, peaks, models)
    step_timing(out)
    long_prompts(out)
    serving(out)
    if list(out.glob("train-*.json")):
        training(out, peaks, models)
    nccl(out)


if __name__ == "__main__":
    main()
