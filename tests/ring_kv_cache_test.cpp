// SPDX-License-Identifier: Apache-2.0
// Golden traces of RingKvCache: the exact segments and positions returned after each update,
// around and across the wrap, for single tokens and for chunks, with and without sinks.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <vector>

#include "cache_test_support.hpp"
#include "kvcache/size.hpp"

namespace kvcache::testing {
namespace {

using Trace = std::vector<std::vector<std::int64_t>>;  // positions of each returned segment

class RingTrace : public ::testing::Test {
 protected:
  void make(std::size_t window, std::size_t sinks, std::size_t slack) {
    cache_.emplace(
        KvCacheConfig{.layers = 1, .kv_heads = 1, .head_dim = 2, .window = window, .sinks = sinks, .slack = slack});
  }

  /// Feeds a chunk of `tokens` and returns the positions of each returned segment; checks
  /// that every returned key holds the data written for its position.
  Trace feed(std::size_t tokens) {
    RingKvCache<float>& cache = *cache_;
    const std::size_t start = cache.length();
    Block<float> k({1, 1, tokens, 2}, 0);
    for (std::size_t t = 0; t < tokens; ++t) {
      k.data[2 * t] = static_cast<float>(start + t);       // key value = its position
      k.data[2 * t + 1] = -static_cast<float>(start + t);  // value value = minus it
    }
    const auto history = cache.update(0, k.view(), k.view(), arange(start, tokens));
    EXPECT_EQ(history.window, cache.window());
    EXPECT_EQ(history.sinks, cache.sinks());
    Trace trace;
    for (const auto& segment : history.segments) {
      trace.emplace_back(segment.positions.begin(), segment.positions.end());
      for (std::size_t j = 0; j < segment.tokens(); ++j) {
        EXPECT_EQ(segment.keys(0, 0, j, 0), static_cast<float>(segment.positions[j]));
        EXPECT_EQ(segment.values(0, 0, j, 1), -static_cast<float>(segment.positions[j]));
      }
    }
    return trace;
  }

