// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include "kvcache/size.hpp"

namespace {

constexpr std::size_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;

// Qwen3-0.6B: 28 layers, 8 KV heads of 128, BF16.
TEST(KvCacheBytes, Qwen3SmallFigures) {
  EXPECT_EQ(kvcache::kv_cache_bytes(28, 1, 1, 8, 128, 2), 112 * KiB);
  EXPECT_EQ(kvcache::kv_cache_bytes(28, 1, 2048, 8, 128, 2), 224 * MiB);
  EXPECT_EQ(kvcache::kv_cache_bytes(28, 1, 32 * 1024, 8, 128, 2), 3 * GiB + GiB / 2);
}

TEST(KvCacheBytes, ScalesWithEveryFactor) {
  const std::size_t base = kvcache::kv_cache_bytes(2, 3, 5, 7, 11, 2);
  EXPECT_EQ(base, 2U * 2 * 3 * 5 * 7 * 11 * 2);
  EXPECT_EQ(kvcache::kv_cache_bytes(2, 6, 5, 7, 11, 2), 2 * base);
  EXPECT_EQ(kvcache::kv_cache_bytes(2, 3, 5, 7, 11, 4), 2 * base);
}

}  // namespace
