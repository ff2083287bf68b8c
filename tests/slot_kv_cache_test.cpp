// SPDX-License-Identifier: Apache-2.0
// The slot cache's own contract, over every storage format: rows admitted, advanced by their
// own counts, finished and reused; each row reading its own tokens only; bad calls refused
// with the cache unchanged; attention over scattered rows of different lengths; a window per row.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cache_test_support.hpp"
#include "kvcache/attention.hpp"
#include "kvcache/ring_kv_cache.hpp"

namespace kvcache::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

template <class Cache>
class Slots : public ::testing::Test {
 protected:
  using T = typename Cache::value_type;
  using In = input_t<T>;
  static constexpr std::size_t layers = 3, slots = 4, kv_heads = 2, head_dim = 8, capacity = 12;

  static Cache make() {
    return Cache(test_config<T>(
        {.layers = layers, .batch = slots, .kv_heads = kv_heads, .head_dim = head_dim, .capacity = capacity}));
  }

  /// Writes `tokens` fresh tokens of each of `rows` into `layer` (every layer if layers), at
  /// positions continuing each row's own length; remembers what each row should hold.
  void feed(Cache& cache, std::vector<std::size_t> rows, std::size_t tokens, std::size_t only_layer = layers) {
    for (std::size_t layer = 0; layer < layers; ++layer) {
      if (only_layer != layers && layer != only_layer) continue;
      const Block<In> k({rows.size(), kv_heads, tokens, head_dim}, seed_++);
      const Block<In> v({rows.size(), kv_heads, tokens, head_dim}, seed_++);
      std::vector<std::int64_t> positions;
      for (const std::size_t row : rows) {
        const auto p = arange(cache.row_length(row, layer), tokens);
        positions.insert(positions.end(), p.begin(), p.end());
      }
      const auto history = cache.update(layer, k.view(), v.view(), Positions(positions.data(), tokens, tokens), rows);
      ASSERT_EQ(history.segments.size(), 1U);
      ASSERT_EQ(history.segments[0].batch(), rows.size());
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const auto one = [&](const Block<In>& b) {
          return TensorView<const In>(b.view().row(i, 0, 0), {1, kv_heads, tokens, head_dim}, b.view().strides());
        };
        auto& expected = expected_[layer][rows[i]];
        for (std::size_t t = 0; t < tokens; ++t) {
          expected[positions[i * tokens + t]] = row_of<T>(one(k), one(v), t);
        }
        EXPECT_EQ(history.segments[0].tokens(i), cache.row_length(rows[i], layer));
      }
    }
  }

  /// What `row` holds in `layer`, read back through history(layer, row).
  static std::map<std::int64_t, Row> held(Cache& cache, std::size_t layer, std::size_t row) {
    return flatten(cache.history(layer, row));
  }

  /// Every row of every layer holds exactly what was fed to it.
  void expect_rows_hold_what_was_fed(Cache& cache) {
    for (std::size_t layer = 0; layer < layers; ++layer) {
      for (std::size_t row = 0; row < slots; ++row) {
        auto expected = expected_[layer][row];
        expected.erase(expected.lower_bound(static_cast<std::int64_t>(cache.row_length(row, layer))), expected.end());
        EXPECT_EQ(held(cache, layer, row), expected) << "layer " << layer << " row " << row;
      }
    }
  }

  std::map<std::int64_t, Row> expected_[layers][slots];
  std::uint64_t seed_ = 1;
};

using SlotCaches = gtest_types<formats::transform<SlotKvCache>>;
TYPED_TEST_SUITE(Slots, SlotCaches, CacheName);

TYPED_TEST(Slots, RowsAdvanceByTheirOwnCountsAndEachHoldsOnlyItsOwnTokens) {
  auto cache = this->make();
  EXPECT_EQ(cache.free_slots(), 4U);
  const std::size_t a = cache.acquire(), b = cache.acquire(), c = cache.acquire();
  EXPECT_EQ(std::vector<std::size_t>({a, b, c}), std::vector<std::size_t>({0, 1, 2}));
  this->feed(cache, {c, a}, 3);  // two prompts of 3, listed out of slot order
  this->feed(cache, {b}, 5);     // one of 5
  this->feed(cache, {a, b, c}, 1);
  this->feed(cache, {b, c}, 2);
  EXPECT_EQ(cache.row_length(a), 4U);
  EXPECT_EQ(cache.row_length(b), 8U);
  EXPECT_EQ(cache.row_length(c), 6U);
  EXPECT_EQ(cache.row_length(3), 0U);
  EXPECT_EQ(cache.length(), 8U);  // the longest row
  this->expect_rows_hold_what_was_fed(cache);
  // The history of every slot: free ones read nothing.
  const auto all = cache.history(1);
  EXPECT_EQ(all.segments[0].batch(), 4U);
  EXPECT_EQ(all.segments[0].tokens(3), 0U);
  EXPECT_EQ(all.segments[0].tokens(1), 8U);
}

