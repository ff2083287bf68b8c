// SPDX-License-Identifier: Apache-2.0
// How much of one core's memory stream survives work done beside it: the question behind decode
// attention at two and four query rows per kv head, which reads K and V from memory while doing
// 8-16 vector multiply-adds per 64-byte line (AVX2, bf16) with its queries read from L1 (at
// D = 128 they do not fit in AVX2's 16 registers).
//
// Each Stream row reads a region far larger than the caches one 64-byte line at a time, asking
// for the line 8 KiB ahead as the attention kernel does (prefetcht0), and does per line:
//   read           nothing more (a plain read, no prefetch instruction: the baseline)
//   prefetch       nothing more
//   multiply_adds  F vector multiply-adds on registers only (8 independent chains)
//   l1_operands    F vector multiply-adds, each taking its other operand from a 4 KiB block in
//                  L1, the same F registers' worth every line, as a query row is for every key
//   l1_loads       F vector loads from that block, added up (no multiplies)
//   l1_accumulators  F vector multiply-adds into sums kept in that block (load, multiply-add,
//                  store), as the weighted sum of V rows for more query rows than registers hold
// Every iteration times, in turn, the plain read of one region and the row's stream over the
// other, each right after reading the other region, so neither finds its bytes in the L3; then
// the same work over a 256 KiB region already in cache. `vs_read` is the median plain read over
// the median stream of the run; `in_cache_vs_read` the rate of the same work in cache over the
// plain read's rate from memory. Work that overlaps the transfer gives vs_read near
// min(1, in_cache_vs_read); work that adds to it, near 1 / (1 + 1 / in_cache_vs_read).
//
//   ./stream_bench
//   KVCACHE_BENCH_SMOKE=1 ./stream_bench --benchmark_min_time=0.001   # a 1 MiB region only

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "kvcache/kvcache.hpp"

