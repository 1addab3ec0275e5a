#!/usr/bin/env bash
# Runs the register-resident attention kernels (src/model/kernels/cuda/
# flash.cuh) on the host, one thread per CUDA thread, against an f64
# reference: their fragment and index logic checked without a GPU. Needs a
# C++17 compiler only (CXX, default c++). About a minute and a half on two cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"${CXX:-c++}" -std=c++17 -O2 -pthread -o "$out/emulate" src/model/kernels/cuda/emulate.cpp
"$out/emulate"