TYPED_TEST(Slots, AFinishedRowsSlotIsReusedEmptyAndTheOthersKeepTheirTokens) {
  auto cache = this->make();
  for (int i = 0; i < 4; ++i) (void)cache.acquire();
  this->feed(cache, {0, 1, 2, 3}, 4);
  try {
    (void)cache.acquire();
    ADD_FAILURE() << "acquire() must throw with every slot in use";
  } catch (const std::length_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("a free slot"), HasSubstr("all 4 slots in use")));
  }
  cache.release(2);
  cache.release(1);
  EXPECT_FALSE(cache.acquired(1));
  EXPECT_EQ(cache.free_slots(), 2U);
  EXPECT_EQ(cache.acquire(), 1U);  // the lowest free slot
  EXPECT_EQ(cache.row_length(1), 0U);
  EXPECT_TRUE(cache.history(0, {1}).segments[0].tokens(0) == 0);
  for (auto& layer : this->expected_) layer[1].clear(), layer[2].clear();
  this->feed(cache, {1}, 2);
  this->feed(cache, {3, 1}, 1);
  EXPECT_EQ(cache.row_length(1), 3U);
  EXPECT_EQ(cache.row_length(3), 5U);
  this->expect_rows_hold_what_was_fed(cache);
  cache.reset();  // as constructed: every slot free and empty
  EXPECT_EQ(cache.free_slots(), 4U);
  EXPECT_EQ(cache.length(), 0U);
}

TYPED_TEST(Slots, APartWayPassMakesThatRowsLengthThrowUntilTruncateRepairsIt) {
  auto cache = this->make();
  (void)cache.acquire();
  (void)cache.acquire();
  this->feed(cache, {0, 1}, 3);
  this->feed(cache, {1}, 1, 0);  // row 1's pass stops after layer 0
  EXPECT_EQ(cache.row_length(0), 3U);
  EXPECT_EQ(cache.row_length(1, 0), 4U);
  EXPECT_EQ(cache.row_length(1, 2), 3U);
  try {
    (void)cache.row_length(1);
    ADD_FAILURE() << "row_length(1) must throw while its layers disagree";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("row 1"), HasSubstr("layer 0 holds 4"), HasSubstr("layers 1-2 hold 3")));
  }
  EXPECT_THROW((void)cache.length(), std::runtime_error);
  EXPECT_THROW(cache.truncate(1, 4), std::out_of_range);
  cache.truncate(1, 3);
  EXPECT_EQ(cache.row_length(1), 3U);
  this->expect_rows_hold_what_was_fed(cache);
}

