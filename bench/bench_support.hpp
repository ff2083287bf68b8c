// SPDX-License-Identifier: Apache-2.0
#pragma once

// What every benchmark program shares: its clock (timing.hpp), the CI smoke switch and its main.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <numeric>
#include <random>
#include <string_view>
#include <utility>
#include <vector>

#include <unistd.h>

#include "kvcache/detail/worker_pool.hpp"
#include "timing.hpp"

namespace kvcache::bench {

/// KVCACHE_BENCH_SMOKE set (and not "0"): register only tiny cases, so CI runs every path in seconds.
inline bool smoke_mode() {
  const char* value = std::getenv("KVCACHE_BENCH_SMOKE");
  return value != nullptr && *value != '\0' && std::string_view(value) != "0";
}

/// Bytes of the L3 as sysconf reports it (0 where it does not, and in the smoke run): memory read
/// ahead of a timed read must exceed it, or part of what is timed still comes from there (an
/// Intel Xeon here reports 480 MiB, shared with other tenants).
inline std::size_t l3_bytes() {
  const long l3 = ::sysconf(_SC_LEVEL3_CACHE_SIZE);
  return l3 > 0 && !smoke_mode() ? static_cast<std::size_t>(l3) : 0;
}

/// A benchmark program's main: takes Google Benchmark's flags (1 on one it does not know), calls
/// `register_all()`, runs what the flags select. Returns 0 once they have run.
template <class Register>
int run_benchmarks(int argc, char** argv, const Register& register_all) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace kvcache::bench
