// SPDX-License-Identifier: Apache-2.0
// Serving many sequences (docs/paged.md): decode attention over a batch of paged sequences in one
// call, against a call per sequence, and a windowed sequence long after its window filled. D =
// 128, 8 kv heads, blocks of 16 tokens; each pair timed in turn inside one iteration, caches
// evicted before every call.
//
// - SharedPrefixDecode: 16 sequences forked from one 4,096-token prompt, each then 64 tokens of
//   its own and one decode token. `time_ratio` is the one call's median time over 16 calls';
//   `bytes_ratio` the blocks the batch holds, each once (what the one call reads), over the
//   blocks the 16 sequences hold one by one (what 16 calls read); `multiply_add_ratio` the
//   time_ratio that the call's multiply-adds alone allow (at the rate of a register-resident
//   loop), and `vs_multiply_adds` that time over the call's (1: the call is at it).
// - IndependentDecode: 16 unrelated sequences of 2,048 tokens in one call. `speedup` is the call
//   on one thread over the call on two; `vs_read_1t` / `vs_read_2t` a plain read of as many bytes
//   on one / two threads over the call on as many (1: the call reads at the machine's rate).
// - WindowedDecode: a decode step (update and attention, one layer) of a sequence in a pool with
//   a window of 4,096 at 16x the window against one at 1x. `time_ratio` and `bytes_ratio` are
//   the long one's over the short one's (1: flat).
//
//   build/release/bench/batch_bench --benchmark_filter=SharedPrefixDecode

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

// GCC 12 with -march=native reports Eigen's AVX-512 code as maybe-uninitialized; see model_bench.cpp.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <Eigen/Core>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include "kvcache/kvcache.hpp"

