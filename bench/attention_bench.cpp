// SPDX-License-Identifier: Apache-2.0
// Decode attention (T = 1) against the machine's plain read bandwidth over as many bytes.
//
// Each DecodeAttention row reports `bytes_per_second`: the K and V bytes a decode step must
// read, per second of attention (manual time: only the attention calls count). Every iteration
// times in turn a plain read of an equally large twin cache (allocated the same way), a plain
// read of the very same K and V bytes, the twin's read again, and one attention call, each right
// after a read of as much other memory and of the L3 besides (`elsewhere`), so that none finds
// its bytes in cache and all meet the memory in the same state. `vs_read` is the median read of
// the same bytes over the median attention call, `vs_buffer` the median of the twin's reads over
// it, and `read_bytes_per_second`, `buffer_bytes_per_second` and `median_bytes_per_second` the
// medians as rates: other work on a shared machine falls on every side alike, and a median
// ignores the odd disturbed call. Each ReadBandwidth row sums a separate buffer of the same size,
// allocated as a cache's storage is, with the same thread count, timed apart.
// `vs_multiply_add_peak` (as for prefill below, with a shorter loop) is the call's flop rate over
// this core's multiply-add peak: with `vs_read`, how far a call is from either limit.
//
// Each PrefillAttention row times a causal chunk of T queries after P cached tokens, which is
// bound by arithmetic, not memory: `vs_multiply_add_peak` is its flop rate over that of a loop of
// independent multiply-adds at the kernel's vector width, the two timed in turn on every
// iteration, medians over the run.
//
// The benchmarks are built for this machine's vector width (KVCACHE_NATIVE), the tests for the
// default one: each DecodeAttention row first checks its output against a plain softmax in
// double, and fails (SkipWithError, and the program's exit status) when they disagree: the
// smoke run in CI is then a check of the kernel at this machine's vector width.
//
//   ./attention_bench --benchmark_filter='Attention|Read'
//   ./attention_bench --benchmark_filter=Prefill
//   KVCACHE_BENCH_SMOKE=1 ./attention_bench --benchmark_min_time=0.001   # tiny cases only

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "kvcache/kvcache.hpp"

