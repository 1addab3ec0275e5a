#!/usr/bin/env bash
# Runs the CUDA build of rloo on a GPU machine whose CUDA libraries come with
# PyTorch's CUDA 13 wheels (`nvidia/cu13/lib`, `nvidia/nccl/lib`); the driver's
# libcuda.so.1 is the system's.
#
#   scripts/cuda/run.sh check --device cuda      # any rloo command line
#   RLOO=path/to/rloo scripts/cuda/run.sh ...    # another binary
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
rloo=${RLOO:-$here/../../.cuda/bin/rloo}
if [ ! -x "$rloo" ]; then
    echo "no CUDA build at $rloo: run scripts/cuda/build.sh (and carry .cuda/bin to this machine)" >&2
    exit 2
fi
nvidia=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
if [ -z "$nvidia" ]; then
    echo "no nvidia CUDA wheels found (python3 -c 'import nvidia' failed): install PyTorch for CUDA 13" >&2
    exit 2
fi
for lib in "$nvidia"/cu13/lib "$nvidia"/nccl/lib; do
    [ -d "$lib" ] && LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
done
export LD_LIBRARY_PATH
exec "$rloo" "$@"
