#!/usr/bin/env bash
# A short pass on a GPU machine that fits one call of BUDGET seconds
# (default 540), with the CUDA build (.cuda/bin) and the peer's wheels
# (bench/.cache/wheels) carried there. Each part runs only while time
# remains for it, in this order, the most needed first (a lease of 15
# minutes, its start among them, holds about one such call):
#   1. `rloo check --device cuda`, the 410m and 1B models made on the CPU
#      meanwhile: every kernel against the CPU's (the flash attention over
#      the bias and over spans, the decoding kernel with the rows of a
#      prompt in a block among them, the race sampler on f32 and on bf16
#      logits), the fixtures against transformers
#      (greedy tokens from shrinking batches and from recorded steps, which
#      must have been recorded) and with their adapters against the CPU;
#      then again with few rows' products made by the rows kernel
#      (RLOO_GEMM=rows, which measured slower than cuBLAS's): the fixtures'
#      KV-cache decoding and greedy tokens through it;
#   2. generation at 410m against transformers, the defaults, a prompt's
#      rows to a block of the decoding kernel (RLOO_DECODE_ROWS=prompt) and
#      the products that cuBLAS's tiles would not spread over the GPU made
#      by the rows kernel (RLOO_GEMM=rows), each step's time split between
#      the GPU and the host (the race sampler's picks among it); then the
#      earlier binary's (below);
#   3. the RLOO step at 410m against TRL under the defaults (the flash
#      kernels reading each query's runs of keys, decoding a key per lane
#      with the biases in cuBLASLt's epilogues, the weights' f32 masters
#      split beside their bf16 copies);
#   4. the step at 1B against TRL;
#   5. the kernels of the training phase over one micro-batch at 410m, of
#      the same step's scoring and reference passes, and of a short
#      generation at the benchmark's 256 rows, under the defaults; then of
#      the short generation with the rows kernel's products (profile-rows,
#      OUT/profile-rows: where its step lost 3.9 ms to cuBLAS's);
#   6. generation at 1B, the same variants;
#   7. rloo serve at 410m under 1, 8 and 32 streaming clients, its steps
#      launched from the host and replayed from recordings as rows come and
#      go (RLOO_DECODE_STEP=shrink, graph);
#   8. the earlier binary's RLOO steps at 410m and 1B (below);
#   9. LoRA (r = 16, all linear layers) at 1B against TRL with PEFT, over
#      spans; then PPO's step at 410m (its critic starting from the reward
#      model), beside the RLOO step of 3., without a peer;
#  10. the Qwen3-8B LoRA arm (bf16 weights, gradient checkpointing) against
#      TRL with PEFT, its reward model on the device and in host memory for
#      the training phase, when PARTS names it (its models take 17 GB, made
#      in about 30 s, and the arm about 170 s beside TRL on an H200: a call
#      of its own, PARTS="check train-8b-lora");
#  11. when PARTS names them, on the same 8B models: generation at 256 rows
#      with the query heads of a key/value head in one block of the decoding
#      kernel and a block per head (RLOO_DECODE_HEADS=grouped, each), the
#      value rows a row a load (RLOO_DECODE_VALUES=rows) and the products
#      tuned, each step's time split between the GPU and the host
#      (generate-8b); and the
#      kernels of a short generation at 256 rows (profile-8b).
# Where .cuda/bin/rloo-before.gz is carried too (bench/gpu/baseline.sh REV
# builds it), generation at 410m (in 2) and the RLOO step at 410m and at 1B
# (8) run with it as well, under the same settings, on the same card
# (OUT/before, its own table, with the revision in rloo-before.rev).
# Logs stay in OUT; the benchmark's table (bench/gpu/report.py) prints last.
# The binaries may come packed in .cuda/carry (bench/gpu/pack.sh: within
# what a call carries), unpacked first.
#
#   bench/gpu/session.sh                 # OUT=/tmp/rloo-gpu-session
#   PARTS="check train-8b-lora" bench/gpu/session.sh
#   PARTS="train-8b-lora generate-8b profile-8b" bench/gpu/session.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/rloo-gpu-session} PY=${PY:-python3} MODELS=${MODELS:-/tmp/rloo-gpu-models}
BUDGET=${BUDGET:-540}
PARTS=${PARTS:-check check-variants generate-410m generate-before train-410m train-1b profile profile-rows generate-1b serve-410m train-before train-1b-lora train-410m-ppo}
mkdir -p "$OUT"
# The binaries as bench/gpu/pack.sh packs them for the call, where carried.
if [[ -e .cuda/carry/rloo.gz ]]; then
    mkdir -p .cuda/bin
    gunzip -c .cuda/carry/rloo.gz >.cuda/bin/rloo && chmod +x .cuda/bin/rloo
    cp -f .cuda/carry/rloo-before.* .cuda/bin/ 2>/dev/null || true
