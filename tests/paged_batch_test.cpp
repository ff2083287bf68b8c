// SPDX-License-Identifier: Apache-2.0
// PagedBatch: several sequences of one pool written and attended as the rows of one batch. What a
// batch update writes equals what each sequence's own update writes; its blocks are counted
// together before anything is written; attention over the batch equals a call per sequence; bad
// calls change nothing.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cache_test_support.hpp"
#include "kvcache/attention.hpp"
#include "kvcache/paged_batch.hpp"

namespace kvcache::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

template <class T>
class Batch : public ::testing::Test {
 protected:
  using In = input_t<T>;
  static constexpr std::size_t layers = 2, kv_heads = 2, head_dim = 8, block = 4;

  static BlockPoolConfig pool_config(std::size_t blocks, std::size_t window = 0, std::size_t sinks = 0) {
    const KvCacheConfig c = test_config<T>({.layers = layers, .kv_heads = kv_heads, .head_dim = head_dim});
    return {.layers = layers,
            .kv_heads = kv_heads,
            .head_dim = head_dim,
            .block_tokens = block,
            .blocks = blocks,
            .window = window,
            .sinks = sinks,
            .key_scales = c.key_scales,
            .value_scales = c.value_scales};
  }

  /// k (or v) of `rows` sequences' next tokens: batch row i is sequence i's token at positions[i].
  static Block<In> next_rows(std::size_t rows, std::size_t tokens, std::uint64_t seed) {
    return Block<In>({rows, kv_heads, tokens, head_dim}, seed);
  }
  /// Batch row i of a block, as a batch of one.
  static TensorView<const In> row(const Block<In>& b, std::size_t i) {
    return {b.data.data() + i * kv_heads * b.shape.tokens * head_dim, {1, kv_heads, b.shape.tokens, head_dim}};
  }

  /// Sequences of a prompt of 10 tokens, a fork of it, and a sequence that reuses its prefix.
  static std::vector<std::unique_ptr<PagedKvCache<T>>> three_sequences(BlockPool<T>& pool) {
    std::vector<std::unique_ptr<PagedKvCache<T>>> seqs;
    const std::vector<TokenId> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    seqs.push_back(std::make_unique<PagedKvCache<T>>(pool));
    seqs[0]->add_token_ids(prompt);
    for (std::size_t layer = 0; layer < layers; ++layer) {
      const Block<In> k = next_rows(1, prompt.size(), 10 + layer), v = next_rows(1, prompt.size(), 20 + layer);
      seqs[0]->update(layer, k.view(), v.view(), arange(0, prompt.size()));
    }
    seqs.push_back(std::make_unique<PagedKvCache<T>>(seqs[0]->fork()));
    seqs.push_back(std::make_unique<PagedKvCache<T>>(pool));
    const std::size_t skip = seqs[2]->reuse_prefix(prompt);
    EXPECT_EQ(skip, 8U);
    for (std::size_t layer = 0; layer < layers; ++layer) {
      const Block<In> k = next_rows(1, prompt.size(), 10 + layer), v = next_rows(1, prompt.size(), 20 + layer);
      seqs[2]->update(layer, k.view().tokens(skip, 2), v.view().tokens(skip, 2), arange(skip, 2));
    }
    return seqs;
  }
};

using Formats = gtest_types<formats>;
TYPED_TEST_SUITE(Batch, Formats, FormatName);

