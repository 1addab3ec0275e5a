#!/usr/bin/env bash
# Add TRL and PEFT to bench/.venv (made by generate/setup.sh with torch and
# transformers). Never run by CI.
set -euo pipefail
BENCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ ! -x "$BENCH_DIR/.venv/bin/python" ]]; then
    "$BENCH_DIR/generate/setup.sh"
fi
"$BENCH_DIR/.venv/bin/pip" install "trl==1.16.0" "peft==0.21.2"
"$BENCH_DIR/.venv/bin/python" -c 'import trl, peft; print("trl", trl.__version__, "| peft", peft.__version__)'
echo "ready: $BENCH_DIR/.venv (run bench/train/run.sh)"