namespace {

constexpr std::size_t kHeadDim = 128;
constexpr std::size_t kKvHeads = 8;

using kvcache::bench::median;
using kvcache::bench::read_all;
using kvcache::bench::smoke_mode;
using kvcache::bench::time_call;

/// Set when an attention output disagreed with the reference: the program then fails.
bool wrong_output = false;

/// Memory read (untimed) before every timed read or call: as much as the L3 that sysconf reports,
/// at least 64 MiB, so that what is timed finds none of its bytes there (1 MiB for the smoke run).
const std::vector<std::pair<const float*, std::size_t>>& elsewhere() {
  static const kvcache::detail::AlignedBuffer<float> buffer = [] {  // zeroed, so every page is touched
    const std::size_t bytes =
        smoke_mode() ? std::size_t{1} << 20 : std::max<std::size_t>(std::size_t{64} << 20, kvcache::bench::l3_bytes());
    return kvcache::detail::AlignedBuffer<float>(bytes / sizeof(float));
  }();
  static const std::vector<std::pair<const float*, std::size_t>> buffers{{buffer.data(), buffer.size()}};
  return buffers;
}

/// K and V for one layer at `tokens` positions, written into a KvCache a chunk at a time.
template <class T>
struct DecodeSetup {
  kvcache::KvCache<T> cache;
  kvcache::History<T> history;
  explicit DecodeSetup(std::size_t tokens)
      : cache({.layers = 1, .kv_heads = kKvHeads, .head_dim = kHeadDim, .capacity = tokens + 1}) {
    constexpr std::size_t kChunk = 256;
    std::vector<T> chunk(kKvHeads * kChunk * kHeadDim);
    for (std::size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<T>(static_cast<float>(i % 97) / 97.0F - 0.5F);
    for (std::size_t done = 0; done < tokens;) {
      const std::size_t n = std::min(kChunk, tokens - done);
      const kvcache::TensorView<const T> kv(chunk.data(), {1, kKvHeads, n, kHeadDim}, {0, kChunk * kHeadDim, kHeadDim});
      std::vector<std::int64_t> positions(n);
      std::iota(positions.begin(), positions.end(), static_cast<std::int64_t>(done));
      history = cache.update(0, kv, kv, positions);
      done += n;
    }
  }
  [[nodiscard]] std::size_t bytes() const { return 2 * history.tokens() * kKvHeads * kHeadDim * sizeof(T); }
  /// The K and V storage as floats, for the plain read over the very same memory.
  [[nodiscard]] std::vector<std::pair<const float*, std::size_t>> buffers() const {
    std::vector<std::pair<const float*, std::size_t>> out;
    for (const auto& s : history.segments) {
      const std::size_t count = s.keys.shape().size() * sizeof(T) / sizeof(float);
      out.emplace_back(reinterpret_cast<const float*>(s.keys.data()), count);
      out.emplace_back(reinterpret_cast<const float*>(s.values.data()), count);
    }
    return out;
  }
};

/// The largest difference between `out` ([1, H_q, 1, D]) and softmax(q . k / sqrt(D)) v over
/// every key of `history`, computed in double.
template <class T>
double reference_error(const std::vector<float>& q, const std::vector<float>& out, const kvcache::History<T>& history,
                       std::size_t q_heads) {
  const std::size_t group = q_heads / kKvHeads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(kHeadDim));
  double worst = 0;
  std::vector<double> scores;
  std::vector<double> row(kHeadDim);
  for (std::size_t h = 0; h < q_heads; ++h) {
    scores.clear();
    double max = -INFINITY;
    for (const auto& seg : history.segments) {
      for (std::size_t j = 0; j < seg.tokens(); ++j) {
        double dot = 0;
        for (std::size_t d = 0; d < kHeadDim; ++d) {
          dot += static_cast<double>(q[h * kHeadDim + d]) *
                 static_cast<double>(static_cast<float>(seg.keys(0, h / group, j, d)));
        }
        scores.push_back(dot * scale);
        max = std::max(max, dot * scale);
      }
    }
    std::fill(row.begin(), row.end(), 0.0);
    double sum = 0;
    std::size_t i = 0;
    for (const auto& seg : history.segments) {
      for (std::size_t j = 0; j < seg.tokens(); ++j, ++i) {
        const double weight = std::exp(scores[i] - max);
        sum += weight;
        for (std::size_t d = 0; d < kHeadDim; ++d) {
          row[d] += weight * static_cast<double>(static_cast<float>(seg.values(0, h / group, j, d)));
        }
      }
    }
    for (std::size_t d = 0; d < kHeadDim; ++d) {
      worst = std::max(worst, std::abs(row[d] / sum - static_cast<double>(out[h * kHeadDim + d])));
    }
  }
  return worst;
}

/// Whether an output of type Q is as close to the double reference as float accumulation over up
/// to 32768 keys of values in [-0.5, 0.5] keeps it, and a 16-bit output's rounding (up to 2^-9 of
/// 0.5) besides, and for bfloat16 the weights' rounding to bfloat16 where V is weighed by pair
/// products (at most 2^-8 / (1 - 2^-8) of the values' range, 1); if not, the benchmark is skipped
/// with the error and the program fails.
template <class Q>
bool matches_reference(benchmark::State& state, double error) {
  constexpr double tolerance = std::is_same_v<Q, float>             ? 1e-4
                               : std::is_same_v<Q, Eigen::bfloat16> ? 1e-4 + 0x1p-10 + 0x1p-8 / (1 - 0x1p-8)
                                                                    : 1e-4 + 0x1p-10;
  if (error <= tolerance) return true;  // NaN is not
  char message[96];
  std::snprintf(message, sizeof message, "output differs from the double reference by %.3g", error);
  state.SkipWithError(message);
  wrong_output = true;
  return false;
}

/// Seconds for `rounds` rounds of independent multiply-add chains on registers of the kernel's
/// vector width: what one core's multiply-add units do flat out. Returns the flops done too.
/// Chains and operands fit in the registers: 16 chains and their two operands under AVX2's 16
/// registers kept some chains on the stack and ran 54.6 Gflop/s instead of 87-95 (AMD EPYC).
std::pair<double, double> multiply_add_peak(std::size_t rounds) {
  using V = kvcache::detail::Vec<float, kvcache::detail::kNativeBytes>;
  constexpr std::size_t kChains = std::min<std::size_t>(16, kvcache::detail::kRegisters - 4);
  V chains[kChains];
  volatile float seed = 1.0F;  // distinct starting values, so no two chains are merged
  for (std::size_t c = 0; c < kChains; ++c) chains[c] = kvcache::detail::splat<V>(seed + static_cast<float>(c));
  const V x = kvcache::detail::splat<V>(0.999999F);
  const V y = kvcache::detail::splat<V>(1e-7F);
  const double seconds = time_call([&] {
    for (std::size_t r = 0; r < rounds; ++r) {
      for (V& c : chains) c = c * x + y;
    }
  });
  for (const V& c : chains) benchmark::DoNotOptimize(c);
  return {seconds, 2.0 * static_cast<double>(rounds * kChains * kvcache::detail::kLanes<V>)};
}

/// Args: H_q, S, threads. q and out are Q: float, or the storage type (a model whose activations
/// are bfloat16).
template <class T, class Q = float>
void BM_DecodeAttention(benchmark::State& state) {
  const auto q_heads = static_cast<std::size_t>(state.range(0));
  const auto tokens = static_cast<std::size_t>(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  DecodeSetup<T> setup(tokens);
  std::vector<Q> q(q_heads * kHeadDim);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<Q>(static_cast<float>(i % 13) / 13.0F - 0.5F);
  std::vector<Q> out(q.size());
  const std::vector<std::int64_t> position{static_cast<std::int64_t>(tokens)};
  const kvcache::Shape shape{1, q_heads, 1, kHeadDim};
  const kvcache::AttentionOptions options{.threads = threads};
  kvcache::causal_attention(kvcache::TensorView<const Q>(q.data(), shape), position, setup.history,
                            kvcache::TensorView<Q>(out.data(), shape), options);
  const std::vector<float> q_values(q.begin(), q.end());
  const std::vector<float> out_values(out.begin(), out.end());
  if (!matches_reference<Q>(state, reference_error(q_values, out_values, setup.history, q_heads))) return;
  const auto buffers = setup.buffers();
  const DecodeSetup<T> twin(tokens);
  const auto twin_buffers = twin.buffers();
  std::vector<double> read_seconds;
  std::vector<double> twin_seconds;
  std::vector<double> attention_seconds;
  std::vector<double> peak_seconds;
  double peak_flops = 0;
  for (auto _ : state) {
    const auto [peak_call, done] = multiply_add_peak(std::size_t{1} << 14);
    peak_seconds.push_back(peak_call);
    peak_flops = done;
    const auto flush = [&] { benchmark::DoNotOptimize(read_all(elsewhere(), threads)); };
    flush();
    twin_seconds.push_back(time_call([&] { benchmark::DoNotOptimize(read_all(twin_buffers, threads)); }));
    flush();
    read_seconds.push_back(time_call([&] { benchmark::DoNotOptimize(read_all(buffers, threads)); }));
    flush();
    twin_seconds.push_back(time_call([&] { benchmark::DoNotOptimize(read_all(twin_buffers, threads)); }));
    flush();
    const double seconds = time_call([&] {
      kvcache::causal_attention(kvcache::TensorView<const Q>(q.data(), shape), position, setup.history,
                                kvcache::TensorView<Q>(out.data(), shape), options);
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
    });
    attention_seconds.push_back(seconds);
    state.SetIterationTime(seconds);
  }
  const auto bytes = static_cast<double>(setup.bytes());
  const double read = median(read_seconds);
  const double twin_read = median(twin_seconds);
  const double attention = median(attention_seconds);
  state.counters["bytes_per_second"] =
      benchmark::Counter(bytes * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["read_bytes_per_second"] = read > 0 ? bytes / read : 0.0;
  state.counters["buffer_bytes_per_second"] = twin_read > 0 ? bytes / twin_read : 0.0;
  state.counters["median_bytes_per_second"] = attention > 0 ? bytes / attention : 0.0;
  state.counters["vs_read"] = attention > 0 ? read / attention : 0.0;
  state.counters["vs_buffer"] = attention > 0 ? twin_read / attention : 0.0;
  // Two multiply-adds (4 flops) per key, query head and value of a row: score and weighted sum.
  const double flops = 4.0 * static_cast<double>(tokens * q_heads * kHeadDim);
  const double peak = median(peak_seconds);
  state.counters["vs_multiply_add_peak"] =
      attention > 0 && peak > 0 ? (flops / attention) / (peak_flops / peak) / static_cast<double>(threads) : 0.0;
}

/// A KvCache of format T holding `tokens` keys of `kv_heads` heads of `dim` values, seeded normal
/// values written as float in chunks, and the history it returns.
template <class T>
struct FormatSetup {
  kvcache::KvCache<T> cache;
  kvcache::History<T> history;
  FormatSetup(std::size_t tokens, std::size_t dim) : cache(config(tokens, dim)) {
    constexpr std::size_t kChunk = 1024;
    const std::vector<float> k = kvcache::bench::normal_floats(kKvHeads * kChunk * dim, 1);
    const std::vector<float> v = kvcache::bench::normal_floats(k.size(), 2);
    const kvcache::Strides strides{kKvHeads * kChunk * dim, kChunk * dim, dim};
    for (std::size_t done = 0; done < tokens;) {
      const std::size_t n = std::min(kChunk, tokens - done);
      history = cache.update(0, kvcache::TensorView<const float>(k.data(), {1, kKvHeads, n, dim}, strides),
                             kvcache::TensorView<const float>(v.data(), {1, kKvHeads, n, dim}, strides),
                             kvcache::next_positions(done, n));
      done += n;
    }
  }
  /// A format with head scales gets those that hold the normal values written (|x| < 6).
  static kvcache::KvCacheConfig config(std::size_t tokens, std::size_t dim) {
    kvcache::KvCacheConfig c{.layers = 1, .kv_heads = kKvHeads, .head_dim = dim, .capacity = tokens};
    if constexpr (kvcache::detail::has_head_scales<T>) {
      static const std::vector<float> scales(kKvHeads, kvcache::storage_codec<T>::scale_for(6.0F));
      c.key_scales = c.value_scales = scales;  // copied by the cache
    }
    return c;
  }
  /// The stored K and V rows, and their row scales where the format keeps a scale per row, as
  /// floats (a K buffer, then its V buffer): the bytes a call must read.
  [[nodiscard]] std::vector<std::pair<const float*, std::size_t>> buffers() const {
    std::vector<std::pair<const float*, std::size_t>> out;
    for (const auto& s : history.segments) {
      const std::size_t count = s.keys.shape().size() * sizeof(typename kvcache::Segment<T>::unit) / sizeof(float);
      out.emplace_back(reinterpret_cast<const float*>(s.keys.data()), count);
      out.emplace_back(reinterpret_cast<const float*>(s.values.data()), count);
      if (!s.key_scales.empty() && s.key_scales.strides.tokens != 0) {
        out.emplace_back(s.key_scales.data, s.keys.shape().batch * s.keys.heads() * s.tokens());
        out.emplace_back(s.value_scales.data, s.keys.shape().batch * s.keys.heads() * s.tokens());
      }
    }
    return out;
  }
};

/// The limit a decode call cannot beat, and the call against it. Each iteration times, in turn
/// and each after a read of other memory: the stored bytes read in every ReadForm on the call's
/// threads, independent multiply-adds on those threads, and the call. The limit is the larger of
/// the fastest read (median per form) and the call's 2 H_q S D multiply-adds at the measured
/// rate; `vs_limit` is the limit over the median call (1: at the limit), `limit_is_read` says
/// which it was, and the `ns_per_key*` counters give call and limits per key of one kv head, as
/// bench/plot.py draws them. `ns_per_key_resident` is the same call over a history short enough
/// to stay in cache, read as from memory (the same runs and prefetch): what the loop's arithmetic
/// costs a key when reading costs next to nothing. Args: H_q, S, threads, D.
template <class T>
void BM_DecodeLimit(benchmark::State& state) {
  const auto q_heads = static_cast<std::size_t>(state.range(0));
  const auto tokens = static_cast<std::size_t>(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  const auto dim = static_cast<std::size_t>(state.range(3));
  const FormatSetup<T> setup(tokens, dim);
  const auto buffers = setup.buffers();
  const std::vector<float> q = kvcache::bench::normal_floats(q_heads * dim, 3);
  std::vector<float> out(q.size());
  const auto at = static_cast<std::int64_t>(tokens);
  const kvcache::Shape shape{1, q_heads, 1, dim};
  const kvcache::AttentionOptions options{.threads = threads};
  const auto call = [&] {
    kvcache::causal_attention(kvcache::TensorView<const float>(q.data(), shape), std::span(&at, 1), setup.history,
                              kvcache::TensorView<float>(out.data(), shape), options);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  };
  // 256 keys a kv head: 2 MiB of float K and V, 8 calls timed together.
  constexpr std::size_t kResidentTokens = 256;
  constexpr int kResidentCalls = 8;
  const FormatSetup<T> resident(kResidentTokens, dim);
  const auto resident_at = static_cast<std::int64_t>(kResidentTokens);
  const kvcache::AttentionOptions from_memory{.threads = threads, .tuning = {.in_cache_bytes = 0}};
  const auto resident_calls = [&] {
    for (int i = 0; i < kResidentCalls; ++i) {
      kvcache::causal_attention(kvcache::TensorView<const float>(q.data(), shape), std::span(&resident_at, 1),
                                resident.history, kvcache::TensorView<float>(out.data(), shape), from_memory);
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  };
  std::vector<std::vector<double>> reads(std::size(kvcache::bench::kReadForms));
  std::vector<double> rates, calls, residents;
  const auto flush = [&] { benchmark::DoNotOptimize(read_all(elsewhere(), threads)); };
  for (auto _ : state) {
    for (std::size_t f = 0; f < reads.size(); ++f) {
      flush();
      reads[f].push_back(
          time_call([&] { benchmark::DoNotOptimize(read_all(buffers, threads, kvcache::bench::kReadForms[f])); }));
    }
    rates.push_back(kvcache::bench::multiply_add_rate(threads, std::size_t{1} << 14));
    flush();
    calls.push_back(time_call(call));
    state.SetIterationTime(calls.back());
    resident_calls();  // brings the short history into cache
    residents.push_back(time_call(resident_calls) / kResidentCalls);
  }
  double read = std::numeric_limits<double>::infinity();
  for (auto& form : reads) read = std::min(read, median(form));
  const double multiply_adds = 2.0 * static_cast<double>(q_heads * tokens * dim);
  const double rate = median(rates);
  const double arithmetic = rate > 0 ? multiply_adds / rate : 0.0;
  const double limit = std::max(read, arithmetic);
  const double attention = median(calls);
  const double keys = static_cast<double>(tokens * kKvHeads);
  state.counters["vs_limit"] = attention > 0 ? limit / attention : 0.0;
  state.counters["limit_is_read"] = read >= arithmetic ? 1.0 : 0.0;
  state.counters["vs_read"] = attention > 0 ? read / attention : 0.0;
  state.counters["ns_per_key"] = attention * 1e9 / keys;
  state.counters["ns_per_key_read"] = read * 1e9 / keys;
  state.counters["ns_per_key_multiply_add"] = arithmetic * 1e9 / keys;
  state.counters["ns_per_key_resident"] = median(residents) * 1e9 / static_cast<double>(kResidentTokens * kKvHeads);
  double bytes = 0;
  for (const auto& [data, count] : buffers) bytes += static_cast<double>(count * sizeof(float));
  state.counters["read_GBps"] = read > 0 ? bytes / read / 1e9 : 0.0;
}

/// A chunk of T queries at positions P .. P + T - 1 over everything before them and themselves
/// (causal prefill), or over the last `window` positions and 4 sinks where window > 0. Reports `flops_per_second` (4 D
/// flops per visible query-key pair and query head: the two products) and `vs_multiply_add_peak`, the median attention
/// call's flop rate over the median rate of multiply_add_peak, timed in turn on every iteration. Args: T, P, H_q,
/// threads, window. q and out are Q, as in BM_DecodeAttention.
template <class T, class Q = float>
void BM_PrefillAttention(benchmark::State& state) {
  const auto chunk = static_cast<std::size_t>(state.range(0));
  const auto prefix = static_cast<std::size_t>(state.range(1));
  const auto q_heads = static_cast<std::size_t>(state.range(2));
  const auto threads = static_cast<std::size_t>(state.range(3));
  const auto window = static_cast<std::size_t>(state.range(4));
  constexpr std::size_t kSinks = 4;
  const DecodeSetup<T> setup(prefix + chunk);
  const kvcache::Shape shape{1, q_heads, chunk, kHeadDim};
  std::vector<Q> q(shape.size());
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<Q>(static_cast<float>(i % 13) / 13.0F - 0.5F);
  std::vector<Q> out(q.size());
  std::vector<std::int64_t> positions(chunk);
  std::iota(positions.begin(), positions.end(), static_cast<std::int64_t>(prefix));
  const kvcache::AttentionOptions options{.window = window, .sinks = window > 0 ? kSinks : 0, .threads = threads};
  const auto attend = [&] {
    kvcache::causal_attention(kvcache::TensorView<const Q>(q.data(), shape), positions, setup.history,
                              kvcache::TensorView<Q>(out.data(), shape), options);
  };
  attend();
  // The last query's rows checked against the double reference over the keys it sees: every
  // key, or the sinks and its window.
  std::vector<float> last_q(q_heads * kHeadDim);
  std::vector<float> last_out(last_q.size());
  for (std::size_t h = 0; h < q_heads; ++h) {
    const std::size_t row = (h * chunk + chunk - 1) * kHeadDim;
    for (std::size_t d = 0; d < kHeadDim; ++d) {
      last_q[h * kHeadDim + d] = static_cast<float>(q[row + d]);
      last_out[h * kHeadDim + d] = static_cast<float>(out[row + d]);
    }
  }
  const std::size_t keys = prefix + chunk;
  const kvcache::Segment<T>& all = setup.history.segments.front();
  std::vector<kvcache::Segment<T>> seen{all};
  if (window > 0 && keys > window + kSinks) {
    seen = {
        {all.keys.tokens(0, kSinks), all.values.tokens(0, kSinks), kvcache::Positions(all.positions.data(), kSinks)},
        {all.keys.tokens(keys - window, window), all.values.tokens(keys - window, window),
         kvcache::Positions(all.positions.data() + keys - window, window)}};
  }
  if (!matches_reference<Q>(state, reference_error(last_q, last_out, kvcache::History<T>{seen}, q_heads))) return;
  double pairs = 0;
  for (std::size_t t = 0; t < chunk; ++t) {
    const std::size_t p = prefix + t;  // sees p + 1 keys, or its window and the sinks before it
    pairs += static_cast<double>(window == 0 || p < window + kSinks ? p + 1 : window + kSinks);
  }
  const double flops = 4.0 * pairs * static_cast<double>(kHeadDim * q_heads);
  std::vector<double> peak_seconds;
  std::vector<double> attention_seconds;
  double peak_flops = 0;
  for (auto _ : state) {
    const auto [seconds, done] = multiply_add_peak(std::size_t{1} << 20);
    peak_seconds.push_back(seconds);
    peak_flops = done;
    const double attention = time_call([&] {
      attend();
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
    });
    attention_seconds.push_back(attention);
    state.SetIterationTime(attention);
  }
  const double attention = median(attention_seconds);
  const double peak = median(peak_seconds);
  state.counters["flops_per_second"] =
      benchmark::Counter(flops * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["vs_multiply_add_peak"] =
      attention > 0 && peak > 0 ? (flops / attention) / (peak_flops / peak) / static_cast<double>(threads) : 0.0;
}

/// Plain read of a buffer as large as the K and V of S tokens of `T`. Args: S, threads, sizeof(T).
void BM_ReadBandwidth(benchmark::State& state) {
  const auto tokens = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  const auto element = static_cast<std::size_t>(state.range(2));
  const std::size_t bytes = 2 * tokens * kKvHeads * kHeadDim * element;
  // Allocated as a cache's storage is (on huge pages where it spans one), so that the two read
  // the same kind of memory.
  kvcache::detail::AlignedBuffer<float> buffer(bytes / sizeof(float));
  for (std::size_t i = 0; i < buffer.size(); ++i) buffer.data()[i] = static_cast<float>(i % 7);
  const std::vector<std::pair<const float*, std::size_t>> buffers{{buffer.data(), buffer.size()}};
  for (auto _ : state) benchmark::DoNotOptimize(read_all(buffers, threads));
  state.counters["bytes_per_second"] = benchmark::Counter(
      static_cast<double>(bytes) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void register_all() {
  const bool tiny = smoke_mode();
  // Smoke runs keep every H_q: each groups its query rows differently (1, 2 or 4 per kv head).
  const std::vector<std::int64_t> heads{8, 16, 32};
  const std::vector<std::int64_t> lengths =
      tiny ? std::vector<std::int64_t>{64} : std::vector<std::int64_t>{512, 4096, 16384, 32768};
  const std::vector<std::int64_t> thread_counts = tiny ? std::vector<std::int64_t>{1} : std::vector<std::int64_t>{1, 2};
  const auto add = [](benchmark::internal::Benchmark* b) { b->UseRealTime()->Unit(benchmark::kMicrosecond); };
  // Attention rows time their calls themselves, between the plain reads they are compared with.
  const auto add_manual = [](benchmark::internal::Benchmark* b) { b->UseManualTime()->Unit(benchmark::kMicrosecond); };
  // A fixed count for decode rows: each iteration also reads an L3's worth of other memory, which
  // manual time leaves out, so a minimum of timed calls would take thousands of iterations.
  const auto add_decode = [&](benchmark::internal::Benchmark* b) { add_manual(b->Iterations(tiny ? 1 : 15)); };
  for (std::int64_t s : lengths) {
    for (std::int64_t t : thread_counts) {
      for (std::int64_t element : {std::int64_t{4}, std::int64_t{2}}) {
        add(benchmark::RegisterBenchmark("ReadBandwidth", BM_ReadBandwidth)
                ->ArgNames({"S", "threads", "bytes"})
                ->Args({s, t, element}));
      }
      for (std::int64_t h : heads) {
        add_decode(benchmark::RegisterBenchmark("DecodeAttention<float>", BM_DecodeAttention<float>)
                       ->ArgNames({"H_q", "S", "threads"})
                       ->Args({h, s, t}));
        add_decode(benchmark::RegisterBenchmark("DecodeAttention<bfloat16>", BM_DecodeAttention<Eigen::bfloat16>)
                       ->ArgNames({"H_q", "S", "threads"})
                       ->Args({h, s, t}));
        add_decode(benchmark::RegisterBenchmark("DecodeAttention<half>", BM_DecodeAttention<Eigen::half>)
                       ->ArgNames({"H_q", "S", "threads"})
                       ->Args({h, s, t}));
        add_decode(benchmark::RegisterBenchmark("DecodeAttention<bfloat16>/q:bfloat16",
                                                BM_DecodeAttention<Eigen::bfloat16, Eigen::bfloat16>)
                       ->ArgNames({"H_q", "S", "threads"})
                       ->Args({h, s, t}));
      }
    }
  }
  // The limit of every stored format: H_q 8 to 64 over 8 kv heads (1 to 8 query rows a kv
  // head), two lengths, one and two threads, D = 128; and the other head sizes at one length.
  const auto limit_rows = [&](auto* bench, const char* name) {
    auto* b = benchmark::RegisterBenchmark(name, bench)->ArgNames({"H_q", "S", "threads", "D"});
    add_decode(b);
    for (const std::int64_t t : thread_counts) {
      for (const std::int64_t s : tiny ? std::vector<std::int64_t>{64} : std::vector<std::int64_t>{16384, 32768}) {
        for (const std::int64_t h : {8, 16, 32, 64}) b->Args({h, s, t, 128});
      }
      for (const std::int64_t d : {64, 96, 256}) {
        for (const std::int64_t h : {8, 32}) b->Args({h, tiny ? 64 : 16384, t, d});
      }
    }
  };
  // Every storage format but double (no engine stores its cache in double).
  kvcache::for_each_format([&]<class T>() {
    if constexpr (!std::is_same_v<T, double>) {
      limit_rows(BM_DecodeLimit<T>, (std::string("DecodeLimit<") + kvcache::format_name<T>() + ">").c_str());
    }
  });
  // Causal prefill, one core: a 512-token chunk from the start and after 2,048 cached tokens (H_q
  // 16 and 32), and a 2,048-token one under a window of 128 (and 4 sinks).
  const std::int64_t chunk = tiny ? 32 : 512;
  const std::int64_t prefix = tiny ? 32 : 2048;
  const std::vector<std::vector<std::int64_t>> prefill{{chunk, 0, 16, 1, 0},
                                                       {chunk, prefix, 16, 1, 0},
                                                       {chunk, 0, 32, 1, 0},
                                                       {chunk, prefix, 32, 1, 0},
                                                       {tiny ? 64 : 2048, 0, 16, 1, tiny ? 8 : 128}};
  for (const auto& args : prefill) {
    add_manual(benchmark::RegisterBenchmark("PrefillAttention<float>", BM_PrefillAttention<float>)
                   ->ArgNames({"T", "P", "H_q", "threads", "window"})
                   ->Args(args));
    add_manual(benchmark::RegisterBenchmark("PrefillAttention<bfloat16>", BM_PrefillAttention<Eigen::bfloat16>)
                   ->ArgNames({"T", "P", "H_q", "threads", "window"})
                   ->Args(args));
    add_manual(benchmark::RegisterBenchmark("PrefillAttention<bfloat16>/q:bfloat16",
                                            BM_PrefillAttention<Eigen::bfloat16, Eigen::bfloat16>)
                   ->ArgNames({"T", "P", "H_q", "threads", "window"})
                   ->Args(args));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int status = kvcache::bench::run_benchmarks(argc, argv, register_all);
  return status != 0 || wrong_output ? 1 : 0;
}