TYPED_TEST(Batch, ABatchUpdateWritesWhatEachSequencesOwnUpdateWrites) {
  using T = TypeParam;
  BlockPool<T> one_by_one(this->pool_config(16)), together(this->pool_config(16));
  auto alone = this->three_sequences(one_by_one);
  auto rows = this->three_sequences(together);
  PagedBatch<T> batch({rows[0].get(), rows[1].get(), rows[2].get()});
  for (std::size_t step = 0; step < 7; ++step) {
    const std::size_t tokens = step == 3 ? 3 : 1;
    for (std::size_t layer = 0; layer < TestFixture::layers; ++layer) {
      const auto k = this->next_rows(3, tokens, 100 * step + layer), v = this->next_rows(3, tokens, 100 * step + 50);
      std::vector<std::int64_t> positions;
      for (std::size_t i = 0; i < 3; ++i) {
        const std::vector<std::int64_t> p = arange(alone[i]->length(layer), tokens);
        positions.insert(positions.end(), p.begin(), p.end());
        alone[i]->update(layer, this->row(k, i), this->row(v, i), std::span(p));
      }
      const History<T> history =
          batch.update(layer, k.view(), v.view(), Positions(positions.data(), tokens, tokens), {0, 1, 2});
      for (std::size_t i = 0; i < 3; ++i) {
        const auto want = flatten(alone[i]->history(layer));
        EXPECT_EQ(flatten_row(history, i), want) << "step " << step << " layer " << layer << " sequence " << i;
        EXPECT_EQ(flatten(rows[i]->history(layer)), want);
      }
    }
    for (std::size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(std::vector<std::size_t>(rows[i]->block_table().begin(), rows[i]->block_table().end()),
                std::vector<std::size_t>(alone[i]->block_table().begin(), alone[i]->block_table().end()));
    }
    ASSERT_NO_THROW(together.check_invariants());
    EXPECT_EQ(together.free_blocks(), one_by_one.free_blocks());
    EXPECT_EQ(together.keyed_blocks(), one_by_one.keyed_blocks());
  }
  EXPECT_EQ(together.clipped(), one_by_one.clipped());
}

TYPED_TEST(Batch, AttentionOverTheBatchEqualsACallPerSequence) {
  using T = TypeParam;
  using Q = std::conditional_t<std::is_same_v<T, double>, double, float>;
  BlockPool<T> pool(this->pool_config(16));
  auto seqs = this->three_sequences(pool);
  PagedBatch<T> batch({seqs[0].get(), seqs[1].get(), seqs[2].get()});
  const std::size_t q_heads = 2 * TestFixture::kv_heads, dim = TestFixture::head_dim;
  for (std::size_t layer = 0; layer < TestFixture::layers; ++layer) {
    const Block<Q> q({3, q_heads, 1, dim}, 7 + layer);
    std::vector<std::int64_t> positions;
    for (const auto& s : seqs) positions.push_back(static_cast<std::int64_t>(s->length(layer)) - 1);
    std::vector<Q> out(q.data.size(), std::numeric_limits<Q>::quiet_NaN());
    causal_attention(q.view(), Positions(positions.data(), 1, 1), batch.history(layer),
                     TensorView<Q>(out.data(), q.shape), {.threads = 2});
    for (std::size_t i = 0; i < 3; ++i) {
      std::vector<Q> alone(q_heads * dim, std::numeric_limits<Q>::quiet_NaN());
      const TensorView<const Q> q_row(q.data.data() + i * q_heads * dim, {1, q_heads, 1, dim});
      causal_attention(q_row, Positions(positions[i]), seqs[i]->history(layer),
                       TensorView<Q>(alone.data(), q_row.shape()));
      for (std::size_t x = 0; x < alone.size(); ++x) {
        EXPECT_NEAR(static_cast<double>(out[i * alone.size() + x]), static_cast<double>(alone[x]), 1e-5)
            << "sequence " << i << " layer " << layer;
      }
    }
  }
}

