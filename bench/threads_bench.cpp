// SPDX-License-Identifier: Apache-2.0
// When a second thread pays: decode attention (T = 1) through the layers of a model, one call per
// layer, each over its own KvCache, as an engine runs a token. With enough layers the K and V of
// a call come from memory, not from the caches the previous call left warm.
//
// Each DecodeLayers row reports `us_per_call` (one layer's attention) and `bytes_per_call` (the
// K and V it reads); `threads:0` is causal_attention's automatic choice (AttentionOptions{}),
// which should be as fast as the faster of `threads:1` and `threads:2` at every size. Compare
// rows of the same run: the machine is shared.
//
// DecodeLayersAfterWideCall rows are DecodeLayers after one call that asked for 64 threads over a
// long history: the kept pool must not make later narrow calls pay for the threads it asked for.
//
//   ./threads_bench
//   KVCACHE_BENCH_SMOKE=1 ./threads_bench --benchmark_min_time=0.001   # tiny cases only

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "kvcache/kvcache.hpp"

namespace {

constexpr std::size_t kHeadDim = 128;
constexpr std::size_t kKvHeads = 8;
constexpr std::size_t kQueryHeads = 8;

/// Args: S, threads (0 = automatic). As many layers as make about 128 MiB of K and V (4 to 64;
/// 2 in a smoke run).
template <class T>
void BM_DecodeLayers(benchmark::State& state) {
  const auto tokens = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  const std::size_t call_bytes = 2 * tokens * kKvHeads * kHeadDim * sizeof(T);
  const std::size_t layers =
      kvcache::bench::smoke_mode() ? 2 : std::clamp<std::size_t>((std::size_t{128} << 20) / call_bytes, 4, 64);

  std::vector<T> rows(kKvHeads * tokens * kHeadDim);
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<T>(static_cast<float>(i % 97) / 97.0F - 0.5F);
  const kvcache::TensorView<const T> kv(rows.data(), {1, kKvHeads, tokens, kHeadDim});
  std::vector<std::int64_t> positions(tokens);
  std::iota(positions.begin(), positions.end(), 0);
  std::vector<std::unique_ptr<kvcache::KvCache<T>>> caches;
  std::vector<kvcache::History<T>> histories;
  for (std::size_t l = 0; l < layers; ++l) {
    caches.push_back(std::make_unique<kvcache::KvCache<T>>(
        kvcache::KvCacheConfig{.layers = 1, .kv_heads = kKvHeads, .head_dim = kHeadDim, .capacity = tokens + 1}));
    histories.push_back(caches.back()->update(0, kv, kv, positions));
  }

  std::vector<float> q(kQueryHeads * kHeadDim, 0.1F);
  std::vector<float> out(q.size());
  const std::vector<std::int64_t> position{static_cast<std::int64_t>(tokens)};
  const kvcache::Shape shape{1, kQueryHeads, 1, kHeadDim};
  const kvcache::AttentionOptions options{.threads = threads};
  double seconds = 0;
  for (auto _ : state) {
    const auto start = kvcache::bench::Clock::now();
    for (const kvcache::History<T>& history : histories) {
      kvcache::causal_attention(kvcache::TensorView<const float>(q.data(), shape), position, history,
                                kvcache::TensorView<float>(out.data(), shape), options);
      benchmark::DoNotOptimize(out.data());
    }
    benchmark::ClobberMemory();
    const double elapsed = kvcache::bench::seconds_since(start);
    state.SetIterationTime(elapsed);
    seconds += elapsed;
  }
  const double calls = static_cast<double>(state.iterations()) * static_cast<double>(layers);
  state.counters["us_per_call"] = calls > 0 ? seconds / calls * 1e6 : 0.0;
  state.counters["bytes_per_call"] = static_cast<double>(call_bytes);
  state.counters["layers"] = static_cast<double>(layers);
}

/// One call asking for 64 threads, over enough keys for as many work items.
void wide_call() {
  constexpr std::size_t kTokens = 64 * 512 / kKvHeads;
  kvcache::KvCache<float> cache({.layers = 1, .kv_heads = kKvHeads, .head_dim = kHeadDim, .capacity = kTokens});
  const std::vector<float> rows(kKvHeads * kTokens * kHeadDim, 0.25F);
  const kvcache::TensorView<const float> kv(rows.data(), {1, kKvHeads, kTokens, kHeadDim});
  const auto history = cache.update(0, kv, kv, kvcache::next_positions(0, kTokens));
  std::vector<float> q(kQueryHeads * kHeadDim, 0.1F);
  std::vector<float> out(q.size());
  const kvcache::Shape shape{1, kQueryHeads, 1, kHeadDim};
  const std::int64_t position = kTokens - 1;
  kvcache::causal_attention(kvcache::TensorView<const float>(q.data(), shape), position, history,
                            kvcache::TensorView<float>(out.data(), shape), {.threads = 64});
}

template <class T>
void BM_DecodeLayersAfterWideCall(benchmark::State& state) {
  wide_call();
  BM_DecodeLayers<T>(state);
}

void register_all() {
  const bool tiny = kvcache::bench::smoke_mode();
  const std::vector<std::int64_t> lengths =
      tiny ? std::vector<std::int64_t>{64} : std::vector<std::int64_t>{128, 512, 1024, 2048, 4096};
  for (std::int64_t s : lengths) {
    for (std::int64_t threads : {1, 2, 0}) {
      benchmark::RegisterBenchmark("DecodeLayers<float>", BM_DecodeLayers<float>)
          ->ArgNames({"S", "threads"})
          ->Args({s, threads})
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark("DecodeLayers<bfloat16>", BM_DecodeLayers<Eigen::bfloat16>)
          ->ArgNames({"S", "threads"})
          ->Args({s, threads})
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
  // Last: with a pool that kept every thread asked for, the wide call would slow the rows after it.
  for (std::int64_t threads : {1, 2}) {
    benchmark::RegisterBenchmark("DecodeLayersAfterWideCall<float>", BM_DecodeLayersAfterWideCall<float>)
        ->ArgNames({"S", "threads"})
        ->Args({tiny ? 64 : 256, threads})
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace

int main(int argc, char** argv) { return kvcache::bench::run_benchmarks(argc, argv, register_all); }
