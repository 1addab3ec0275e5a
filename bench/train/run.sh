#!/usr/bin/env bash
# rloo train vs TRL's RLOOTrainer on the same Pythia-shaped policy, the same
# prompts and reward, the same machine and thread count. Two settings: a
# word-list reward and a reward model; arms: full fine-tuning, LoRA (r = 16
# on every linear layer), and full fine-tuning with gradient checkpointing.
# Alternates RUNS runs of each side per setting and arm and prints
# completions/s and peak RSS of every run, the medians and the ratios (rloo /
# TRL for speed, TRL / rloo for memory; LoRA also against TRL's full
# fine-tuning when that arm ran).
#
# Env: BENCH_PY   python with torch, transformers, trl and peft (default bench/.venv/bin/python)
#      RUNS       runs of each side per setting and arm (default 5)
#      THREADS    threads for both sides (default 2)
#      SHAPE      policy shape: tiny, 160m or 410m (default tiny)
#      SETTINGS   which settings (default "words reward_model")
#      ARMS       which arms: full, lora, checkpointing (default full)
#      STEPS      optimizer steps per run (default 6)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BENCH_PY="${BENCH_PY:-$ROOT/bench/.venv/bin/python}"
SHAPE="${SHAPE:-tiny}"
case "$SHAPE" in
    tiny) MODEL_DIR="$ROOT/bench/.cache/pythia-bench" TASK_DIR="$ROOT/bench/.cache/rloo-task" ;;
    160m|410m) MODEL_DIR="$ROOT/bench/.cache/pythia-$SHAPE" TASK_DIR="$ROOT/bench/.cache/rloo-task-$SHAPE" ;;
    *) echo "unknown SHAPE $SHAPE (tiny, 160m, 410m)" >&2; exit 1 ;;
esac
RUNS="${RUNS:-5}"
THREADS="${THREADS:-2}"
SETTINGS="${SETTINGS:-words reward_model}"
ARMS="${ARMS:-full}"
STEPS="${STEPS:-6}"
PROMPTS_PER_STEP=8 K=4

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
    "$BENCH_PY" "$ROOT/bench/generate/make_model.py" "$MODEL_DIR" "$SHAPE"
fi
if [[ ! -f "$TASK_DIR/reward-model/model.safetensors" ]]; then
    "$BENCH_PY" "$HERE/make_task.py" "$MODEL_DIR" "$TASK_DIR"
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/rloo-train-bench.XXXXXX")"
echo "== $SHAPE policy: $RUNS runs of each side per setting and arm, $THREADS threads, outputs in $WORK" >&2

