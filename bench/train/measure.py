#!/usr/bin/env python3
"""Runs one trainer as a child process and reports its steady-state
throughput and peak resident memory as one JSON line.

Usage: measure.py rloo|trl OUT_JSON -- COMMAND...

Peak RSS is the child's own ru_maxrss from wait4 (the whole process: for
TRL that includes Python, PyTorch and the tokenizers). On a GPU, the peak
GPU memory allocated: PyTorch's max_memory_allocated for TRL, the high-water
mark of rloo's memory pool (its last stderr lines) for rloo. Throughput is taken
over the steady-state steps: every step but the first, which carries
one-time warm-up work on both sides.
"""

import json
import os
import re
import subprocess
import sys


def rloo_steps(out_dir):
    rows = [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl")) if l.strip()]
    keys = ["generation", "scoring", "reference", "scoring_and_reference", "training",
            "training_forward", "training_backward", "training_update",
            "training_forward_queued", "training_backward_queued", "advantages", "metrics", "step"]
    breakdown = {k: sum(r.get(f"time/{k}", 0.0) for r in rows[1:]) / max(len(rows) - 1, 1) for k in keys}
    # The most memory each phase held at once, and what the training phase
    # held as it began and after a micro-batch's forward, over the steps.
    for name in {k for r in rows for k in r if k.startswith(("memory/peak_", "memory/held_", "memory/activations"))}:
        breakdown[name.removeprefix("memory/")] = max(r.get(name, 0.0) for r in rows)
    return [r["time/step"] for r in rows], sum(r["completions/mean_length"] for r in rows) / len(rows), breakdown


def main():
    side, out_json = sys.argv[1], sys.argv[2]
    cmd = sys.argv[sys.argv.index("--") + 1:]
    stdout_path = out_json + ".stdout"
    with open(stdout_path, "w") as out, open(out_json + ".stderr", "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        sys.stderr.write(open(out_json + ".stderr").read()[-4000:])
        sys.exit(f"{side}: {' '.join(cmd)} failed with status {status}")
    peak_mb = usage.ru_maxrss / 1024  # KiB on Linux
    if side == "trl":
        result = json.loads(open(stdout_path).read().strip().splitlines()[-1])
        seconds, per_step = result["step_seconds"], result["completions_per_step"]
        length = result["mean_completion_length"]
        breakdown = {k: sum(v[1:]) / max(len(v) - 1, 1) for k, v in result.get("phase_seconds", {}).items()}
        peak_gpu = result.get("peak_gpu_bytes")
    else:
        out_dir = cmd[cmd.index("--output-dir") + 1] if "--output-dir" in cmd else os.environ["RLOO_OUT"]
        seconds, length, breakdown = rloo_steps(out_dir)
        per_step = int(os.environ["COMPLETIONS_PER_STEP"])
        peak = re.search(r"peak allocated ([\d.]+) GiB", open(out_json + ".stderr").read())
        peak_gpu = peak and float(peak.group(1)) * 2**30
    steady = seconds[1:]
    json.dump(
        {
            "side": side,
            "steps": len(seconds),
            "completions_per_s": per_step * len(steady) / sum(steady),
            "peak_rss_mb": peak_mb,
            "mean_completion_length": length,
            "breakdown": breakdown,
            "step_seconds": seconds,
            "peak_gpu_gib": peak_gpu and peak_gpu / 2**30,
        },
        open(out_json, "w"),
    )


if __name__ == "__main__":
    main()