TYPED_TEST(Slots, BadCallsThrowNamingBothValuesAndLeaveTheCacheUnchanged) {
  using Cache = TypeParam;
  using E = typename TestFixture::In;
  constexpr std::size_t H = TestFixture::kv_heads, D = TestFixture::head_dim;
  const auto update = [](std::vector<std::size_t> rows, std::size_t batch, std::size_t tokens,
                         std::vector<std::int64_t> firsts) {
    return [=](Cache& cache) {
      const Block<E> k({batch, H, tokens, D}, 9);
      std::vector<std::int64_t> positions;
      for (const std::int64_t first : firsts) {
        const auto p = arange(static_cast<std::size_t>(first), tokens);
        positions.insert(positions.end(), p.begin(), p.end());
      }
      cache.update(1, k.view(), k.view(), Positions(positions.data(), tokens, tokens), rows);
    };
  };
  struct Case {
    std::string name;
    std::function<void(Cache&)> call;
    Throws type;
    std::vector<std::string> parts;
  };
  // Rows 0 and 1 hold 3 and 5 tokens, row 2 is free, row 3 was released.
  const std::vector<Case> cases = {
      {"row past the slots", update({0, 7}, 2, 1, {3, 0}), Throws::out_of_range, {"rows[1]", "a slot < 4", "given 7"}},
      {"row not acquired",
       update({2}, 1, 1, {0}),
       Throws::invalid_argument,
       {"rows[0]", "acquired", "slot 2, which is free"}},
      {"row released", update({1, 3}, 2, 1, {5, 0}), Throws::invalid_argument, {"rows[1]", "slot 3, which is free"}},
      {"row twice", update({0, 0}, 2, 1, {3, 3}), Throws::invalid_argument, {"rows[1]", "slot 0, also rows[0]"}},
      {"positions of another row",
       update({0, 1}, 2, 1, {3, 3}),
       Throws::invalid_argument,
       {"rows[1] (slot 1)", "positions[0]", "expected 5", "given 3"}},
      {"row past its capacity",
       update({1, 0}, 2, 8, {5, 3}),
       Throws::length_error,
       {"rows[0] (slot 1)", "capacity 12", "5 + 8"}},
      {"k batch not the rows count",
       update({0, 1}, 3, 1, {3, 5}),
       Throws::invalid_argument,
       {"k batch", "expected 2", "given 3"}},
      {"acquire none free",
       [](Cache& cache) { (void)cache.acquire(), (void)cache.acquire(), (void)cache.acquire(); },
       Throws::length_error,
       {"all 4 slots in use"}},
      {"release a free row",
       [](Cache& cache) { cache.release(2); },
       Throws::invalid_argument,
       {"release", "slot 2, which is free"}},
      {"release past the slots",
       [](Cache& cache) { cache.release(4); },
       Throws::out_of_range,
       {"a slot < 4", "given 4"}},
      {"truncate a row beyond its length",
       [](Cache& cache) { cache.truncate(0, 4); },
       Throws::out_of_range,
       {"row 0", "<= 3", "given 4"}},
      {"truncate a row past the slots",
       [](Cache& cache) { cache.truncate(9, 0); },
       Throws::out_of_range,
       {"a slot < 4", "given 9"}},
      {"length of a row past the slots",
       [](Cache& cache) { (void)cache.row_length(4); },
       Throws::out_of_range,
       {"row", "given 4"}},
      {"length of a bad layer",
       [](Cache& cache) { (void)cache.row_length(0, 3); },
       Throws::out_of_range,
       {"layer", "expected < 3", "given 3"}},
      {"history of a row past the slots",
       [](Cache& cache) { (void)cache.history(0, {5}); },
       Throws::out_of_range,
       {"rows[0]", "given 5"}},
  };

  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto cache = this->make();
    (void)cache.acquire();
    (void)cache.acquire();
    (void)cache.acquire();
    (void)cache.acquire();
    cache.release(2);
    cache.release(3);
    this->feed(cache, {0, 1}, 3);
    this->feed(cache, {1}, 2);
    const std::size_t bytes = cache.bytes();
    std::vector<std::size_t> lengths;
    for (std::size_t row = 0; row < TestFixture::slots; ++row)
      for (std::size_t layer = 0; layer < TestFixture::layers; ++layer) lengths.push_back(cache.row_length(row, layer));
    expect_throw_naming([&] { c.call(cache); }, c.type, c.parts);
    if (c.name == "acquire none free") {  // the two free slots were taken before the third threw
      cache.release(2);
      cache.release(3);
    }
    std::vector<std::size_t> after;
    for (std::size_t row = 0; row < TestFixture::slots; ++row)
      for (std::size_t layer = 0; layer < TestFixture::layers; ++layer) after.push_back(cache.row_length(row, layer));
    EXPECT_EQ(after, lengths);
    EXPECT_EQ(cache.bytes(), bytes);
    EXPECT_EQ(cache.free_slots(), 2U);
    EXPECT_TRUE(cache.acquired(0) && cache.acquired(1));
    this->expect_rows_hold_what_was_fed(cache);
  }
}

// ---- seeded random operation sequences against the reference model ---------------------------

