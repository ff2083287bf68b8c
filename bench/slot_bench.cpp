// SPDX-License-Identifier: Apache-2.0
// Continuous batching through a SlotKvCache, each pair timed in turn inside one iteration so
// that both meet the same machine:
//
// - SlotDecode: a decode step (T = 1, D = 128, 8 kv heads) of 8 rows holding S keys each, in
//   one attention call over the 8 rows against 8 single-row calls. `one_vs_eight` is the one
//   call's median time over the eight's (below 1: batching pays); `vs_read` is a plain read of
//   the 8 rows' K and V over the one call (1: it reads at the plain read's rate).
// - SlotModel: the reference decoder (its default tiny shape) serving 8 sequences, a prompt
//   then single tokens, as one batch of 8 rows a step against the 8 sequences one after
//   another through a KvCache each. `batch_vs_sequential` is tokens a second of the batch over
//   the sequential run's.
//
//   build/release/bench/slot_bench --benchmark_filter=SlotDecode
//   build/release/bench/slot_bench --benchmark_filter=SlotModel

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

// GCC 12 with -march=native reports Eigen's AVX-512 matrix-product packing as maybe-uninitialized
// (_mm512_undefined_ps is uninitialized on purpose); see model_bench.cpp.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <Eigen/Core>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include "kvcache/kvcache.hpp"
#include "qwen3/model.hpp"

