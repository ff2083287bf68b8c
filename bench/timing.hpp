// SPDX-License-Identifier: Apache-2.0
#pragma once

// Timing and reading memory, shared by the benchmark programs and kvcache-bench (which needs no
// Google Benchmark and no Eigen).

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "kvcache/detail/worker_pool.hpp"

namespace kvcache::bench {

using Clock = std::chrono::steady_clock;

/// Seconds from `start` to now.
inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// Seconds `f()` takes, on a steady clock.
template <class F>
double time_call(const F& f) {
  const auto start = Clock::now();
  f();
  return seconds_since(start);
}

/// The middle value of `seconds` (the upper one of an even count), 0 for none; reorders them.
/// Programs that time two things in turn on every iteration compare medians: a median ignores
/// the odd call a shared machine disturbs.
inline double median(std::vector<double>& seconds) {
  if (seconds.empty()) return 0;
  const auto middle = seconds.begin() + static_cast<std::ptrdiff_t>(seconds.size() / 2);
  std::nth_element(seconds.begin(), middle, seconds.end());
  return *middle;
}

/// Sums `count` floats with independent lane accumulators, so the loop is bound by memory: the
/// plain read that decode attention is measured against.
inline float sum_floats(const float* data, std::size_t count) {
  constexpr std::size_t kLanes = 32;
  float lanes[kLanes] = {};
  std::size_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    for (std::size_t l = 0; l < kLanes; ++l) lanes[l] += data[i + l];
  }
  for (std::size_t l = 0; i < count; ++i, ++l) lanes[l] += data[i];
  return std::accumulate(std::begin(lanes), std::end(lanes), 0.0F);
}

/// Reads every float of `buffers` (pointer, count) once, split among `threads` threads (the
/// caller's included); returns their sum.
inline float read_all(const std::vector<std::pair<const float*, std::size_t>>& buffers, std::size_t threads) {
  std::vector<float> sums(threads, 0.0F);
  const auto work = [&](std::size_t worker) {
    for (const auto& [data, count] : buffers) {
      const std::size_t begin = count * worker / threads;
      const std::size_t end = count * (worker + 1) / threads;
      sums[worker] += sum_floats(data + begin, end - begin);
    }
  };
  kvcache::detail::run_workers(threads, work);
  return std::accumulate(sums.begin(), sums.end(), 0.0F);
}

/// `n` floats from a standard normal distribution, seeded: the keys, values and queries the
/// benchmarks read.
inline std::vector<float> normal_floats(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::vector<float> out(n);
  for (float& x : out) x = normal(rng);
  return out;
}

}  // namespace kvcache::bench
