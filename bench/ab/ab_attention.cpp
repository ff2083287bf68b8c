// SPDX-License-Identifier: Apache-2.0
// Decode attention of several revisions of the library, timed in turn on the same memory:
// bench/ab/run.sh builds one copy of the kernel per revision (bench/ab/variant.cpp) and links
// them here. Every iteration times a plain read of the K and V bytes, then each revision's call
// in turn (the order rotating from one iteration to the next), each right after a read of as
// much other memory (and no less than the L3), so that all meet the memory in the same state. `vs_read:<name>` is the
// median read over that revision's median call; the revisions' outputs must agree within 1e-4.
// A shared machine's memory speed drifts from minute to minute (one core read 22-46 GB/s
// within an hour, 2-core AMD EPYC); timed in turn inside one iteration, every revision meets the
// same drift, where two programs run one after the other do not.
//
// InCacheAB rows time the same call over one kv head of G query heads whose K and V (512 KiB)
// stay in cache (G 1 to 8), 16 calls a timing, one core: the arithmetic alone, which decides the cells the
// memory no longer does (four 16-bit query rows per kv head on one AVX-512 AMD EPYC core).
// `ns_per_key:<name>` is that revision's median call per key; `vs_read` is against reading the
// same bytes from cache. ShortAB rows do the same over 8 kv heads of 16 or 512 keys, where a
// call's fixed costs show (`us_per_call:<name>`). Rows named `.../q:bfloat16` hand the call
// the same queries rounded to bfloat16 and take a bfloat16 output (a bfloat16 model's decode).
//
//   bench/ab/run.sh cdadbfa HEAD -- --benchmark_filter='<bfloat16>/H_q:32'
//   bench/ab/run.sh cdadbfa HEAD -- --benchmark_filter=InCache
//   KVCACHE_AB_S=512,4096 bench/ab/run.sh cdadbfa HEAD -- --benchmark_filter=DecodeAB   # other lengths

#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bench_support.hpp"
#include "kvcache/detail/aligned_buffer.hpp"
#include "kvcache/quantized.hpp"
#include "variant.hpp"

#define KVCACHE_AB_DECLARE(name) void kvcache_ab_decode_##name(const kvcache_ab::DecodeCall&);
KVCACHE_AB_VARIANTS(KVCACHE_AB_DECLARE)

