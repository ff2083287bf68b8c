// SPDX-License-Identifier: Apache-2.0
// The read path against itself, each pair timed in turn inside one iteration so that both meet
// the same memory:
//
// - PagedDecode: a decode step (T = 1, D = 128, 8 kv heads) over a history held as 16-token
//   segments against the same bytes as one contiguous segment. `vs_contiguous` is the median
//   contiguous call over the median paged one (1.0: pages cost nothing).
// - HeadSizes: a decode step over 2,048 keys of one kv head of four query heads, for every head
//   size that is a multiple of 8 from 8 to 256 and every format, in cache. `GBps` is the K and V
//   bytes read a second; compare a format's row against float's at the same head size, and a
//   head size's against 128's.
//
//   build/release/bench/read_path_bench --benchmark_filter=PagedDecode
//   build/release/bench/read_path_bench --benchmark_filter='HeadSizes<bfloat16>'

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "kvcache/kvcache.hpp"

namespace {

using kvcache::bench::median;
using kvcache::bench::read_all;
using kvcache::bench::smoke_mode;
using kvcache::bench::time_call;

template <class T>
kvcache::detail::AlignedBuffer<T> filled(std::size_t size, std::size_t salt) {
  kvcache::detail::AlignedBuffer<T> b(size);
  for (std::size_t i = 0; i < size; ++i)
    b.data()[i] = kvcache::detail::narrow<T>(float((i + salt) % 97) / 97.0F - 0.5F);
  return b;
}

/// Args: H_q, S, threads. 8 kv heads, D = 128, 16-token segments against one.
template <class T>
void BM_PagedDecode(benchmark::State& state) {
  const auto q_heads = static_cast<std::size_t>(state.range(0));
  const auto tokens = static_cast<std::size_t>(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  constexpr std::size_t kHeads = 8, kDim = 128, kPage = 16;
  const auto keys = filled<T>(kHeads * tokens * kDim, 1);
  const auto values = filled<T>(kHeads * tokens * kDim, 2);
  std::vector<std::int64_t> positions(tokens);
  std::iota(positions.begin(), positions.end(), std::int64_t{0});
  const kvcache::Shape shape{1, kHeads, tokens, kDim};
  const kvcache::Segment<T> whole{kvcache::TensorView<const T>(keys.data(), shape),
                                  kvcache::TensorView<const T>(values.data(), shape), positions};
  std::vector<kvcache::Segment<T>> pages;
  for (std::size_t first = 0; first < tokens; first += kPage) {
    pages.push_back({whole.keys.tokens(first, kPage), whole.values.tokens(first, kPage),
                     kvcache::Positions(positions.data() + first, kPage)});
  }
  std::vector<float> q(q_heads * kDim, 0.01F), out(q.size());
  const std::int64_t at = static_cast<std::int64_t>(tokens);
  const kvcache::Shape q_shape{1, q_heads, 1, kDim};
  const auto call = [&](const kvcache::History<T>& history) {
    kvcache::causal_attention(kvcache::TensorView<const float>(q.data(), q_shape), std::span(&at, 1), history,
                              kvcache::TensorView<float>(out.data(), q_shape), {.threads = threads});
  };
  const std::vector<float> other(smoke_mode() ? std::size_t{1} << 18 : std::size_t{64} << 20, 1.0F);
  std::vector<double> contiguous, paged;
  for (auto _ : state) {
    benchmark::DoNotOptimize(read_all({{other.data(), other.size()}}, threads));
    contiguous.push_back(time_call([&] { call(kvcache::History<T>{std::span(&whole, 1)}); }));
    benchmark::DoNotOptimize(read_all({{other.data(), other.size()}}, threads));
    paged.push_back(time_call([&] { call(kvcache::History<T>{pages}); }));
    state.SetIterationTime(paged.back());
  }
  state.counters["segments"] = static_cast<double>(pages.size());
  state.counters["vs_contiguous"] = median(contiguous) / median(paged);
}

/// Args: head size. One kv head of four query heads over 2,048 keys, in cache, one thread.
template <class T>
void BM_HeadSizes(benchmark::State& state) {
  const auto dim = static_cast<std::size_t>(state.range(0));
  constexpr std::size_t kKeys = 2048, kGroup = 4;
  const auto keys = filled<T>(kKeys * dim, 3);
  const auto values = filled<T>(kKeys * dim, 4);
  std::vector<std::int64_t> positions(kKeys);
  std::iota(positions.begin(), positions.end(), std::int64_t{0});
  const kvcache::Shape shape{1, 1, kKeys, dim};
  const kvcache::Segment<T> segment{kvcache::TensorView<const T>(keys.data(), shape),
                                    kvcache::TensorView<const T>(values.data(), shape), positions};
  std::vector<float> q(kGroup * dim, 0.01F), out(q.size());
  const std::int64_t at = kKeys;
  const kvcache::Shape q_shape{1, kGroup, 1, dim};
  for (auto _ : state) {
    kvcache::causal_attention(kvcache::TensorView<const float>(q.data(), q_shape), std::span(&at, 1),
                              kvcache::History<T>{std::span(&segment, 1)},
                              kvcache::TensorView<float>(out.data(), q_shape), {.threads = 1});
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["GBps"] = benchmark::Counter(static_cast<double>(keys.bytes() + values.bytes()) * 1e-9,
                                              benchmark::Counter::kIsIterationInvariantRate);
}

template <class T>
void register_type(const char* name) {
  auto* paged = benchmark::RegisterBenchmark((std::string("PagedDecode<") + name + ">").c_str(), BM_PagedDecode<T>)
                    ->ArgNames({"H_q", "S", "threads"})
                    ->UseManualTime()
                    ->Iterations(smoke_mode() ? 1 : 11);
  for (const long threads : {1L, 2L}) {
    for (const long tokens : smoke_mode() ? std::vector<long>{256} : std::vector<long>{16384, 32768}) {
      for (const long q_heads : {8L, 16L, 32L}) paged->Args({q_heads, tokens, threads});
    }
  }
  auto* sizes =
      benchmark::RegisterBenchmark((std::string("HeadSizes<") + name + ">").c_str(), BM_HeadSizes<T>)->ArgNames({"D"});
  for (long dim = 8; dim <= 256; dim += smoke_mode() ? 248 : 8) sizes->Arg(dim);
}

}  // namespace

int main(int argc, char** argv) {
  register_type<float>("float");
  register_type<kvcache::bfloat16>("bfloat16");
  register_type<kvcache::half>("half");
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
