// SPDX-License-Identifier: Apache-2.0
// How fast one core reads memory depends on the form of the loads that read it, not only on the
// bytes: the question behind decode attention on one core of an Intel Xeon, whose passes read
// 0.74-0.83 of the plain read there (bench/RESULTS.md, "One core on the Intel Xeon"), and of the
// attention kernel's passes taken one at a time (the rows from k_by_keys on).
//
// Each ReadForms row reads a region far larger than the caches in order, 128 bytes an iteration,
// with loads of one form, added into independent sums (x86-64 assembly, so that the compiler does
// not choose the form):
//   ymm_indexed     four 32-byte loads a step, addressed base + index + offset
//   ymm_base        the same loads addressed base + offset, the base moved each step
//   zmm_indexed     two 64-byte loads a step, base + index + offset (AVX-512)
//   widen16_indexed four loads of 16 16-bit values widened to 32-bit lanes (vpmovzxwd),
//                   base + index + offset (AVX-512)
// and, taking the region as bf16 rows of D = 128 (256 bytes), the passes of a decode at four query
// rows per kv head as the kernel runs them (detail/attention_math.hpp), in tiles of 2,048 keys:
//   k_by_keys       the K pass kVector / 4 keys at a time (score_keys), rows asked for 1 KiB
//                   ahead into L1, a row at a time
//   k_in_order_near the K pass one whole row after another (score_in_order), rows asked for 1 KiB
//                   ahead into L1, a line at a time
//   k_in_order      the same, asked for 16 KiB ahead into L2 (FetchPolicy::rows on Intel)
//   v_pass          the V pass (accumulate_whole_rows_in_l1), asked for 16 KiB ahead into L2
//   switch_512k, switch_1m, switch_2m
//                   ymm_indexed over the first half of the region (K) and the second (V) in turn,
//                   runs of 512 KiB, 1 MiB or 2 MiB each: what a tile's length costs the plain read
// Every iteration times, in turn, the plain read the attention benchmarks compare against
// (bench_support.hpp's read_all over one buffer) and the row's form, each right after reading as
// much other memory twice over, and at least as much as the L3, so neither finds its bytes there. `vs_plain_read` is
// the median rate of the form over the median rate of the plain read in the same run.
//
//   ./read_forms_bench
//   KVCACHE_BENCH_SMOKE=1 ./read_forms_bench --benchmark_min_time=0.001   # a 1 MiB region only

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "kvcache/detail/aligned_buffer.hpp"
#include "kvcache/detail/attention_math.hpp"
#include "kvcache/detail/row_fetcher.hpp"

namespace {

using kvcache::bench::median;
using kvcache::bench::read_all;
using kvcache::bench::time_call;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__AVX2__)
#define KVCACHE_READ_FORMS 1

/// Reads [data, data + bytes) (a whole number of 128-byte steps) with the loads of one form.
using ReadForm = void (*)(const char* data, std::size_t bytes);

// A loop of 128-byte steps: `zero` clears the sums, `step` reads a step at %0 + %1 (data and the
// bytes done).
#define KVCACHE_INDEXED_LOOP(zero, step)                                                \
  std::size_t i = 0;                                                                    \
  asm volatile(zero "1:\n\t" step "sub $-128, %1\n\tcmp %1, %2\n\tjne 1b\n\tvzeroupper" \
               : "+r"(data), "+r"(i)                                                    \
               : "r"(bytes)                                                             \
               : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "memory", "cc")
#define KVCACHE_ZERO_FOUR(r)                                                                                  \
  "vxorps %%xmm0, %%xmm0, %%xmm0\n\tvmovaps %%" r "0, %%" r "1\n\tvmovaps %%" r "0, %%" r "2\n\tvmovaps %%" r \
  "0, %%" r "3\n"

void ymm_indexed(const char* data, std::size_t bytes) {
  KVCACHE_INDEXED_LOOP(KVCACHE_ZERO_FOUR("ymm"),
                       "vaddps (%0,%1), %%ymm0, %%ymm0\n\t"
                       "vaddps 0x20(%0,%1), %%ymm1, %%ymm1\n\t"
                       "vaddps 0x40(%0,%1), %%ymm2, %%ymm2\n\t"
                       "vaddps 0x60(%0,%1), %%ymm3, %%ymm3\n\t");
}

void ymm_base(const char* data, std::size_t bytes) {
  const char* end = data + bytes;
  asm volatile(KVCACHE_ZERO_FOUR("ymm") "1:\n\t"
               "vaddps (%0), %%ymm0, %%ymm0\n\t"
               "vaddps 0x20(%0), %%ymm1, %%ymm1\n\t"
               "vaddps 0x40(%0), %%ymm2, %%ymm2\n\t"
               "vaddps 0x60(%0), %%ymm3, %%ymm3\n\t"
               "sub $-128, %0\n\tcmp %0, %1\n\tjne 1b\n\tvzeroupper"
               : "+r"(data)
               : "r"(end)
               : "xmm0", "xmm1", "xmm2", "xmm3", "memory", "cc");
}

