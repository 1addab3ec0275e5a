#!/usr/bin/env bash
# Runs the register-resident attention kernels (src/model/kernels/cuda/
# flash.cuh) on the host, one thread per CUDA thread, against an f64
# reference, the kernels that cut attention's heads out of a fused
# projection (heads.cuh), the norms (norms.cuh), the elementwise kernels
# (elementwise.cuh), the decoding-attention kernels (decode.cuh), the LM
# head's log-prob kernels (logprobs.cuh), the non-finite check
# (finite.cuh), the race sampler (race.cuh, against the rule of
# src/generate/race.rs), the product of few rows split along k
# (rows_gemm.cuh) and AdamW over split masters (adamw.cuh): their fragment
# and index logic checked without a GPU. Then a few small cases again
# under ThreadSanitizer, which reports any read of shared memory that no
# barrier orders after the write it sees (a missing __syncthreads). Needs a
# C++17 compiler (CXX, default c++) with -fsanitize=thread; about two
# minutes on two cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cxx=${CXX:-c++}
src=src/model/kernels/cuda/emulate.cpp
"$cxx" -std=c++17 -O2 -pthread -o "$out/emulate" "$src"
"$out/emulate"
"$cxx" -std=c++17 -O1 -g -fsanitize=thread -pthread -o "$out/emulate-races" "$src"
TSAN_OPTIONS="halt_on_error=1 exitcode=66" "$out/emulate-races" races