TYPED_TEST(Slots, RandomOperationSequencesMatchTheReference) {
  using Cache = TypeParam;
  using Stored = typename Cache::value_type;
  using E = typename TestFixture::In;
  constexpr std::size_t L = TestFixture::layers, S = TestFixture::slots, H = TestFixture::kv_heads,
                        D = TestFixture::head_dim, C = TestFixture::capacity;
  std::mt19937_64 rng(20261204);
  const auto pick = [&](std::size_t lo, std::size_t hi) {
    return std::uniform_int_distribution<std::size_t>(lo, hi)(rng);
  };

  for (int sequence = 0; sequence < 40; ++sequence) {
    SCOPED_TRACE("sequence " + std::to_string(sequence));
    Cache cache = this->make();
    // The reference: what each (layer, slot) was given by position, and which S are in use.
    Stream<Stored> held[L][S];
    std::vector<bool> in_use(S, false);
    const auto length_of = [&](std::size_t layer, std::size_t row) { return held[layer][row].size(); };

    for (int op = 0; op < 40; ++op) {
      const std::size_t kind = pick(0, 9);
      if (kind <= 1) {  // admit
        const auto free = std::find(in_use.begin(), in_use.end(), false);
        if (free == in_use.end()) {
          ASSERT_THROW((void)cache.acquire(), std::length_error);
        } else {
          ASSERT_EQ(cache.acquire(), static_cast<std::size_t>(free - in_use.begin()));
          *free = true;
        }
      } else if (kind == 2) {  // finish
        const std::size_t row = pick(0, S - 1);
        if (in_use[row]) {
          cache.release(row);
          in_use[row] = false;
          for (auto& layer : held) layer[row].clear();
        } else {
          ASSERT_THROW(cache.release(row), std::invalid_argument);
        }
      } else if (kind <= 6) {  // a group of acquired rows advancing by one count, maybe part-way
        std::vector<std::size_t> rows;
        for (std::size_t r = 0; r < S; ++r)
          if (in_use[r] && pick(0, 2) != 0) rows.push_back(r);
        std::shuffle(rows.begin(), rows.end(), rng);
        const std::size_t tokens = pick(0, 2) == 0 ? pick(2, 5) : 1;
        const std::size_t stop = pick(0, 4) == 0 ? pick(1, L) : L;
        bool fits = true;
        for (const std::size_t r : rows) {
          for (std::size_t l = 0; l < L; ++l) fits = fits && length_of(l, r) == length_of(0, r);
          fits = fits && length_of(0, r) + tokens <= C;
        }
        if (!fits) continue;
        for (std::size_t layer = 0; layer < stop; ++layer) {
          const Block<E> k({rows.size(), H, tokens, D}, rng()), v({rows.size(), H, tokens, D}, rng());
          std::vector<std::int64_t> positions;
          for (const std::size_t r : rows) {
            const auto p = arange(length_of(layer, r), tokens);
            positions.insert(positions.end(), p.begin(), p.end());
          }
          const auto history =
              cache.update(layer, k.view(), v.view(), Positions(positions.data(), tokens, tokens), rows);
          std::vector<const Stream<Stored>*> streams;
          std::vector<std::int64_t> last;
          for (std::size_t t = 0; t < tokens; ++t) {
            std::vector<StoredToken<Stored>> token = store_tokens<Stored>(k.view(), v.view(), t);
            for (std::size_t i = 0; i < rows.size(); ++i) held[layer][rows[i]].push_back(std::move(token[i]));
          }
          for (std::size_t i = 0; i < rows.size(); ++i) {
            ASSERT_EQ(history.segments[0].tokens(i), length_of(layer, rows[i]));
            streams.push_back(&held[layer][rows[i]]);
            last.push_back(static_cast<std::int64_t>(length_of(layer, rows[i])) - 1);
          }
          // Each row's last query reads what the reference model's uncached attention reads.
          if (tokens != 0 && !rows.empty() && pick(0, 3) == 0)
            expect_reference_attention(history, streams, last, {}, H, 2, D, rng());
        }
      } else if (kind == 7) {  // roll a row back, valid or not
        const std::size_t row = pick(0, S - 1);
        std::size_t common = C;
        for (std::size_t l = 0; l < L; ++l) common = std::min(common, length_of(l, row));
        const std::size_t n = pick(0, common + 1);
        if (n > common) {
          ASSERT_THROW(cache.truncate(row, n), std::out_of_range);
        } else {
          cache.truncate(row, n);
          for (auto& layer : held) layer[row].resize(n);
        }
      } else if (kind == 8) {  // a bad update: a free row, or positions that do not continue
        const std::size_t row = pick(0, S - 1);
        const std::size_t layer = pick(0, L - 1);
        const Block<E> k({1, H, 1, D}, rng());
        const auto at = static_cast<std::int64_t>(length_of(layer, row) + (in_use[row] ? 1 : 0));
        ASSERT_THROW(cache.update(layer, k.view(), k.view(), Positions(at), row), std::invalid_argument);
      } else if (pick(0, 3) == 0) {
        cache.reset();
        std::fill(in_use.begin(), in_use.end(), false);
        for (auto& layer : held)
          for (auto& row : layer) row.clear();
      }
      // Every row of every layer holds exactly the reference's tokens, and nothing else.
      for (std::size_t row = 0; row < S; ++row) {
        ASSERT_EQ(cache.acquired(row), in_use[row]) << "row " << row;
        for (std::size_t layer = 0; layer < L; ++layer) {
          ASSERT_EQ(cache.row_length(row, layer), length_of(layer, row)) << "layer " << layer << " row " << row;
          ASSERT_EQ(flatten(cache.history(layer, row)), flatten(held[layer][row]))
              << "layer " << layer << " row " << row;
        }
      }
    }
  }
}

