#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the libFuzzer harnesses (preset fuzz) and runs them side by side for SECONDS each
# (default 60), starting from the seed corpora in fuzz/corpus/. New inputs go to a scratch
# directory, never into the repository. Exits non-zero if any harness finds a failure; its
# crashing input is kept in build/fuzz/findings/. KVCACHE_FUZZ_SEED fixes libFuzzer's seed (CI
# sets it, so that a run repeats what the last one did); unset, every run draws its own.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
seed=${KVCACHE_FUZZ_SEED:-0}  # 0: libFuzzer draws one
cmake --workflow --preset fuzz
findings=build/fuzz/findings
mkdir -p "$findings"
pids=()
for harness in cache_fuzz state_fuzz checkpoint_fuzz; do
  scratch=$(mktemp -d)
  ./build/fuzz/fuzz/$harness -max_total_time="$seconds" -seed="$seed" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$findings/$harness-" "$scratch" "fuzz/corpus/$harness" >"$findings/$harness.log" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!pids[@]}"; do
  harness=$(sed -n "$((i + 1))p" <<<$'cache_fuzz\nstate_fuzz\ncheckpoint_fuzz')
  if wait "${pids[$i]}"; then
    printf '%s: ok, %s\n' "$harness" "$(grep -E '^stat::number_of_executed_units|^#[0-9]+.*DONE' "$findings/$harness.log" | tr '\n' ' ')"
  else
    status=1
    printf '%s: FAILED\n' "$harness"
    tail -n 60 "$findings/$harness.log"
  fi
done
exit $status
