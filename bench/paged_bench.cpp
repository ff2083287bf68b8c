// SPDX-License-Identifier: Apache-2.0
// The paged cache against the contiguous one, each pair timed in turn inside one iteration:
//
// - PagedDecode: a decode step (T = 1, D = 128, 8 kv heads) over S keys held in blocks of 16
//   tokens (a segment per block) against the same keys in a KvCache. `vs_kv_cache` is the
//   KvCache's median time over the paged one's (1: as fast; the target is 0.9 or more).
// - SharedPrefix: the reference decoder (its default tiny shape) prefilling 16 sequences whose
//   prompts share a 2,048-token prefix (then 16 tokens each), in one pool with prefix reuse
//   against 16 KvCaches. `time_ratio` is the paged prefill's time over the KvCaches';
//   `memory_ratio` the bytes of the blocks held over the KvCaches' bytes.
//
//   build/release/bench/paged_bench --benchmark_filter=PagedDecode
//   build/release/bench/paged_bench --benchmark_filter=SharedPrefix

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <cstddef>
#include <cstdint>
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

constexpr std::size_t kHeads = 8, kDim = 128, kBlock = 16;

/// Args: H_q, S, threads.
template <class T>
void BM_PagedDecode(benchmark::State& state) {
  const auto q_heads = static_cast<std::size_t>(state.range(0));
  const auto tokens = static_cast<std::size_t>(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  kvcache::KvCache<T> dense({.layers = 1, .kv_heads = kHeads, .head_dim = kDim, .capacity = tokens});
  kvcache::BlockPool<T> pool({.layers = 1,
                              .kv_heads = kHeads,
                              .head_dim = kDim,
                              .block_tokens = kBlock,
                              .blocks = (tokens + kBlock - 1) / kBlock});
  kvcache::PagedKvCache<T> paged(pool);
  constexpr std::size_t kChunk = 1024;
  const std::vector<float> k = normal_floats(kHeads * kChunk * kDim, 1), v = normal_floats(k.size(), 2);
  for (std::size_t first = 0; first < tokens; first += kChunk) {
    const std::size_t n = std::min(kChunk, tokens - first);
    const kvcache::Strides strides{kHeads * kChunk * kDim, kChunk * kDim, kDim};
    const kvcache::TensorView<const float> kv(k.data(), {1, kHeads, n, kDim}, strides);
    const kvcache::TensorView<const float> vv(v.data(), {1, kHeads, n, kDim}, strides);
    const auto positions = kvcache::next_positions(first, n);
    dense.update(0, kv, vv, positions);
    paged.update(0, kv, vv, positions);
  }
  const auto dense_history = dense.history(0);
  const auto paged_history = paged.history(0);
  const std::vector<float> q = normal_floats(q_heads * kDim, 3);
  std::vector<float> out(q.size());
  const auto at = static_cast<std::int64_t>(tokens);
  const kvcache::Shape shape{1, q_heads, 1, kDim};
  const auto call = [&](const auto& history) {
    kvcache::causal_attention(kvcache::TensorView<const float>(q.data(), shape), kvcache::Positions(at), history,
                              kvcache::TensorView<float>(out.data(), shape), {.threads = threads});
  };
  const std::vector<float> other(smoke_mode() ? std::size_t{1} << 18 : std::size_t{64} << 20, 1.0F);
  const auto evict = [&] { benchmark::DoNotOptimize(read_all({{other.data(), other.size()}}, threads)); };
  std::vector<double> pages, contiguous;
  for (auto _ : state) {
    evict();
    pages.push_back(time_call([&] { call(paged_history); }));
    state.SetIterationTime(pages.back());
    evict();
    contiguous.push_back(time_call([&] { call(dense_history); }));
  }
  state.counters["vs_kv_cache"] = median(contiguous) / median(pages);
}

/// Args: shared prefix tokens, own tokens, sequences.
void BM_SharedPrefix(benchmark::State& state) {
  const auto prefix = static_cast<std::size_t>(state.range(0));
  const auto own = static_cast<std::size_t>(state.range(1));
  const auto sequences = static_cast<std::size_t>(state.range(2));
  qwen3::Model model(qwen3::random_weights(qwen3::Config{}));
  const qwen3::Config& c = model.config();
  std::vector<std::vector<qwen3::TokenId>> prompts(sequences);
  for (std::size_t s = 0; s < sequences; ++s) {
    for (std::size_t t = 0; t < prefix + own; ++t)
      prompts[s].push_back(static_cast<qwen3::TokenId>(t < prefix ? (t * 13) % 256 : (s * 31 + t) % 256));
  }
  std::size_t paged_bytes = 0, dense_bytes = 0;
  const auto paged = [&] {
    kvcache::BlockPool<float> pool({.layers = c.layers,
                                    .kv_heads = c.kv_heads,
                                    .head_dim = c.head_dim,
                                    .block_tokens = kBlock,
                                    .blocks = sequences * ((prefix + own) / kBlock + 1)});
    std::vector<kvcache::PagedKvCache<float>> seqs;
    seqs.reserve(sequences);
    for (std::size_t s = 0; s < sequences; ++s) {
      seqs.emplace_back(pool);
      const std::size_t skip = seqs.back().reuse_prefix(prompts[s]);
      benchmark::DoNotOptimize(model.forward(std::span(prompts[s]).subspan(skip), seqs.back(), qwen3::Logits::last));
    }
    paged_bytes = (pool.blocks() - pool.free_blocks()) * pool.block_bytes();
  };
  const auto dense = [&] {
    std::vector<kvcache::KvCache<float>> caches;
    caches.reserve(sequences);
    dense_bytes = 0;
    for (std::size_t s = 0; s < sequences; ++s) {
      caches.emplace_back(kvcache::KvCacheConfig{
          .layers = c.layers, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .capacity = prefix + own});
      benchmark::DoNotOptimize(model.forward(prompts[s], caches.back(), qwen3::Logits::last));
      dense_bytes += caches.back().bytes();
    }
  };
  std::vector<double> paged_times, dense_times;
  for (auto _ : state) {
    paged_times.push_back(time_call(paged));
    state.SetIterationTime(paged_times.back());
    dense_times.push_back(time_call(dense));
  }
  state.counters["time_ratio"] = median(paged_times) / median(dense_times);
  state.counters["memory_ratio"] = static_cast<double>(paged_bytes) / static_cast<double>(dense_bytes);
}

template <class T>
void register_decode(const char* name) {
  auto* b = benchmark::RegisterBenchmark((std::string("PagedDecode<") + name + ">").c_str(), BM_PagedDecode<T>)
                ->ArgNames({"H_q", "S", "threads"})
                ->UseManualTime()
                ->Iterations(smoke_mode() ? 1 : 15);
  for (const long threads : {1L, 2L}) {
    for (const long q_heads : {8L, 32L}) b->Args({q_heads, smoke_mode() ? 256L : 32768L, threads});
  }
}

}  // namespace

int main(int argc, char** argv) {
  return kvcache::bench::run_benchmarks(argc, argv, [] {
    register_decode<float>("float");
    register_decode<Eigen::bfloat16>("bfloat16");
    benchmark::RegisterBenchmark("SharedPrefix", BM_SharedPrefix)
        ->ArgNames({"prefix", "own", "sequences"})
        ->Args(smoke_mode() ? std::vector<long>{32, 4, 3} : std::vector<long>{2048, 16, 16})
        ->UseManualTime()
        ->Iterations(smoke_mode() ? 1 : 3);
  });
}
