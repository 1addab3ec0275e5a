#!/usr/bin/env bash
# rloo serve under load: throughput and latency at 1, 8 and 32 concurrent
# clients on one model, printed as a table with the ratio against one client.
#
# Env: MODEL_DIR  model to serve (default: the RLOO model of `rloo pipeline`,
#                 made by running the pipeline if missing)
#      PROMPTS    JSONL rows with a text `prompt` (default: the pipeline's held-out prompts)
#      CLIENTS    concurrency levels (default 1,8,32)
#      REQUESTS   requests per client at each level (default 8)
#      MAX_TOKENS new tokens per request, exactly (default 64)
#      THREADS    threads for the server (default 2)
#      DEVICE     cpu, cuda (default cpu); EXTRA: more `rloo serve` flags
#      RLOO_CMD   the rloo command (default: a release build made here; on a
#                 GPU machine, scripts/cuda/run.sh)
#      JSON       also write the levels' figures here
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
MODEL_DIR="${MODEL_DIR:-$ROOT/runs/pipeline/rloo}"
PROMPTS="${PROMPTS:-$ROOT/runs/pipeline/data/eval_prompts.jsonl}"
export RAYON_NUM_THREADS="${THREADS:-2}"

# Not RLOO: scripts/cuda/run.sh reads that as the binary it runs.
if [[ -n ${RLOO_CMD:-} ]]; then
    rloo=$RLOO_CMD
else
    echo "== building rloo (release)" >&2
    (cd "$ROOT" && cargo build --release)
    rloo="${CARGO_TARGET_DIR:-$ROOT/target}/release/rloo"
fi
if [[ ! -f "$MODEL_DIR/config.json" ]]; then
    echo "== no model at $MODEL_DIR: running rloo pipeline" >&2
    (cd "$ROOT" && "$rloo" pipeline)
fi

LOG="$(mktemp "${TMPDIR:-/tmp}/rloo-serve-bench.XXXXXX")"
# shellcheck disable=SC2086
"$rloo" serve --model "bench=$MODEL_DIR" --port 0 --device "${DEVICE:-cpu}" ${EXTRA:-} 2>"$LOG" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
    grep -q "http://" "$LOG" && break
    kill -0 $SERVER 2>/dev/null || { cat "$LOG" >&2; exit 1; }
    sleep 0.1
done
URL="$(grep -o 'http://[^ ]*' "$LOG" | head -1)"
echo "== serving $MODEL_DIR at $URL with $RAYON_NUM_THREADS threads" >&2
python3 "$HERE/load.py" "$URL" bench "$PROMPTS" --clients "${CLIENTS:-1,8,32}" \
    --requests-per-client "${REQUESTS:-8}" --max-tokens "${MAX_TOKENS:-64}" ${JSON:+--json "$JSON"}
