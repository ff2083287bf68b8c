// SPDX-License-Identifier: Apache-2.0
//
// What the cache buys, measured side by side in one process.
//
// The machine these figures come from is shared and noisy, so every figure that is compared
// with another is measured in the same benchmark, the two sides interleaved iteration by
// iteration, and the comparison is reported as a ratio counter. Times are steady_clock
// intervals around the work being compared (UseManualTime); setup is never timed.
//
//   generate/...      a whole generation, prefill P then N single-token updates over all layers,
//                     through KvCache and, where its quadratic copying fits the time budget,
//                     ConcatKvCache (elsewhere its total is derived from its middle token).
//   decode_step/...   one single-token update over all layers at a given history: the cost per
//                     token that ConcatKvCache grows linearly and KvCache keeps flat.
//   prefill_chunk/... a 512-token chunk written through update() next to memcpy of its bytes.
//   token_flat/...    a single-token update at history 64 next to one at history 32k.
//   ring_decode/...   RingKvCache per-token cost at positions 1k to 64k, and its bytes.
//   storage/...       cache storage on huge pages against the system's pages: allocating and
//                     zeroing it, and reading it.
//
// KVCACHE_BENCH_SMOKE=1 registers only tiny shapes, so CI can run every path in seconds.

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

// The cache headers alone: this program measures caches, not attention.
#include "kvcache/concat_kv_cache.hpp"
#include "kvcache/config.hpp"
#include "kvcache/detail/aligned_buffer.hpp"
#include "kvcache/kv_cache.hpp"
#include "kvcache/ring_kv_cache.hpp"
#include "kvcache/size.hpp"
#include "kvcache/views.hpp"

namespace {

using kvcache::bench::Clock;
using kvcache::bench::seconds_since;
using kvcache::bench::smoke_mode;

/// The cache geometry of a model: Qwen3-0.6B is 28 layers of 8 kv heads x 128.
struct Model {
  std::size_t layers = 0;
  std::size_t kv_heads = 0;
  std::size_t head_dim = 0;

  [[nodiscard]] kvcache::KvCacheConfig dense(std::size_t capacity) const {
    return {.layers = layers, .kv_heads = kv_heads, .head_dim = head_dim, .capacity = capacity};
  }
  /// K and V bytes one token adds to the whole cache.
  template <class T>
  [[nodiscard]] std::size_t token_bytes() const {
    return kvcache::kv_cache_bytes(layers, 1, 1, kv_heads, head_dim, sizeof(T));
  }
};

template <class T>
const char* type_name() {
  return std::is_same_v<T, float> ? "float" : "bf16";
}

/// A [1, kv_heads, tokens, head_dim] block of new keys or values, as a model would produce.
template <class T>
class Tokens {
 public:
  Tokens(const Model& model, std::size_t tokens, float seed)
      : shape_{1, model.kv_heads, tokens, model.head_dim}, data_(shape_.size()) {
    for (std::size_t i = 0; i < data_.size(); ++i) data_[i] = T(seed + static_cast<float>(i % 61) * 0.125f);
  }
  [[nodiscard]] kvcache::TensorView<const T> view() const { return {data_.data(), shape_}; }
  [[nodiscard]] const T* data() const { return data_.data(); }
  [[nodiscard]] std::size_t bytes() const { return data_.size() * sizeof(T); }

