#!/usr/bin/env bash
# On the GPU machine, in one call: the CUDA build against the CPU and the
# committed fixtures (`rloo check`), a 20-step RLOO run on the GPU beside the
# same run on the CPU, a bf16 run, and every command on `--device cuda`.
# Prints a summary table last; exits non-zero if anything failed.
#
#   scripts/cuda/check.sh [OUTPUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-/tmp/rloo-check}}
export RUST_BACKTRACE=0
mkdir -p "$out"
rloo=scripts/cuda/run.sh
summary=()
failed=0
record() { # name status seconds [detail]
    summary+=("$(printf '%-34s %-5s %8.1f s  %s' "$1" "$2" "$3" "${4:-}")")
    [ "$2" = ok ] || failed=1
}
timed() { # name log command...
    local name=$1 log=$2 start end
    shift 2
    start=$(date +%s.%N)
    if "$@" >"$log" 2>&1; then status=ok; else status=FAIL; fi
    end=$(date +%s.%N)
    record "$name" "$status" "$(awk "BEGIN { print $end - $start }")"
    [ "$status" = ok ] || tail -20 "$log"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
nvidia=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')
LD_LIBRARY_PATH=$nvidia/cu13/lib:$nvidia/nccl/lib ldd "${RLOO:-.cuda/bin/rloo}" | grep -E "not found|cuda|cublas|curand|nvrtc"

echo "== rloo check --device cuda"
timed "rloo check (kernels, fixtures)" "$out/check.txt" $rloo check --device cuda
cat "$out/check.txt"

echo "== 20 RLOO steps: CPU, CUDA f32, CUDA bf16"
steps=(--set train.total_episodes=320 --set train.num_sample_generations=0)
timed "train 20 steps, cpu f32" "$out/train-cpu.log" $rloo train examples/rloo.toml "${steps[@]}" --set model.device='"cpu"' --set train.output_dir="\"$out/train-cpu\""
timed "train 20 steps, cuda f32" "$out/train-cuda.log" $rloo train examples/rloo.toml "${steps[@]}" --set model.device='"cuda"' --set train.output_dir="\"$out/train-cuda\""
timed "train 20 steps, cuda bf16" "$out/train-bf16.log" $rloo train examples/rloo.toml "${steps[@]}" --set model.device='"cuda"' --bf16 --set train.output_dir="\"$out/train-bf16\""
RLOO_DECODE_STEP=graph timed "train 20 steps, cuda bf16, graph" "$out/train-graph.log" $rloo train examples/rloo.toml "${steps[@]}" --set model.device='"cuda"' --bf16 --set train.output_dir="\"$out/train-graph\""
learning() { # the mean score of the first and last five steps of each run
    python3 - "$out" "$@" <<'PY'
import json, sys, os
out = sys.argv[1]
print(f"{'run':<12} {'steps':>5} {'score, first 5':>15} {'score, last 5':>14} {'KL, last':>9}")
for run in sys.argv[2:]:
    path = os.path.join(out, run, "metrics.jsonl")
    if not os.path.exists(path):
        print(f"{run:<12} (no metrics)")
        continue
    rows = [json.loads(l) for l in open(path) if '"objective/scores"' in l]
    first = sum(r["objective/scores"] for r in rows[:5]) / 5
    last = sum(r["objective/scores"] for r in rows[-5:]) / 5
    print(f"{run:<12} {len(rows):>5} {first:>15.3f} {last:>14.3f} {rows[-1]['objective/kl']:>9.3f}")
PY
}
learning train-cpu train-cuda train-bf16 train-graph
for run in cpu cuda bf16 graph; do
    echo "$run: $(grep -h "completions/s" "$out/train-$run.log" | sed 's/.*; //')"
done
echo "== memory over a long run: 200 steps on the GPU"
timed "train 200 steps, cuda bf16" "$out/train-long.log" $rloo train examples/rloo.toml --set train.total_episodes=3200 --set train.num_sample_generations=0 --set model.device='"cuda"' --bf16 --set train.output_dir="\"$out/train-long\""
learning train-long
grep -h "GPU memory" "$out/train-long.log" || true

echo "== every command on --device cuda"
policy=tests/fixtures/models/gpt_neox-causal
rm -rf "$out/pipeline"
timed "pipeline --fast" "$out/pipeline.log" $rloo pipeline --fast --device cuda --out "$out/pipeline"
timed "generate" "$out/generate.log" $rloo generate --model $policy --prompts examples/prompts.jsonl --output "$out/generated.jsonl" --device cuda
RLOO_DECODE_STEP=graph timed "generate, graph" "$out/generate-graph.log" $rloo generate --model $policy --prompts examples/prompts.jsonl --output "$out/generated-graph.jsonl" --device cuda
cmp -s "$out/generated.jsonl" "$out/generated-graph.jsonl" && same=yes || same=no
echo "generate, graph: the same completions as a shrinking batch: $same"
timed "score" "$out/score.log" $rloo score --model tests/fixtures/models/gpt_neox-seqcls --input tests/fixtures/score/rows_plain.jsonl --output "$out/scored.jsonl" --device cuda
timed "eval" "$out/eval.log" $rloo eval --prompts examples/prompts.jsonl --model "$out/pipeline/rloo" --model-b "$out/pipeline/sft" --reward-model "$out/pipeline/reward_model" --max-new-tokens 16 --device cuda --output "$out/eval.json"
timed "sft" "$out/sft.log" $rloo sft --model "$out/pipeline/init" --dataset "$out/pipeline/data/sft.jsonl" --output-dir "$out/sft" --num-train-epochs 1 --device cuda
timed "reward train" "$out/reward.log" $rloo reward train --model "$out/pipeline/init" --dataset "$out/pipeline/data/preferences.jsonl" --output-dir "$out/rm" --num-train-epochs 1 --device cuda

echo
echo "== summary"
printf '%s\n' "${summary[@]}"
exit $failed
