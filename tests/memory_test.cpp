// SPDX-License-Identifier: Apache-2.0
// Memory given back: each variant's shrink_to_fit() (and a ring's reset()) makes what held no
// token stop counting, as bytes() for the caches that reallocate (ConcatKvCache, a ring's
// staging area) and as resident pages (mincore) for those that keep their addresses (KvCache,
// SlotKvCache, BlockPool), and what is still held reads as before.

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "cache_test_support.hpp"
#include "kvcache/kvcache.hpp"

namespace kvcache {
namespace {

using testing::arange;
using testing::Block;

/// Bytes of the pages of [data, data + bytes) that are resident, whole pages inside it.
std::size_t resident_bytes(const void* data, std::size_t bytes) {
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t first = (begin + page - 1) / page * page, last = (begin + bytes) / page * page;
  if (first >= last) return 0;
  std::vector<unsigned char> flags((last - first) / page);
  if (::mincore(reinterpret_cast<void*>(first), last - first, flags.data()) != 0) return 0;
  return static_cast<std::size_t>(
             std::count_if(flags.begin(), flags.end(), [](unsigned char f) { return (f & 1) != 0; })) *
         page;
}

constexpr std::size_t kDim = 128;
constexpr std::size_t kHeads = 2;

/// Writes `tokens` tokens of every layer, `chunk` at a time, from position `first` on.
template <class Cache>
void fill(Cache& cache, std::size_t first, std::size_t tokens, std::size_t chunk = 256) {
  for (std::size_t done = 0; done < tokens;) {
    const std::size_t n = std::min(chunk, tokens - done);
    const Block<float> kv({cache.batch(), kHeads, n, kDim}, first + done);
    for (std::size_t l = 0; l < cache.layers(); ++l)
      (void)cache.update(l, kv.view(), kv.view(), arange(first + done, n));
    done += n;
  }
}

/// Resident bytes of a layer's keys in a cache whose rows lie at one address for life: its
/// history's first segment starts there, [slots, H_kv, capacity, D] floats.
template <class Cache>
std::size_t resident_keys(Cache& cache, std::size_t layer, std::size_t slots) {
  const History<float> h = cache.history(layer);
  return resident_bytes(h.segments[0].keys.data(), slots * kHeads * cache.capacity() * kDim * sizeof(float));
}

TEST(ShrinkToFit, KvCacheGivesBackThePagesPastItsLength) {
  KvCache<float> cache({.layers = 2, .kv_heads = kHeads, .head_dim = kDim, .capacity = 4096});
  const std::size_t all = kHeads * 4096 * kDim * sizeof(float);
  fill(cache, 0, 4096);
  EXPECT_GE(resident_keys(cache, 1, 1), all * 9 / 10);
  cache.truncate(1024);
  const std::size_t bytes = cache.bytes();
  cache.shrink_to_fit();
  // A quarter of every head's rows is held: that stays, with at most a page of each head's
  // boundary; the rest is given back.
  const std::size_t held = resident_keys(cache, 1, 1);
  EXPECT_GE(held, all / 4 - kHeads * 4096);
  EXPECT_LE(held, all / 4 + kHeads * 4096);
  EXPECT_EQ(cache.bytes(), bytes);  // allocated, at the same addresses
  EXPECT_EQ(cache.length(), 1024U);
  // What is held reads as before, and the cache grows back into what it gave.
  const Block<float> first({1, kHeads, 1024, kDim}, 0);
  EXPECT_EQ(0, std::memcmp(cache.history(0).segments[0].keys.data(), first.data.data(), kDim * sizeof(float)));
  fill(cache, 1024, 3072);
  EXPECT_GE(resident_keys(cache, 1, 1), all * 9 / 10);
  cache.reset();
  cache.shrink_to_fit();
  EXPECT_LE(resident_keys(cache, 1, 1), kHeads * 4096);
}

TEST(ShrinkToFit, SlotKvCacheGivesBackReleasedSlots) {
  SlotKvCache<float> cache({.layers = 2, .batch = 4, .kv_heads = kHeads, .head_dim = kDim, .capacity = 1024});
  const std::size_t all = 4 * kHeads * 1024 * kDim * sizeof(float);
  std::vector<std::size_t> rows(4);
  for (std::size_t& r : rows) r = cache.acquire();
  for (std::size_t l = 0; l < 2; ++l) {
    const Block<float> kv({4, kHeads, 1024, kDim}, l);
    (void)cache.update(l, kv.view(), kv.view(), arange(0, 1024), rows);
  }
  EXPECT_GE(resident_keys(cache, 0, 4), all * 9 / 10);
  cache.release(rows[1]);
  cache.release(rows[3]);
  EXPECT_GE(resident_keys(cache, 0, 4), all * 9 / 10);  // release() keeps them for the next request
  cache.shrink_to_fit();
  const std::size_t held = resident_keys(cache, 0, 4);
  EXPECT_LE(held, all / 2 + 4 * kHeads * 4096);
  EXPECT_GE(held, all / 2 - 4 * kHeads * 4096);
  EXPECT_EQ(cache.row_length(rows[0]), 1024U);
  EXPECT_EQ(cache.row_length(rows[2]), 1024U);
  // A sequence admitted into a released slot writes its pages again.
  const std::size_t row = cache.acquire();
  const Block<float> kv({1, kHeads, 16, kDim}, 9);
  for (std::size_t l = 0; l < 2; ++l) (void)cache.update(l, kv.view(), kv.view(), arange(0, 16), {row});
  const History<float> h = cache.history(0, {row});
  const Segment<float>& s = h.segments[0];
  EXPECT_EQ(0, std::memcmp(s.keys.row(s.stored_row(0), 1, 15), kv.view().row(0, 1, 15), kDim * sizeof(float)));
}

TEST(ShrinkToFit, BlockPoolGivesBackFreeBlocksAndKeepsReusablePrefixes) {
  BlockPool<float> pool({.layers = 2, .kv_heads = kHeads, .head_dim = kDim, .block_tokens = 16, .blocks = 128});
  const std::size_t all = kHeads * 128 * 16 * kDim * sizeof(float);
  const auto pool_keys = [&] {
    PagedKvCache<float> probe(pool);  // an empty sequence's history says where the pool's rows are
    const Block<float> kv({1, kHeads, 1, kDim}, 0);
    const History<float> h = probe.update(0, kv.view(), kv.view(), {0});
    // The block it took is the lowest free one; blocks lie in order from the rows' start.
    return h.segments[0].keys.data() - probe.block_table()[0] * 16 * kDim;
  };
  std::vector<TokenId> prompt(512);
  std::iota(prompt.begin(), prompt.end(), 0);
  {
    PagedKvCache<float> keyed(pool), plain(pool);
    (void)keyed.reuse_prefix(prompt);  // its full blocks are keyed for reuse
    fill(keyed, 0, 512);
    fill(plain, 0, 1024);
  }
  const float* rows = pool_keys();
  const std::size_t before = resident_bytes(rows, all);
  EXPECT_GE(before, all * 9 / 10);
  pool.shrink_to_fit();
  const std::size_t after = resident_bytes(rows, all);
  // The plain sequence's 64 blocks are given back; the keyed one's 32 stay for reuse.
  EXPECT_LE(after, all * 40 / 128);
  EXPECT_GE(after, all * 31 / 128);
  PagedKvCache<float> again(pool);
  EXPECT_EQ(again.reuse_prefix(prompt), 511U);  // all but the last token, which is fed for its logits
  const Block<float> first({1, kHeads, 256, kDim}, 0);
  EXPECT_EQ(0, std::memcmp(again.history(1).segments[0].keys.data(), first.data.data(), 16 * kDim * sizeof(float)));
  pool.check_invariants();
}

TEST(ShrinkToFit, ConcatKvCacheReallocatesToWhatItHolds) {
  ConcatKvCache<float> cache({.layers = 2, .kv_heads = kHeads, .head_dim = kDim, .capacity = 1024});
  fill(cache, 0, 1000, 1000);
  const std::size_t per_token = 2 * 2 * kHeads * kDim * sizeof(float);
  EXPECT_EQ(cache.bytes(), 1000 * per_token);
  cache.truncate(100);
  EXPECT_EQ(cache.bytes(), 1000 * per_token);  // truncate keeps the buffers
  cache.shrink_to_fit();
  EXPECT_EQ(cache.bytes(), 100 * per_token);
  const Block<float> first({1, kHeads, 1000, kDim}, 0);
  EXPECT_EQ(0, std::memcmp(cache.history(1).segments[0].keys.row(0, 1, 99), first.view().row(0, 1, 99),
                           kDim * sizeof(float)));
  cache.reset();
  cache.shrink_to_fit();
  EXPECT_EQ(cache.bytes(), 0U);
  fill(cache, 0, 10, 10);
  EXPECT_EQ(cache.bytes(), 10 * per_token);
}

TEST(ShrinkToFit, ARingGivesBackItsStagingAreaOnResetAndShrink) {
  RingKvCache<float> ring({.layers = 2, .kv_heads = kHeads, .head_dim = kDim, .window = 64, .sinks = 4});
  const std::size_t ring_bytes = ring.bytes();
  fill(ring, 0, 2000, 2000);  // a chunk longer than the window is staged
  EXPECT_GT(ring.bytes(), ring_bytes + 1900 * 2 * 2 * kHeads * kDim * sizeof(float));
  ring.reset();
  EXPECT_EQ(ring.bytes(), ring_bytes);

  fill(ring, 0, 500, 500);
  const std::vector<std::int64_t> before(ring.history(0).segments.back().positions.begin(),
                                         ring.history(0).segments.back().positions.end());
  ring.shrink_to_fit();
  EXPECT_EQ(ring.bytes(), ring_bytes);
  EXPECT_EQ(ring.length(), 500U);
  // The staged chunk's tail is in the ring now: the last window of positions is still held.
  std::vector<std::int64_t> held;
  for (const Segment<float>& s : ring.history(1).segments)
    held.insert(held.end(), s.positions.begin(), s.positions.end());
  ASSERT_GE(held.size(), 64U);
  EXPECT_EQ(held.back(), 499);
  EXPECT_EQ(before.back(), 499);
  fill(ring, 500, 1, 1);
  EXPECT_EQ(ring.length(), 501U);
}

}  // namespace
}  // namespace kvcache