namespace {

using kvcache::bench::median;
using kvcache::bench::normal_floats;
using kvcache::bench::read_all;
using kvcache::bench::smoke_mode;
using kvcache::bench::time_call;

constexpr std::size_t kRows = 8, kHeads = 8, kDim = 128;

/// Args: H_q, S (keys a row), threads.
template <class T>
void BM_SlotDecode(benchmark::State& state) {
  const auto q_heads = static_cast<std::size_t>(state.range(0));
  const auto tokens = static_cast<std::size_t>(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  kvcache::SlotKvCache<T> cache(
      {.layers = 1, .batch = kRows, .kv_heads = kHeads, .head_dim = kDim, .capacity = tokens});
  {
    const std::vector<float> k = normal_floats(kHeads * tokens * kDim, 1), v = normal_floats(k.size(), 2);
    const kvcache::TensorView<const float> kv(k.data(), {1, kHeads, tokens, kDim});
    const kvcache::TensorView<const float> vv(v.data(), {1, kHeads, tokens, kDim});
    const auto positions = kvcache::next_positions(0, tokens);
    for (std::size_t r = 0; r < kRows; ++r) {
      const std::size_t row = cache.acquire();
      cache.update(0, kv, vv, positions, row);
    }
  }
  std::vector<std::size_t> rows(kRows);
  std::iota(rows.begin(), rows.end(), std::size_t{0});
  const std::vector<float> q = normal_floats(kRows * q_heads * kDim, 3);
  std::vector<float> out(q.size());
  const std::vector<std::int64_t> at(kRows, static_cast<std::int64_t>(tokens));
  const kvcache::AttentionOptions options{.threads = threads};
  const auto one_call = [&] {
    const kvcache::Shape shape{kRows, q_heads, 1, kDim};
    kvcache::causal_attention(kvcache::TensorView<const float>(q.data(), shape), kvcache::Positions(at.data(), 1, 1),
                              cache.history(0, rows), kvcache::TensorView<float>(out.data(), shape), options);
  };
  const auto eight_calls = [&] {
    const kvcache::Shape shape{1, q_heads, 1, kDim};
    const std::size_t stride = q_heads * kDim;
    for (std::size_t r = 0; r < kRows; ++r) {
      kvcache::causal_attention(kvcache::TensorView<const float>(q.data() + r * stride, shape),
                                kvcache::Positions(at[r]), cache.history(0, r),
                                kvcache::TensorView<float>(out.data() + r * stride, shape), options);
    }
  };
  // The plain read of the same stored rows: each (row, head) slice's first S rows.
  const auto history = cache.history(0);
  const kvcache::Segment<T>& s = history.segments[0];
  using Codec = kvcache::storage_codec<T>;
  const std::size_t slice_floats = tokens * Codec::units(kDim) * sizeof(typename Codec::unit) / sizeof(float);
  std::vector<std::pair<const float*, std::size_t>> slices;
  for (std::size_t r = 0; r < kRows; ++r) {
    for (std::size_t h = 0; h < kHeads; ++h) {
      slices.emplace_back(reinterpret_cast<const float*>(s.keys.row(r, h, 0)), slice_floats);
      slices.emplace_back(reinterpret_cast<const float*>(s.values.row(r, h, 0)), slice_floats);
    }
  }
  const std::vector<float> other(smoke_mode() ? std::size_t{1} << 18 : std::size_t{64} << 20, 1.0F);
  const auto evict = [&] { benchmark::DoNotOptimize(read_all({{other.data(), other.size()}}, threads)); };
  std::vector<double> ones, eights, plain;
  for (auto _ : state) {
    evict();
    ones.push_back(time_call(one_call));
    state.SetIterationTime(ones.back());
    evict();
    eights.push_back(time_call(eight_calls));
    evict();
    plain.push_back(time_call([&] { benchmark::DoNotOptimize(read_all(slices, threads)); }));
  }
  state.counters["one_vs_eight"] = median(ones) / median(eights);
  state.counters["vs_read"] = median(plain) / median(ones);
}

/// Args: prompt tokens, decode steps.
void BM_SlotModel(benchmark::State& state) {
  const auto prompt = static_cast<std::size_t>(state.range(0));
  const auto steps = static_cast<std::size_t>(state.range(1));
  qwen3::Model model(qwen3::random_weights(qwen3::Config{}));
  const qwen3::Config& c = model.config();
  std::vector<std::vector<qwen3::TokenId>> sequences(kRows);
  for (std::size_t r = 0; r < kRows; ++r) {
    for (std::size_t t = 0; t < prompt + steps; ++t)
      sequences[r].push_back(static_cast<qwen3::TokenId>((r * 31 + t * 7) % 256));
  }
  const auto config = kvcache::KvCacheConfig{
      .layers = c.layers, .batch = kRows, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .capacity = prompt + steps};
  const auto batched = [&] {
    kvcache::SlotKvCache<float> cache(config);
    std::vector<qwen3::Model::RowTokens> batch(kRows);
    for (std::size_t r = 0; r < kRows; ++r) batch[r] = {cache.acquire(), std::span(sequences[r]).first(prompt)};
    benchmark::DoNotOptimize(model.forward(batch, cache, qwen3::Logits::last));
    for (std::size_t t = prompt; t < prompt + steps; ++t) {
      for (std::size_t r = 0; r < kRows; ++r) batch[r].tokens = std::span(sequences[r]).subspan(t, 1);
      benchmark::DoNotOptimize(model.forward(batch, cache, qwen3::Logits::last));
    }
  };
  const auto sequential = [&] {
    for (std::size_t r = 0; r < kRows; ++r) {
      kvcache::KvCache<float> cache(
          {.layers = c.layers, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .capacity = prompt + steps});
      benchmark::DoNotOptimize(model.forward(std::span(sequences[r]).first(prompt), cache, qwen3::Logits::last));
      for (std::size_t t = prompt; t < prompt + steps; ++t)
        benchmark::DoNotOptimize(model.forward(std::span(sequences[r]).subspan(t, 1), cache, qwen3::Logits::last));
    }
  };
  std::vector<double> batch_times, sequential_times;
  for (auto _ : state) {
    batch_times.push_back(time_call(batched));
    state.SetIterationTime(batch_times.back());
    sequential_times.push_back(time_call(sequential));
  }
  const double tokens = static_cast<double>(kRows * (prompt + steps));
  state.counters["batch_tokens_per_s"] = tokens / median(batch_times);
  state.counters["sequential_tokens_per_s"] = tokens / median(sequential_times);
  state.counters["batch_vs_sequential"] = median(sequential_times) / median(batch_times);
}

template <class T>
void register_decode(const char* name) {
  auto* b = benchmark::RegisterBenchmark((std::string("SlotDecode<") + name + ">").c_str(), BM_SlotDecode<T>)
                ->ArgNames({"H_q", "S", "threads"})
                ->UseManualTime()
                ->Iterations(smoke_mode() ? 1 : 15);
  for (const long threads : {1L, 2L}) {
    for (const long q_heads : {8L, 32L}) b->Args({q_heads, smoke_mode() ? 64L : 4096L, threads});
  }
}

}  // namespace

int main(int argc, char** argv) {
  return kvcache::bench::run_benchmarks(argc, argv, [] {
    register_decode<float>("float");
    register_decode<Eigen::bfloat16>("bfloat16");
    benchmark::RegisterBenchmark("SlotModel", BM_SlotModel)
        ->ArgNames({"prompt", "steps"})
        ->Args(smoke_mode() ? std::vector<long>{4, 2} : std::vector<long>{64, 64})
        ->UseManualTime()
        ->Iterations(smoke_mode() ? 1 : 5);
  });
}