namespace {

using kvcache::bench::median;
using kvcache::bench::normal_floats;
using kvcache::bench::read_all;
using kvcache::bench::smoke_mode;
using kvcache::bench::time_call;

constexpr std::size_t kHeads = 8, kDim = 128, kBlock = 16;

/// Feeds `tokens` tokens of seeded values to layer 0 of `seq`, in chunks of up to 1,024.
template <class T>
void feed(kvcache::PagedKvCache<T>& seq, std::size_t tokens, std::uint64_t seed) {
  constexpr std::size_t kChunk = 1024;
  const std::vector<float> k = normal_floats(kHeads * kChunk * kDim, seed), v = normal_floats(k.size(), seed + 1);
  for (std::size_t done = 0; done < tokens;) {
    const std::size_t n = std::min(kChunk, tokens - done);
    const kvcache::Strides strides{kHeads * kChunk * kDim, kChunk * kDim, kDim};
    const auto positions = kvcache::next_positions(seq.length(0), n);
    seq.update(0, kvcache::TensorView<const float>(k.data(), {1, kHeads, n, kDim}, strides),
               kvcache::TensorView<const float>(v.data(), {1, kHeads, n, kDim}, strides), positions);
    done += n;
  }
}

/// A buffer larger than the caches, read before every timed call.
struct Evictor {
  std::vector<float> other = std::vector<float>(smoke_mode() ? std::size_t{1} << 18 : std::size_t{64} << 20, 1.0F);
  void operator()(std::size_t threads) const {
    benchmark::DoNotOptimize(read_all({{other.data(), other.size()}}, threads));
  }
};

/// The queries of `rows` sequences at their next positions, and their outputs.
struct Queries {
  std::vector<float> q, out;
  std::vector<std::int64_t> positions;
  kvcache::Shape shape;
  Queries(std::size_t rows, std::size_t q_heads)
      : q(normal_floats(rows * q_heads * kDim, 3)), out(q.size()), shape{rows, q_heads, 1, kDim} {}
  /// Row i's view, as a batch of one.
  [[nodiscard]] kvcache::TensorView<const float> row_q(std::size_t i) const {
    return {q.data() + i * shape.heads * kDim, {1, shape.heads, 1, kDim}};
  }
  [[nodiscard]] kvcache::TensorView<float> row_out(std::size_t i) {
    return {out.data() + i * shape.heads * kDim, {1, shape.heads, 1, kDim}};
  }
};

/// Args: H_q, threads.
template <class T>
void BM_SharedPrefixDecode(benchmark::State& state) {
  const auto q_heads = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  const std::size_t prefix = smoke_mode() ? 128 : 4096, own = smoke_mode() ? 8 : 64, rows = smoke_mode() ? 3 : 16;
  kvcache::BlockPool<T> pool({.layers = 1,
                              .kv_heads = kHeads,
                              .head_dim = kDim,
                              .block_tokens = kBlock,
                              .blocks = prefix / kBlock + rows * ((own + 1) / kBlock + 2)});
  std::vector<std::unique_ptr<kvcache::PagedKvCache<T>>> seqs;
  seqs.push_back(std::make_unique<kvcache::PagedKvCache<T>>(pool));
  feed(*seqs[0], prefix, 1);
  for (std::size_t i = 1; i < rows; ++i) seqs.push_back(std::make_unique<kvcache::PagedKvCache<T>>(seqs[0]->fork()));
  std::vector<kvcache::PagedKvCache<T>*> members;
  std::size_t apart = 0;
  for (std::size_t i = 0; i < rows; ++i) {
    feed(*seqs[i], own + 1, 100 + 2 * i);
    members.push_back(seqs[i].get());
    apart += seqs[i]->bytes();
  }
  kvcache::PagedBatch<T> batch(members);
  Queries q(rows, q_heads);
  for (const auto* s : members) q.positions.push_back(static_cast<std::int64_t>(s->length()) - 1);
  const kvcache::AttentionOptions options{.threads = threads};
  const Evictor evict;
  std::vector<double> one, each, rates;
  for (auto _ : state) {
    rates.push_back(kvcache::bench::multiply_add_rate(threads, std::size_t{1} << 14));
    evict(threads);
    const kvcache::History<T> history = batch.history(0);
    one.push_back(time_call([&] {
      kvcache::causal_attention(kvcache::TensorView<const float>(q.q.data(), q.shape),
                                kvcache::Positions(q.positions.data(), 1, 1), history,
                                kvcache::TensorView<float>(q.out.data(), q.shape), options);
    }));
    state.SetIterationTime(one.back());
    std::vector<kvcache::History<T>> alone;  // each sequence's own segments, valid until its next history()
    for (const auto& s : seqs) alone.push_back(s->history(0));
    evict(threads);
    each.push_back(time_call([&] {
      for (std::size_t i = 0; i < rows; ++i) {
        kvcache::causal_attention(q.row_q(i), kvcache::Positions(q.positions[i]), alone[i], q.row_out(i), options);
      }
    }));
  }
  state.counters["time_ratio"] = median(one) / median(each);
  state.counters["bytes_ratio"] = static_cast<double>(batch.bytes()) / static_cast<double>(apart);
  // Both ways do the same multiply-adds, 2 D per query head and key (K, then V), which the one
  // call no longer hides under 16 reads: the time_ratio they allow, and the call's time over it.
  const double keys = static_cast<double>(prefix + own + 1);
  const double floor = 2.0 * static_cast<double>(rows * q_heads * kDim) * keys / median(rates);
  state.counters["multiply_add_ratio"] = floor / median(each);
  state.counters["vs_multiply_adds"] = floor / median(one);
}

/// Args: H_q.
template <class T>
void BM_IndependentDecode(benchmark::State& state) {
  const auto q_heads = static_cast<std::size_t>(state.range(0));
  const std::size_t tokens = smoke_mode() ? 64 : 2048, rows = smoke_mode() ? 3 : 16;
  kvcache::BlockPool<T> pool({.layers = 1,
                              .kv_heads = kHeads,
                              .head_dim = kDim,
                              .block_tokens = kBlock,
                              .blocks = rows * (tokens / kBlock + 1)});
  std::vector<std::unique_ptr<kvcache::PagedKvCache<T>>> seqs;
  std::vector<kvcache::PagedKvCache<T>*> members;
  for (std::size_t i = 0; i < rows; ++i) {
    seqs.push_back(std::make_unique<kvcache::PagedKvCache<T>>(pool));
    feed(*seqs.back(), tokens, 10 + 2 * i);
    members.push_back(seqs.back().get());
  }
  kvcache::PagedBatch<T> batch(members);
  Queries q(rows, q_heads);
  q.positions.assign(rows, static_cast<std::int64_t>(tokens) - 1);
  // A plain read of as many bytes as the call's K and V, in a buffer of its own.
  const std::vector<float> twin(batch.bytes() / sizeof(float), 1.0F);
  const Evictor evict;
  std::vector<double> call[2], read[2];
  for (auto _ : state) {
    for (std::size_t threads = 1; threads <= 2; ++threads) {
      evict(threads);
      const kvcache::History<T> history = batch.history(0);
      call[threads - 1].push_back(time_call([&] {
        kvcache::causal_attention(kvcache::TensorView<const float>(q.q.data(), q.shape),
                                  kvcache::Positions(q.positions.data(), 1, 1), history,
                                  kvcache::TensorView<float>(q.out.data(), q.shape), {.threads = threads});
      }));
      evict(threads);
      read[threads - 1].push_back(time_call([&] {
        benchmark::DoNotOptimize(read_all({{twin.data(), twin.size()}}, threads));
      }));
    }
    state.SetIterationTime(call[1].back());
  }
  state.counters["speedup"] = median(call[0]) / median(call[1]);
  state.counters["vs_read_1t"] = median(read[0]) / median(call[0]);
  state.counters["vs_read_2t"] = median(read[1]) / median(call[1]);
}

/// Args: H_q, threads.
template <class T>
void BM_WindowedDecode(benchmark::State& state) {
  const auto q_heads = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  const std::size_t window = smoke_mode() ? 64 : 4096;
  const kvcache::BlockPoolConfig config{.layers = 1,
                                        .kv_heads = kHeads,
                                        .head_dim = kDim,
                                        .block_tokens = kBlock,
                                        .blocks = (window + 1024) / kBlock + 8,  // a fed chunk and its window
                                        .window = window};
  kvcache::BlockPool<T> short_pool(config), long_pool(config);
  kvcache::PagedKvCache<T> at_window(short_pool), far_past(long_pool);
  feed(at_window, window, 1);
  feed(far_past, 16 * window, 1);
  const std::vector<float> k = normal_floats(kHeads * kDim, 7), v = normal_floats(k.size(), 8);
  Queries q(1, q_heads);
  const Evictor evict;
  const auto step = [&](kvcache::PagedKvCache<T>& seq) {
    const auto at = static_cast<std::int64_t>(seq.length());
    const kvcache::History<T> history =
        seq.update(0, kvcache::TensorView<const float>(k.data(), {1, kHeads, 1, kDim}),
                   kvcache::TensorView<const float>(v.data(), {1, kHeads, 1, kDim}), at);
    kvcache::causal_attention(q.row_q(0), kvcache::Positions(at), history, q.row_out(0), {.threads = threads});
  };
  std::vector<double> near, far;
  for (auto _ : state) {
    evict(threads);
    far.push_back(time_call([&] { step(far_past); }));
    state.SetIterationTime(far.back());
    evict(threads);
    near.push_back(time_call([&] { step(at_window); }));
  }
  state.counters["time_ratio"] = median(far) / median(near);
  state.counters["bytes_ratio"] = static_cast<double>(far_past.bytes()) / static_cast<double>(at_window.bytes());
}

template <class T>
void register_all(const std::string& name) {
  const int iterations = smoke_mode() ? 1 : 15;
  auto* shared = benchmark::RegisterBenchmark(("SharedPrefixDecode<" + name + ">").c_str(), BM_SharedPrefixDecode<T>)
                     ->ArgNames({"H_q", "threads"})
                     ->UseManualTime()
                     ->Iterations(iterations);
  auto* independent = benchmark::RegisterBenchmark(("IndependentDecode<" + name + ">").c_str(), BM_IndependentDecode<T>)
                          ->ArgNames({"H_q"})
                          ->UseManualTime()
                          ->Iterations(iterations);
  auto* windowed = benchmark::RegisterBenchmark(("WindowedDecode<" + name + ">").c_str(), BM_WindowedDecode<T>)
                       ->ArgNames({"H_q", "threads"})
                       ->UseManualTime()
                       ->Iterations(iterations);
  for (const long q_heads : {8L, 32L}) {
    independent->Args({q_heads});
    for (const long threads : {1L, 2L}) {
      shared->Args({q_heads, threads});
      windowed->Args({q_heads, threads});
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  return kvcache::bench::run_benchmarks(argc, argv, [] {
    register_all<float>("float");
    register_all<Eigen::bfloat16>("bfloat16");
  });
}
