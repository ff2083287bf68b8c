// SPDX-License-Identifier: Apache-2.0
// Regression tests for what fuzz/cache_fuzz found: each reproduces the input's failure with the
// fewest calls that show it, and checks what the contract says instead.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "kvcache/attention.hpp"
#include "kvcache/paged_kv_cache.hpp"
#include "kvcache/slot_kv_cache.hpp"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;

// reuse_prefix asked whether the sequence was empty through length(), which throws
// std::runtime_error when a forward pass stopped part-way; its contract is std::logic_error.
TEST(FuzzFindings, ReusePrefixAfterAPassStoppedPartWayThrowsLogicError) {
  BlockPool<float> pool({.layers = 3, .kv_heads = 1, .head_dim = 3, .block_tokens = 2, .blocks = 4});
  PagedKvCache<float> seq(pool);
  const std::vector<float> k(2 * 3, 0.5F);
  const TensorView<const float> kv(k.data(), {.batch = 1, .heads = 1, .tokens = 2, .head_dim = 3});
  (void)seq.update(2, kv, kv, next_positions(0, 2));  // the last layer only
  const std::vector<TokenId> prompt = {1, 2, 3};
  try {
    (void)seq.reuse_prefix(prompt);
    ADD_FAILURE() << "no exception";
  } catch (const std::logic_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("an empty sequence"));
    EXPECT_THAT(e.what(), HasSubstr("2 tokens"));
  }
  EXPECT_EQ(seq.length(0), 0U);
  EXPECT_EQ(seq.length(2), 2U);
  EXPECT_EQ(seq.block_table().size(), 1U);
  EXPECT_NO_THROW(pool.check_invariants());
}

// SlotKvCache's history() wrote the same per-layer view that update() returns: a read of the
// layer between an update and its attention call turned the update's one listed row into every
// slot, and causal_attention over it refused the batch. A read is no mutating call.
TEST(FuzzFindings, SlotHistoryReadLeavesWhatUpdateReturnedIntact) {
  SlotKvCache<float> cache({.layers = 1, .batch = 3, .kv_heads = 1, .head_dim = 3, .capacity = 8});
  for (int i = 0; i < 3; ++i) (void)cache.acquire();
  const std::vector<float> k = {1.0F, 2.0F, 3.0F};
  const TensorView<const float> kv(k.data(), {.batch = 1, .heads = 1, .tokens = 1, .head_dim = 3});
  const std::int64_t position = 0;
  const std::size_t row = 1;
  const History<float> history = cache.update(0, kv, kv, position, row);
  (void)cache.history(0);  // every slot
  ASSERT_EQ(history.segments.size(), 1U);
  EXPECT_EQ(history.segments[0].batch(), 1U);
  EXPECT_EQ(history.segments[0].stored_row(0), 1U);
  EXPECT_EQ(history.segments[0].tokens(0), 1U);

  std::vector<float> out(3);
  causal_attention(kv, position, history, TensorView<float>(out.data(), kv.shape()));
  EXPECT_EQ(out, k);  // one visible key: its value
}

}  // namespace
}  // namespace kvcache::testing