namespace {

using kvcache::bench::median;
using kvcache::bench::read_all;
using kvcache::bench::time_call;

struct Variant {
  const char* name;
  void (*decode)(const kvcache_ab::DecodeCall&);
};
#define KVCACHE_AB_ENTRY(name) Variant{#name, kvcache_ab_decode_##name},
const Variant kVariants[] = {KVCACHE_AB_VARIANTS(KVCACHE_AB_ENTRY)};
constexpr std::size_t kVariantCount = sizeof kVariants / sizeof kVariants[0];

/// Set when two revisions' outputs disagree: the program then fails.
bool outputs_differ = false;

constexpr std::size_t kHeadDim = 128;
constexpr std::size_t kKvHeads = 8;

/// Storage as a cache's: on huge pages where Linux gives them on request.
template <class T>
using Buffer = kvcache::detail::AlignedBuffer<T>;

/// A buffer as read_all takes it.
template <class T>
std::pair<const float*, std::size_t> floats(const Buffer<T>& b) {
  return {reinterpret_cast<const float*>(b.data()), b.bytes() / sizeof(float)};
}

template <class T>
void fill(Buffer<T>& b, std::size_t salt) {
  for (std::size_t i = 0; i < b.size(); ++i) {
    b.data()[i] = static_cast<T>(static_cast<float>((i + salt) % 97) / 97.0F - 0.5F);
  }
}

/// The type of a call storing T.
template <class T>
constexpr kvcache_ab::Type type_of() {
  using kvcache_ab::Type;
  if constexpr (std::is_same_v<T, float>) return Type::kFloat;
  if constexpr (std::is_same_v<T, Eigen::bfloat16>) return Type::kBfloat16;
  if constexpr (std::is_same_v<T, Eigen::half>) return Type::kHalf;
  if constexpr (std::is_same_v<T, kvcache::fp8_e4m3>) return Type::kFp8;
  if constexpr (std::is_same_v<T, kvcache::fp8_e4m3_heads>) return Type::kFp8Heads;
  if constexpr (std::is_same_v<T, kvcache::int8_rows>) return Type::kInt8;
  if constexpr (std::is_same_v<T, kvcache::int4_groups>) return Type::kInt4;
  if constexpr (std::is_same_v<T, kvcache::int4_rotated>) return Type::kInt4Rotated;
}

/// Bytes a stored row of T takes at kHeadDim, its row scale included.
template <class T>
constexpr std::size_t row_bytes() {
  using Codec = kvcache::storage_codec<T>;
  const bool row_scale = kvcache::detail::has_row_scales<T>;
  return Codec::units(kHeadDim) * sizeof(typename Codec::unit) + (row_scale ? sizeof(float) : 0);
}

/// Times every revision's decode call over `kv_heads` kv heads of `tokens` keys, in turn with a
/// plain read of the same K and V bytes. From memory (`in_cache` false): each read and call
/// right after a read of as much other memory. In cache: K and V stay where the last call left
/// them (L2 for 512 KiB), and each timing covers kBatch calls or reads in a row, so that the
/// clock's own cost stays small beside calls of a few microseconds.
template <class T>
void run_ab(benchmark::State& state, std::size_t kv_heads, std::size_t q_heads, std::size_t tokens, std::size_t threads,
            bool in_cache, bool stored_queries) {
  constexpr std::size_t kBatch = 16;
  constexpr bool kQuantized = kvcache_ab::quantized(type_of<T>());
  using Given = std::conditional_t<kQuantized, float, T>;  // a quantized format is given floats
  const std::size_t size = kv_heads * tokens * kHeadDim;
  const std::size_t bytes = kv_heads * tokens * row_bytes<T>();
  Buffer<Given> keys(size), values(size);
  // What the plain read reads: the K and V bytes themselves, or as many as a quantized format stores.
  Buffer<float> stored_keys(kQuantized ? bytes / sizeof(float) : 0), stored_values(stored_keys.size());
  // Twice the history, and no less than the L3: a 64 MiB history read after only twice as much
  // other memory was partly still in a 480 MiB L3 (Intel Xeon), and read faster than memory.
  const Buffer<float> other(in_cache ? 0 : std::max(2 * bytes, kvcache::bench::l3_bytes()) / sizeof(float));
  fill(keys, 0);
  fill(values, 31);
  fill(stored_keys, 0);
  fill(stored_values, 31);
  std::vector<std::int64_t> positions(tokens);
  std::iota(positions.begin(), positions.end(), 0);
  std::vector<float> q(q_heads * kHeadDim);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i % 13) / 13.0F - 0.5F;
  std::vector<std::vector<float>> out(kVariantCount, std::vector<float>(q.size()));
  bool missing = false;
  const auto call = [&](std::size_t v) {
    kVariants[v].decode({type_of<T>(), keys.data(), values.data(), positions, kv_heads, q_heads, tokens, kHeadDim,
                         threads, q.data(), out[v].data(), stored_queries, &missing});
    benchmark::DoNotOptimize(out[v].data());
    benchmark::ClobberMemory();
  };
  for (std::size_t v = 0; v < kVariantCount; ++v) {
    call(v);
    if (missing) {
      state.SkipWithError((std::string(kVariants[v].name) + " has no such storage format").c_str());
      return;
    }
  }
  for (std::size_t v = 1; v < kVariantCount; ++v) {
    for (std::size_t i = 0; i < q.size(); ++i) {
      // Outputs in the storage type may differ by its rounding, 2^-8 of a value in bfloat16, and
      // by the weights' rounding where one revision weighs V by bfloat16 pair products: up to
      // 2^-8 / (1 - 2^-8) of the values' range (1).
      const float tolerance = 1e-4F + (stored_queries ? (std::abs(out[0][i]) + 1.01F) / 256.0F : 0.0F);
      if (!(std::abs(out[v][i] - out[0][i]) <= tolerance)) {
        outputs_differ = true;
        state.SkipWithError(
            (std::string(kVariants[v].name) + "'s output differs from " + kVariants[0].name + "'s").c_str());
        return;
      }
    }
  }
  const std::vector<std::pair<const float*, std::size_t>> same =
      kQuantized ? std::vector{floats(stored_keys), floats(stored_values)} : std::vector{floats(keys), floats(values)};
  const std::vector<std::pair<const float*, std::size_t>> elsewhere{{other.data(), other.size()}};
  std::vector<double> read_seconds;
  std::vector<std::vector<double>> call_seconds(kVariantCount);
  std::size_t round = 0;
  const std::size_t repeats = in_cache ? kBatch : 1;
  const auto evict = [&] {
    if (!in_cache) benchmark::DoNotOptimize(read_all(elsewhere, threads));
  };
  for (auto _ : state) {
    evict();
    read_seconds.push_back(time_call([&] {
      for (std::size_t r = 0; r < repeats; ++r) benchmark::DoNotOptimize(read_all(same, threads));
    }));
    double first = 0;
    for (std::size_t i = 0; i < kVariantCount; ++i) {
      const std::size_t v = (i + round) % kVariantCount;
      evict();
      call_seconds[v].push_back(time_call([&] {
        for (std::size_t r = 0; r < repeats; ++r) call(v);
      }));
      if (v == 0) first = call_seconds[v].back() / static_cast<double>(repeats);
    }
    state.SetIterationTime(first);
    ++round;
  }
  const double read = median(read_seconds) / static_cast<double>(repeats);
  state.counters["read_GBps"] = read > 0 ? static_cast<double>(2 * bytes) / read / 1e9 : 0.0;
  for (std::size_t v = 0; v < kVariantCount; ++v) {
    const double seconds = median(call_seconds[v]) / static_cast<double>(repeats);
    state.counters[std::string("vs_read:") + kVariants[v].name] = seconds > 0 ? read / seconds : 0.0;
    if (in_cache) {
      state.counters[std::string("ns_per_key:") + kVariants[v].name] =
          seconds * 1e9 / static_cast<double>(kv_heads * tokens);
      state.counters[std::string("us_per_call:") + kVariants[v].name] = seconds * 1e6;
    }
  }
}

