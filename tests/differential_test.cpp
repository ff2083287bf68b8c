// SPDX-License-Identifier: Apache-2.0
// Seeded random operation sequences (chunked updates, passes stopped part-way, truncates,
// resets, bad calls) on every variant, checked after every operation against a trivially
// correct reference: one growing map of position -> data per layer, the window applied by
// position.

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <stdexcept>

#include "cache_test_support.hpp"

namespace kvcache::testing {
namespace {

template <class Cache>
class Differential : public ::testing::Test {};
TYPED_TEST_SUITE(Differential, AllCaches, CacheName);

struct Limits {
  std::size_t window = 0, sinks = 0, slack = 0;
};

/// What the contract says a layer must hold, independent of how any cache stores it.
struct ReferenceLayer {
  std::map<std::int64_t, Row> written;  // every position ever written and not truncated away
  std::set<std::int64_t> held;          // what the layer's last update returned (it may hold more)
};

TYPED_TEST(Differential, RandomOperationSequencesMatchTheReference) {
  using Cache = TypeParam;
  using T = typename Cache::value_type;
  constexpr std::size_t layers = 3, batch = batch_of<Cache>, kv_heads = 2, head_dim = 3, capacity = 64;
  constexpr int sequences = 150, operations = 40;

  std::mt19937_64 rng(20261130);
  const auto pick = [&](std::size_t lo, std::size_t hi) {  // uniform in [lo, hi]
    return std::uniform_int_distribution<std::size_t>(lo, hi)(rng);
  };

  for (int sequence = 0; sequence < sequences; ++sequence) {
    Limits limits;
    KvCacheConfig config{
        .layers = layers, .batch = batch, .kv_heads = kv_heads, .head_dim = head_dim, .capacity = capacity};
    // Rings always have a window; slots and pages every other sequence (a slot's slack at least
    // the longest chunk less one, so that chunks may wrap it).
    if (is_ring<Cache> || ((is_slot<Cache> || is_paged<Cache>)&&sequence % 2 == 1)) {
      limits = {pick(1, 8), pick(0, 3), is_slot<Cache> ? pick(11, 14) : pick(0, 4)};
      config.window = limits.window;
      config.sinks = limits.sinks;
      config.slack = limits.slack;
    }
    Cache cache(test_config<T>(config));
    std::vector<ReferenceLayer> reference(layers);
    std::vector<std::size_t> lengths(layers, 0);
    SCOPED_TRACE("sequence " + std::to_string(sequence) + " window " + std::to_string(limits.window) + " sinks " +
                 std::to_string(limits.sinks) + " slack " + std::to_string(limits.slack));

    const auto check_length = [&] {
      const bool agree = std::all_of(lengths.begin(), lengths.end(), [&](std::size_t n) { return n == lengths[0]; });
      if (agree) {
        ASSERT_EQ(cache.length(), lengths[0]);
      } else {
        ASSERT_THROW((void)cache.length(), std::runtime_error);
      }
    };

    // Updates one layer with `tokens` fresh tokens and checks the returned history.
    const auto update = [&](std::size_t layer, std::size_t tokens) {
      const std::size_t start = lengths[layer];
      const Block<input_t<T>> k({batch, kv_heads, tokens, head_dim}, rng());
      const Block<input_t<T>> v({batch, kv_heads, tokens, head_dim}, rng());
      const auto history = cache.update(layer, k.view(), v.view(), arange(start, tokens));
      ReferenceLayer& ref = reference[layer];
      for (std::size_t t = 0; t < tokens; ++t)
        ref.written[static_cast<std::int64_t>(start + t)] = row_of<T>(k.view(), v.view(), t);
      lengths[layer] = start + tokens;

      const auto rows = flatten(history);
      ref.held.clear();
      for (const auto& [position, row] : rows) {
        ASSERT_LT(position, static_cast<std::int64_t>(lengths[layer]));
        ASSERT_EQ(row, ref.written.at(position)) << "data of position " << position;
        ref.held.insert(position);
      }
      // A slot's ring and a sequence's blocks return what they hold around the window: at most
      // the ring, or the window's blocks and the sinks'.
      std::size_t most = limits.sinks + limits.window - 1 + tokens;
      if (is_slot<Cache>) most = limits.sinks + limits.window + limits.slack;
      if (is_paged<Cache>) most += 2 * (kPooledBlockTokens - 1);
      // Every key some query of this chunk may see must be there.
      for (std::size_t p = 0; p < lengths[layer]; ++p) {
        const bool needed = limits.window == 0 || p < limits.sinks || p + limits.window > start;
        if (needed) {
          ASSERT_TRUE(ref.held.count(static_cast<std::int64_t>(p))) << "missing position " << p;
        }
      }
      if (limits.window != 0) {
        ASSERT_LE(rows.size(), most);  // nothing no query reads, or not much
        ASSERT_EQ(history.window, limits.window);
        ASSERT_EQ(history.sinks, limits.sinks);
      }
    };

    for (int op = 0; op < operations; ++op) {
      const std::size_t kind = pick(0, 9);
      const std::size_t common = *std::min_element(lengths.begin(), lengths.end());
      if (kind <= 4) {  // a forward pass, sometimes stopped part-way
        const std::size_t tokens = pick(0, 3) == 0 ? pick(2, 12) : 1;
        if (common + tokens > capacity) continue;
        const std::size_t stop = pick(0, 5) == 0 ? pick(1, layers) : layers;
        const bool agree = std::all_of(lengths.begin(), lengths.end(), [&](std::size_t n) { return n == common; });
        if (!agree) continue;
        for (std::size_t layer = 0; layer < stop; ++layer) update(layer, tokens);
      } else if (kind <= 6) {  // truncate, valid or not
        const std::size_t n = pick(0, common + 2);
        const auto forget_after = [&] {
          for (ReferenceLayer& ref : reference) {
            ref.written.erase(ref.written.lower_bound(static_cast<std::int64_t>(n)), ref.written.end());
            ref.held.erase(ref.held.lower_bound(static_cast<std::int64_t>(n)), ref.held.end());
          }
          std::fill(lengths.begin(), lengths.end(), n);
        };
        // Valid for sure when every layer's last update returned what a query at n reads.
        bool returned = true;
        for (std::size_t layer = 0; layer < layers && limits.window != 0; ++layer) {
          const std::size_t from = std::max(limits.sinks, n + 1 > limits.window ? n + 1 - limits.window : 0);
          for (std::size_t p = from; p < n; ++p)
            returned = returned && reference[layer].held.count(static_cast<std::int64_t>(p));
        }
        // A paged sequence gave back whole blocks: it cannot go back into one.
        if constexpr (is_paged<Cache>) {
          const std::size_t last = n == 0 ? 0 : (n - 1) / kPooledBlockTokens;
          if (n != 0 && last < cache.block_table().size() && cache.block_table()[last] == PagedKvCache<T>::kReleased)
            returned = false;
        }
        if (n > common) {
          ASSERT_THROW(cache.truncate(n), std::out_of_range) << "truncate(" << n << ")";
        } else if (returned) {
          ASSERT_NO_THROW(cache.truncate(n)) << "truncate(" << n << ")";
          forget_after();
        } else {
          // A ring holds older keys than it returns (its slack, for truncate): it may take this
          // or throw, and if it takes it, the updates after check every key a query reads.
          bool taken = true;
          try {
            cache.truncate(n);
          } catch (const std::out_of_range&) {
            taken = false;
          }
          if (taken) forget_after();
        }
      } else if (kind == 7) {
        cache.reset();
        reference.assign(layers, {});
        std::fill(lengths.begin(), lengths.end(), 0);
      } else {  // a bad call: must throw and change nothing (the next update checks the data)
        const std::size_t layer = pick(0, layers - 1);
        const Block<input_t<T>> k({batch, kv_heads, 1, head_dim}, rng());
        const Block<input_t<T>> wrong({batch, kv_heads + 1, 1, head_dim}, rng());
        switch (pick(0, 3)) {
          case 0:
            ASSERT_THROW(cache.update(layers, k.view(), k.view(), arange(lengths[0], 1)), std::out_of_range);
            break;
          case 1:
            ASSERT_THROW(cache.update(layer, k.view(), k.view(), arange(lengths[layer] + 1, 1)), std::invalid_argument);
            break;
          case 2:
            ASSERT_THROW(cache.update(layer, k.view(), wrong.view(), arange(lengths[layer], 1)), std::invalid_argument);
            break;
          default:
            ASSERT_THROW(cache.update(layer, k.view(), k.view(), arange(lengths[layer], 2)), std::invalid_argument);
        }
      }
      check_length();
    }
  }
}

}  // namespace
}  // namespace kvcache::testing
