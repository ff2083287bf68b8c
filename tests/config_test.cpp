// SPDX-License-Identifier: Apache-2.0
// KvCacheConfig takes an engine's own integer types in designated initializers and refuses a
// negative count by name.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>

#include "cache_test_support.hpp"
#include "kvcache/config.hpp"

namespace kvcache::testing {
namespace {

/// An engine's model config, as C engines declare it.
struct EngineConfig {
  int n_layers = 3;
  long n_kv_heads = 2;
  unsigned head_size = 8;
  std::int16_t seq_len = 20;
  std::uint64_t window = 6;
};

/// Writes `tokens` tokens into every layer, then checks each layer's history holds them.
template <class Cache>
void expect_working(Cache& cache, std::size_t layers, std::size_t kv_heads, std::size_t head_dim, std::size_t tokens) {
  const Block<float> k({1, kv_heads, tokens, head_dim}, 1);
  const Block<float> v({1, kv_heads, tokens, head_dim}, 2);
  std::map<std::int64_t, Row> expected;
  for (std::size_t t = 0; t < tokens; ++t)
    expected[static_cast<std::int64_t>(t)] = row_of<float>(k.view(), v.view(), t);
  for (std::size_t layer = 0; layer < layers; ++layer) {
    EXPECT_EQ(flatten(cache.update(layer, k.view(), v.view(), arange(0, tokens))), expected);
  }
  EXPECT_EQ(cache.length(), tokens);
  EXPECT_EQ(cache.layers(), layers);
}

TEST(KvCacheConfig, TakesAnEnginesIntegerFieldsInDesignatedInitializers) {
  const EngineConfig e;
  KvCache<float> dense(
      {.layers = e.n_layers, .kv_heads = e.n_kv_heads, .head_dim = e.head_size, .capacity = e.seq_len});
  ConcatKvCache<float> concat(
      {.layers = e.n_layers, .kv_heads = e.n_kv_heads, .head_dim = e.head_size, .capacity = e.seq_len});
  RingKvCache<float> ring({.layers = e.n_layers,
                           .kv_heads = e.n_kv_heads,
                           .head_dim = e.head_size,
                           .window = e.window,
                           .sinks = 1,
                           .slack = 2U});
  EXPECT_EQ(dense.capacity(), 20U);
  EXPECT_EQ(concat.capacity(), 20U);
  expect_working(dense, 3, 2, 8, 5);
  expect_working(concat, 3, 2, 8, 5);
  expect_working(ring, 3, 2, 8, 5);
}

TEST(KvCacheConfig, FieldsReadAsSizeT) {
  constexpr KvCacheConfig config{.layers = 28, .kv_heads = 8, .head_dim = 128, .capacity = 4096};
  static_assert(config.batch == 1, "batch defaults to one row");
  const std::size_t capacity = config.capacity;
  EXPECT_EQ(capacity, 4096U);
  EXPECT_EQ(config.layers * config.kv_heads * config.head_dim, std::size_t{28 * 8 * 128});
  KvCacheConfig assigned;
  assigned.window = 7;
  EXPECT_EQ(assigned.window, 7U);
}

TEST(KvCacheConfig, ANegativeCountThrowsNamingTheFieldAndTheValue) {
  const int minus_three = -3;
  const long minus_one = -1;
  const auto layers = [&] { return KvCacheConfig{.layers = minus_three}; };
  const auto capacity = [&] { return KvCacheConfig{.layers = 2, .kv_heads = 2, .head_dim = 8, .capacity = minus_one}; };
  const auto sinks = [] { return KvCacheConfig{.layers = 1, .kv_heads = 1, .head_dim = 4, .window = 4, .sinks = -2}; };
  using ::testing::StrEq;
  using ::testing::ThrowsMessage;
  EXPECT_THAT(layers,
              ThrowsMessage<std::invalid_argument>(StrEq("KvCacheConfig.layers: expected a count >= 0, given -3")));
  EXPECT_THAT(capacity,
              ThrowsMessage<std::invalid_argument>(StrEq("KvCacheConfig.capacity: expected a count >= 0, given -1")));
  EXPECT_THAT(sinks,
              ThrowsMessage<std::invalid_argument>(StrEq("KvCacheConfig.sinks: expected a count >= 0, given -2")));
}

}  // namespace
}  // namespace kvcache::testing
