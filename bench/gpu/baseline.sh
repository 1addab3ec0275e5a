#!/usr/bin/env bash
# Builds the CUDA binary of an earlier revision, for a GPU session to time
# it beside the current one on the same card (session.sh runs it when it
# finds it): .cuda/bin/rloo-before.gz, gzipped so that both binaries fit
# what a call carries. Run before scripts/cuda/build.sh, which it shares
# the toolchain and the build cache with (a binary already built is kept).
#
#   bench/gpu/baseline.sh REV
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=$(git rev-parse --short "${1:?a revision}")
root=$PWD/.cuda
tree=$(mktemp -d)/rloo-$rev
git worktree add --quiet --detach "$tree" "$rev"
trap 'git worktree remove --force "$tree"' EXIT
mkdir -p "$root/bin"
# The revision's build script builds into the shared .cuda; the current binary waits aside.
[ ! -e "$root/bin/rloo" ] || mv "$root/bin/rloo" "$root/bin/rloo.current"
ln -s "$root" "$tree/.cuda"
bash "$tree/scripts/cuda/build.sh"
gzip -c "$root/bin/rloo" >"$root/bin/rloo-before.gz"
echo "$rev" >"$root/bin/rloo-before.rev"
rm "$root/bin/rloo"
[ ! -e "$root/bin/rloo.current" ] || mv "$root/bin/rloo.current" "$root/bin/rloo"
echo "built $root/bin/rloo-before.gz ($rev, $(du -h "$root/bin/rloo-before.gz" | cut -f1))"
