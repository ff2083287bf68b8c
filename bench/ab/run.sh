#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# Decode attention of two or more revisions timed in turn inside one program (see
# ab_attention.cpp): each revision's include/ is taken from git, compiled into a namespace of its
# own, and linked with the others. A working tree's uncommitted headers are the revision WORKTREE.
#
#   bench/ab/run.sh cdadbfa HEAD                                   # every cell, 15 iterations
#   bench/ab/run.sh cdadbfa WORKTREE -- --benchmark_filter='<bfloat16>/H_q:32'
#   KVCACHE_AB_FLAGS=-mno-avx512f bench/ab/run.sh cdadbfa HEAD        # another vector width
#   KVCACHE_AB_FLAGS_r1=-mno-avx512f bench/ab/run.sh HEAD HEAD         # ... for one revision (r1)
#   KVCACHE_AB_CXX=clang++ bench/ab/run.sh cdadbfa HEAD                # another compiler
#   KVCACHE_AB_KEEP=/tmp/ab bench/ab/run.sh HEAD -- ...                # keep the program (for perf)
#   KVCACHE_AB_S=512,4096 bench/ab/run.sh cdadbfa HEAD                 # DecodeAB at other lengths
#   bench/ab/run.sh cdadbfa HEAD HEAD                                  # HEAD twice: what placement alone moves
#
# Revisions are named r0, r1, ... in the counters (vs_read:r0 is the first one given), in the
# order given. Needs g++ (or KVCACHE_AB_CXX) and the Debian packages of scripts/install-deps.sh.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
revisions=()
while [[ $# -gt 0 && "$1" != "--" ]]; do revisions+=("$1"); shift; done
[[ $# -gt 0 ]] && shift
if [[ ${#revisions[@]} -lt 1 ]]; then
  echo "usage: bench/ab/run.sh REVISION... [-- benchmark arguments]" >&2
  exit 2
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cxx="${KVCACHE_AB_CXX:-g++}"
flags=(-std=gnu++20 -O3 -DNDEBUG -march=native ${KVCACHE_AB_FLAGS:-} -isystem /usr/include/eigen3)
objects=()
list=""
for i in "${!revisions[@]}"; do
  rev="${revisions[$i]}"
  name="r$i"
  mkdir -p "$work/$name"
  if [[ "$rev" == WORKTREE ]]; then
    cp -r "$root/include" "$work/$name/"
    echo "kvcache ab: $name = the working tree's include/ ($(git -C "$root" rev-parse --short HEAD) + uncommitted)"
  else
    git -C "$root" archive "$rev" include | tar -x -C "$work/$name"
    echo "kvcache ab: $name = $rev ($(git -C "$root" rev-parse --short "$rev"))"
  fi
  own="KVCACHE_AB_FLAGS_$name"
  # A revision from before storage codecs (7ec4d29 and earlier) is built for the dense types only.
  legacy=0
  [[ -f "$work/$name/include/kvcache/codec.hpp" ]] || legacy=1
  if [[ -n "${!own:-}" ]]; then echo "kvcache ab: $name built with ${!own}"; fi
  # The library's namespace renamed per revision, so that their inline functions stay apart.
  # shellcheck disable=SC2086  # the flags are words
  "$cxx" "${flags[@]}" ${!own:-} -Dkvcache="kvcache_$name" -DKVCACHE_AB_NAME="$name" -DKVCACHE_AB_NO_CODECS=$legacy -I"$work/$name/include" \
    -I"$root/bench/ab" -c "$root/bench/ab/variant.cpp" -o "$work/$name.o" &
  objects+=("$work/$name.o")
  list+="X($name) "
done
wait
"$cxx" "${flags[@]}" "-DKVCACHE_AB_VARIANTS(X)=$list" -I"$root/include" -I"$root/bench" -I"$root/bench/ab" \
  "$root/bench/ab/ab_attention.cpp" "${objects[@]}" -o "$work/ab_attention" -lbenchmark -lpthread
if [[ -n "${KVCACHE_AB_KEEP:-}" ]]; then cp "$work/ab_attention" "$KVCACHE_AB_KEEP"; fi
"$work/ab_attention" "$@"
