#!/usr/bin/env bash
# Packs what a GPU call carries into .cuda/carry, within the 64 MiB a call
# takes with the repository: the CUDA build gzipped (about 15 MB where it
# is 44), and the earlier revision's build with its revision, if
# bench/gpu/baseline.sh made them. session.sh unpacks them there.
#
#   scripts/cuda/build.sh && bench/gpu/pack.sh    # then carry .cuda/carry
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .cuda/carry
gzip -c .cuda/bin/rloo >.cuda/carry/rloo.gz
for f in rloo-before.gz rloo-before.rev; do
    if [[ -e .cuda/bin/$f ]]; then cp -f ".cuda/bin/$f" .cuda/carry/; else rm -f ".cuda/carry/$f"; fi
done
du -ch .cuda/carry/* | tail -1
