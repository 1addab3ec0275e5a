#!/usr/bin/env bash
# rloo train vs TRL's RLOOTrainer on the same tiny Pythia-shaped policy, the
# same prompts and reward, the same machine and thread count. Two settings:
# a word-list reward and a reward model. Alternates RUNS runs of each side per
# setting and prints completions/s and peak RSS of every run, the medians and
# the ratios (rloo / TRL for speed, TRL / rloo for memory).
#
# Env: BENCH_PY   python with torch, transformers and trl (default bench/.venv/bin/python)
#      RUNS       runs of each side per setting (default 5)
#      THREADS    threads for both sides (default 2)
#      SETTINGS   which settings (default "words reward_model")
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BENCH_PY="${BENCH_PY:-$ROOT/bench/.venv/bin/python}"
MODEL_DIR="$ROOT/bench/.cache/pythia-bench"
TASK_DIR="$ROOT/bench/.cache/rloo-task"
RUNS="${RUNS:-5}"
THREADS="${THREADS:-2}"
SETTINGS="${SETTINGS:-words reward_model}"
PROMPTS_PER_STEP=8 K=4 STEPS=6

export RAYON_NUM_THREADS="$THREADS" OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS"
export TOKENIZERS_PARALLELISM=false COMPLETIONS_PER_STEP=$((PROMPTS_PER_STEP * K))

if ! "$BENCH_PY" -c 'import trl' 2>/dev/null; then
    echo "no python with trl at $BENCH_PY: run bench/train/setup.sh or set BENCH_PY" >&2
    exit 1
fi

echo "== building rloo (release)" >&2
(cd "$ROOT" && cargo build --release)
RLOO="${CARGO_TARGET_DIR:-$ROOT/target}/release/rloo"

if [[ ! -f "$MODEL_DIR/model.safetensors" ]]; then
    "$BENCH_PY" "$ROOT/bench/generate/make_model.py" "$MODEL_DIR"
fi
if [[ ! -f "$TASK_DIR/reward-model/model.safetensors" ]]; then
    "$BENCH_PY" "$HERE/make_task.py" "$MODEL_DIR" "$TASK_DIR"
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/rloo-train-bench.XXXXXX")"
echo "== $RUNS runs of each side per setting, $THREADS threads, outputs in $WORK" >&2

for setting in $SETTINGS; do
    case "$setting" in
        words) trl_reward=(--words "$TASK_DIR")
               rloo_reward=$'[[reward]]\ntype = "lexicon"\npositive_file = "'"$TASK_DIR"$'/positive.txt"\nnegative_file = "'"$TASK_DIR"$'/negative.txt"' ;;
        reward_model) trl_reward=(--reward-model "$TASK_DIR/reward-model")
               rloo_reward=$'[[reward]]\ntype = "model"\npath = "'"$TASK_DIR"$'/reward-model"\nbatch_size = 32' ;;
        *) echo "unknown setting $setting (words, reward_model)" >&2; exit 1 ;;
    esac
    for i in $(seq 1 "$RUNS"); do
        "$BENCH_PY" "$HERE/measure.py" trl "$WORK/$setting.trl.$i.json" -- \
            "$BENCH_PY" "$HERE/trl_rloo.py" --model "$MODEL_DIR" --prompts "$TASK_DIR/train_prompts.jsonl" \
            "${trl_reward[@]}" --steps "$STEPS" --threads "$THREADS" --seed "$i" \
            --prompts-per-step "$PROMPTS_PER_STEP" --k "$K" --output "$WORK/$setting.trl.$i"
        out="$WORK/$setting.rloo.$i"
        sed -e "s|@MODEL@|$MODEL_DIR|" -e "s|@TASK@|$TASK_DIR|" -e "s|@OUT@|$out|" -e "s|@SEED@|$i|" \
            "$HERE/rloo.toml.in" >"$out.toml"
        printf '\n%s\n' "$rloo_reward" >>"$out.toml"
        RLOO_OUT="$out" "$BENCH_PY" "$HERE/measure.py" rloo "$WORK/$setting.rloo.$i.json" -- \
            "$RLOO" train "$out.toml"
        "$BENCH_PY" - "$WORK" "$setting" "$i" <<'PY' >&2
import json, os, sys
work, setting, i = sys.argv[1:]
t = json.load(open(f"{work}/{setting}.trl.{i}.json"))
r = json.load(open(f"{work}/{setting}.rloo.{i}.json"))
print(f"{setting} run {i}: rloo {r['completions_per_s']:6.1f} completions/s, {r['peak_rss_mb']:6.0f} MB | "
      f"TRL {t['completions_per_s']:6.1f} completions/s, {t['peak_rss_mb']:6.0f} MB | "
      f"mean length {r['mean_completion_length']:.1f} / {t['mean_completion_length']:.1f} | "
      f"load avg {os.getloadavg()[0]:.2f}")
PY
    done
done

"$BENCH_PY" - "$WORK" "$RUNS" "$THREADS" $SETTINGS <<'PY'
import json, statistics, sys
work, runs, threads, settings = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
print()
print(f"{'setting':<13} {'side':<5} {'completions/s':>14} {'peak RSS MB':>12}   per-step seconds: "
      "generation scoring reference (both, side by side) training")
for s in settings:
    med = {}
    for side in ["rloo", "trl"]:
        res = [json.load(open(f"{work}/{s}.{side}.{i}.json")) for i in range(1, runs + 1)]
        med[side] = (statistics.median(r["completions_per_s"] for r in res),
                     statistics.median(r["peak_rss_mb"] for r in res))
        parts = ""
        if side == "rloo":
            parts = "   " + " ".join(f"{statistics.median(r['breakdown'][k] for r in res):.3f}"
                                     for k in ["generation", "scoring", "reference", "scoring_and_reference", "training"])
        print(f"{s:<13} {side:<5} {med[side][0]:>14.1f} {med[side][1]:>12.0f}{parts}")
    print(f"{s:<13} ratio {med['rloo'][0] / med['trl'][0]:>13.2f}x {med['trl'][1] / med['rloo'][1]:>11.2f}x less"
          f"   (medians of {runs}, {threads} threads)")
PY