namespace {

using V = kvcache::detail::Vector<float>;
using kvcache::bench::median;
using kvcache::bench::time_call;
using kvcache::detail::in_register;
using kvcache::detail::kVector;
using kvcache::detail::load_vector;
using kvcache::detail::splat;
using kvcache::detail::unroll;

constexpr std::size_t kLineFloats = 64 / sizeof(float);
constexpr std::size_t kLineVectors = kLineFloats >= kVector<float> ? kLineFloats / kVector<float> : 1;
constexpr std::size_t kStep = kLineVectors * kVector<float>;  // floats a step reads: a line, or one register
constexpr std::size_t kChains = 8;                            // independent sums: latency never binds
constexpr std::size_t kAheadFloats = 8192 / sizeof(float);
constexpr std::size_t kBlockFloats = 4096 / sizeof(float);  // the L1 block: 4 KiB
constexpr std::size_t kCachedBytes = 256 << 10;             // the in-cache region: within any L2 here
constexpr std::size_t kCachedPasses = 16;

enum class Work { kRead, kPrefetch, kMultiplyAdds, kL1Operands, kL1Loads, kL1Accumulators };

alignas(64) float l1_block[kBlockFloats];

/// Reads `count` floats (a whole number of kChains steps) a step at a time, doing `W` F times a
/// step. Every index into `chains` is known at compile time and every step inlined, so the chains
/// stay in registers.
template <Work W, std::size_t F>
float stream(const float* data, std::size_t count) {
  V chains[kChains];
  unroll<kChains>([&](auto c) { chains[c] = splat(static_cast<float>(c)); });
  const V x = splat(0.999999F);
  for (std::size_t first = 0; first < count; first += kChains * kStep) {
    unroll<kChains>([&](auto s) KVCACHE_ALWAYS_INLINE {
      const float* step = data + first + s * kStep;
      if constexpr (W != Work::kRead) {
#if defined(__GNUC__) || defined(__clang__)
        __builtin_prefetch(step + kAheadFloats, 0, 3);
#endif
      }
      V line[kLineVectors];
      // Held in registers: folded into each multiply-add instead, the line would be read F times.
      unroll<kLineVectors>([&](auto v) { line[v] = in_register(load_vector<V>(step + v * kVector<float>)); });
      if constexpr (W == Work::kRead || W == Work::kPrefetch || W == Work::kL1Loads) {
        unroll<kLineVectors>([&](auto v) { chains[(s + v) % kChains] += line[v]; });
      }
      // Operand f: the same register's worth of the L1 block every step, as a query row is for
      // every key. The block's address is hidden from the optimizer each step, so that the
      // operands are loaded every time and never hoisted out of the loop.
      float* block = l1_block;
#if defined(__GNUC__) || defined(__clang__)
      asm("" : "+r"(block));
#endif
      unroll<F>([&](auto f) KVCACHE_ALWAYS_INLINE {
        V& chain = chains[f % kChains];
        const auto operand = [&] { return load_vector<V>(block + f * kVector<float> % kBlockFloats); };
        if constexpr (W == Work::kMultiplyAdds) chain = chain * x + line[f % kLineVectors];
        if constexpr (W == Work::kL1Operands) chain = chain * operand() + line[f % kLineVectors];
        if constexpr (W == Work::kL1Loads) chain += operand();
        if constexpr (W == Work::kL1Accumulators) {
          float* const sum = block + f * kVector<float> % kBlockFloats;
          kvcache::detail::store_vector(sum, load_vector<V>(sum) * x + line[f % kLineVectors]);
        }
      });
    });
  }
  V total = chains[0];
  unroll<kChains - 1>([&](auto c) { total += chains[c + 1]; });
  return total[0];
}

/// The largest whole number of kChains steps in `floats`.
constexpr std::size_t whole_groups(std::size_t floats) { return floats / (kChains * kStep) * (kChains * kStep); }

/// A region allocated as a cache's storage is (huge pages where it spans one), filled.
kvcache::detail::AlignedBuffer<float> region(std::size_t bytes) {
  kvcache::detail::AlignedBuffer<float> buffer(bytes / sizeof(float) + kAheadFloats);
  for (std::size_t i = 0; i < buffer.size(); ++i) buffer.data()[i] = static_cast<float>(i % 7) * 1e-3F;
  return buffer;
}

template <Work W, std::size_t F>
void BM_Stream(benchmark::State& state, std::size_t bytes) {
  const std::size_t count = whole_groups(bytes / sizeof(float));
  const auto a = region(bytes);
  const auto b = region(bytes);
  const auto cached = region(kCachedBytes);
  const std::size_t cached_count = whole_groups(kCachedBytes / sizeof(float));
  std::fill(std::begin(l1_block), std::end(l1_block), 1.0F);
  std::vector<double> read_seconds;
  std::vector<double> stream_seconds;
  std::vector<double> cached_seconds;
  for (auto _ : state) {
    read_seconds.push_back(time_call([&] { benchmark::DoNotOptimize(stream<Work::kRead, 0>(a.data(), count)); }));
    const double seconds = time_call([&] { benchmark::DoNotOptimize(stream<W, F>(b.data(), count)); });
    stream_seconds.push_back(seconds);
    state.SetIterationTime(seconds);
    benchmark::DoNotOptimize(stream<W, F>(cached.data(), cached_count));  // into the cache first
    cached_seconds.push_back(time_call([&] {
      for (std::size_t pass = 0; pass < kCachedPasses; ++pass) {
        benchmark::DoNotOptimize(stream<W, F>(cached.data(), cached_count));
      }
    }));
  }
  const double read = median(read_seconds);
  const double streamed = median(stream_seconds);
  const double in_cache = median(cached_seconds);
  const auto total = static_cast<double>(count * sizeof(float));
  const auto total_cached = static_cast<double>(kCachedPasses * cached_count * sizeof(float));
  state.counters["bytes_per_second"] =
      benchmark::Counter(total * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["read_bytes_per_second"] = read > 0 ? total / read : 0.0;
  state.counters["vs_read"] = streamed > 0 ? read / streamed : 0.0;
  state.counters["in_cache_vs_read"] = in_cache > 0 && read > 0 ? (total_cached / in_cache) / (total / read) : 0.0;
}

/// Registers BM_Stream<W, F> over `bytes`, named by its work and F.
template <Work W, std::size_t F>
void add(const char* work, std::size_t bytes) {
  const std::string name =
      std::string("Stream/") + work + "/per_line:" + std::to_string(F) + "/bytes:" + std::to_string(bytes);
  benchmark::RegisterBenchmark(name.c_str(), [bytes](benchmark::State& state) { BM_Stream<W, F>(state, bytes); })
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

/// add<W, F>(work, bytes) for each F given.
template <Work W, std::size_t... F>
void add_each(const char* work, std::size_t bytes) {
  (add<W, F>(work, bytes), ...);
}

void register_all() {
  const std::size_t bytes = kvcache::bench::smoke_mode() ? std::size_t{1} << 20 : std::size_t{256} << 20;
  add_each<Work::kRead, 0>("read", bytes);
  add_each<Work::kPrefetch, 0>("prefetch", bytes);
  add_each<Work::kMultiplyAdds, 8, 16, 32>("multiply_adds", bytes);
  add_each<Work::kL1Operands, 4, 8, 16>("l1_operands", bytes);
  add_each<Work::kL1Loads, 4, 16>("l1_loads", bytes);
  add_each<Work::kL1Accumulators, 4, 8, 16>("l1_accumulators", bytes);
}

}  // namespace

int main(int argc, char** argv) { return kvcache::bench::run_benchmarks(argc, argv, register_all); }
