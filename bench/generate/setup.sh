#!/usr/bin/env bash
# Create bench/.venv with the pinned transformers side of the benchmark.
# Never run by CI. CPU-only use; the default PyPI wheels are fine.
set -euo pipefail
BENCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$BENCH_DIR/.venv"
PYTHON="${PYTHON:-python3}"

"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
"$VENV/bin/pip" install "torch==2.15.0" "transformers==5.23.0"
"$VENV/bin/python" -c 'import torch, transformers, tokenizers; print("torch", torch.__version__, "| transformers", transformers.__version__, "| tokenizers", tokenizers.__version__)'
echo "ready: $VENV (run bench/generate/run.sh)"
