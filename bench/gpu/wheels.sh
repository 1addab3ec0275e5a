#!/usr/bin/env bash
# Downloads, here, the peer's packages that the GPU machine lacks (it has
# PyTorch, transformers, accelerate and peft, and no network) into
# bench/.cache/wheels, which bench/gpu/run.sh installs from there. Carry
# the folder with the run (about 2 MB).
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=bench/.cache/wheels
mkdir -p "$dest"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" trl==1.16.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
ls -l "$dest"