// ---- attention over scattered rows ----------------------------------------------------------

TEST(SlotAttention, ScatteredRowsOfDifferentLengthsReadWhatEachRowAloneReads) {
  constexpr std::size_t layers = 1, H = 2, Hq = 4, D = 16;
  const std::vector<std::size_t> lengths = {9, 0, 23, 4};  // slot 1 stays empty
  SlotKvCache<float> slots({.layers = layers, .batch = 4, .kv_heads = H, .head_dim = D, .capacity = 32});
  std::vector<KvCache<float>> alone;
  for (std::size_t row = 0; row < 4; ++row) {
    (void)slots.acquire();
    alone.emplace_back(KvCacheConfig{.layers = layers, .kv_heads = H, .head_dim = D, .capacity = 32});
    const Block<float> k({1, H, lengths[row], D}, 10 + row), v({1, H, lengths[row], D}, 20 + row);
    const std::size_t only = row;
    slots.update(0, k.view(), v.view(), arange(0, lengths[row]), only);
    alone[row].update(0, k.view(), v.view(), arange(0, lengths[row]));
  }
  // Batch rows read slots 3, 1, 0 and 2, each one query at its row's last position + 1.
  const std::vector<std::size_t> order = {3, 1, 0, 2};
  const Block<float> q({order.size(), Hq, 1, D}, 99);
  std::vector<std::int64_t> q_positions;
  for (const std::size_t row : order) q_positions.push_back(static_cast<std::int64_t>(lengths[row]));
  Block<float> out({order.size(), Hq, 1, D}, 0);
  causal_attention(q.view(), Positions(q_positions.data(), 1, 1), slots.history(0, order), out.mutable_view());
  for (std::size_t i = 0; i < order.size(); ++i) {
    const TensorView<const float> qi(q.view().row(i, 0, 0), {1, Hq, 1, D}, q.view().strides());
    Block<float> expected({1, Hq, 1, D}, 0);
    causal_attention(qi, Positions(q_positions.data() + i, 1), alone[order[i]].history(0), expected.mutable_view());
    for (std::size_t h = 0; h < Hq; ++h) {
      for (std::size_t d = 0; d < D; ++d) {
        EXPECT_NEAR(out.view()(i, h, 0, d), expected.view()(0, h, 0, d), 1e-6F) << "slot " << order[i];
        if (lengths[order[i]] == 0) {
          EXPECT_EQ(out.view()(i, h, 0, d), 0.0F) << "an empty row gives zeros";
        }
      }
    }
  }
}

TEST(SlotAttention, RowsListedInOneUpdateMayAdvanceFromDifferentLengths) {
  SlotKvCache<float> cache({.layers = 1, .batch = 3, .kv_heads = 1, .head_dim = 8, .capacity = 16});
  for (int i = 0; i < 3; ++i) (void)cache.acquire();
  const Block<float> prompt({1, 1, 5, 8}, 1);
  cache.update(0, prompt.view(), prompt.view(), arange(0, 5), {2});
  const Block<float> step({2, 1, 1, 8}, 2);
  const std::int64_t positions[] = {5, 0};  // slot 2 continues at 5, slot 0 starts
  const auto history = cache.update(0, step.view(), step.view(), Positions(positions, 1, 1), {2, 0});
  EXPECT_EQ(history.segments[0].tokens(0), 6U);
  EXPECT_EQ(history.segments[0].tokens(1), 1U);
  EXPECT_EQ(cache.row_length(2), 6U);
  EXPECT_EQ(cache.row_length(0), 1U);
  EXPECT_EQ(cache.row_length(1), 0U);
}

