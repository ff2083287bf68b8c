// SPDX-License-Identifier: Apache-2.0
// What docs/threads.md allows to run concurrently, run concurrently: each layer of one cache
// updated (and read) by a thread of its own, whole-cache calls between passes, attention called
// from several threads sharing the kept pool, and pool calls of different widths. Each pattern
// checks its results against the same work done on one thread; ThreadSanitizer (the tsan
// preset, run by CI) checks that none of it races.

#include <gtest/gtest.h>

#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <type_traits>
#include <vector>

#include "kvcache/attention.hpp"
#include "kvcache/concat_kv_cache.hpp"
#include "kvcache/detail/worker_pool.hpp"
#include "kvcache/kv_cache.hpp"
#include "kvcache/quantized.hpp"
#include "kvcache/ring_kv_cache.hpp"
#include "kvcache/slot_kv_cache.hpp"

namespace kvcache {
namespace {

constexpr std::size_t kLayers = 4;
constexpr std::size_t kKvHeads = 2;
constexpr std::size_t kQueryHeads = 4;
constexpr std::size_t kHeadDim = 32;

/// Seeded values in [-magnitude, magnitude]: the same for the same seed on every thread.
std::vector<float> seeded(std::size_t count, std::uint64_t seed, float magnitude) {
  std::vector<float> values(count);
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ULL + 1;
  for (float& x : values) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    x = magnitude * (static_cast<float>(state >> 40) / static_cast<float>(1U << 23) - 1.0F);
  }
  return values;
}

template <class Cache>
inline constexpr bool is_slot_cache = std::is_same_v<Cache, SlotKvCache<typename Cache::value_type>>;

/// Tokens `layer` holds (in its one slot, for the slot cache).
template <class Cache>
std::size_t layer_length(const Cache& cache, std::size_t layer) {
  if constexpr (is_slot_cache<Cache>) {
    return cache.row_length(0, layer);
  } else {
    return cache.length(layer);
  }
}

/// One layer's share of a pass: `tokens` new tokens through update() and attention (with
/// `threads` threads), its outputs appended to `outputs`. Later positions have larger values,
/// so that fp8_e4m3_heads' given scales saturate (and count it) in later ones.
template <class Cache>
void step_layer(Cache& cache, std::size_t layer, std::size_t tokens, std::size_t threads, std::vector<float>& outputs) {
  const std::size_t start = layer_length(cache, layer);
  const std::vector<std::int64_t> positions = next_positions(start, tokens);
  const auto magnitude = 1.0F + static_cast<float>(start) / 4.0F;
  const std::uint64_t seed = layer * 1000 + start;
  const std::vector<float> k = seeded(kKvHeads * tokens * kHeadDim, seed, magnitude);
  const std::vector<float> v = seeded(k.size(), seed + 1, magnitude);
  const std::vector<float> q = seeded(kQueryHeads * tokens * kHeadDim, seed + 2, 1.0F);
  std::vector<float> out(q.size());
  const Shape kv_shape{1, kKvHeads, tokens, kHeadDim};
  const Shape q_shape{1, kQueryHeads, tokens, kHeadDim};
  const History<typename Cache::value_type> history = cache.update(
      layer, TensorView<const float>(k.data(), kv_shape), TensorView<const float>(v.data(), kv_shape), positions);
  causal_attention(TensorView<const float>(q.data(), q_shape), positions, history,
                   TensorView<float>(out.data(), q_shape), {.threads = threads});
  outputs.insert(outputs.end(), out.begin(), out.end());
  // What a layer's own thread may also read: its history and its length.
  const History<typename Cache::value_type> again = cache.history(layer);
  outputs.push_back(static_cast<float>(again.tokens()));
  outputs.push_back(static_cast<float>(layer_length(cache, layer)));
}

/// A prompt chunk, then single tokens: one layer's whole run.
constexpr std::size_t kChunks[] = {6, 1, 1, 3, 1, 1, 1, 1};

template <class Cache>
Cache make_cache() {
  if constexpr (std::is_same_v<Cache, RingKvCache<typename Cache::value_type>>) {
    // A window as long as the prompt chunk: the chunk is staged, and the ring wraps.
    return Cache({.layers = kLayers, .kv_heads = kKvHeads, .head_dim = kHeadDim, .window = 6, .sinks = 2});
  } else if constexpr (detail::has_head_scales<typename Cache::value_type>) {
    static const std::vector<float> scales(kLayers * kKvHeads, 2.0F / 448);  // the first tokens' range
    return Cache({.layers = kLayers,
                  .kv_heads = kKvHeads,
                  .head_dim = kHeadDim,
                  .capacity = 64,
                  .key_scales = scales,
                  .value_scales = scales});
  } else {
    return Cache({.layers = kLayers, .kv_heads = kKvHeads, .head_dim = kHeadDim, .capacity = 64});
  }
}

template <class Cache>
class Threads : public ::testing::Test {};

// Variants whose per-layer state differs (one buffer, reallocated buffers, a ring with staging,
// slots admitted by the protocol's update), and a format whose head scales and saturation counts
// are kept per layer.
using Caches = ::testing::Types<KvCache<float>, ConcatKvCache<float>, RingKvCache<float>, SlotKvCache<float>,
                                KvCache<fp8_e4m3_heads>>;
TYPED_TEST_SUITE(Threads, Caches);

TYPED_TEST(Threads, EachLayerUpdatedByAThreadOfItsOwn) {
  TypeParam cache = make_cache<TypeParam>();
  std::vector<std::vector<float>> outputs(kLayers);
  std::vector<std::thread> threads;
  for (std::size_t layer = 0; layer < kLayers; ++layer) {
    threads.emplace_back([&, layer] {
      for (const std::size_t tokens : kChunks) step_layer(cache, layer, tokens, 2, outputs[layer]);
    });
  }
  for (std::thread& t : threads) t.join();

  std::vector<std::vector<float>> expected(kLayers);
  TypeParam replay = make_cache<TypeParam>();
  for (std::size_t layer = 0; layer < kLayers; ++layer) {
    for (const std::size_t tokens : kChunks) step_layer(replay, layer, tokens, 2, expected[layer]);
  }
  for (std::size_t layer = 0; layer < kLayers; ++layer) EXPECT_EQ(outputs[layer], expected[layer]) << "layer " << layer;
  EXPECT_EQ(cache.length(), replay.length());
  EXPECT_EQ(cache.clipped(), replay.clipped());
  EXPECT_EQ(cache.bytes(), replay.bytes());
  if constexpr (std::is_same_v<typename TypeParam::value_type, fp8_e4m3_heads>) {
    EXPECT_GT(cache.clipped(), 0U) << "the later tokens were meant to saturate";
  }
}

TYPED_TEST(Threads, WholeCacheCallsBetweenPasses) {
  // A thread per layer; between passes, while every layer's thread waits at the barrier, one
  // thread rolls the cache back a token and reads its length and bytes.
  TypeParam cache = make_cache<TypeParam>();
  std::vector<std::size_t> lengths;
  std::barrier pass(static_cast<std::ptrdiff_t>(kLayers), [&]() noexcept {
    const std::size_t length = cache.length();
    cache.truncate(length - 1);
    lengths.push_back(cache.length());
    lengths.push_back(cache.bytes() != 0 ? 1 : 0);
  });
  std::vector<std::vector<float>> outputs(kLayers);
  std::vector<std::thread> threads;
  for (std::size_t layer = 0; layer < kLayers; ++layer) {
    threads.emplace_back([&, layer] {
      for (const std::size_t tokens : kChunks) {
        step_layer(cache, layer, tokens, 1, outputs[layer]);
        pass.arrive_and_wait();
      }
    });
  }
  for (std::thread& t : threads) t.join();

  TypeParam alone = make_cache<TypeParam>();
  std::vector<std::vector<float>> expected(kLayers);
  std::vector<std::size_t> expected_lengths;
  for (const std::size_t tokens : kChunks) {
    for (std::size_t layer = 0; layer < kLayers; ++layer) step_layer(alone, layer, tokens, 1, expected[layer]);
    alone.truncate(alone.length() - 1);
    expected_lengths.push_back(alone.length());
    expected_lengths.push_back(1);
  }
  EXPECT_EQ(outputs, expected);
  EXPECT_EQ(lengths, expected_lengths);
}

TEST(Threads, AttentionFromSeveralThreadsSharesThePool) {
  // Several engine threads read one history at once, each asking for helper threads: one at a
  // time has the kept pool, the others start threads of their own; every result is the one a
  // call alone gives.
  constexpr std::size_t kTokens = 1200;  // enough keys to split them among threads
  KvCache<float> cache({.layers = 1, .kv_heads = kKvHeads, .head_dim = kHeadDim, .capacity = kTokens});
  const std::vector<float> kv = seeded(kKvHeads * kTokens * kHeadDim, 7, 1.0F);
  const TensorView<const float> keys(kv.data(), {1, kKvHeads, kTokens, kHeadDim});
  const History<float> history = cache.update(0, keys, keys, next_positions(0, kTokens));
  const std::int64_t position = kTokens - 1;
  const Shape q_shape{1, kQueryHeads, 1, kHeadDim};
  const auto attend = [&](std::uint64_t seed, std::size_t threads) {
    const std::vector<float> q = seeded(q_shape.size(), seed, 1.0F);
    std::vector<float> out(q.size());
    causal_attention(TensorView<const float>(q.data(), q_shape), position, history,
                     TensorView<float>(out.data(), q_shape), {.threads = threads});
    return out;
  };
  constexpr std::size_t kCallers = 3;
  constexpr std::size_t kCalls = 12;
  const std::size_t widths[] = {2, 3, 0};
  std::vector<std::vector<std::vector<float>>> expected(kCallers);
  for (std::size_t c = 0; c < kCallers; ++c) {
    for (std::size_t i = 0; i < kCalls; ++i) expected[c].push_back(attend(c * 100 + i, widths[(c + i) % 3]));
  }
  std::vector<std::vector<std::vector<float>>> got(kCallers);
  std::vector<std::thread> callers;
  for (std::size_t c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (std::size_t i = 0; i < kCalls; ++i) got[c].push_back(attend(c * 100 + i, widths[(c + i) % 3]));
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(got, expected);
}

TEST(Threads, PoolCallsOfDifferentWidths) {
  // Two callers share a pool that keeps three threads, with jobs of one to five workers: each
  // worker index writes its own slot without atomics, which the caller reads after the call.
  detail::WorkerPool pool(3);
  const auto caller = [&](std::size_t first) {
    std::size_t bad = 0;
    for (std::size_t call = 0; call < 60; ++call) {
      const std::size_t workers = (first + call) % 5 + 1;
      std::vector<std::size_t> ran(workers, 0);
      const auto work = [&](std::size_t worker) { ran[worker] += worker + 1; };
      const detail::PoolJob job{
          [](const void* context, std::size_t worker) { (*static_cast<const decltype(work)*>(context))(worker); },
          &work, workers};
      const std::size_t threads = pool.try_run(job);
      if (threads == 0) {
        for (std::size_t w = 0; w < workers; ++w) work(w);  // the pool was busy: as run_workers does
      }
      bad += threads > 4;
      for (std::size_t w = 0; w < workers; ++w) bad += ran[w] != w + 1;
    }
    return bad;
  };
  std::size_t bad_a = 0;
  std::size_t bad_b = 0;
  std::thread a([&] { bad_a = caller(0); });
  std::thread b([&] { bad_b = caller(2); });
  a.join();
  b.join();
  EXPECT_EQ(bad_a, 0U);
  EXPECT_EQ(bad_b, 0U);
  EXPECT_EQ(pool.threads(), 3U);
}

}  // namespace
}  // namespace kvcache