/// Args: H_q, S, threads. From memory, 8 kv heads.
template <class T, bool StoredQueries = false>
void BM_DecodeAB(benchmark::State& state) {
  run_ab<T>(state, kKvHeads, static_cast<std::size_t>(state.range(0)), static_cast<std::size_t>(state.range(1)),
            static_cast<std::size_t>(state.range(2)), false, StoredQueries);
}

/// Args: G (query heads of the one kv head). One core, K and V 512 KiB together, in cache: the
/// call's arithmetic alone, where the memory of a shared machine does not move the figures.
template <class T, bool StoredQueries = false>
void BM_InCacheAB(benchmark::State& state) {
  const std::size_t tokens = (std::size_t{512} << 10) / (2 * row_bytes<T>());
  run_ab<T>(state, 1, static_cast<std::size_t>(state.range(0)), tokens, 1, true, StoredQueries);
}

/// Args: H_q, S. One core, 8 kv heads of a short history, in cache: what a call costs besides
/// reading keys (queries in, outputs out, each kv head set up), which decides short decodes.
template <class T, bool StoredQueries = false>
void BM_ShortAB(benchmark::State& state) {
  run_ab<T>(state, kKvHeads, static_cast<std::size_t>(state.range(0)), static_cast<std::size_t>(state.range(1)), 1,
            true, StoredQueries);
}

/// The history lengths of the DecodeAB rows: KVCACHE_AB_S (a comma-separated list) where set,
/// else 16,384 and 32,768 (512 in the smoke run).
std::vector<long> decode_lengths() {
  if (kvcache::bench::smoke_mode()) return {512};
  const char* given = std::getenv("KVCACHE_AB_S");
  if (given == nullptr || *given == '\0') return {16384, 32768};
  std::vector<long> lengths;
  for (const char* p = given; *p != '\0';) {
    char* end = nullptr;
    const long length = std::strtol(p, &end, 10);
    if (end == p || length <= 0) {
      std::fprintf(stderr, "KVCACHE_AB_S: expected positive lengths separated by commas, given \"%s\"\n", given);
      std::exit(2);
    }
    lengths.push_back(length);
    p = *end == ',' ? end + 1 : end;
  }
  return lengths;
}