TYPED_TEST(Batch, CopiesOfASharedBlockAreCountedTogetherAndAShortPoolChangesNothing) {
  using T = TypeParam;
  // Three holders of a partial block each write a token into it: two copies, the last writes
  // in place. A pool with one free block refuses the batch at its second row.
  for (const std::size_t blocks : {std::size_t{3}, std::size_t{4}}) {
    BlockPool<T> pool(this->pool_config(blocks));
    PagedKvCache<T> first(pool);
    const auto prompt = this->next_rows(1, 6, 1);
    for (std::size_t layer = 0; layer < TestFixture::layers; ++layer)
      first.update(layer, prompt.view(), prompt.view(), arange(0, 6));
    PagedKvCache<T> second = first.fork(), third = first.fork();
    PagedBatch<T> batch({&first, &second, &third});
    const std::size_t free = pool.free_blocks();
    ASSERT_EQ(free, blocks - 2);
    const auto k = this->next_rows(3, 1, 2);
    const std::vector<std::int64_t> at{6};
    if (free < 2) {
      try {
        batch.update(0, k.view(), k.view(), at, {0, 1, 2});
        ADD_FAILURE() << "no exception";
      } catch (const std::length_error& e) {
        EXPECT_THAT(e.what(), AllOf(HasSubstr("rows[1] (sequence 1)"), HasSubstr("the 0 free"), HasSubstr("1 needed")));
      }
      EXPECT_EQ(pool.free_blocks(), free);
      for (const PagedKvCache<T>* s : {&first, &second, &third}) {
        EXPECT_EQ(s->length(0), 6U);
        EXPECT_EQ(s->block_table()[1], first.block_table()[1]);
      }
    } else {
      const std::size_t shared = first.block_table()[1];
      batch.update(0, k.view(), k.view(), at, {0, 1, 2});
      EXPECT_EQ(pool.free_blocks(), 0U);
      EXPECT_NE(first.block_table()[1], shared);
      EXPECT_NE(second.block_table()[1], shared);
      EXPECT_EQ(third.block_table()[1], shared) << "the last holder writes in place";
    }
    ASSERT_NO_THROW(pool.check_invariants());
  }
}

TYPED_TEST(Batch, BadCallsThrowNamingTheRowAndChangeNothing) {
  using T = TypeParam;
  BlockPool<T> pool(this->pool_config(16));
  auto seqs = this->three_sequences(pool);
  PagedBatch<T> batch({seqs[0].get(), seqs[1].get(), seqs[2].get()});
  const auto k = this->next_rows(2, 1, 3);
  const std::vector<std::int64_t> both{10, 10};
  const auto unchanged = [&] {
    for (const auto& s : seqs) EXPECT_EQ(s->length(), 10U);
    EXPECT_EQ(pool.free_blocks(), 16U - 4U);
    ASSERT_NO_THROW(pool.check_invariants());
  };
  expect_throw_naming(
      [&] {
        batch.update(0, k.view(), k.view(), Positions(both.data(), 1, 1), {1, 1});
      },
      Throws::invalid_argument, {"PagedBatch::update", "rows[1]", "also rows[0]"});
  unchanged();
  expect_throw_naming(
      [&] {
        batch.update(0, k.view(), k.view(), Positions(both.data(), 1, 1), {0, 3});
      },
      Throws::out_of_range, {"rows[1]", "a row < 3", "3"});
  unchanged();
  const std::vector<std::int64_t> off{10, 11};
  expect_throw_naming(
      [&] {
        batch.update(1, k.view(), k.view(), Positions(off.data(), 1, 1), {0, 2});
      },
      Throws::invalid_argument, {"rows[1] (sequence 2)", "expected 10", "given 11"});
  unchanged();
  expect_throw_naming(
      [&] {
        batch.update(2, k.view(), k.view(), Positions(both.data(), 1, 1), {0, 2});
      },
      Throws::out_of_range, {"layer", "< 2"});
  unchanged();
  expect_throw_naming([&] { batch.update(0, k.view(), k.view(), Positions(both.data(), 1, 1), {0}); },
                      Throws::invalid_argument, {"k batch", "expected 1", "given 2"});
  unchanged();
  EXPECT_THROW((void)batch.history(0, {3}), std::out_of_range);
  EXPECT_THROW((void)batch.row_length(3), std::out_of_range);

  // The batch itself: at least one sequence, each in this pool, none twice.
  BlockPool<T> other(this->pool_config(4));
  PagedKvCache<T> stranger(other);
  PagedKvCache<T> moved(pool);
  PagedKvCache<T> taker = std::move(moved);
  expect_throw_naming([&] { (void)PagedBatch<T>(std::span<PagedKvCache<T>* const>{}); }, Throws::invalid_argument,
                      {"sequences", "at least one"});
  expect_throw_naming(
      [&] {
        PagedBatch<T>({seqs[0].get(), &stranger});
      },
      Throws::invalid_argument, {"sequences[1]", "another pool"});
  expect_throw_naming(
      [&] {
        PagedBatch<T>({seqs[0].get(), seqs[0].get()});
      },
      Throws::invalid_argument, {"sequences[1]", "sequences[0]'s"});
  expect_throw_naming(
      [&] {
        PagedBatch<T>({seqs[0].get(), nullptr});
      },
      Throws::invalid_argument, {"sequences[1]", "null"});
  expect_throw_naming([&] { PagedBatch<T>({&moved}); }, Throws::invalid_argument, {"sequences[0]", "moved-from"});
}

