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

#include "kvcache/detail/simd.hpp"
#include "kvcache/detail/worker_pool.hpp"
#include "timing.hpp"

namespace kvcache::bench {

/// Sums `count` floats as sum_floats does, asking for the lines 2 KiB ahead: a read form that
/// does not wait on the hardware prefetcher alone.
inline float sum_floats_prefetched(const float* data, std::size_t count) {
  constexpr std::size_t kLanes = 32;
  constexpr std::size_t kAhead = 512;  // floats: 2 KiB
  float lanes[kLanes] = {};
  std::size_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    if (i + kAhead + kLanes <= count) {
      __builtin_prefetch(data + i + kAhead);
      __builtin_prefetch(data + i + kAhead + 16);
    }
    for (std::size_t l = 0; l < kLanes; ++l) lanes[l] += data[i + l];
  }
  for (std::size_t l = 0; i < count; ++i, ++l) lanes[l] += data[i];
  return std::accumulate(std::begin(lanes), std::end(lanes), 0.0F);
}

/// Sums two buffers of `count` floats together, a 256-byte step of each in turn: two streams
/// that advance as a decode call's K and V do.
inline float sum_floats_paired(const float* a, const float* b, std::size_t count) {
  constexpr std::size_t kStep = 64;
  float sum = 0;
  std::size_t i = 0;
  for (; i + kStep <= count; i += kStep) sum += sum_floats(a + i, kStep) + sum_floats(b + i, kStep);
  return sum + sum_floats(a + i, count - i) + sum_floats(b + i, count - i);
}

/// The ways a decode call's stored bytes can be read: the limit a call is held to is the fastest.
enum class ReadForm { plain, prefetched, paired };
inline constexpr ReadForm kReadForms[] = {ReadForm::plain, ReadForm::prefetched, ReadForm::paired};
inline const char* name_of(ReadForm form) {
  return form == ReadForm::plain ? "plain" : form == ReadForm::prefetched ? "prefetched" : "paired";
}

/// read_all in form `form`: paired reads buffers 2i and 2i + 1 (a K and its V) together.
inline float read_all(const std::vector<std::pair<const float*, std::size_t>>& buffers, std::size_t threads,
                      ReadForm form) {
  if (form == ReadForm::plain) return read_all(buffers, threads);
  std::vector<float> sums(threads, 0.0F);
  const auto work = [&](std::size_t worker) {
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      const auto& [data, count] = buffers[i];
      const std::size_t begin = count * worker / threads;
      const std::size_t end = count * (worker + 1) / threads;
      if (form == ReadForm::prefetched) {
        sums[worker] += sum_floats_prefetched(data + begin, end - begin);
      } else if (i % 2 == 0 && i + 1 < buffers.size() && buffers[i + 1].second == count) {
        sums[worker] += sum_floats_paired(data + begin, buffers[i + 1].first + begin, end - begin);
        ++i;
      } else {
        sums[worker] += sum_floats(data + begin, end - begin);
      }
    }
  };
  kvcache::detail::run_workers(threads, work);
  return std::accumulate(sums.begin(), sums.end(), 0.0F);
}

/// Multiply-adds a second on `threads` threads at once, each running `rounds` rounds of
/// independent chains on registers of the build's vector width: what the call's cores do flat
/// out (two threads on one physical core share its units, and this shows it).
inline double multiply_add_rate(std::size_t threads, std::size_t rounds) {
  using V = kvcache::detail::Vec<float, kvcache::detail::kNativeBytes>;
  constexpr std::size_t kChains = std::min<std::size_t>(16, kvcache::detail::kRegisters - 4);
  const auto start = Clock::now();
  kvcache::detail::run_workers(threads, [&](std::size_t worker) {
    V chains[kChains];
    volatile float seed = 1.0F;  // distinct starting values, so no two chains are merged
    for (std::size_t c = 0; c < kChains; ++c)
      chains[c] = kvcache::detail::splat<V>(seed + static_cast<float>(c + worker));
    const V x = kvcache::detail::splat<V>(0.999999F);
    const V y = kvcache::detail::splat<V>(1e-7F);
    for (std::size_t r = 0; r < rounds; ++r) {
      for (V& c : chains) c = c * x + y;
    }
    for (const V& c : chains) benchmark::DoNotOptimize(c);
  });
  const double seconds = seconds_since(start);
  const double done = static_cast<double>(threads * rounds * kChains * kvcache::detail::kLanes<V>);
  return seconds > 0 ? done / seconds : 0.0;
}

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
