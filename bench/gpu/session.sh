#!/usr/bin/env bash
# A short pass on a GPU machine that fits one call of BUDGET seconds
# (default 540), with the CUDA build (.cuda/bin) and the peer's wheels
# (bench/.cache/wheels) carried there. In order, each part only while time
# remains for it:
#   1. `rloo check --device cuda`: every kernel against the CPU's (LoRA and
#      the activated dense layer among them), the fixtures against
#      transformers (greedy tokens from shrinking batches and from steps
#      recorded with the decoding kernel that takes their head size, a key
#      per lane);
#   2. generation at 410m: recorded steps attending a key per warp, a key
#      per lane, and a key per lane with the biases added in cuBLASLt's
#      epilogues;
#   3. the RLOO step at 410m against TRL: the defaults (flash attention
#      from the fused projection, recorded decoding steps) and the same
#      with a key per lane in decoding and the biases in the epilogues;
#   4. LoRA (r = 16, all linear layers) at 1B against TRL with PEFT, with
#      a key per lane and the epilogues;
#   5. full fine-tuning at 1B with a key per lane and the epilogues, and
#      the same with the MLP's wide input made again in the backward
#      (RLOO_MLP_INPUT=remade);
#   6. decoding 4 rows over 1,600-token prompts at 410m, with the keys
#      split across blocks and not;
#   7. generation at Qwen3-0.6B's shape (two query heads a key/value
#      head): a key per warp, and a key per lane with a block per key/value
#      head and per query head;
#   8. the kernels of the training phase over one micro-batch at 410m.
# Logs stay in OUT; the benchmark's table (bench/gpu/report.py) prints last.
#
#   bench/gpu/session.sh                 # OUT=/tmp/rloo-gpu-session
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/rloo-gpu-session} PY=${PY:-python3} MODELS=${MODELS:-/tmp/rloo-gpu-models}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
left() { echo $((BUDGET - SECONDS)); }
# part NAME SECONDS COMMAND...: runs COMMAND if SECONDS remain, stopped when the budget ends.
part() {
    local name=$1 needs=$2
    shift 2
    if (($(left) < needs)); then
        echo "== [$SECONDS s] $name: skipped, $(left) s left of $BUDGET" >&2
        return
    fi
    echo "== [$SECONDS s] $name" >&2
    timeout "$(left)" "$@" >"$OUT/$name.log" 2>&1 || echo "== $name: exit $? (log: $name.log)" >&2
}

part check 60 env RLOO_DECODE_ATTENTION=lanes scripts/cuda/run.sh check --device cuda
grep -sE "checks on|FAIL" "$OUT/check.log" >&2
part generate-410m 90 env SIZES=410m RUNS=2 DECODERS="race+fused+fused+graph race+lanes+fused+graph race+lanes+fused+graph+epilogue" \
    bench/gpu/run.sh peaks generate
part train-410m 120 env ARMS=410m-full TRAIN_RUNS=1 STEPS=3 \
    ATTENTION="flash+fused+graph flash+fused+graph+lanes+epilogue" bench/gpu/run.sh train
part train-1b-lora 100 env ARMS=1b-lora TRAIN_RUNS=1 STEPS=3 ATTENTION=flash+fused+graph+lanes+epilogue bench/gpu/run.sh train
part train-1b 120 env ARMS=1b-full TRAIN_RUNS=1 STEPS=3 \
    ATTENTION="flash+fused+graph+lanes+epilogue flash+fused+graph+lanes+epilogue+remade" bench/gpu/run.sh train
part long-410m 40 env SIZES=410m RUNS=2 bench/gpu/run.sh long
part generate-qwen3 60 env SIZES=qwen3-0.6b RUNS=1 PEER=off \
    DECODERS="race+fused+fused+graph race+lanes+fused+graph+pass+grouped race+lanes+fused+graph+pass+each" \
    bench/gpu/run.sh generate
part profile 60 env SIZES=410m PROFILED=train bench/gpu/run.sh profile
"$PY" bench/gpu/report.py "$OUT" | tee "$OUT/table.txt"
