// SPDX-License-Identifier: Apache-2.0
// What distinguishes the dense caches: KvCache never moves its storage, ConcatKvCache does.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <stdexcept>

#include "cache_test_support.hpp"
#include "kvcache/size.hpp"

namespace kvcache::testing {
namespace {

constexpr KvCacheConfig kConfig{.layers = 2, .batch = 1, .kv_heads = 2, .head_dim = 16, .capacity = 300};

TEST(KvCache, StorageIsAlignedAndNeverMovesDuringAGeneration) {
  KvCache<float> cache(kConfig);
  const std::size_t bytes = cache.bytes();
  std::vector<const float*> keys(kConfig.layers), values(kConfig.layers);
  const Block<float> prompt({1, 2, 44, 16}, 1);
  for (std::size_t layer = 0; layer < kConfig.layers; ++layer) {
    const auto history = cache.update(layer, prompt.view(), prompt.view(), arange(0, 44));
    keys[layer] = history.segments[0].keys.data();
    values[layer] = history.segments[0].values.data();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(keys[layer]) % 64, 0U);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(values[layer]) % 64, 0U);
  }
  const Block<float> token({1, 2, 1, 16}, 2);
  for (std::size_t p = 44; p < kConfig.capacity; ++p) {
    for (std::size_t layer = 0; layer < kConfig.layers; ++layer) {
      const auto history = cache.update(layer, token.view(), token.view(), arange(p, 1));
      ASSERT_EQ(history.segments.size(), 1U);
      ASSERT_EQ(history.segments[0].keys.data(), keys[layer]);
      ASSERT_EQ(history.segments[0].values.data(), values[layer]);
      ASSERT_EQ(history.segments[0].tokens(), p + 1);
    }
  }
  EXPECT_EQ(cache.bytes(), bytes);
}

TEST(KvCache, BytesAreTheFullCapacityFromTheStart) {
  KvCache<Eigen::bfloat16> cache(kConfig);
  EXPECT_EQ(cache.bytes(), kv_cache_bytes(2, 1, 300, 2, 16, 2));
}

TEST(ConcatKvCache, EveryUpdateReallocatesAndBytesGrowWithTheSequence) {
  ConcatKvCache<float> cache(kConfig);
  EXPECT_EQ(cache.bytes(), 0U);
  const Block<float> token({1, 2, 1, 16}, 2);
  const float* previous = nullptr;
  for (std::size_t p = 0; p < 20; ++p) {
    const auto history = cache.update(0, token.view(), token.view(), arange(p, 1));
    EXPECT_NE(history.segments[0].keys.data(), previous);
    previous = history.segments[0].keys.data();
  }
  EXPECT_EQ(cache.bytes(), kv_cache_bytes(1, 1, 20, 2, 16, sizeof(float)));
}

TEST(DenseConfig, RejectsZeroSizesAndRingFields) {
  for (auto config : {KvCacheConfig{.layers = 0, .kv_heads = 1, .head_dim = 1, .capacity = 1},
                      KvCacheConfig{.layers = 1, .batch = 0, .kv_heads = 1, .head_dim = 1, .capacity = 1},
                      KvCacheConfig{.layers = 1, .kv_heads = 0, .head_dim = 1, .capacity = 1},
                      KvCacheConfig{.layers = 1, .kv_heads = 1, .head_dim = 0, .capacity = 1},
                      KvCacheConfig{.layers = 1, .kv_heads = 1, .head_dim = 1, .capacity = 0},
                      KvCacheConfig{.layers = 1, .kv_heads = 1, .head_dim = 1, .capacity = 4, .window = 2}}) {
    EXPECT_THROW(KvCache<float>{config}, std::invalid_argument);
    EXPECT_THROW(ConcatKvCache<float>{config}, std::invalid_argument);
  }
}

TEST(DenseConfig, SizesWhoseBytesOverflowAreRejectedNotWrapped) {
  // 2 x 2^62 x 4 bytes wraps to 0: without the check this would allocate nothing.
  const KvCacheConfig config{.layers = 1, .batch = std::size_t{1} << 62, .kv_heads = 1, .head_dim = 1, .capacity = 1};
  try {
    KvCache<float> cache(config);
    FAIL() << "no exception; bytes() = " << cache.bytes();
  } catch (const std::length_error& e) {
    EXPECT_THAT(e.what(), ::testing::AllOf(::testing::HasSubstr("batch 4611686018427387904"),
                                           ::testing::HasSubstr("expected at most 18446744073709551615"),
                                           ::testing::HasSubstr("given 3.689e+19")));
  }
  // ConcatKvCache allocates only on update, where the wrapped size would allocate too little:
  // it refuses the config up front as well.
  try {
    ConcatKvCache<float> cache(config);
    FAIL() << "no exception";
  } catch (const std::length_error& e) {
    EXPECT_THAT(e.what(), ::testing::AllOf(::testing::HasSubstr("ConcatKvCache"),
                                           ::testing::HasSubstr("expected at most 18446744073709551615")));
  }
}

}  // namespace
}  // namespace kvcache::testing