void register_all() {
  const bool smoke = kvcache::bench::smoke_mode();
  const std::vector<long> lengths = decode_lengths();
  const auto each = [&](auto* bench, const char* name) {
    auto* b = benchmark::RegisterBenchmark(name, bench)->ArgNames({"H_q", "S", "threads"})->UseManualTime();
    b->Iterations(smoke ? 2 : 15);
    for (const long threads : {1L, 2L}) {
      for (const long tokens : lengths) {
        for (const long q_heads : {8L, 16L, 32L, 64L}) b->Args({q_heads, tokens, threads});
      }
    }
  };
  each(BM_DecodeAB<float>, "DecodeAB<float>");
  each(BM_DecodeAB<Eigen::bfloat16>, "DecodeAB<bfloat16>");
  each(BM_DecodeAB<Eigen::half>, "DecodeAB<half>");
  each(BM_DecodeAB<Eigen::bfloat16, true>, "DecodeAB<bfloat16>/q:bfloat16");
  each(BM_DecodeAB<kvcache::fp8_e4m3>, "DecodeAB<fp8_e4m3>");
  each(BM_DecodeAB<kvcache::fp8_e4m3_heads>, "DecodeAB<fp8_e4m3_heads>");
  each(BM_DecodeAB<kvcache::int8_rows>, "DecodeAB<int8_rows>");
  each(BM_DecodeAB<kvcache::int4_groups>, "DecodeAB<int4_groups>");
  each(BM_DecodeAB<kvcache::int4_rotated>, "DecodeAB<int4_rotated>");
  const auto cached = [&](auto* bench, const char* name) {
    auto* b = benchmark::RegisterBenchmark(name, bench)->ArgNames({"G"})->UseManualTime();
    b->Iterations(smoke ? 2 : 15);
    for (const long group : {1L, 2L, 4L, 8L}) b->Args({group});
  };
  cached(BM_InCacheAB<float>, "InCacheAB<float>");
  cached(BM_InCacheAB<Eigen::bfloat16>, "InCacheAB<bfloat16>");
  cached(BM_InCacheAB<Eigen::half>, "InCacheAB<half>");
  cached(BM_InCacheAB<Eigen::bfloat16, true>, "InCacheAB<bfloat16>/q:bfloat16");
  cached(BM_InCacheAB<kvcache::fp8_e4m3>, "InCacheAB<fp8_e4m3>");
  cached(BM_InCacheAB<kvcache::fp8_e4m3_heads>, "InCacheAB<fp8_e4m3_heads>");
  cached(BM_InCacheAB<kvcache::int8_rows>, "InCacheAB<int8_rows>");
  cached(BM_InCacheAB<kvcache::int4_groups>, "InCacheAB<int4_groups>");
  cached(BM_InCacheAB<kvcache::int4_rotated>, "InCacheAB<int4_rotated>");
  const auto short_history = [&](auto* bench, const char* name) {
    auto* b = benchmark::RegisterBenchmark(name, bench)->ArgNames({"H_q", "S"})->UseManualTime();
    b->Iterations(smoke ? 2 : 15);
    for (const long tokens : {16L, 512L}) b->Args({32, tokens});
  };
  short_history(BM_ShortAB<float>, "ShortAB<float>");
  short_history(BM_ShortAB<Eigen::bfloat16>, "ShortAB<bfloat16>");
  short_history(BM_ShortAB<Eigen::half>, "ShortAB<half>");
  short_history(BM_ShortAB<Eigen::bfloat16, true>, "ShortAB<bfloat16>/q:bfloat16");
}

}  // namespace

int main(int argc, char** argv) {
  const int status = kvcache::bench::run_benchmarks(argc, argv, register_all);
  return status != 0 || outputs_differ ? 1 : 0;
}