#if defined(__AVX512F__)
void zmm_indexed(const char* data, std::size_t bytes) {
  KVCACHE_INDEXED_LOOP(KVCACHE_ZERO_FOUR("zmm"),
                       "vaddps (%0,%1), %%zmm0, %%zmm0\n\t"
                       "vaddps 0x40(%0,%1), %%zmm1, %%zmm1\n\t");
}

void widen16_indexed(const char* data, std::size_t bytes) {
  KVCACHE_INDEXED_LOOP(KVCACHE_ZERO_FOUR("zmm"),
                       "vpmovzxwd (%0,%1), %%zmm4\n\tvpaddd %%zmm4, %%zmm0, %%zmm0\n\t"
                       "vpmovzxwd 0x20(%0,%1), %%zmm5\n\tvpaddd %%zmm5, %%zmm1, %%zmm1\n\t"
                       "vpmovzxwd 0x40(%0,%1), %%zmm4\n\tvpaddd %%zmm4, %%zmm2, %%zmm2\n\t"
                       "vpmovzxwd 0x60(%0,%1), %%zmm5\n\tvpaddd %%zmm5, %%zmm3, %%zmm3\n\t");
}
#endif

namespace kd = kvcache::detail;

constexpr std::size_t kDim = 128;
constexpr std::size_t kQueryRows = 4;
constexpr std::size_t kTileKeys = 2048;
constexpr std::size_t kRowBytes = kDim * sizeof(Eigen::bfloat16);

/// What the four query rows of the pass forms read and write besides the rows: their queries, a
/// tile's scores (the V pass's weights) and their sums, all small enough for L1 and L2.
struct FourRows {
  alignas(64) float queries[kQueryRows][kDim];
  alignas(64) float scores[kQueryRows][kTileKeys];
  alignas(64) float sums[kQueryRows][kDim];
  FourRows() {
    for (auto& row : queries) std::fill(std::begin(row), std::end(row), 0.01F);
    for (auto& row : scores) std::fill(std::begin(row), std::end(row), 0.001F);
    for (auto& row : sums) std::fill(std::begin(row), std::end(row), 0.0F);
  }
};
FourRows four_rows;

/// Calls pass(tile, keys, fetch) for each tile of the region's rows, with a fetcher that asks
/// `ahead` bytes ahead (into L2 where `into_l2`) through to the region's end.
template <class Pass>
void over_tiles(const char* data, std::size_t bytes, std::size_t ahead, bool into_l2, const Pass& pass) {
  const auto* rows = reinterpret_cast<const Eigen::bfloat16*>(data);
  const std::size_t total = bytes / kRowBytes;
  for (std::size_t first = 0; first < total; first += kTileKeys) {
    const Eigen::bfloat16* tile = rows + first * kDim;
    const kd::RowFetcher fetch(tile, kRowBytes, kRowBytes, total - first, kd::FetchDistance{ahead, into_l2});
    pass(tile, std::min(kTileKeys, total - first), fetch);
  }
}

template <bool InOrder, std::size_t Ahead, bool IntoL2>
void k_pass(const char* data, std::size_t bytes) {
  const float* q[kQueryRows];
  float* out[kQueryRows];
  for (std::size_t r = 0; r < kQueryRows; ++r) {
    q[r] = four_rows.queries[r];
    out[r] = four_rows.scores[r];
  }
  over_tiles(data, bytes, Ahead, IntoL2,
             [&](const Eigen::bfloat16* tile, std::size_t count, const kd::RowFetcher& fetch) {
               if constexpr (InOrder) {
                 kd::score_in_order<kQueryRows, kDim>(q, tile, kDim, count, out, fetch);
               } else {
                 constexpr std::size_t kKeys = kd::kVector<float> / kQueryRows;
                 for (std::size_t j = 0; j + kKeys <= count; j += kKeys) {
                   const Eigen::bfloat16* keys[kKeys];
                   for (std::size_t k = 0; k < kKeys; ++k) {
                     keys[k] = tile + (j + k) * kDim;
                     fetch.row<kRowBytes>(j + k);
                   }
                   float* at[kQueryRows];
                   for (std::size_t r = 0; r < kQueryRows; ++r) at[r] = out[r] + j;
                   kd::score_keys<kQueryRows, kDim>(q, keys, kDim, at);
                 }
               }
             });
}

