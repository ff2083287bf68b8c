// SPDX-License-Identifier: Apache-2.0
// What distinguishes the dense caches: KvCache never moves its storage, ConcatKvCache does;
// and the storage the preallocating caches hold asks for huge pages once it is large.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

#include "cache_test_support.hpp"
#include "kvcache/detail/aligned_buffer.hpp"
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

/// The VmFlags of the mapping that holds `address`, from /proc/self/smaps ("" if none does).
std::string mapping_flags(const void* address) {
  const auto a = reinterpret_cast<std::uintptr_t>(address);
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    std::uintptr_t begin = 0;
    std::uintptr_t end = 0;
    char dash = 0;
    std::istringstream range(line);
    if (range >> std::hex >> begin >> dash >> end && dash == '-' && line.find(':') > line.find(' ')) {
      inside = begin <= a && a < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

/// The first huge-page boundary at or after `p`.
const void* first_huge_page(const void* p) {
  constexpr std::uintptr_t kHuge = detail::kHugePageBytes;
  return reinterpret_cast<const void*>((reinterpret_cast<std::uintptr_t>(p) + kHuge - 1) / kHuge * kHuge);
}

TEST(HugePages, KvCacheAndRingStorageAsksForHugePagesConcatDoesNot) {
  if (!detail::kAdvisesHugePages) {
    GTEST_SKIP() << "Transparent huge pages are asked for on Linux only, unless KVCACHE_HUGE_PAGES is 0.";
  }
  if (!std::filesystem::exists("/sys/kernel/mm/transparent_hugepage/enabled")) {
    GTEST_SKIP() << "This kernel has no transparent huge pages to ask for.";
  }
  // 8 MiB of K and as much of V: the whole huge pages inside each are advised ("hg").
  KvCache<float> dense({.layers = 2, .kv_heads = 4, .head_dim = 64, .capacity = 4096});
  RingKvCache<float> ring({.layers = 1, .kv_heads = 8, .head_dim = 64, .window = 4096});
  const Block<float> token({1, 4, 1, 64}, 1);
  const Block<float> ring_token({1, 8, 1, 64}, 2);
  const auto dense_history = dense.update(1, token.view(), token.view(), arange(0, 1));
  const auto ring_history = ring.update(0, ring_token.view(), ring_token.view(), arange(0, 1));
  for (const auto* segment : {&dense_history.segments[0], &ring_history.segments[0]}) {
    for (const void* data :
         {static_cast<const void*>(segment->keys.data()), static_cast<const void*>(segment->values.data())}) {
      const std::string flags = mapping_flags(first_huge_page(data));
      EXPECT_THAT(flags, ::testing::HasSubstr(" hg")) << "storage at " << data;
    }
  }
  // The baseline keeps the pages a framework's allocator gives a concatenation.
  ConcatKvCache<float> concat({.layers = 1, .kv_heads = 4, .head_dim = 64, .capacity = 8192});
  const Block<float> prompt({1, 4, 4096, 64}, 3);
  const auto concat_history = concat.update(0, prompt.view(), prompt.view(), arange(0, 4096));
  const std::string flags = mapping_flags(first_huge_page(concat_history.segments[0].keys.data()));
  EXPECT_THAT(flags, ::testing::StartsWith("VmFlags:"));
  EXPECT_THAT(flags, ::testing::Not(::testing::HasSubstr(" hg")));
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

template <class Cache>
class DenseHistory : public ::testing::Test {};
using DenseCaches = ::testing::Types<KvCache<float>, ConcatKvCache<float>>;
TYPED_TEST_SUITE(DenseHistory, DenseCaches);

TYPED_TEST(DenseHistory, HistoryOfALayerIsWhatUpdateReturnedWithoutWriting) {
  TypeParam cache(kConfig);
  EXPECT_EQ(cache.history(1).tokens(), 0U);
  const Block<float> prompt({1, 2, 5, 16}, 1);
  const Block<float> token({1, 2, 1, 16}, 2);
  (void)cache.update(0, prompt.view(), prompt.view(), arange(0, 5));
  const auto returned = flatten(cache.update(0, token.view(), token.view(), arange(5, 1)));
  ASSERT_EQ(returned.size(), 6U);
  EXPECT_EQ(flatten(cache.history(0)), returned);
  EXPECT_EQ(cache.history(0).segments.size(), 1U);
  EXPECT_EQ(cache.length(0), 6U);
  EXPECT_EQ(cache.length(1), 0U);

  cache.truncate(0);
  (void)cache.update(0, prompt.view(), prompt.view(), arange(0, 5));
  (void)cache.update(1, prompt.view(), prompt.view(), arange(0, 5));
  cache.truncate(3);
  auto expected = flatten(cache.history(1));
  EXPECT_EQ(expected.size(), 3U);
  for (std::int64_t p = 0; p < 3; ++p)
    EXPECT_EQ(expected[p], row_of<float>(prompt.view(), prompt.view(), std::size_t(p)));
  EXPECT_THROW((void)cache.history(2), std::out_of_range);
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