for setting in $SETTINGS; do
    case "$setting" in
        words) trl_reward=(--words "$TASK_DIR")
               rloo_reward=$'[[reward]]\ntype = "lexicon"\npositive_file = "'"$TASK_DIR"$'/positive.txt"\nnegative_file = "'"$TASK_DIR"$'/negative.txt"' ;;
        reward_model) trl_reward=(--reward-model "$TASK_DIR/reward-model")
               rloo_reward=$'[[reward]]\ntype = "model"\npath = "'"$TASK_DIR"$'/reward-model"\nbatch_size = 32' ;;
        *) echo "unknown setting $setting (words, reward_model)" >&2; exit 1 ;;
    esac
    for arm in $ARMS; do
        case "$arm" in
            full) trl_arm=() rloo_arm="" ;;
            lora) trl_arm=(--lora-r 16)
                  rloo_arm=$'[peft]\nuse_peft = true\nlora_r = 16\nlora_alpha = 32\nlora_target_modules = ["all-linear"]' ;;
            checkpointing) trl_arm=(--gradient-checkpointing) rloo_arm="" ;;
            *) echo "unknown arm $arm (full, lora, checkpointing)" >&2; exit 1 ;;
        esac
        run="$setting.$arm"
        for i in $(seq 1 "$RUNS"); do
            "$BENCH_PY" "$HERE/measure.py" trl "$WORK/$run.trl.$i.json" -- \
                "$BENCH_PY" "$HERE/trl_rloo.py" --model "$MODEL_DIR" --prompts "$TASK_DIR/train_prompts.jsonl" \
                "${trl_reward[@]}" "${trl_arm[@]}" --steps "$STEPS" --threads "$THREADS" --seed "$i" \
                --prompts-per-step "$PROMPTS_PER_STEP" --k "$K" --output "$WORK/$run.trl.$i"
            out="$WORK/$run.rloo.$i"
            sed -e "s|@MODEL@|$MODEL_DIR|" -e "s|@TASK@|$TASK_DIR|" -e "s|@OUT@|$out|" -e "s|@SEED@|$i|" \
                -e "s|@EPISODES@|$((STEPS * PROMPTS_PER_STEP * K))|" \
                -e "s|@CHECKPOINTING@|$([[ $arm == checkpointing ]] && echo true || echo false)|" \
                "$HERE/rloo.toml.in" >"$out.toml"
            printf '\n%s\n\n%s\n' "$rloo_reward" "$rloo_arm" >>"$out.toml"
            RLOO_OUT="$out" "$BENCH_PY" "$HERE/measure.py" rloo "$WORK/$run.rloo.$i.json" -- \
                "$RLOO" train "$out.toml"
            "$BENCH_PY" - "$WORK" "$run" "$i" <<'PY' >&2
import json, os, sys
work, run, i = sys.argv[1:]
t = json.load(open(f"{work}/{run}.trl.{i}.json"))
r = json.load(open(f"{work}/{run}.rloo.{i}.json"))
print(f"{run} run {i}: rloo {r['completions_per_s']:6.1f} completions/s, {r['peak_rss_mb']:6.0f} MB | "
      f"TRL {t['completions_per_s']:6.1f} completions/s, {t['peak_rss_mb']:6.0f} MB | "
      f"mean length {r['mean_completion_length']:.1f} / {t['mean_completion_length']:.1f} | "
      f"load avg {os.getloadavg()[0]:.2f}")
PY
        done
    done
done

"$BENCH_PY" - "$WORK" "$RUNS" "$THREADS" "$SHAPE" "$SETTINGS" $ARMS <<'PY'
import json, statistics, sys
work, runs, threads, shape, settings, arms = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5].split(), sys.argv[6:]
print()
print(f"{shape} policy, medians of {runs} runs, {threads} threads")
print(f"{'setting':<27} {'side':<5} {'completions/s':>14} {'peak RSS MB':>12}   per-step seconds: "
      "generation scoring reference (both, side by side) training")
for s in settings:
    med = {}
    for arm in arms:
        run = f"{s}.{arm}"
        for side in ["rloo", "trl"]:
            res = [json.load(open(f"{work}/{run}.{side}.{i}.json")) for i in range(1, runs + 1)]
            med[arm, side] = (statistics.median(r["completions_per_s"] for r in res),
                              statistics.median(r["peak_rss_mb"] for r in res))
            parts = ""
            if side == "rloo":
                parts = "   " + " ".join(f"{statistics.median(r['breakdown'][k] for r in res):.3f}"
                                         for k in ["generation", "scoring", "reference", "scoring_and_reference", "training"])
            print(f"{run:<27} {side:<5} {med[arm, side][0]:>14.1f} {med[arm, side][1]:>12.0f}{parts}")
        ratio = lambda base: (f"{med[arm, 'rloo'][0] / med[base, 'trl'][0]:>13.2f}x "
                              f"{med[base, 'trl'][1] / med[arm, 'rloo'][1]:>11.2f}x less")
        print(f"{run:<27} ratio {ratio(arm)}   (vs TRL's {arm})")
        if arm != "full" and ("full", "trl") in med:
            print(f"{run:<27} ratio {ratio('full')}   (vs TRL's full fine-tuning)")
PY
