#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# The one command behind bench/RESULTS.md: builds the benchmarks with the release preset
# (-O3, -march=native), runs each with JSON output into bench/results/, records the machine,
# renders the plots and tables (bench/plot.py), and writes bench/RESULTS.md and the README's
# headline figures from this run (bench/results.py).
#
#   bench/run.sh                                   # everything
#   bench/run.sh --benchmark_filter=generate/      # extra arguments go to every benchmark program
#   KVCACHE_BENCHES="cache_bench" bench/run.sh     # only these programs
#
# The machine is shared: the figures worth quoting are the ratios, each measured inside one
# benchmark with its two sides interleaved. Run it when the machine is quiet (see `uptime`).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
results="bench/results"
mkdir -p "$results"

if [[ -n "${KVCACHE_BENCHES:-}" ]]; then
  read -r -a benches <<<"$KVCACHE_BENCHES"
else
  benches=()
  for source in bench/*_bench.cpp; do benches+=("$(basename "$source" .cpp)"); done
fi

# The release preset configures tests and examples too; should one of those not configure (a
# change in progress), the benchmarks, which need neither, get a tree of their own with the
# same preset settings.
build_args=(--preset release)
bin="build/release"
if ! cmake --preset release; then
  echo "run.sh: the release preset does not configure; using build/release-bench (benchmarks only)" >&2
  cmake --preset release -B build/release-bench -DKVCACHE_BUILD_TESTS=OFF -DKVCACHE_BUILD_EXAMPLES=OFF
  build_args=(build/release-bench --parallel 2)
  bin="build/release-bench"
fi
# Results of an earlier run must not be plotted as this run's.
for bench in "${benches[@]}"; do rm -f "$results/$bench.json"; done
rm -f "$results/tables.md"

# Benchmarks are built together; if that fails (a program mid-edit), each is built alone and
# those that do not build are left out, loudly, rather than costing the others their figures.
if ! cmake --build "${build_args[@]}" --target "${benches[@]}"; then
  built=()
  for bench in "${benches[@]}"; do
    if cmake --build "${build_args[@]}" --target "$bench"; then
      built+=("$bench")
    else
      echo "run.sh: $bench does not build; left out of this run" >&2
    fi
  done
  benches=("${built[@]}")
fi
if [[ ${#benches[@]} -eq 0 ]]; then
  echo "run.sh: no benchmark builds; nothing measured" >&2
  exit 1
fi

{
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  # A copy made with `git archive` has no .git: KVCACHE_COMMIT names its commit then.
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo "${KVCACHE_COMMIT:-unknown}")"
  if changed="$(git status --porcelain --untracked-files=no 2>/dev/null)" && [[ -n "$changed" ]]; then
    echo "uncommitted changes to tracked files: $(echo "$changed" | awk '{print $2}' | tr '\n' ' ')"
  fi
  echo "compiler: $(c++ --version | head -n 1), build tree $bin"
  echo "kernel: $(uname -sr)"
  echo "load before the run: $(cut -d ' ' -f 1-3 /proc/loadavg)"
  echo
  lscpu
  echo
  free -h
} >"$results/machine.txt"

# store_bench measures the Redis block store against a server of its own (stopped on exit).
source scripts/redis-for-tests.sh
kvcache_start_redis || echo "run.sh: no Redis server: store_bench's Redis cases will be skipped" >&2

for bench in "${benches[@]}"; do
  echo "== $bench"
  # KVCACHE_BENCH_SMOKE would register only the tiny cases: never for figures.
  env -u KVCACHE_BENCH_SMOKE "$bin/bench/$bench" \
    --benchmark_out="$results/$bench.json" --benchmark_out_format=json "$@"
done
echo "load after the run: $(cut -d ' ' -f 1-3 /proc/loadavg)" >>"$results/machine.txt"

# Debian's python3-matplotlib lives with the system interpreter, not with whatever python3 is first on PATH.
# Without it there are no plots or tables, but the figures below are still written.
/usr/bin/python3 bench/plot.py "$results" || echo "run.sh: bench/plot.py failed (python3-matplotlib?); no plots" >&2
/usr/bin/python3 bench/results.py --results "$results" --build "$bin" --out bench/RESULTS.md --readme README.md
