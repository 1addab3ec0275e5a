#!/usr/bin/env bash
# The GPU benchmark, in one call on the GPU machine, with the CUDA build
# (scripts/cuda/build.sh: .cuda/bin/rloo) and the peer's wheels
# (bench/gpu/wheels.sh: bench/.cache/wheels) carried there. Prints a short
# table last (bench/gpu/report.py); logs and results stay in OUT.
#
#   bench/gpu/run.sh [PART...]   PART: peaks generate long train nccl profile
#                                (default: peaks generate train nccl)
#
#   peaks     bf16 matrix product rate and copy bandwidth (bench/gpu/peaks.py)
#   generate  rloo generate --device cuda --bf16 (with each of DECODERS)
#             against transformers' generate: 64 prompts x 4 x 128 new
#             tokens, batch 256, per SIZES
#   long      rloo generate over long prompts: LONG_ROWS prompts of 1,600
#             tokens x 1 sample, 256 new tokens, at the first of SIZES, with
#             the keys split across blocks and not (RLOO_DECODE_SPLIT: auto,
#             off), as a server's few requests over long contexts decode
#   train     rloo train against TRL's RLOOTrainer: 64 prompts x k = 4, 128
#             new tokens, bf16, reward-model scoring, one epoch, one
#             mini-batch, per ARMS; the 8B arm's rollouts timed on CUDA
#             events as generation's are (RLOO_DECODE_TIMING=on); a PPO arm
#             (SIZE-ppo) trains the same step with PPO, its critic starting
#             from the reward model, without a peer (TRL's PPO is
#             experimental)
#   serve     rloo serve --device cuda --bf16 at the first of SIZES under
#             bench/serve/load.py (1, 8 and 32 clients streaming 64 tokens a
#             request), its steps launched from the host and replayed from
#             recordings (RLOO_DECODE_STEP: shrink, graph); not in the
#             default parts
#   nccl      one RLOO run on the GPU through every collective of a job
#             (RLOO_DIST_BACKEND=nccl, one rank) beside the same run alone
#   profile   the kernels of a short generation (the benchmark's 256 rows, 16 new
#             tokens; each kernel of a recorded step on its own), of one
#             RLOO step's training phase over one micro-batch (16 prompts x 4
#             x 128 tokens, the benchmark's micro-batch) and of the same step's
#             scoring and reference passes, at the first of SIZES, by total
#             time, with the host's CUDA calls, from Nsight
#             Systems (else Nsight Compute, bench/gpu/kernels.py); not in the
#             default parts
#
# Env: OUT         results and logs (default $OUT, else /tmp/rloo-gpu-bench)
#      SIZES       generation models: 410m 1b (default both)
#      ARMS        training arms: 410m-full 1b-full 1b-lora qwen3-8b-lora 410m-ppo
#                  (default the first three; the 8B arm makes a 16 GB model)
#      DECODERS    rloo's decoding variants, SAMPLER+ATTENTION[+APPEND[+STEP[+BIAS[+HEADS[+ROWS[+VALUES]]]]]]]:
#                  how tokens are picked (RLOO_SAMPLER: race, host), how a step attends over the
#                  cache (RLOO_DECODE_ATTENTION: lanes, a key per lane; fused, a key per warp;
#                  composed), how it rotates and appends its keys (RLOO_DECODE_APPEND: fused,
#                  composed), how the batch's steps are launched (RLOO_DECODE_STEP: graph, one
#                  CUDA graph replayed per step; fixed; shrink), how dense layers add their
#                  biases (RLOO_DENSE_BIAS: epilogue, pass), how many query heads a block of the
#                  kernel with a lane per key takes (RLOO_DECODE_HEADS: grouped, those of a
#                  key/value head; each), how many rows (RLOO_DECODE_ROWS: auto, each, prompt,
#                  the rows of a prompt) and how it reads value rows (RLOO_DECODE_VALUES:
#                  packed, rows). A piece left out or empty, and the whole
#                  variant `default`, leave the binary's own choice. Each run logs where its steps' time goes
#                  (RLOO_DECODE_TIMING=on). A variant ending in +tuned times cuBLASLt's
#                  candidates for each product of a step (RLOO_GEMM=tuned); one ending in
#                  +rowsgemm makes a step's products that cuBLAS's tiles would not spread over
#                  the GPU by the rows kernel, split along k (RLOO_GEMM=rows). Default: default
#      ATTENTION   rloo's variants in the training runs, KERNELS[+HEADS[+STEP[+DECODE[+BIAS[+MLP[+MASK[+ROWS]]]]]]]:
#                  the attention kernels for whole sequences (RLOO_ATTENTION: flash, tensor,
#                  rows), how they get their heads from a fused projection
#                  (RLOO_ATTENTION_HEADS: fused, composed), how the rollouts' decoding steps are
#                  launched (RLOO_DECODE_STEP) and attend (RLOO_DECODE_ATTENTION), how dense
#                  layers add their biases (RLOO_DENSE_BIAS), whether the MLP's wide input is
#                  kept for the backward or made again there (RLOO_MLP_INPUT: kept, remade),
#                  what masks the flash kernels (RLOO_ATTENTION_MASK: spans, bias) and how many
#                  rows a block of the decoding kernel takes (RLOO_DECODE_ROWS). As DECODERS: a
#                  piece left out, and `default`, leave the binary's own. A variant ending in
#                  +offload moves the reference and the reward model to host memory for the
#                  training phase (ref_reward_offload); one ending in +f32 keeps the
#                  weights' f32 masters whole beside their bf16 copies (RLOO_MASTERS=f32);
#                  one ending in +tuned or +rowsgemm (before or after the others) makes the
#                  rollouts' products as DECODERS says.
#                  Default: default
#      PROFILED    what `profile` profiles: generate train scoring (default all three)
#      PEER        on (default), or off: rloo's runs alone, without transformers' generate
#                  and TRL (for a short call whose peer figures an earlier one on the card gave)
#      RUNS        generation runs of each side (default 3)
#      LONG_ROWS   rows of the long prompts' decoding (default 4)
#      TRAIN_RUNS  training runs of each side per arm (default 2)
#      STEPS       optimizer steps per training run, the first not counted (default 4)
#      MICRO       completions per forward and backward, both sides (default 64)
#      LIMIT       seconds one run may take before it is stopped (default 300)
#      MODELS      where the models are made (default /tmp/rloo-gpu-models)
#      RLOO        the CUDA binary (default .cuda/bin/rloo)
#      PY          the Python with torch and transformers (default python3)
#      DEVICE      cuda (default), or cpu for a dry run of the script itself
#                  (with SIZES=tiny ARMS=tiny-full RLOO=target/release/rloo)
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-/tmp/rloo-gpu-bench}
SIZES=${SIZES:-410m 1b}
DECODERS=${DECODERS:-default}
ATTENTION=${ATTENTION:-default}
ARMS=${ARMS:-410m-full 1b-full 1b-lora}
RUNS=${RUNS:-3}
TRAIN_RUNS=${TRAIN_RUNS:-2}
STEPS=${STEPS:-4}
MICRO=${MICRO:-64}
LIMIT=${LIMIT:-300}
MODELS=${MODELS:-/tmp/rloo-gpu-models}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
PEER=${PEER:-on}
PROFILED=${PROFILED:-generate train scoring}
LONG_ROWS=${LONG_ROWS:-4}
PARTS=${*:-peaks generate train nccl}
PROMPTS=64 K=4 NEW=128
export RLOO=${RLOO:-$ROOT/.cuda/bin/rloo} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export COMPLETIONS_PER_STEP=$((PROMPTS * K))
if [[ $DEVICE == cuda ]]; then rloo_cmd=("$ROOT/scripts/cuda/run.sh"); else rloo_cmd=("$RLOO"); fi
rloo=(timeout "$LIMIT" "${rloo_cmd[@]}")
mkdir -p "$OUT" "$MODELS"
log() { echo "== [${SECONDS} s] $*" >&2; }