TYPED_TEST(Batch, LengthsBytesTruncateAndResetReachEverySequence) {
  using T = TypeParam;
  BlockPool<T> pool(this->pool_config(16));
  auto seqs = this->three_sequences(pool);
  PagedBatch<T> batch({seqs[0].get(), seqs[1].get(), seqs[2].get()});
  EXPECT_EQ(batch.size(), 3U);
  EXPECT_EQ(batch.layers(), TestFixture::layers);
  EXPECT_EQ(batch.capacity(), pool.capacity());
  EXPECT_EQ(batch.length(), 10U);
  EXPECT_EQ(batch.row_length(1), 10U);
  // Blocks 0 and 1 are shared by all three, block 2 by the fork and its parent (the reused
  // sequence wrote its own): 4 blocks, against 9 held one sequence at a time.
  EXPECT_EQ(batch.bytes(), 4 * pool.block_bytes());
  EXPECT_EQ(seqs[0]->bytes() + seqs[1]->bytes() + seqs[2]->bytes(), 9 * pool.block_bytes());
  batch.truncate(1, 5);
  EXPECT_EQ(seqs[1]->length(), 5U);
  EXPECT_EQ(batch.length(), 10U);
  EXPECT_THROW(batch.truncate(11), std::out_of_range);
  batch.truncate(7);
  EXPECT_EQ(seqs[0]->length(), 7U);
  EXPECT_EQ(seqs[1]->length(), 5U);
  EXPECT_EQ(seqs[2]->length(), 7U);
  ASSERT_NO_THROW(pool.check_invariants());
  batch.reset();
  EXPECT_EQ(batch.length(), 0U);
  EXPECT_EQ(pool.free_blocks(), 16U);
}

TYPED_TEST(Batch, WindowedSequencesHoldTheirWindowAndAreAttendedInOneCall) {
  using T = TypeParam;
  constexpr std::size_t window = 6, sinks = 1;
  BlockPool<T> pool(this->pool_config(24, window, sinks));
  PagedKvCache<T> first(pool);
  const auto prompt = this->next_rows(1, 9, 1);
  for (std::size_t layer = 0; layer < TestFixture::layers; ++layer)
    first.update(layer, prompt.view(), prompt.view(), arange(0, 9));
  PagedKvCache<T> second = first.fork();
  PagedBatch<T> batch({&first, &second});
  for (std::size_t step = 0; step < 40; ++step) {
    const std::size_t at = first.length();
    const std::vector<std::int64_t> positions{static_cast<std::int64_t>(at)};
    for (std::size_t layer = 0; layer < TestFixture::layers; ++layer) {
      const auto k = this->next_rows(2, 1, 1000 + 10 * step + layer);
      const History<T> history = batch.update(layer, k.view(), k.view(), positions);
      EXPECT_EQ(history.window, window);
      EXPECT_EQ(history.sinks, sinks);
      for (std::size_t i = 0; i < 2; ++i) {
        const auto held = flatten_row(history, i);
        EXPECT_EQ(held, flatten(batch.sequence(i).history(layer)));
        for (std::size_t p = 0; p <= at; ++p) {
          if (p < sinks || p + window > at) {
            EXPECT_EQ(held.count(static_cast<std::int64_t>(p)), 1U) << p;
          }
        }
      }
    }
    ASSERT_NO_THROW(pool.check_invariants());
    // The sinks' block, the window's (at most two more than it spans) and a block of slack.
    const std::size_t bound = 1 + (window + TestFixture::block - 1) / TestFixture::block + 2;
    EXPECT_LE(first.bytes(), bound * pool.block_bytes()) << "step " << step;
    EXPECT_LE(batch.bytes(), 2 * bound * pool.block_bytes());
  }
  EXPECT_GT(first.block_table().size(), 10U);
  EXPECT_EQ(first.block_table()[1], PagedKvCache<T>::kReleased);
}

}  // namespace
}  // namespace kvcache::testing