fi
left() { echo $((BUDGET - SECONDS)); }
# part NAME SECONDS COMMAND...: runs COMMAND if PARTS names it and SECONDS remain,
# stopped when the budget ends.
part() {
    local name=$1 needs=$2
    shift 2
    [[ " $PARTS " == *" $name "* ]] || return 0
    if (($(left) < needs)); then
        echo "== [$SECONDS s] $name: skipped, $(left) s left of $BUDGET" >&2
        return
    fi
    echo "== [$SECONDS s] $name" >&2
    timeout "$(left)" "$@" >"$OUT/$name.log" 2>&1 || echo "== $name: exit $? (log: $name.log)" >&2
}

# The 410m and 1B models are made on the CPU while the checks, whose times
# nothing measures, hold the GPU; the first timed part waits for them.
making() {
    local size needed
    for size in 410m 1b; do
        # The parts that run at each size (the earlier binary's generation at 410m).
        needed="-$size|train-before"
        [[ $size == 410m ]] && needed+="|generate-before|profile"
        [[ $PARTS =~ $needed && ! -f $MODELS/$size/shape.json ]] || continue
        "$PY" bench/gpu/make_models.py "$size" "$MODELS/$size" >"$OUT/make-$size.log" 2>&1 || tail -5 "$OUT/make-$size.log" >&2
    done
}
making &
maker=$!
trap 'pkill -P "$maker" 2>/dev/null; kill "$maker" 2>/dev/null' EXIT
part check 60 scripts/cuda/run.sh check --device cuda
grep -sE "checks on|FAIL" "$OUT/check.log" >&2
part check-variants 40 env RLOO_GEMM=rows scripts/cuda/run.sh check --device cuda
grep -sE "checks on|FAIL" "$OUT/check-variants.log" >&2
# The models, within the budget.
while kill -0 "$maker" 2>/dev/null && (($(left) > 0)); do sleep 1; done
defaults=flash+fused+graph+lanes+epilogue+kept
decoded=race+lanes+fused+graph+epilogue
decoders="$decoded $decoded+grouped+prompt $decoded+rowsgemm"
before() { [[ -e .cuda/bin/rloo-before.gz ]]; }
if before; then
    gunzip -c .cuda/bin/rloo-before.gz >/tmp/rloo-before && chmod +x /tmp/rloo-before
    mkdir -p "$OUT/before" && cp -f .cuda/bin/rloo-before.rev "$OUT/before/" 2>/dev/null
fi
part generate-410m 60 env SIZES=410m RUNS=2 DECODERS="$decoders" bench/gpu/run.sh peaks generate
before && part generate-before 30 env OUT="$OUT/before" RLOO=/tmp/rloo-before PEER=off SIZES=410m RUNS=2 \
    DECODERS="$decoded" bench/gpu/run.sh generate
part train-410m 90 env ARMS=410m-full TRAIN_RUNS=1 STEPS=3 ATTENTION="$defaults+spans" bench/gpu/run.sh train
part train-1b 100 env ARMS=1b-full TRAIN_RUNS=1 STEPS=3 ATTENTION="$defaults+spans" bench/gpu/run.sh train
part profile 120 env SIZES=410m bench/gpu/run.sh profile
part profile-rows 40 env SIZES=410m PROFILED=generate RLOO_GEMM=rows OUT="$OUT/profile-rows" bench/gpu/run.sh profile
part generate-1b 30 env SIZES=1b RUNS=2 PEER=off DECODERS="$decoders" bench/gpu/run.sh generate
part serve-410m 45 env SIZES=410m bench/gpu/run.sh serve
before && part train-before 120 env OUT="$OUT/before" RLOO=/tmp/rloo-before PEER=off ARMS="410m-full 1b-full" \
    TRAIN_RUNS=1 STEPS=3 ATTENTION="$defaults" bench/gpu/run.sh train
part train-1b-lora 100 env ARMS=1b-lora TRAIN_RUNS=1 STEPS=3 ATTENTION="$defaults+spans" bench/gpu/run.sh train
part train-410m-ppo 60 env ARMS=410m-ppo TRAIN_RUNS=1 STEPS=3 ATTENTION="$defaults+spans" bench/gpu/run.sh train
part train-8b-lora 240 env ARMS=qwen3-8b-lora TRAIN_RUNS=1 STEPS=3 ATTENTION="$defaults+spans $defaults+spans+offload" \
    bench/gpu/run.sh train
part generate-8b 60 env SIZES=qwen3-8b RUNS=1 PEER=off DECODERS="$decoded+grouped $decoded+each $decoded+grouped+auto+rows $decoded+grouped+tuned" \
    bench/gpu/run.sh generate
part profile-8b 90 env SIZES=qwen3-8b PROFILED=generate OUT="$OUT/profile-8b" bench/gpu/run.sh profile
"$PY" bench/gpu/report.py "$OUT" | tee "$OUT/table.txt"
