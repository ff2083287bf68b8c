// SPDX-License-Identifier: Apache-2.0
// The quantized formats against bfloat16, each pair timed in turn inside one iteration so that
// both meet the same memory:
//
// - QuantizedDecode: a decode step (T = 1, D = 128, 8 kv heads) over S keys of a KvCache of the
//   format against the same keys in a KvCache<bfloat16>. `vs_bfloat16` is the format's median
//   time over bfloat16's (0.5: twice as fast); `vs_read` is a plain read of the format's rows
//   over the call.
// - QuantizedUpdate: update() of a 512-token chunk of float k and v into the format against a
//   memcpy of the same input bytes; `vs_memcpy` is the memcpy's time over the update's.
//
//   build/release/bench/quantized_bench --benchmark_filter=QuantizedDecode
//   build/release/bench/quantized_bench --benchmark_filter=QuantizedUpdate

#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "kvcache/kvcache.hpp"

namespace {

using kvcache::bench::median;
using kvcache::bench::normal_floats;
using kvcache::bench::read_all;
using kvcache::bench::smoke_mode;
using kvcache::bench::time_call;

constexpr std::size_t kHeads = 8, kDim = 128;

/// The config of a cache of format T holding `tokens` keys: a format with head scales is given
/// ones that cover the seeded values (normal, of deviation 1).
template <class T>
kvcache::KvCacheConfig config_of(std::size_t tokens) {
  kvcache::KvCacheConfig config{.layers = 1, .kv_heads = kHeads, .head_dim = kDim, .capacity = tokens};
  if constexpr (kvcache::detail::has_head_scales<T>) {
    static const std::vector<float> scales(kHeads, 6.0F / 448.0F);
    config.key_scales = config.value_scales = scales;
  }
  return config;
}

/// A cache of format T holding `tokens` keys of seeded values, written in chunks.
template <class T>
kvcache::KvCache<T> filled_cache(std::size_t tokens) {
  kvcache::KvCache<T> cache(config_of<T>(tokens));
  constexpr std::size_t kChunk = 2048;
  const std::vector<float> k = normal_floats(kHeads * kChunk * kDim, 1), v = normal_floats(k.size(), 2);
  for (std::size_t first = 0; first < tokens; first += kChunk) {
    const std::size_t n = std::min(kChunk, tokens - first);
    const kvcache::Strides strides{kHeads * kChunk * kDim, kChunk * kDim, kDim};
    std::vector<std::int64_t> positions(n);
    std::iota(positions.begin(), positions.end(), static_cast<std::int64_t>(first));
    cache.update(0, kvcache::TensorView<const float>(k.data(), {1, kHeads, n, kDim}, strides),
                 kvcache::TensorView<const float>(v.data(), {1, kHeads, n, kDim}, strides), positions);
  }
  return cache;
}

/// The history a cache holds, read with a zero-token update.
template <class T>
kvcache::History<T> history_of(kvcache::KvCache<T>& cache) {
  const std::vector<float> none;
  const kvcache::TensorView<const float> empty(none.data(), {1, kHeads, 0, kDim});
  const std::vector<std::int64_t> no_positions;
  return cache.update(0, empty, empty, no_positions);
}

/// Args: H_q, S, threads.
template <class T>
void BM_QuantizedDecode(benchmark::State& state) {
  const auto q_heads = static_cast<std::size_t>(state.range(0));
  const auto tokens = static_cast<std::size_t>(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  auto format = filled_cache<T>(tokens);
  auto reference = filled_cache<Eigen::bfloat16>(tokens);
  const kvcache::History<T> history = history_of(format);
  const kvcache::History<Eigen::bfloat16> reference_history = history_of(reference);
  const std::vector<float> q = normal_floats(q_heads * kDim, 3);
  std::vector<float> out(q.size());
  const auto at = static_cast<std::int64_t>(tokens);
  const kvcache::Shape q_shape{1, q_heads, 1, kDim};
  const auto call = [&](const auto& h) {
    kvcache::causal_attention(kvcache::TensorView<const float>(q.data(), q_shape), std::span(&at, 1), h,
                              kvcache::TensorView<float>(out.data(), q_shape), {.threads = threads});
  };
  // What a plain read of the format's stored rows takes (their scales, 3% or less, aside).
  using Codec = kvcache::storage_codec<T>;
  const auto* bytes = reinterpret_cast<const float*>(history.segments[0].keys.data());
  const auto* value_bytes = reinterpret_cast<const float*>(history.segments[0].values.data());
  const std::size_t row_floats = kHeads * tokens * Codec::units(kDim) * sizeof(typename Codec::unit) / sizeof(float);
  const std::vector<float> other(smoke_mode() ? std::size_t{1} << 18 : std::size_t{64} << 20, 1.0F);
  std::vector<double> theirs, ours, plain;
  bool ours_first = false;  // the order alternates, so that neither call always follows the other
  for (auto _ : state) {
    for (int turn = 0; turn < 2; ++turn) {
      benchmark::DoNotOptimize(read_all({{other.data(), other.size()}}, threads));
      if ((turn == 0) == ours_first) {
        ours.push_back(time_call([&] { call(history); }));
      } else {
        theirs.push_back(time_call([&] { call(reference_history); }));
      }
    }
    ours_first = !ours_first;
    state.SetIterationTime(ours.back());
    benchmark::DoNotOptimize(read_all({{other.data(), other.size()}}, threads));
    plain.push_back(time_call([&] {
      benchmark::DoNotOptimize(read_all({{bytes, row_floats}, {value_bytes, row_floats}}, threads));
    }));
  }
  state.counters["vs_bfloat16"] = median(ours) / median(theirs);
  state.counters["vs_read"] = median(plain) / median(ours);
}

/// Args: none. A 512-token chunk into an empty cache.
template <class T>
void BM_QuantizedUpdate(benchmark::State& state) {
  constexpr std::size_t kChunk = 512;
  kvcache::KvCache<T> cache(config_of<T>(kChunk));
  const std::vector<float> k = normal_floats(kHeads * kChunk * kDim, 4), v = normal_floats(k.size(), 5);
  std::vector<float> copy_k(k.size()), copy_v(v.size());
  std::vector<std::int64_t> positions(kChunk);
  std::iota(positions.begin(), positions.end(), std::int64_t{0});
  const kvcache::Shape shape{1, kHeads, kChunk, kDim};
  std::vector<double> updates, copies;
  for (auto _ : state) {
    cache.reset();
    updates.push_back(time_call([&] {
      cache.update(0, kvcache::TensorView<const float>(k.data(), shape),
                   kvcache::TensorView<const float>(v.data(), shape), positions);
    }));
    state.SetIterationTime(updates.back());
    copies.push_back(time_call([&] {
      std::memcpy(copy_k.data(), k.data(), k.size() * sizeof(float));
      std::memcpy(copy_v.data(), v.data(), v.size() * sizeof(float));
      benchmark::DoNotOptimize(copy_v.data());
    }));
  }
  state.counters["vs_memcpy"] = median(copies) / median(updates);
}

template <class T>
void register_format() {
  const std::string name = kvcache::format_name<T>();
  auto* decode =
      benchmark::RegisterBenchmark((std::string("QuantizedDecode<") + name + ">").c_str(), BM_QuantizedDecode<T>)
          ->ArgNames({"H_q", "S", "threads"})
          ->UseManualTime()
          ->Iterations(smoke_mode() ? 1 : 11);
  for (const long threads : {1L, 2L}) {
    for (const long q_heads : {8L, 32L}) decode->Args({q_heads, smoke_mode() ? 256L : 32768L, threads});
  }
  benchmark::RegisterBenchmark((std::string("QuantizedUpdate<") + name + ">").c_str(), BM_QuantizedUpdate<T>)
      ->UseManualTime()
      ->Iterations(smoke_mode() ? 1 : 51);
}

}  // namespace

int main(int argc, char** argv) {
  // Every quantized format (one an engine does not compute in), then bfloat16 alone.
  kvcache::for_each_format([]<class T>() {
    if constexpr (!kvcache::compute_type<T>) register_format<T>();
  });
  register_format<Eigen::bfloat16>();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