// ---- a window per row --------------------------------------------------------------------------

constexpr std::size_t kWindow = 5, kSinks = 1, kSlack = 2;

SlotKvCache<float> windowed_slots(std::size_t slots) {
  return SlotKvCache<float>(
      {.layers = 1, .batch = slots, .kv_heads = 2, .head_dim = 8, .window = kWindow, .sinks = kSinks, .slack = kSlack});
}

// Each row of a windowed slot cache advances on its own, by chunks up to slack + 1 that wrap its
// ring, and attention over it equals attention over a RingKvCache of the same window fed the same
// row; every position a query reads is held, and the cache's bytes never grow.
TEST(SlotWindows, EachRowReadsWhatARingOfItsOwnReadsAndMemoryStaysFlat) {
  constexpr std::size_t slots = 3, H = 2, Hq = 4, D = 8;
  SlotKvCache<float> cache = windowed_slots(slots);
  EXPECT_EQ(cache.rows_per_slot(), kSinks + kWindow + kSlack);
  const std::size_t bytes = cache.bytes();
  std::vector<RingKvCache<float>> rings;
  for (std::size_t row = 0; row < slots; ++row) {
    EXPECT_EQ(cache.acquire(), row);
    rings.emplace_back(
        KvCacheConfig{.layers = 1, .kv_heads = H, .head_dim = D, .window = kWindow, .sinks = kSinks, .slack = kSlack});
  }
  std::mt19937_64 rng(7);
  const auto pick = [&](std::size_t lo, std::size_t hi) {
    return std::uniform_int_distribution<std::size_t>(lo, hi)(rng);
  };
  for (std::size_t step = 0; step < 40; ++step) {
    std::vector<std::size_t> rows;
    for (std::size_t row = 0; row < slots; ++row)
      if (pick(0, 2) != 0) rows.push_back(row);
    if (rows.empty()) continue;
    const std::size_t tokens = pick(1, kSlack + 1);
    const Block<float> k({rows.size(), H, tokens, D}, rng()), v({rows.size(), H, tokens, D}, rng());
    std::vector<std::int64_t> positions;
    for (const std::size_t row : rows) {
      const auto p = arange(cache.row_length(row), tokens);
      positions.insert(positions.end(), p.begin(), p.end());
    }
    const auto history = cache.update(0, k.view(), v.view(), Positions(positions.data(), tokens, tokens), rows);
    EXPECT_EQ(history.window, kWindow);
    EXPECT_EQ(history.sinks, kSinks);
    const Block<float> q({rows.size(), Hq, tokens, D}, rng());
    Block<float> out({rows.size(), Hq, tokens, D}, 0);
    causal_attention(q.view(), Positions(positions.data(), tokens, tokens), history, out.mutable_view());
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const auto one = [&](const Block<float>& b) {
        return TensorView<const float>(b.view().row(i, 0, 0), {1, b.shape.heads, tokens, D}, b.view().strides());
      };
      const std::span<const std::int64_t> own(positions.data() + i * tokens, tokens);
      const auto ring_history = rings[rows[i]].update(0, one(k), one(v), own);
      Block<float> expected({1, Hq, tokens, D}, 0);
      causal_attention(one(q), own, ring_history, expected.mutable_view());
      for (std::size_t h = 0; h < Hq; ++h) {
        for (std::size_t t = 0; t < tokens; ++t) {
          for (std::size_t d = 0; d < D; ++d) {
            ASSERT_NEAR(out.view()(i, h, t, d), expected.view()(0, h, t, d), 1e-6F)
                << "step " << step << " slot " << rows[i] << " position " << own[t];
          }
        }
      }
      // Every position a query of this chunk reads is held, with the data the ring holds there.
      const auto held = flatten_row(history, i), ring_held = flatten(ring_history);
      const std::size_t n = cache.row_length(rows[i]), first = static_cast<std::size_t>(own[0]);
      for (std::size_t p = 0; p < n; ++p) {
        if (p < kSinks || p + kWindow > first) {
          ASSERT_TRUE(held.count(static_cast<std::int64_t>(p))) << "slot " << rows[i] << " position " << p;
          ASSERT_EQ(held.at(static_cast<std::int64_t>(p)), ring_held.at(static_cast<std::int64_t>(p)));
        }
      }
    }
    EXPECT_EQ(cache.bytes(), bytes);
  }
  for (std::size_t row = 0; row < slots; ++row) EXPECT_GT(cache.row_length(row), 3 * (kSinks + kWindow + kSlack));
}