# The peer's packages that the machine lacks (TRL and its datasets), from
# carried wheels, into a folder of their own, once a machine.
site=/tmp/rloo-bench-site
if ! "$PY" -c 'import trl' 2>/dev/null && ls bench/.cache/wheels/*.whl >/dev/null 2>&1; then
    [[ -e $site/installed ]] || { "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" bench/.cache/wheels/*.whl && touch "$site/installed"; }
    export PYTHONPATH=$site
fi
"$PY" -c 'import trl; print("trl", trl.__version__)' >&2 || log "no TRL: the training arms run rloo alone"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$OUT/gpu.txt" 2>&1 ||
    echo "no GPU (nvidia-smi failed)" >"$OUT/gpu.txt"
cat "$OUT/gpu.txt" >&2

models() { # SIZE: makes the models once
    [ -f "$MODELS/$1/shape.json" ] && return
    log "making the $1 models"
    "$PY" bench/gpu/make_models.py "$1" "$MODELS/$1" >"$OUT/make-$1.log" 2>&1 || { tail -5 "$OUT/make-$1.log"; return 1; }
}

part() { [[ " $PARTS " == *" $1 "* ]]; }

# flags VARIANT: sets pieces to VARIANT without its trailing +offload,
# +f32, +tuned and +rowsgemm, offload to whether it had +offload, masters
# to f32 where it had +f32 (else empty), and gemm to tuned or rows where
# it had +tuned or +rowsgemm (else empty).
flags() {
    pieces=$1 offload=false masters= gemm=
    while [[ $pieces == *+offload || $pieces == *+f32 || $pieces == *+tuned || $pieces == *+rowsgemm ]]; do
        [[ $pieces == *+offload ]] && offload=true pieces=${pieces%+offload}
        [[ $pieces == *+f32 ]] && masters=f32 pieces=${pieces%+f32}
        [[ $pieces == *+tuned ]] && gemm=tuned pieces=${pieces%+tuned}
        [[ $pieces == *+rowsgemm ]] && gemm=rows pieces=${pieces%+rowsgemm}
    done
}

if part peaks && [[ $DEVICE == cuda ]]; then
    log "peaks"
    "$PY" bench/gpu/peaks.py >"$OUT/peaks.json" 2>"$OUT/peaks.log" || tail -5 "$OUT/peaks.log"
fi

if part generate; then
    for size in $SIZES; do
        models "$size" || continue
        dir=$MODELS/$size
        for i in $(seq 1 "$RUNS"); do
            log "generate $size run $i"
            for decoder in $DECODERS; do
                # The same seed every run: the runs must give the same tokens.
                run=$OUT/gen-$size-rloo_$decoder-$i
                flags "${decoder#default}"
                IFS=+ read -r sampler attention append step bias heads rows values <<<"$pieces"
                RLOO_DECODE_TIMING=on env ${gemm:+RLOO_GEMM=$gemm} ${sampler:+RLOO_SAMPLER=$sampler} ${attention:+RLOO_DECODE_ATTENTION=$attention} \
                    ${append:+RLOO_DECODE_APPEND=$append} ${step:+RLOO_DECODE_STEP=$step} ${bias:+RLOO_DENSE_BIAS=$bias} \
                    ${heads:+RLOO_DECODE_HEADS=$heads} ${rows:+RLOO_DECODE_ROWS=$rows} ${values:+RLOO_DECODE_VALUES=$values} \
                    "${rloo[@]}" generate --device "$DEVICE" --bf16 --model "$dir/policy" \
                    --prompts "$dir/prompts.jsonl" --output "$run.jsonl" --num-return-sequences $K \
                    --max-new-tokens $NEW --temperature 1.0 --batch-size $((PROMPTS * K)) --ignore-eos --seed 1 \
                    2>"$run.log" || tail -5 "$run.log"
            done
            [[ $PEER == off ]] || timeout "$LIMIT" "$PY" bench/generate/hf_generate.py "$dir/policy" --prompts "$dir/prompts.jsonl" \
                --device "$DEVICE" --bf16 --num-return-sequences $K --max-new-tokens $NEW --seed "$i" \
                >"$OUT/gen-$size-hf-$i.json" 2>"$OUT/gen-$size-hf-$i.log" || tail -5 "$OUT/gen-$size-hf-$i.log"
        done
    done
    "$PY" -c 'import vllm' 2>/dev/null && echo yes >"$OUT/vllm.txt" || echo no >"$OUT/vllm.txt"
fi

if part long; then
    size=${SIZES%% *}
    if models "$size"; then
        dir=$MODELS/$size
        # Prompts of 1,600 words from the benchmark's (the synthetic tokenizer makes a token of each word).
        "$PY" - "$dir/prompts.jsonl" "$OUT/long-prompts.jsonl" "$LONG_ROWS" <<'EOF'
import json, sys
words = " ".join(json.loads(l)["prompt"] for l in open(sys.argv[1]) if l.strip()).split()
with open(sys.argv[2], "w") as f:
    for i in range(int(sys.argv[3])):
        f.write(json.dumps({"prompt": " ".join(words[(97 * i + j) % len(words)] for j in range(1600))}) + "\n")
EOF
        for i in $(seq 1 "$RUNS"); do
            for split in auto off; do
                log "long prompts $size, keys split $split, run $i"
                run=$OUT/long-$size-$split-$i
                RLOO_DECODE_SPLIT=$split RLOO_DECODE_ATTENTION=lanes RLOO_DECODE_APPEND=fused RLOO_DECODE_STEP=graph \
                    "${rloo[@]}" generate --device "$DEVICE" --bf16 --model "$dir/policy" \
                    --prompts "$OUT/long-prompts.jsonl" --output "$run.jsonl" --max-new-tokens 256 \
                    --temperature 1.0 --batch-size "$LONG_ROWS" --ignore-eos --seed 1 2>"$run.log" || tail -5 "$run.log"
            done
        done
    fi
fi

if part train; then
    for arm in $ARMS; do
        size=${arm%-*} kind=${arm##*-}
        models "$size" || continue
        dir=$MODELS/$size
        trl_arm=() checkpointing=false lora="" timing=off algo=rloo
        case "$kind" in
            full) ;;
            ppo) algo=ppo ;;
            lora) trl_arm=(--lora-r 16)
                  lora=$'[peft]\nuse_peft = true\nlora_r = 16\nlora_alpha = 32\nlora_target_modules = ["all-linear"]' ;;
            *) log "unknown arm $arm (SIZE-full, SIZE-lora or SIZE-ppo)"; continue ;;
        esac
        # The 8B policy runs as a LoRA user runs it: bf16 weights, gradient checkpointing
        # (qwen3-tiny: the same on the CPU, a dry run). Its rollouts' steps are timed as
        # generation's are (CUDA events, one wait after the prefill): whether they were
        # recorded, and how long they took on the GPU.
        if [[ $size == qwen3-8b || $size == qwen3-tiny ]]; then
            trl_arm+=(--gradient-checkpointing --weights-bf16) checkpointing=true timing=on
        fi
        for i in $(seq 1 "$TRAIN_RUNS"); do
            for attention in $ATTENTION; do
                log "train $arm run $i: rloo, $attention attention"
                flags "${attention#default}"
                IFS=+ read -r kernels heads step decode bias mlp mask rows <<<"$pieces"
                run=$OUT/train-$arm-rloo_$attention-$i
                # Left out when off, the default, so that a binary older than the option reads the file.
                offload_line="# ref_reward_offload = false"
                [[ $offload == true ]] && offload_line="ref_reward_offload = true"
                sed -e "s|@MODELS@|$dir|" -e "s|@DEVICE@|$DEVICE|" -e "s|@OUT@|$run|" -e "s|@MICRO@|$MICRO|" \
                    -e "s|@ACCUMULATION@|$((COMPLETIONS_PER_STEP / MICRO))|" \
                    -e "s|@EPISODES@|$((STEPS * COMPLETIONS_PER_STEP))|" -e "s|@CHECKPOINTING@|$checkpointing|" \
                    -e "s|@OFFLOAD@|$offload_line|" -e "s|@ALGO@|$algo|" \
                    bench/gpu/rloo.toml.in >"$run.toml"
                printf '\n%s\n' "$lora" >>"$run.toml"
                RLOO_OUT=$run "$PY" bench/train/measure.py rloo "$run.json" -- env RLOO_DECODE_TIMING=$timing ${gemm:+RLOO_GEMM=$gemm} ${masters:+RLOO_MASTERS=$masters} ${kernels:+RLOO_ATTENTION=$kernels} \
                    ${heads:+RLOO_ATTENTION_HEADS=$heads} ${step:+RLOO_DECODE_STEP=$step} ${decode:+RLOO_DECODE_ATTENTION=$decode} \
                    ${bias:+RLOO_DENSE_BIAS=$bias} ${mlp:+RLOO_MLP_INPUT=$mlp} ${mask:+RLOO_ATTENTION_MASK=$mask} \
                    ${rows:+RLOO_DECODE_ROWS=$rows} timeout "$LIMIT" "${rloo_cmd[@]}" train "$run.toml" >"$run.log" 2>&1 || tail -5 "$run.log"
                # The trained model is of no further use, and would travel back with OUT.
                rm -rf "$run"/*.safetensors "$run"/checkpoint-* "$run"/critic
            done
            # TRL after rloo: a run the budget stops keeps rloo's figures.
            if [[ $PEER != off && $algo == rloo ]] && "$PY" -c 'import trl' 2>/dev/null; then
                log "train $arm run $i: TRL"
                "$PY" bench/train/measure.py trl "$OUT/train-$arm-trl-$i.json" -- \
                    timeout "$LIMIT" "$PY" bench/train/trl_rloo.py --model "$dir/policy" --prompts "$dir/prompts.jsonl" \
                    --reward-model "$dir/reward" --device "$DEVICE" --bf16 --steps "$STEPS" --seed "$i" \
                    --prompts-per-step $PROMPTS --k $K --max-new-tokens $NEW --micro-batch "$MICRO" "${trl_arm[@]}" \
                    >"$OUT/train-$arm-trl-$i.log" 2>&1 || tail -5 "$OUT/train-$arm-trl-$i.log"
            fi
        done
    done
fi

if part serve; then
    size=${SIZES%% *}
    if models "$size"; then
        for step in shrink graph; do
            log "serve $size, steps $step"
            # TMPDIR: the server's own log stays in OUT.
            RLOO_DECODE_STEP=$step RLOO_CMD="${rloo_cmd[*]}" DEVICE=$DEVICE EXTRA=--bf16 THREADS=4 TMPDIR=$OUT \
                MODEL_DIR=$MODELS/$size/policy PROMPTS=$MODELS/$size/prompts.jsonl REQUESTS=4 \
                JSON=$OUT/serve-$size-$step.json timeout "$LIMIT" bench/serve/run.sh \
                >"$OUT/serve-$size-$step.log" 2>&1 || tail -5 "$OUT/serve-$size-$step.log"
        done
    fi
fi

if part nccl && [[ $DEVICE == cuda ]]; then
    # The fixture policy, 20 steps: alone, then as a job of one over NCCL.
    steps=(examples/rloo.toml --set train.total_episodes=320 --set train.num_sample_generations=0
        --set model.device='"cuda"')
    log "nccl: alone"
    "${rloo[@]}" train "${steps[@]}" --set train.output_dir="\"$OUT/nccl-alone\"" >"$OUT/nccl-alone.log" 2>&1 ||
        tail -5 "$OUT/nccl-alone.log"
    log "nccl: a job of one rank over NCCL"
    RLOO_DIST_BACKEND=nccl RUST_LOG=info "${rloo[@]}" launch --nproc_per_node 1 --timeout 120 -- \
        train "${steps[@]}" --set train.output_dir="\"$OUT/nccl-job\"" >"$OUT/nccl-job.log" 2>&1 ||
        tail -5 "$OUT/nccl-job.log"
fi

if part profile && [[ $DEVICE == cuda ]]; then
    size=${SIZES%% *}
    nsys=$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda*/bin/nsys \
        /usr/local/cuda*/nsight-systems*/bin/nsys 2>/dev/null | tail -1)
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu \
        /usr/local/cuda*/nsight-compute*/ncu 2>/dev/null | tail -1)
    if [[ -z $nsys && -z $ncu ]]; then
        log "profile: neither nsys nor ncu on this machine"
    elif models "$size"; then
        dir=$MODELS/$size
        head -16 "$dir/prompts.jsonl" >"$OUT/profile-prompts.jsonl"
        profiled() { # NAME PHASE COMMAND...: the kernels of one run (of one phase of its step, RLOO_CUDA_PROFILE,
            # unless PHASE is -) by total time, and the host's CUDA calls. Nsight Compute times kernels one
            # by one: it measures the first 9,000 launches.
            local name=$1 phase=$2 window=()
            shift 2
            log "profile: $name"
            if [[ -n $nsys ]]; then
                # Nsight Systems: kernels and driver calls as they ran, without replay.
                [[ $phase == - ]] || window=(--capture-range cudaProfilerApi)
                RLOO_CUDA_PROFILE=${phase/#-/off} timeout "$LIMIT" "$nsys" profile --trace cuda --cuda-graph-trace node --sample none \
                    --cpuctxsw none --force-overwrite true "${window[@]}" -o "/tmp/profile-$name" "$@" \
                    >"$OUT/profile-$name.log" 2>&1 || tail -5 "$OUT/profile-$name.log"
                "$nsys" stats --report cuda_gpu_kern_sum --report cuda_api_sum --format table \
                    "/tmp/profile-$name.nsys-rep" 2>&1 | cut -c1-180 >"$OUT/profile-$name.txt"
                grep -A28 -m2 -E "cuda_gpu_kern_sum|cuda_api_sum" "$OUT/profile-$name.txt"
            else
                [[ $phase == - ]] || window=(--profile-from-start off)
                RLOO_CUDA_PROFILE=${phase/#-/off} timeout "$LIMIT" "$ncu" --target-processes all --csv --page raw \
                    --metrics gpu__time_duration.sum "${window[@]}" --launch-count 9000 "$@" \
                    >"$OUT/profile-$name.csv" 2>"$OUT/profile-$name.log" || tail -5 "$OUT/profile-$name.log"
                "$PY" bench/gpu/kernels.py "$OUT/profile-$name.csv" >"$OUT/profile-$name.txt" && cat "$OUT/profile-$name.txt"
            fi
        }
        # Generation at the benchmark's 256 rows; a step over 16 prompts: its training (one micro-batch), its scoring.
        [[ " $PROFILED " != *" generate "* ]] || profiled generate - "${rloo_cmd[@]}" generate --device cuda --bf16 --model "$dir/policy" \
            --prompts "$dir/prompts.jsonl" --output "$OUT/profile-generate.jsonl" --num-return-sequences $K \
            --max-new-tokens 16 --temperature 1.0 --batch-size $((PROMPTS * K)) --ignore-eos --seed 1
        for phase in train scoring; do
            [[ " $PROFILED " == *" $phase "* ]] || continue
            run=$OUT/profile-$phase
            sed -e "s|@MODELS@|$dir|" -e "s|@DEVICE@|cuda|" -e "s|@OUT@|$run|" -e "s|@MICRO@|$((16 * K))|" \
                -e "s|@ACCUMULATION@|1|" -e "s|@EPISODES@|$((16 * K))|" -e "s|@CHECKPOINTING@|false|" \
                -e "s|@OFFLOAD@|false|" -e "s|^path = \"$dir/prompts.jsonl\"|path = \"$OUT/profile-prompts.jsonl\"|" \
                bench/gpu/rloo.toml.in >"$run.toml"
            # RLOO_CUDA_PROFILE's names for the step's phases.
            profiled "$phase" "${phase/train/training}" "${rloo_cmd[@]}" train "$run.toml"
        done
    fi
fi

MODELS=$MODELS MICRO=$MICRO "$PY" bench/gpu/report.py "$OUT" | tee "$OUT/table.txt"