  std::optional<RingKvCache<float>> cache_;
};

TEST_F(RingTrace, SingleTokensWrapIntoTwoSegments) {
  make(/*window=*/4, /*sinks=*/0, /*slack=*/0);
  const std::vector<Trace> expected = {
      {{0}},
      {{0, 1}},
      {{0, 1, 2}},
      {{0, 1, 2, 3}},  // filling
      {{1, 2, 3}, {4}},
      {{2, 3}, {4, 5}},
      {{3}, {4, 5, 6}},
      {{4, 5, 6, 7}},  // wrapped once
      {{5, 6, 7}, {8}},
      {{6, 7}, {8, 9}},
  };
  for (std::size_t p = 0; p < expected.size(); ++p) EXPECT_EQ(feed(1), expected[p]) << "after position " << p;
  EXPECT_EQ(cache_->bytes(), kv_cache_bytes(1, 1, 4, 1, 2, sizeof(float)));
}

TEST_F(RingTrace, SinksStayWhileTheWindowSlides) {
  make(/*window=*/3, /*sinks=*/2, /*slack=*/1);
  const std::vector<Trace> expected = {
      {{0}},
      {{0, 1}},
      {{0, 1}, {2}},
      {{0, 1}, {2, 3}},
      {{0, 1}, {2, 3, 4}},
      {{0, 1}, {3, 4, 5}},  // 2 is held (slack), not returned: query 5 reads 3..5
      {{0, 1}, {4, 5}, {6}},
      {{0, 1}, {5}, {6, 7}},
      {{0, 1}, {6, 7, 8}},
      {{0, 1}, {7, 8, 9}},
  };
  for (std::size_t p = 0; p < expected.size(); ++p) EXPECT_EQ(feed(1), expected[p]) << "after position " << p;
}

TEST_F(RingTrace, ChunkShorterThanTheWindowAfterTheWrapIsStagedWholeThenFolded) {
  make(/*window=*/4, /*sinks=*/0, /*slack=*/0);
  for (int i = 0; i < 6; ++i) feed(1);
  // Writing 6..8 in place would overwrite 3 and 4, which queries 6 and 7 still need; 2, which
  // no query of the chunk reads, is held but not returned.
  EXPECT_EQ(feed(3), (Trace{{3}, {4, 5}, {6, 7, 8}}));
  EXPECT_EQ(feed(1), (Trace{{6, 7}, {8, 9}}));
}

TEST_F(RingTrace, ChunkLongerThanTheWindowKeepsEveryQuerysWindow) {
  make(/*window=*/4, /*sinks=*/0, /*slack=*/0);
  for (int i = 0; i < 5; ++i) feed(1);
  EXPECT_EQ(feed(10), (Trace{{2, 3}, {4}, {5, 6, 7, 8, 9, 10, 11, 12, 13, 14}}));
  // Folding keeps only the chunk's last window, 11..14; query 15 reads 12..15.
  EXPECT_EQ(feed(2), (Trace{{12, 13, 14}, {15, 16}}));
  EXPECT_EQ(feed(1), (Trace{{14, 15}, {16, 17}}));
}

TEST_F(RingTrace, FirstChunkCoveringTheSinksFillsThemOnFold) {
  make(/*window=*/3, /*sinks=*/2, /*slack=*/0);
  EXPECT_EQ(feed(5), (Trace{{0, 1, 2, 3, 4}}));
  EXPECT_EQ(feed(1), (Trace{{0, 1}, {3, 4}, {5}}));
  EXPECT_EQ(feed(1), (Trace{{0, 1}, {4}, {5, 6}}));
}

TEST_F(RingTrace, ChunkAsLongAsTheWindowWhenTheRingIsFullKeepsTheWholeRing) {
  make(/*window=*/4, /*sinks=*/0, /*slack=*/0);
  for (int i = 0; i < 4; ++i) feed(1);
  // Query 4 needs 1..4: none of 1..3 may be overwritten by 4..7 before it reads them.
  EXPECT_EQ(feed(4), (Trace{{1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(feed(1), (Trace{{5, 6, 7}, {8}}));
  EXPECT_EQ(feed(4), (Trace{{6, 7}, {8}, {9, 10, 11, 12}}));
  EXPECT_EQ(feed(1), (Trace{{10, 11}, {12, 13}}));
}

TEST_F(RingTrace, WindowOfOneHoldsOnlyTheNewestPosition) {
  make(/*window=*/1, /*sinks=*/0, /*slack=*/0);
  EXPECT_EQ(feed(1), (Trace{{0}}));
  EXPECT_EQ(feed(1), (Trace{{1}}));
  EXPECT_EQ(feed(3), (Trace{{2, 3, 4}}));  // each query of the chunk reads only itself
  EXPECT_EQ(feed(1), (Trace{{5}}));
  EXPECT_EQ(cache_->bytes(), kv_cache_bytes(1, 1, 1 + 3, 1, 2, sizeof(float)));  // one slot + staging for 3
}

TEST_F(RingTrace, ChunkRightAfterAStagedChunkFoldsItFirst) {
  make(/*window=*/4, /*sinks=*/0, /*slack=*/0);
  for (int i = 0; i < 6; ++i) feed(1);
  EXPECT_EQ(feed(5), (Trace{{3}, {4, 5}, {6, 7, 8, 9, 10}}));
  // 6..10 folded (the ring keeps 7..10; query 11 reads 8..10 of them), then 11..15 staged.
  EXPECT_EQ(feed(5), (Trace{{8, 9, 10}, {11, 12, 13, 14, 15}}));
  EXPECT_EQ(feed(1), (Trace{{13, 14, 15}, {16}}));
}

TEST_F(RingTrace, SinksStayThroughAChunkLongerThanTheWindowAfterTheWrap) {
  make(/*window=*/3, /*sinks=*/2, /*slack=*/0);
  for (int i = 0; i < 7; ++i) feed(1);  // sinks 0, 1; ring 4..6
  EXPECT_EQ(feed(7), (Trace{{0, 1}, {5, 6}, {7, 8, 9, 10, 11, 12, 13}}));
  EXPECT_EQ(feed(1), (Trace{{0, 1}, {12, 13}, {14}}));
  EXPECT_EQ(feed(1), (Trace{{0, 1}, {13}, {14, 15}}));
}

TEST_F(RingTrace, ZeroTokenUpdateFoldsAStagedChunkAndKeepsWhatTheNextQueryNeeds) {
  make(/*window=*/4, /*sinks=*/0, /*slack=*/0);
  for (int i = 0; i < 6; ++i) feed(1);
  EXPECT_EQ(feed(3), (Trace{{3}, {4, 5}, {6, 7, 8}}));
  EXPECT_EQ(feed(0), (Trace{{6, 7}, {8}}));
  EXPECT_EQ(cache_->length(), 9U);
  EXPECT_EQ(feed(1), (Trace{{6, 7}, {8, 9}}));
}

TEST_F(RingTrace, SlackLetsAChunkOfSlackPlusOneGoStraightIntoTheRing) {
  make(/*window=*/4, /*sinks=*/0, /*slack=*/2);
  for (int i = 0; i < 8; ++i) feed(1);
  EXPECT_EQ(feed(3), (Trace{{5}, {6, 7, 8, 9, 10}}));                        // slack + 1 tokens: written in place
  EXPECT_EQ(feed(2), (Trace{{8, 9, 10, 11}, {12}}));                         // 7 is held for truncate(), not returned
  EXPECT_EQ(cache_->bytes(), kv_cache_bytes(1, 1, 6, 1, 2, sizeof(float)));  // the ring alone
  EXPECT_EQ(feed(4), (Trace{{10, 11}, {12}, {13, 14, 15, 16}}));             // more: staged
  EXPECT_EQ(cache_->bytes(), kv_cache_bytes(1, 1, 6 + 4, 1, 2, sizeof(float)));  // ring + staging for 4
}

TEST_F(RingTrace, TruncateWithinSlackAfterTheWrapIsExact) {
  make(/*window=*/4, /*sinks=*/0, /*slack=*/2);
  for (int i = 0; i < 10; ++i) feed(1);  // holds 4..9
  cache_->truncate(7);                   // query 7 needs 4..7: held
  EXPECT_EQ(cache_->length(), 7U);
  EXPECT_EQ(feed(1), (Trace{{4, 5}, {6, 7}}));
  EXPECT_EQ(feed(1), (Trace{{5}, {6, 7, 8}}));
}

TEST_F(RingTrace, TruncateBeyondWhatIsHeldThrowsAndChangesNothing) {
  make(/*window=*/4, /*sinks=*/0, /*slack=*/2);
  for (int i = 0; i < 10; ++i) feed(1);  // holds 4..9; query 6 would need 3
  try {
    cache_->truncate(6);
    FAIL() << "truncate(6) must throw: position 3 was overwritten";
  } catch (const std::out_of_range& e) {
    EXPECT_THAT(e.what(), ::testing::AllOf(::testing::HasSubstr(">= 7"), ::testing::HasSubstr("given 6")));
  }
  EXPECT_EQ(cache_->length(), 10U);
  EXPECT_EQ(feed(1), (Trace{{7, 8, 9, 10}}));
}

TEST_F(RingTrace, SlackCountsFromTheFurthestLengthNotFromTheLastRollback) {
  make(/*window=*/4, /*sinks=*/0, /*slack=*/1);
  for (int i = 0; i < 12; ++i) feed(1);  // furthest length 12: holds 7..11
  cache_->truncate(10);                  // slack + 1 back: query 10 needs 7..10
  EXPECT_EQ(feed(1), (Trace{{7, 8, 9}, {10}}));
  // The forgotten 11 had taken 6's slot, so 6 is gone: going back to 9 (query 9 needs 6..9)
  // throws, although it is only slack + 1 back from the length 11; it is 3 back from 12.
  try {
    cache_->truncate(9);
    FAIL() << "truncate(9) must throw: position 6 was overwritten";
  } catch (const std::out_of_range& e) {
    EXPECT_THAT(e.what(), ::testing::AllOf(::testing::HasSubstr(">= 10"), ::testing::HasSubstr("given 9")));
  }
  EXPECT_EQ(cache_->length(), 11U);
  EXPECT_EQ(feed(1), (Trace{{8, 9}, {10, 11}}));  // nothing was lost by the failed call
}

TEST_F(RingTrace, TruncateIntoAStagedChunkKeepsItsHead) {
  make(/*window=*/4, /*sinks=*/0, /*slack=*/0);
  for (int i = 0; i < 6; ++i) feed(1);
  feed(5);  // 6..10 staged
  cache_->truncate(8);
  EXPECT_EQ(feed(1), (Trace{{5, 6, 7}, {8}}));
}

TEST_F(RingTrace, TruncateToTheLengthAfterAStagedChunkChangesNothing) {
  make(/*window=*/4, /*sinks=*/0, /*slack=*/0);
  for (int i = 0; i < 6; ++i) feed(1);
  feed(5);  // 6..10 staged
  cache_->truncate(11);
  EXPECT_EQ(cache_->length(), 11U);
  EXPECT_EQ(feed(1), (Trace{{8, 9, 10, 11}}));
}

TEST_F(RingTrace, TruncateBackToTheStartOfAStagedChunkForgetsAllOfIt) {
  make(/*window=*/4, /*sinks=*/1, /*slack=*/0);
  for (int i = 0; i < 7; ++i) feed(1);                                   // sink 0; ring 3..6
  EXPECT_EQ(feed(6), (Trace{{0}, {4}, {5, 6}, {7, 8, 9, 10, 11, 12}}));  // a rejected draft
  cache_->truncate(7);
  EXPECT_EQ(cache_->length(), 7U);
  EXPECT_EQ(feed(2), (Trace{{0}, {4}, {5, 6}, {7, 8}}));  // as if 7..12 had never come
}

TEST_F(RingTrace, TruncateIntoTheSinksAfterTheWrapStartsTheRingAfresh) {
  make(/*window=*/3, /*sinks=*/2, /*slack=*/0);
  for (int i = 0; i < 9; ++i) feed(1);
  cache_->truncate(1);
  EXPECT_EQ(feed(1), (Trace{{0, 1}}));
  EXPECT_EQ(feed(1), (Trace{{0, 1}, {2}}));
}

TEST(RingRollback, AnyRollbackIntoTheLastChunkSucceedsAfterTheWrap) {
  // Speculative decoding: a chunk of drafts, then a rollback to keep some of them.
  for (std::size_t window = 1; window <= 5; ++window) {
    for (std::size_t sinks = 0; sinks <= 2; ++sinks) {
      for (std::size_t slack = 0; slack <= 3; ++slack) {
        for (std::size_t tokens = 1; tokens <= 2 * window + slack; ++tokens) {
          for (std::size_t keep = 0; keep <= tokens; ++keep) {
            RingKvCache<float> cache(
                {.layers = 2, .kv_heads = 1, .head_dim = 2, .window = window, .sinks = sinks, .slack = slack});
            const std::size_t start = 3 * (sinks + window + slack);
            const Block<float> one({1, 1, 1, 2}, 1);
            const Block<float> chunk({1, 1, tokens, 2}, 2);
            for (std::size_t p = 0; p < start; ++p)
              for (std::size_t layer = 0; layer < 2; ++layer) cache.update(layer, one.view(), one.view(), arange(p, 1));
            for (std::size_t layer = 0; layer < 2; ++layer)
              cache.update(layer, chunk.view(), chunk.view(), arange(start, tokens));
            ASSERT_NO_THROW(cache.truncate(start + keep)) << "window " << window << " sinks " << sinks << " slack "
                                                          << slack << " chunk " << tokens << " keep " << keep;
            ASSERT_EQ(cache.length(), start + keep);
          }
        }
      }
    }
  }
}

TEST(RingHistory, ReturnsExactlyThePositionsTheQueriesOfAnUpdateRead) {
  // Query p reads the sinks and p - window < k <= p, so an update of T tokens from position q
  // returns the sinks and q - window + 1 .. q + T - 1: window + T - 1 keys besides the sinks once
  // the ring is full, whatever the slack holds for truncate() and however the chunk is staged.
  const std::vector<std::size_t> chunks = {1, 3, 1, 1, 7, 2, 1, 12, 1, 5, 1, 1, 2, 9, 1};
  for (std::size_t window = 1; window <= 5; ++window) {
    for (std::size_t sinks = 0; sinks <= 2; ++sinks) {
      for (std::size_t slack = 0; slack <= 3; ++slack) {
        RingKvCache<float> cache(
            {.layers = 1, .kv_heads = 1, .head_dim = 2, .window = window, .sinks = sinks, .slack = slack});
        std::size_t length = 0;
        for (const std::size_t tokens : chunks) {
          const Block<float> chunk({1, 1, tokens, 2}, 4);
          const auto history = cache.update(0, chunk.view(), chunk.view(), arange(length, tokens));
          std::vector<std::int64_t> returned;
          for (const auto& segment : history.segments) {
            returned.insert(returned.end(), segment.positions.begin(), segment.positions.end());
          }
          std::vector<std::int64_t> read;
          const std::size_t end = length + tokens;
          for (std::size_t p = 0; p < std::min(sinks, end); ++p) read.push_back(static_cast<std::int64_t>(p));
          for (std::size_t p = std::max(sinks, length + 1 > window ? length + 1 - window : 0); p < end; ++p) {
            read.push_back(static_cast<std::int64_t>(p));
          }
          ASSERT_EQ(returned, read) << "window " << window << " sinks " << sinks << " slack " << slack << ", " << tokens
                                    << " tokens from position " << length;
          length = end;
        }
      }
    }
  }
}

/// Positions of every segment of `history`, in order.
std::vector<std::int64_t> positions_of(const History<float>& history) {
  std::vector<std::int64_t> all;
  for (const auto& segment : history.segments)
    all.insert(all.end(), segment.positions.begin(), segment.positions.end());
  return all;
}

TEST(RingHistory, HistoryOfALayerHoldsEveryHeldPositionWithoutWriting) {
  // window 4, 1 sink, slack 2: the ring holds 6 positions after the sink.
  RingKvCache<float> cache({.layers = 2, .kv_heads = 1, .head_dim = 2, .window = 4, .sinks = 1, .slack = 2});
  EXPECT_TRUE(cache.history(1).segments.empty());
  History<float> last;
  for (std::size_t p = 0; p < 12; ++p) {
    Block<float> k({1, 1, 1, 2}, 0);
    k.data = {static_cast<float>(p), -static_cast<float>(p)};
    last = cache.update(0, k.view(), k.view(), arange(p, 1));
  }
  const std::vector<std::int64_t> update_read = {0, 8, 9, 10, 11};  // query 11's sink and window
  ASSERT_EQ(positions_of(last), update_read);

  const History<float> held = cache.history(0);
  EXPECT_EQ(positions_of(held), (std::vector<std::int64_t>{0, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(held.window, 4U);
  EXPECT_EQ(held.sinks, 1U);
  for (const auto& segment : held.segments) {
    for (std::size_t j = 0; j < segment.tokens(); ++j) {
      EXPECT_EQ(segment.keys(0, 0, j, 0), static_cast<float>(segment.positions[j]));
      EXPECT_EQ(segment.values(0, 0, j, 1), -static_cast<float>(segment.positions[j]));
    }
  }
  EXPECT_EQ(positions_of(last), update_read) << "history(layer) overwrote what update() returned";
  EXPECT_EQ(cache.length(0), 12U);
  EXPECT_EQ(cache.length(1), 0U);

  // A staged chunk is part of what the layer holds until the next update folds it.
  const Block<float> chunk({1, 1, 5, 2}, 3);
  (void)cache.update(0, chunk.view(), chunk.view(), arange(12, 5));
  EXPECT_EQ(positions_of(cache.history(0)), (std::vector<std::int64_t>{0, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}));
  EXPECT_THROW((void)cache.history(2), std::out_of_range);
}

TEST(RingConfig, ZeroWindowIsRejected) {
  EXPECT_THROW(RingKvCache<float>({.layers = 1, .kv_heads = 1, .head_dim = 2}), std::invalid_argument);
}

TEST(RingConfig, SlotCountsOrBytesThatOverflowAreRejectedNotWrapped) {
  constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
  EXPECT_THROW(RingKvCache<float>({.layers = 1, .kv_heads = 1, .head_dim = 2, .window = max, .slack = 1}),
               std::length_error);
  EXPECT_THROW(RingKvCache<float>({.layers = 1, .kv_heads = 1, .head_dim = 2, .window = 4, .sinks = max - 3}),
               std::length_error);
  EXPECT_THROW(
      RingKvCache<float>({.layers = 1, .batch = std::size_t{1} << 62, .kv_heads = 1, .head_dim = 1, .window = 1}),
      std::length_error);
}

TEST(RingConfig, UnboundedUnlessACapacityIsGiven) {
  RingKvCache<float> unbounded({.layers = 1, .kv_heads = 1, .head_dim = 2, .window = 4});
  EXPECT_EQ(unbounded.capacity(), std::numeric_limits<std::size_t>::max());
  RingKvCache<float> bounded({.layers = 1, .kv_heads = 1, .head_dim = 2, .capacity = 100, .window = 4});
  EXPECT_EQ(bounded.capacity(), 100U);
}

TEST(RingMemory, StaysBoundedOverALongSequence) {
  RingKvCache<float> cache({.layers = 2, .kv_heads = 2, .head_dim = 8, .window = 16, .sinks = 2, .slack = 2});
  const std::size_t bytes = cache.bytes();
  const Block<float> k({1, 2, 1, 8}, 3);
  for (std::size_t p = 0; p < 5000; ++p) {
    for (std::size_t layer = 0; layer < 2; ++layer) {
      const auto history = cache.update(layer, k.view(), k.view(), arange(p, 1));
      ASSERT_LE(history.tokens(), 2U + 16U + 2U);
    }
  }
  EXPECT_EQ(cache.bytes(), bytes);
  EXPECT_EQ(bytes, kv_cache_bytes(2, 1, 2 + 16 + 2, 2, 8, sizeof(float)));
}

}  // namespace
}  // namespace kvcache::testing