void k_by_keys(const char* data, std::size_t bytes) { k_pass<false, 1024, false>(data, bytes); }
void k_in_order_near(const char* data, std::size_t bytes) { k_pass<true, 1024, false>(data, bytes); }
void k_in_order(const char* data, std::size_t bytes) { k_pass<true, 16384, true>(data, bytes); }

void v_pass(const char* data, std::size_t bytes) {
  constexpr std::size_t kHeld = std::min<std::size_t>(kQueryRows - 1, kd::kAccumulators / (kDim / kd::kVector<float>));
  float* sums[kQueryRows];
  const float* weights[kQueryRows];
  for (std::size_t r = 0; r < kQueryRows; ++r) {
    sums[r] = four_rows.sums[r];
    weights[r] = four_rows.scores[r];
  }
  over_tiles(data, bytes, 16384, true,
             [&](const Eigen::bfloat16* tile, std::size_t count, const kd::RowFetcher& fetch) {
               kd::accumulate_whole_rows_in_l1<kQueryRows, kDim, kHeld>(sums, weights, tile, kDim, count, fetch);
             });
}

template <std::size_t RunBytes>
void switch_runs(const char* data, std::size_t bytes) {
  const std::size_t half = bytes / 2;
  const std::size_t run = std::min(RunBytes, half);
  for (std::size_t done = 0; done + run <= half; done += run) {
    ymm_indexed(data + done, run);
    ymm_indexed(data + half + done, run);
  }
}

/// Args: region MiB (0: 1 MiB, for the smoke run).
void BM_ReadForms(benchmark::State& state, ReadForm form) {
  const std::size_t bytes = state.range(0) == 0 ? std::size_t{1} << 20 : static_cast<std::size_t>(state.range(0)) << 20;
  // Allocated as a cache's storage is (huge pages where Linux gives them), zeroed.
  const kvcache::detail::AlignedBuffer<float> data(bytes / sizeof(float));
  const std::size_t other_bytes = std::max(2 * bytes, kvcache::bench::l3_bytes());
  const kvcache::detail::AlignedBuffer<float> other(other_bytes / sizeof(float));
  const std::vector<std::pair<const float*, std::size_t>> plain{{data.data(), bytes / sizeof(float)}};
  const std::vector<std::pair<const float*, std::size_t>> elsewhere{{other.data(), other_bytes / sizeof(float)}};
  std::vector<double> plain_seconds;
  std::vector<double> form_seconds;
  for (auto _ : state) {
    benchmark::DoNotOptimize(read_all(elsewhere, 1));
    plain_seconds.push_back(time_call([&] { benchmark::DoNotOptimize(read_all(plain, 1)); }));
    benchmark::DoNotOptimize(read_all(elsewhere, 1));
    const double seconds = time_call([&] { form(reinterpret_cast<const char*>(data.data()), bytes); });
    form_seconds.push_back(seconds);
    state.SetIterationTime(seconds);
  }
  const double plain_read = median(plain_seconds);
  const double read = median(form_seconds);
  const auto b = static_cast<double>(bytes);
  state.counters["bytes_per_second"] = read > 0 ? b / read : 0.0;
  state.counters["plain_read_bytes_per_second"] = plain_read > 0 ? b / plain_read : 0.0;
  state.counters["vs_plain_read"] = read > 0 ? plain_read / read : 0.0;
}
#endif

void register_all() {
#if KVCACHE_READ_FORMS
  const long mib = kvcache::bench::smoke_mode() ? 0 : 128;
  const auto add = [&](const char* name, ReadForm form) {
    benchmark::RegisterBenchmark(name, BM_ReadForms, form)
        ->Arg(mib)
        ->ArgName("MiB")
        ->UseManualTime()
        ->Iterations(kvcache::bench::smoke_mode() ? 2 : 15);
  };
  add("ReadForms/ymm_indexed", ymm_indexed);
  add("ReadForms/ymm_base", ymm_base);
#if defined(__AVX512F__)
  add("ReadForms/zmm_indexed", zmm_indexed);
  add("ReadForms/widen16_indexed", widen16_indexed);
#endif
  add("ReadForms/k_by_keys", k_by_keys);
  add("ReadForms/k_in_order_near", k_in_order_near);
  add("ReadForms/k_in_order", k_in_order);
  add("ReadForms/v_pass", v_pass);
  add("ReadForms/switch_512k", switch_runs<std::size_t{512} << 10>);
  add("ReadForms/switch_1m", switch_runs<std::size_t{1} << 20>);
  add("ReadForms/switch_2m", switch_runs<std::size_t{2} << 20>);
#endif
}

}  // namespace

int main(int argc, char** argv) { return kvcache::bench::run_benchmarks(argc, argv, register_all); }