 private:
  kvcache::Shape shape_;
  std::vector<T> data_;
};

/// Positions 0, 1, ..., count - 1; updates take a slice of it.
std::vector<std::int64_t> iota_positions(std::size_t count) {
  std::vector<std::int64_t> positions(count);
  std::iota(positions.begin(), positions.end(), std::int64_t{0});
  return positions;
}

/// Appends k, v to every layer, continuing the cache's length, as one forward pass does.
template <class Cache, class T>
void append(Cache& cache, const Tokens<T>& k, const Tokens<T>& v, const std::vector<std::int64_t>& positions) {
  const auto slice = std::span(positions).subspan(cache.length(), k.view().tokens());
  for (std::size_t layer = 0; layer < cache.layers(); ++layer) {
    auto history = cache.update(layer, k.view(), v.view(), slice);
    benchmark::DoNotOptimize(history);
  }
  benchmark::ClobberMemory();
}

/// Brings a cache to `length` tokens in chunks of at most `chunk` (untimed setup).
template <class Cache, class T>
void fill_to(Cache& cache, std::size_t length, const Model& model, std::size_t chunk,
             const std::vector<std::int64_t>& positions) {
  const Tokens<T> k(model, chunk, 0.5f);
  const Tokens<T> v(model, chunk, -0.5f);
  while (cache.length() + chunk <= length) append(cache, k, v, positions);
  if (const std::size_t rest = length - cache.length(); rest != 0) {
    append(cache, Tokens<T>(model, rest, 0.5f), Tokens<T>(model, rest, -0.5f), positions);
  }
}

// ---------------------------------------------------------------------------------------------
// 1. KvCache against ConcatKvCache.

/// Decode time of one generation: reset, prefill (untimed), then `steps` single-token updates.
template <class Cache, class T>
double timed_generation(Cache& cache, const Tokens<T>& prompt_k, const Tokens<T>& prompt_v, const Tokens<T>& token_k,
                        const Tokens<T>& token_v, std::size_t steps, const std::vector<std::int64_t>& positions) {
  cache.reset();
  if (prompt_k.bytes() != 0) append(cache, prompt_k, prompt_v, positions);
  const auto start = Clock::now();
  for (std::size_t i = 0; i < steps; ++i) append(cache, token_k, token_v, positions);
  return seconds_since(start);
}

/// ConcatKvCache's single-token update over all layers at history `history`, as it runs inside a
/// generation: right after the update before it, which left the history it copies in the
/// processor's caches when it fits there. That update is done untimed first, then the timed one.
template <class T>
double timed_step(kvcache::ConcatKvCache<T>& concat, std::size_t history, const Tokens<T>& token_k,
                  const Tokens<T>& token_v, const std::vector<std::int64_t>& positions) {
  concat.truncate(history);
  append(concat, token_k, token_v, positions);
  concat.truncate(history);
  const auto start = Clock::now();
  append(concat, token_k, token_v, positions);
  return seconds_since(start);
}

/// A whole generation, prefill P (untimed) then N single-token updates, through KvCache and,
/// where `full_concat`, through ConcatKvCache. Every iteration also times ConcatKvCache's update
/// of the middle token (history P + (N - 1) / 2): its cost is linear in the history, so N times
/// that is its whole decode, the figure reported where the full loop would take too long.
template <class T>
void generate(benchmark::State& state, Model model, std::size_t prefill, std::size_t steps, bool full_concat) {
  const auto positions = iota_positions(prefill + steps);
  const std::size_t middle = prefill + (steps - 1) / 2;
  kvcache::KvCache<T> cache(model.dense(prefill + steps));
  kvcache::ConcatKvCache<T> concat(model.dense(prefill + steps));
  kvcache::ConcatKvCache<T> concat_middle(model.dense(middle + 1));
  fill_to<kvcache::ConcatKvCache<T>, T>(concat_middle, middle, model, std::max<std::size_t>(middle, 1), positions);
  const Tokens<T> prompt_k(model, prefill, 0.5f);
  const Tokens<T> prompt_v(model, prefill, -0.5f);
  const Tokens<T> token_k(model, 1, 0.25f);
  const Tokens<T> token_v(model, 1, -0.25f);
  // KvCache's generation is short next to ConcatKvCache's; repeating it to at least 2048 tokens
  // keeps its timing above the clock's noise even when the benchmark runs one iteration.
  const std::size_t repeats = std::max<std::size_t>(1, 2048 / steps);
  double cache_seconds = 0;
  double concat_seconds = 0;
  double middle_seconds = 0;
  for (auto _ : state) {
    double c = 0;
    for (std::size_t r = 0; r < repeats; ++r) {
      c += timed_generation(cache, prompt_k, prompt_v, token_k, token_v, steps, positions);
    }
    c /= static_cast<double>(repeats);
    const double k = full_concat ? timed_generation(concat, prompt_k, prompt_v, token_k, token_v, steps, positions) : 0;
    const double m = timed_step(concat_middle, middle, token_k, token_v, positions);
    cache_seconds += c;
    concat_seconds += k;
    middle_seconds += m;
    state.SetIterationTime(c + k + m);
  }
  const auto iterations = static_cast<double>(state.iterations());
  const auto n = static_cast<double>(steps);
  const double cache_total = cache_seconds / iterations;
  const double derived_total = middle_seconds / iterations * n;
  const double concat_total = full_concat ? concat_seconds / iterations : derived_total;
  state.counters["P"] = static_cast<double>(prefill);
  state.counters["N"] = n;
  state.counters["value_bytes"] = sizeof(T);
  state.counters["concat_full_loop"] = full_concat ? 1 : 0;  // 0: concat totals are N x middle token
  state.counters["cache_us_per_token"] = cache_total / n * 1e6;
  state.counters["cache_total_ms"] = cache_total * 1e3;
  state.counters["concat_us_per_token"] = concat_total / n * 1e6;
  state.counters["concat_total_ms"] = concat_total * 1e3;
  state.counters["concat_middle_us"] = middle_seconds / iterations * 1e6;
  state.counters["concat_total_ms_derived"] = derived_total * 1e3;
  state.counters["concat_over_cache"] = concat_total / cache_total;
}

// Tokens a KvCache decode step writes per timed block (it is microseconds; one is below noise).
constexpr std::size_t kStepBlock = 16;

/// One single-token update over all layers of a cache already holding `history` tokens. The
/// KvCache block runs right after ConcatKvCache's step has streamed the history through memory,
/// so it finds the processor's caches cold, as a decode step does after attention has read them.
template <class T>
void decode_step(benchmark::State& state, Model model, std::size_t history, std::size_t prefill, std::size_t steps) {
  const auto positions = iota_positions(history + kStepBlock);
  kvcache::KvCache<T> cache(model.dense(history + kStepBlock));
  kvcache::ConcatKvCache<T> concat(model.dense(history + 1));
  fill_to<kvcache::KvCache<T>, T>(cache, history, model, std::max<std::size_t>(history, 1), positions);
  fill_to<kvcache::ConcatKvCache<T>, T>(concat, history, model, std::max<std::size_t>(history, 1), positions);
  const Tokens<T> token_k(model, 1, 0.25f);
  const Tokens<T> token_v(model, 1, -0.25f);
  double cache_seconds = 0;
  double concat_seconds = 0;
  for (auto _ : state) {
    cache.truncate(history);
    const auto start = Clock::now();
    for (std::size_t i = 0; i < kStepBlock; ++i) append(cache, token_k, token_v, positions);
    const double c = seconds_since(start) / static_cast<double>(kStepBlock);
    const double k = timed_step(concat, history, token_k, token_v, positions);
    cache_seconds += c;
    concat_seconds += k;
    state.SetIterationTime(c + k);
  }
  const auto iterations = static_cast<double>(state.iterations());
  state.counters["P"] = static_cast<double>(prefill);
  state.counters["N"] = static_cast<double>(steps);
  state.counters["history"] = static_cast<double>(history);
  state.counters["value_bytes"] = sizeof(T);
  state.counters["cache_us_per_token"] = cache_seconds / iterations * 1e6;
  state.counters["concat_us_per_token"] = concat_seconds / iterations * 1e6;
  state.counters["concat_over_cache"] = concat_seconds / cache_seconds;
}

// ---------------------------------------------------------------------------------------------
// 2. update() against memcpy, and the cost of a token against the history behind it.

/// A prefill chunk written into every layer through update(), next to memcpy of the same bytes
/// from the same sources into a buffer of the cache's size. Both cycle through their whole
/// destination so that every write goes to memory the caches have not just seen.
template <class T>
void prefill_chunk(benchmark::State& state, Model model, std::size_t chunk) {
  const std::size_t capacity = 8 * chunk;
  const auto positions = iota_positions(capacity);
  kvcache::KvCache<T> cache(model.dense(capacity));
  const Tokens<T> k(model, chunk, 0.5f);
  const Tokens<T> v(model, chunk, -0.5f);
  // Zero-filled like the cache's own storage, so that neither side pays first-touch page faults.
  std::vector<T> target(cache.bytes() / sizeof(T));
  const std::size_t chunk_elements = k.bytes() / sizeof(T);
  const std::size_t layer_elements = 2 * capacity / chunk * chunk_elements;
  std::size_t offset = 0;
  bool update_first = true;
  double update_seconds = 0;
  double memcpy_seconds = 0;
  for (auto _ : state) {
    if (cache.length() + chunk > capacity) {
      cache.reset();
      offset = 0;
    }
    const auto through_update = [&] {
      const auto start = Clock::now();
      append(cache, k, v, positions);
      return seconds_since(start);
    };
    const auto through_memcpy = [&] {
      const auto start = Clock::now();
      for (std::size_t layer = 0; layer < model.layers; ++layer) {
        T* to = target.data() + layer * layer_elements + 2 * offset;
        std::memcpy(static_cast<void*>(to), k.data(), k.bytes());
        std::memcpy(static_cast<void*>(to + chunk_elements), v.data(), v.bytes());
      }
      benchmark::ClobberMemory();
      return seconds_since(start);
    };
    // Alternate which goes first, so that neither always finds the sources warmer.
    double u = 0;
    double m = 0;
    if (update_first) {
      u = through_update();
      m = through_memcpy();
    } else {
      m = through_memcpy();
      u = through_update();
    }
    update_first = !update_first;
    offset += chunk_elements;
    update_seconds += u;
    memcpy_seconds += m;
    state.SetIterationTime(u + m);
  }
  const double bytes = static_cast<double>(state.iterations()) * static_cast<double>(model.layers) * 2.0 *
                       static_cast<double>(k.bytes());
  state.counters["T"] = static_cast<double>(chunk);
  state.counters["layers"] = static_cast<double>(model.layers);
  state.counters["value_bytes"] = sizeof(T);
  state.counters["update_GBps"] = bytes / update_seconds * 1e-9;
  state.counters["memcpy_GBps"] = bytes / memcpy_seconds * 1e-9;
  state.counters["update_over_memcpy"] = memcpy_seconds / update_seconds;  // fraction of memcpy's speed
}

/// A single-token update at history `near` next to one at history `far`, in two caches of the
/// same capacity, alternating which goes first. Each timed block writes `block` tokens from that
/// history, then the cache is truncated back to it.
template <class T>
void token_flat(benchmark::State& state, Model model, std::size_t near, std::size_t far, std::size_t block) {
  const auto positions = iota_positions(far + block);
  kvcache::KvCache<T> near_cache(model.dense(far + block));
  kvcache::KvCache<T> far_cache(model.dense(far + block));
  fill_to<kvcache::KvCache<T>, T>(near_cache, near, model, 1024, positions);
  fill_to<kvcache::KvCache<T>, T>(far_cache, far, model, 1024, positions);
  const Tokens<T> token_k(model, 1, 0.25f);
  const Tokens<T> token_v(model, 1, -0.25f);
  const auto timed_block = [&](kvcache::KvCache<T>& cache, std::size_t history) {
    cache.truncate(history);
    const auto start = Clock::now();
    for (std::size_t i = 0; i < block; ++i) append(cache, token_k, token_v, positions);
    return seconds_since(start);
  };
  double near_seconds = 0;
  double far_seconds = 0;
  bool near_first = true;
  for (auto _ : state) {
    double n = 0;
    double f = 0;
    if (near_first) {
      n = timed_block(near_cache, near);
      f = timed_block(far_cache, far);
    } else {
      f = timed_block(far_cache, far);
      n = timed_block(near_cache, near);
    }
    near_first = !near_first;
    near_seconds += n;
    far_seconds += f;
    state.SetIterationTime(n + f);
  }
  const double tokens = static_cast<double>(state.iterations()) * static_cast<double>(block);
  state.counters["layers"] = static_cast<double>(model.layers);
  state.counters["near_history"] = static_cast<double>(near);
  state.counters["far_history"] = static_cast<double>(far);
  state.counters["value_bytes"] = sizeof(T);
  state.counters["near_ns_per_token"] = near_seconds / tokens * 1e9;
  state.counters["far_ns_per_token"] = far_seconds / tokens * 1e9;
  state.counters["far_over_near"] = far_seconds / near_seconds;
}

// ---------------------------------------------------------------------------------------------
// 3. RingKvCache: flat per token, bounded in memory.

/// Per-token decode cost of one ring at each of `at` positions (one ring per position, all in
/// one benchmark, interleaved). `slack` = block lets each ring truncate back after a timed block.
template <class T>
void ring_decode(benchmark::State& state, Model model, std::size_t window, std::size_t sinks,
                 std::vector<std::size_t> at, std::size_t block) {
  const auto positions = iota_positions(at.back() + block);
  const kvcache::KvCacheConfig config{.layers = model.layers,
                                      .kv_heads = model.kv_heads,
                                      .head_dim = model.head_dim,
                                      .window = window,
                                      .sinks = sinks,
                                      .slack = block};
  std::vector<kvcache::RingKvCache<T>> rings;
  rings.reserve(at.size());
  for (const std::size_t position : at) {
    rings.emplace_back(config);
    // Chunks of slack + 1 tokens are written straight into the ring: no staging area is allocated.
    fill_to<kvcache::RingKvCache<T>, T>(rings.back(), position, model, block + 1, positions);
  }
  const Tokens<T> token_k(model, 1, 0.25f);
  const Tokens<T> token_v(model, 1, -0.25f);
  std::vector<double> seconds(at.size());
  for (auto _ : state) {
    double total = 0;
    for (std::size_t i = 0; i < at.size(); ++i) {
      rings[i].truncate(at[i]);
      const auto start = Clock::now();
      for (std::size_t t = 0; t < block; ++t) append(rings[i], token_k, token_v, positions);
      const double s = seconds_since(start);
      seconds[i] += s;
      total += s;
    }
    state.SetIterationTime(total);
  }
  const double tokens = static_cast<double>(state.iterations()) * static_cast<double>(block);
  state.counters["window"] = static_cast<double>(window);
  state.counters["layers"] = static_cast<double>(model.layers);
  state.counters["value_bytes"] = sizeof(T);
  for (std::size_t i = 0; i < at.size(); ++i) {
    const std::string suffix = "_at_" + std::to_string(at[i]);
    state.counters["us_per_token" + suffix] = seconds[i] / tokens * 1e6;
    state.counters["bytes" + suffix] = static_cast<double>(rings[i].bytes());
  }
  // What a KvCache holding every position up to the last one would need, for scale.
  state.counters["dense_bytes_at_" + std::to_string(at.back())] = static_cast<double>(
      kvcache::kv_cache_bytes(model.layers, 1, at.back(), model.kv_heads, model.head_dim, sizeof(T)));
  const auto [fastest, slowest] = std::minmax_element(seconds.begin(), seconds.end());
  state.counters["last_over_first"] = seconds.back() / seconds.front();
  state.counters["slowest_over_fastest"] = *slowest / *fastest;
}

// ---------------------------------------------------------------------------------------------
// 4. The storage's pages: huge pages against the system's.

/// Storage of `bytes` as the preallocating caches hold it (AlignedBuffer: on huge pages where it
/// spans one) next to the same storage on the system's pages (as ConcatKvCache holds it): each
/// allocated and zeroed, then read once, the two kinds interleaved iteration by iteration and
/// in alternating order. `allocate_plain_over_huge` is the ratio of their allocation times,
/// `read_huge_over_plain` of their read rates (medians).
void storage(benchmark::State& state, std::size_t bytes) {
  using Buffer = kvcache::detail::AlignedBuffer<float>;
  const std::size_t count = bytes / sizeof(float);
  std::vector<double> allocate[2];
  std::vector<double> read[2];
  const auto run = [&](bool huge) {
    const auto start = Clock::now();
    const Buffer buffer(count, {.zero_fill = true, .huge_pages = huge});
    benchmark::DoNotOptimize(buffer.data());
    allocate[huge ? 1 : 0].push_back(seconds_since(start));
    const auto read_start = Clock::now();
    float lanes[16] = {};
    for (std::size_t i = 0; i + 16 <= count; i += 16) {
      for (std::size_t l = 0; l < 16; ++l) lanes[l] += buffer.data()[i + l];
    }
    benchmark::DoNotOptimize(lanes);
    const double seconds = seconds_since(read_start);
    read[huge ? 1 : 0].push_back(seconds);
    return seconds_since(start);
  };
  bool huge_first = true;
  for (auto _ : state) {
    const double first = run(huge_first);
    const double second = run(!huge_first);
    huge_first = !huge_first;
    state.SetIterationTime(first + second);
  }
  const auto median = [](std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    return v[v.size() / 2];
  };
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["allocate_ms_plain"] = median(allocate[0]) * 1e3;
  state.counters["allocate_ms_huge"] = median(allocate[1]) * 1e3;
  state.counters["allocate_plain_over_huge"] = median(allocate[0]) / median(allocate[1]);
  state.counters["read_gb_per_s_plain"] = static_cast<double>(bytes) / median(read[0]) / 1e9;
  state.counters["read_gb_per_s_huge"] = static_cast<double>(bytes) / median(read[1]) / 1e9;
  state.counters["read_huge_over_plain"] = median(read[0]) / median(read[1]);
}

// ---------------------------------------------------------------------------------------------
// Registration.

struct Plan {
  Model model;
  std::vector<std::size_t> prefills;
  std::vector<std::size_t> steps;
  // Full generations run only where ConcatKvCache copies at most this many bytes per iteration
  // (its cost is quadratic in N; at this machine's ~10 GB/s, 16 GB is a few seconds).
  double concat_budget_bytes = 0;
  // Seconds each generation benchmark runs at least (0: --benchmark_min_time decides). Its
  // largest cells take a second an iteration; more than one iteration keeps a single burst of
  // other work on a shared machine from being the whole figure.
  double generate_min_time = 0;
  std::size_t chunk = 0;
  Model flat_model;
  std::size_t flat_near = 0;
  std::size_t flat_far = 0;
  std::size_t flat_block = 0;
  std::size_t ring_window = 0;
  std::size_t ring_sinks = 0;
  std::vector<std::size_t> ring_at;
  std::size_t ring_block = 0;
  std::size_t storage_bytes = 0;
  // The first allocations of huge pages may wait for the kernel to compact memory (here 1 s
  // instead of 0.1 for 448 MiB): later ones show the steady state.
  double storage_min_time = 0;
};

Plan full_plan() {
  const Model qwen3{.layers = 28, .kv_heads = 8, .head_dim = 128};
  return {.model = qwen3,
          .prefills = {0, 1024},
          .steps = {64, 256, 1024, 4096},
          .concat_budget_bytes = 16e9,
          .generate_min_time = 2.0,
          .chunk = 512,
          // One layer: a 32k-token float KvCache of all 28 layers would be 7.5 GB.
          .flat_model = {.layers = 1, .kv_heads = 8, .head_dim = 128},
          .flat_near = 64,
          .flat_far = 32768,
          .flat_block = 64,
          .ring_window = 4096,
          .ring_sinks = 4,
          .ring_at = {1024, 4096, 16384, 65536},
          .ring_block = 64,
          // The K (or V) storage of all 28 layers at 8,192 tokens in bf16: 448 MiB.
          .storage_bytes = std::size_t{448} << 20,
          .storage_min_time = 5};
}

Plan smoke_plan() {
  const Model tiny{.layers = 2, .kv_heads = 2, .head_dim = 16};
  return {.model = tiny,
          .prefills = {0, 8},
          .steps = {4, 16},
          .concat_budget_bytes = 20e3,  // leaves N = 16 to the derived path, so smoke runs it too
          .chunk = 16,
          .flat_model = tiny,
          .flat_near = 4,
          .flat_far = 64,
          .flat_block = 4,
          .ring_window = 16,
          .ring_sinks = 2,
          .ring_at = {8, 32, 128},
          .ring_block = 4,
          .storage_bytes = std::size_t{4} << 20};  // two huge pages: the huge path runs too
}

/// Bytes ConcatKvCache copies in one generation: the prompt, then the whole history per token.
template <class T>
double concat_generation_bytes(const Model& model, std::size_t prefill, std::size_t steps) {
  const auto p = static_cast<double>(prefill);
  const auto n = static_cast<double>(steps);
  return static_cast<double>(model.token_bytes<T>()) * (p + n * p + n * (n + 1) / 2);
}

template <class T>
void register_type(const Plan& plan) {
  const std::string type = type_name<T>();
  const Model model = plan.model;
  for (const std::size_t p : plan.prefills) {
    for (const std::size_t n : plan.steps) {
      const std::string cell = type + "/P:" + std::to_string(p) + "/N:" + std::to_string(n);
      const bool full_concat = concat_generation_bytes<T>(model, p, n) <= plan.concat_budget_bytes;
      auto* generation =
          benchmark::RegisterBenchmark(("generate/" + cell).c_str(), generate<T>, model, p, n, full_concat)
              ->UseManualTime()
              ->Unit(benchmark::kMillisecond);
      if (plan.generate_min_time > 0) generation->MinTime(plan.generate_min_time);
      // The N-th token's update: history P + N - 1.
      benchmark::RegisterBenchmark(("decode_step/" + cell).c_str(), decode_step<T>, model, p + n - 1, p, n)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
  benchmark::RegisterBenchmark(("prefill_chunk/" + type + "/T:" + std::to_string(plan.chunk)).c_str(), prefill_chunk<T>,
                               model, plan.chunk)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

void register_all(const Plan& plan) {
  register_type<float>(plan);
  register_type<Eigen::bfloat16>(plan);
  benchmark::RegisterBenchmark(("token_flat/float/layers:" + std::to_string(plan.flat_model.layers) +
                                "/history:" + std::to_string(plan.flat_near) + "_vs_" + std::to_string(plan.flat_far))
                                   .c_str(),
                               token_flat<float>, plan.flat_model, plan.flat_near, plan.flat_far, plan.flat_block)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
  // bf16, the model's own storage type: four rings of all 28 layers are 1.9 GB in it.
  benchmark::RegisterBenchmark(("ring_decode/bf16/window:" + std::to_string(plan.ring_window)).c_str(),
                               ring_decode<Eigen::bfloat16>, plan.model, plan.ring_window, plan.ring_sinks,
                               plan.ring_at, plan.ring_block)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
  auto* pages = benchmark::RegisterBenchmark(("storage/bytes:" + std::to_string(plan.storage_bytes)).c_str(), storage,
                                             plan.storage_bytes)
                    ->UseManualTime()
                    ->Unit(benchmark::kMillisecond);
  if (plan.storage_min_time > 0) pages->MinTime(plan.storage_min_time);
}

}  // namespace

int main(int argc, char** argv) {
  return kvcache::bench::run_benchmarks(argc, argv, [] {
    const bool smoke = smoke_mode();
    const Plan plan = smoke ? smoke_plan() : full_plan();
    benchmark::AddCustomContext("kvcache_bench_mode", smoke ? "smoke (tiny shapes, not for figures)" : "full");
    benchmark::AddCustomContext("kvcache_model", "layers=" + std::to_string(plan.model.layers) +
                                                     " kv_heads=" + std::to_string(plan.model.kv_heads) +
                                                     " head_dim=" + std::to_string(plan.model.head_dim) + " batch=1");
    register_all(plan);
  });
}