TEST(SlotWindows, BadWindowsChunksAndTruncatesThrowAndLeaveTheCacheUnchanged) {
  expect_throw_naming(
      [] { SlotKvCache<float>({.layers = 1, .batch = 1, .kv_heads = 1, .head_dim = 4, .capacity = 8, .sinks = 2}); },
      Throws::invalid_argument, {"SlotKvCache", "config.sinks/slack", "expected 0 without a window", "given 2/0"});
  expect_throw_naming([] { BlockPool<float>({.layers = 1, .kv_heads = 1, .head_dim = 4, .blocks = 4, .slack = 3}); },
                      Throws::invalid_argument,
                      {"BlockPool", "config.sinks/slack", "expected 0 without a window", "given 0/3"});

  SlotKvCache<float> cache = windowed_slots(2);
  for (int i = 0; i < 2; ++i) (void)cache.acquire();
  // A chunk longer than slack + 1 fits while it does not wrap the ring: a prompt of 8 = sinks +
  // window + slack tokens.
  const Block<float> prompt({1, 2, 8, 8}, 1);
  EXPECT_NO_THROW(cache.update(0, prompt.view(), prompt.view(), arange(0, 8), {0}));
  const Block<float> small({1, 2, 2, 8}, 2);
  cache.update(0, small.view(), small.view(), arange(0, 2), {1});
  const auto snapshot = [&] {
    std::vector<std::map<std::int64_t, Row>> rows;
    for (std::size_t row = 0; row < 2; ++row) rows.push_back(flatten(cache.history(0, row)));
    return std::pair{rows, std::vector<std::size_t>{cache.row_length(0), cache.row_length(1)}};
  };
  const auto before = snapshot();
  // Slot 0 would wrap by a chunk of slack + 2: refused naming the bound; the other row listed
  // with it is not written either.
  const Block<float> long_chunk({2, 2, kSlack + 2, 8}, 3);
  std::vector<std::int64_t> positions = arange(2, kSlack + 2);  // rows[0]: slot 1, then slot 0
  const auto slot_0 = arange(8, kSlack + 2);
  positions.insert(positions.end(), slot_0.begin(), slot_0.end());
  expect_throw_naming(
      [&] {
        cache.update(0, long_chunk.view(), long_chunk.view(), Positions(positions.data(), kSlack + 2, kSlack + 2),
                     {1, 0});
      },
      Throws::length_error, {"rows[1] (slot 0)", "chunk that wraps the window", "slack + 1 = 3", "given 4"});
  EXPECT_EQ(snapshot(), before);

  // Past the ring's slack, a truncate would need positions it overwrote: refused, unchanged.
  for (std::size_t step = 0; step < 6; ++step) {
    const Block<float> one({1, 2, 1, 8}, 10 + step);
    cache.update(0, one.view(), one.view(), arange(cache.row_length(0), 1), {0});
  }
  const auto later = snapshot();
  EXPECT_EQ(cache.row_length(0), 14U);
  expect_throw_naming([&] { cache.truncate(0, 9); }, Throws::out_of_range, {"SlotKvCache::truncate", "row 0", "9"});
  EXPECT_THROW(cache.truncate(9), std::out_of_range);
  EXPECT_EQ(snapshot(), later);
  // Within the slack, and back to the sinks, it works.
  cache.truncate(0, 14 - kSlack);
  EXPECT_EQ(cache.row_length(0), 14 - kSlack);
  cache.truncate(0, kSinks);
  EXPECT_EQ(snapshot().first[0].size(), kSinks);
}

}  // namespace
}  // namespace kvcache::testing
