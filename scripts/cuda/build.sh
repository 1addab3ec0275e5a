#!/usr/bin/env bash
# Builds rloo with CUDA (sm_90) on a machine that may have no GPU and no CUDA
# toolkit. Idempotent: a second run reuses the toolchain and the build cache.
#
#   scripts/cuda/build.sh            # -> .cuda/bin/rloo (stripped)
#   scripts/cuda/build.sh --check    # type-checks the CUDA code only (CI)
#
# The toolchain is CUDA 13.0 from PyPI wheels, the versions PyTorch's CUDA 13
# build pins, so the binary matches the libraries on the GPU machine. nvcc
# stays at 13.0.x: driver 580 rejects PTX from newer toolkits.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD/.cuda
venv=$root/toolkit
mkdir -p "$root/bin"

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import nvidia' 2>/dev/null || [ ! -x "$(ls -d "$venv"/lib/python3*/site-packages/nvidia/cu13 2>/dev/null)/bin/nvcc" ]; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        "cuda-toolkit[nvcc,crt,nvvm,cccl,cudart,cublas,curand,nvrtc]==13.0.2" "nvidia-nccl-cu13==2.28.9"
fi
cuda=$(ls -d "$venv"/lib/python3*/site-packages/nvidia/cu13)
nccl=$(dirname "$cuda")/nccl

# Linking wants unversioned names, nvcc.profile looks in lib64, and no wheel
# ships libcuda.so: a stub of the driver's symbols serves the link step only
# (the GPU machine's driver provides the real libcuda.so.1 at run time).
for lib in "$cuda"/lib/lib*.so.[0-9]* "$nccl"/lib/lib*.so.[0-9]*; do
    base=${lib%%.so.*}.so
    [ -e "$base" ] || ln -s "$(basename "$lib")" "$base"
done
[ -e "$cuda/lib64" ] || ln -s lib "$cuda/lib64"
stubs=$root/stubs
if [ ! -e "$stubs/libcuda.so" ]; then
    mkdir -p "$stubs"
    # A fresh machine has not unpacked cudarc yet (ls fails: not an error here).
    sys=$(ls -d "$HOME"/.cargo/registry/src/*/cudarc-0.19.10/src/driver/sys/mod.rs 2>/dev/null | head -1 || true)
    if [ -z "$sys" ]; then
        cargo fetch --locked >/dev/null
        sys=$(ls -d "$HOME"/.cargo/registry/src/*/cudarc-0.19.10/src/driver/sys/mod.rs | head -1)
    fi
    grep -o 'pub unsafe fn cu[A-Za-z0-9_]*' "$sys" | sed 's/pub unsafe fn //' | sort -u |
        sed 's/.*/int &(void) { return 999; }/' >"$stubs/libcuda.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so" "$stubs/libcuda.c"
fi

export PATH=$cuda/bin:$PATH
export CUDA_HOME=$cuda CUDA_PATH=$cuda CUDA_ROOT=$cuda
export CUDA_COMPUTE_CAP=90 CUDARC_CUDA_VERSION=13000
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-2}
export LIBRARY_PATH=$stubs:$cuda/lib:$nccl/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
export RUSTFLAGS="${RUSTFLAGS:-} -L native=$stubs -L native=$cuda/lib"
if [ "${1:-}" = --check ]; then
    cargo check --release --locked --features cuda --target-dir "$root/target" --all-targets
    exit
fi
cargo build --release --locked --features cuda --target-dir "$root/target" --bin rloo "$@"
cp "$root/target/release/rloo" "$root/bin/rloo.tmp"
strip "$root/bin/rloo.tmp"
mv "$root/bin/rloo.tmp" "$root/bin/rloo"
echo "built $root/bin/rloo ($(du -h "$root/bin/rloo" | cut -f1))"
