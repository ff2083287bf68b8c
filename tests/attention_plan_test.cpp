// SPDX-License-Identifier: Apache-2.0
// How a call's work is cut into items (attention_plan.hpp): batch rows that read the same stored
// rows share items, so those keys are read once; every (batch row, kv head, block of queries) is
// written exactly once, directly or merged from the pieces that read its keys. And the outputs
// of one call over a batch whose rows share blocks equal those of a call per row.

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "cache_test_support.hpp"
#include "kvcache/attention.hpp"

namespace kvcache {
namespace {

using testing::arange;

/// Blocks of `block` tokens laid out as a BlockPool lays out a layer ([H, blocks x block, D]),
/// and histories of batch rows that each read their own list of blocks (a block table), read
/// through the [blocks, H, block, D] view a batch of paged sequences is.
template <class T>
struct Blocks {
  std::size_t heads, dim, block, blocks;
  std::vector<T> k, v;
  std::vector<std::int64_t> positions;
  std::vector<Segment<T>> segments;
  std::vector<std::vector<std::size_t>> rows, row_tokens;

  Blocks(std::size_t heads_, std::size_t dim_, std::size_t block_, std::size_t blocks_, std::uint64_t seed)
      : heads(heads_), dim(dim_), block(block_), blocks(blocks_) {
    const testing::Block<T> keys({1, heads, blocks * block, dim}, seed);
    const testing::Block<T> values({1, heads, blocks * block, dim}, seed + 1);
    k = keys.data;
    v = values.data;
    positions = arange(0, blocks * block);
  }

  /// Batch row b reads the first lengths[b] tokens of the blocks tables[b] lists.
  History<T> history(const std::vector<std::vector<std::size_t>>& tables, const std::vector<std::size_t>& lengths,
                     std::size_t window = 0, std::size_t sinks = 0) {
    std::size_t longest = 0;
    for (const std::size_t n : lengths) longest = std::max(longest, (n + block - 1) / block);
    segments.clear();
    rows.assign(longest, std::vector<std::size_t>(tables.size(), 0));
    row_tokens.assign(longest, std::vector<std::size_t>(tables.size(), 0));
    const Shape shape{blocks, heads, block, dim};
    const Strides strides{block * dim, blocks * block * dim, dim};
    for (std::size_t j = 0; j < longest; ++j) {
      for (std::size_t b = 0; b < tables.size(); ++b) {
        if (j * block >= lengths[b]) continue;
        rows[j][b] = tables[b][j];
        row_tokens[j][b] = std::min(block, lengths[b] - j * block);
      }
      Segment<T> s{TensorView<const T>(k.data(), shape, strides), TensorView<const T>(v.data(), shape, strides),
                   Positions(positions.data() + j * block, block)};
      s.rows = rows[j];
      s.row_tokens = row_tokens[j];
      segments.push_back(s);
    }
    return {segments, window, sinks};
  }

  /// The value a stored row holds, in double.
  [[nodiscard]] double at(const std::vector<T>& x, std::size_t block_id, std::size_t h, std::size_t t,
                          std::size_t d) const {
    return static_cast<double>(static_cast<float>(x[(h * blocks + block_id) * block * dim + t * dim + d]));
  }
};

/// Softmax attention in double of batch row b's queries over the keys of its table.
template <class T>
std::vector<double> reference_row(const Blocks<T>& store, const std::vector<std::size_t>& table, std::size_t length,
                                  const std::vector<float>& q, std::size_t b, std::size_t q_heads, std::size_t tokens,
                                  std::size_t window, std::size_t sinks) {
  const std::size_t dim = store.dim, group = q_heads / store.heads;
  std::vector<double> out(q_heads * tokens * dim, 0.0);
  for (std::size_t h = 0; h < q_heads; ++h) {
    for (std::size_t t = 0; t < tokens; ++t) {
      const auto query = static_cast<std::int64_t>(length - tokens + t);
      const float* qr = q.data() + ((b * q_heads + h) * tokens + t) * dim;
      std::vector<double> scores(length, -std::numeric_limits<double>::infinity());
      double max = -std::numeric_limits<double>::infinity();
      for (std::size_t j = 0; j < length; ++j) {
        const auto key = static_cast<std::int64_t>(j);
        const bool visible = key <= query && (window == 0 || key < static_cast<std::int64_t>(sinks) ||
                                              query - key < static_cast<std::int64_t>(window));
        if (!visible) continue;
        double s = 0;
        for (std::size_t d = 0; d < dim; ++d)
          s += qr[d] * store.at(store.k, table[j / store.block], h / group, j % store.block, d);
        scores[j] = s / std::sqrt(static_cast<double>(dim));
        max = std::max(max, scores[j]);
      }
      double sum = 0;
      for (double& s : scores) sum += s = std::exp(s - max);
      for (std::size_t j = 0; j < length; ++j) {
        if (scores[j] == 0.0) continue;
        for (std::size_t d = 0; d < dim; ++d) {
          out[(h * tokens + t) * dim + d] +=
              scores[j] / sum * store.at(store.v, table[j / store.block], h / group, j % store.block, d);
        }
      }
    }
  }
  return out;
}

/// A batch of rows over shared blocks: the tables, lengths and the chunk each row attends.
struct Batch {
  std::vector<std::vector<std::size_t>> tables;
  std::vector<std::size_t> lengths;
};

/// Blocks [first, first + n).
std::vector<std::size_t> run_of(std::size_t first, std::size_t n) {
  std::vector<std::size_t> blocks(n);
  std::iota(blocks.begin(), blocks.end(), first);
  return blocks;
}
std::vector<std::size_t> join(std::vector<std::size_t> a, const std::vector<std::size_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// Four samples forked from one 300-token prompt (blocks of 16: 18 whole blocks shared, the
/// partial one copied by each before its first own token), a system prompt of 10 blocks shared
/// by five questions of which two forked again (4 more blocks shared), an independent row, an
/// empty row and a row listed twice.
Batch mixed_batch() {
  Batch b;
  const auto prompt = run_of(0, 18);
  for (std::size_t i = 0; i < 4; ++i) {
    b.tables.push_back(join(prompt, {100 + i}));
    b.lengths.push_back(300 + 1 + i);
  }
  const auto system = run_of(20, 10);
  const auto forked = join(system, run_of(40, 4));
  b.tables.push_back(join(system, run_of(50, 6)));
  b.lengths.push_back(160 + 90);
  b.tables.push_back(join(system, run_of(60, 3)));
  b.lengths.push_back(160 + 33);
  b.tables.push_back(join(system, {}));
  b.lengths.push_back(160);
  b.tables.push_back(join(forked, {70, 71}));
  b.lengths.push_back(224 + 20);
  b.tables.push_back(join(forked, {72}));
  b.lengths.push_back(224 + 3);
  b.tables.push_back(run_of(80, 12));  // independent
  b.lengths.push_back(190);
  b.tables.push_back({});  // empty: zeros
  b.lengths.push_back(0);
  b.tables.push_back(b.tables[0]);  // the same row twice
  b.lengths.push_back(b.lengths[0]);
  return b;
}

/// One call over the whole batch against a call per row and against the reference.
template <class T>
void check_batch(const Batch& batch, std::size_t kv_heads, std::size_t group, std::size_t tokens, std::size_t window,
                 std::size_t sinks, std::size_t threads, double tolerance) {
  constexpr std::size_t dim = 64, block = 16, blocks = 128;
  Blocks<T> store(kv_heads, dim, block, blocks, 7);
  const std::size_t rows = batch.tables.size(), q_heads = kv_heads * group;
  const testing::Block<float> q({rows, q_heads, tokens, dim}, 9);
  std::vector<std::int64_t> q_positions(rows * tokens);
  for (std::size_t b = 0; b < rows; ++b) {
    for (std::size_t t = 0; t < tokens; ++t) {
      q_positions[b * tokens + t] = static_cast<std::int64_t>(batch.lengths[b] + t) - static_cast<std::int64_t>(tokens);
    }
  }
  const AttentionOptions options{.threads = threads};
  std::vector<float> one(q.data.size(), std::numeric_limits<float>::quiet_NaN());
  causal_attention(q.view(), Positions(q_positions.data(), tokens, tokens),
                   store.history(batch.tables, batch.lengths, window, sinks), TensorView<float>(one.data(), q.shape),
                   options);
  const std::size_t per_row = q_heads * tokens * dim;
  for (std::size_t b = 0; b < rows; ++b) {
    SCOPED_TRACE("batch row " + std::to_string(b) + " of " + std::to_string(batch.lengths[b]) + " keys");
    std::vector<float> alone(per_row, std::numeric_limits<float>::quiet_NaN());
    const TensorView<const float> q_row(q.data.data() + b * per_row, {1, q_heads, tokens, dim});
    causal_attention(q_row, Positions(q_positions.data() + b * tokens, tokens),
                     store.history({batch.tables[b]}, {batch.lengths[b]}, window, sinks),
                     TensorView<float>(alone.data(), q_row.shape()), options);
    const std::vector<double> want =
        batch.lengths[b] < tokens
            ? std::vector<double>(per_row, 0.0)
            : reference_row(store, batch.tables[b], batch.lengths[b], q.data, b, q_heads, tokens, window, sinks);
    double apart = 0, error = 0;
    for (std::size_t i = 0; i < per_row; ++i) {
      apart = std::max(apart, static_cast<double>(std::abs(one[b * per_row + i] - alone[i])));
      error = std::max(error, std::abs(static_cast<double>(one[b * per_row + i]) - want[i]));
      if (std::isnan(one[b * per_row + i])) apart = error = std::numeric_limits<double>::infinity();
    }
    EXPECT_LE(apart, 1e-5) << "one call against a call for this row alone";
    EXPECT_LE(error, tolerance) << "one call against the reference";
  }
}

TEST(BatchAttention, OneCallOverRowsSharingBlocksEqualsACallPerRow) {
  const Batch batch = mixed_batch();
  for (const std::size_t threads : {std::size_t{1}, std::size_t{2}, std::size_t{3}}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    check_batch<float>(batch, 2, 4, 1, 0, 0, threads, 2e-5);
  }
  check_batch<kvcache::bfloat16>(batch, 2, 2, 1, 0, 0, 2, 2e-5);
  check_batch<double>(batch, 1, 1, 1, 0, 0, 2, 2e-5);
}

TEST(BatchAttention, ChunksWindowsAndSinksOverSharedBlocks) {
  // Rows that share blocks have different queries and positions: each row's mask is its own.
  // Rows shorter than the chunk are left out (their queries would have negative positions).
  Batch batch = mixed_batch();
  batch.tables.erase(batch.tables.begin() + 10);
  batch.lengths.erase(batch.lengths.begin() + 10);
  check_batch<float>(batch, 2, 4, 3, 0, 0, 2, 2e-5);    // 12 rows a member: 5 members an item
  check_batch<float>(batch, 1, 2, 1, 100, 4, 1, 2e-5);  // a window inside the shared prefix
  check_batch<float>(batch, 2, 1, 5, 40, 0, 3, 2e-5);   // and a chunk under it
}

TEST(BatchAttention, ManyRowsSharingOnePrefixAreReadInItemsOfAtMostSixtyFourRows) {
  Batch batch;
  for (std::size_t i = 0; i < 20; ++i) {
    batch.tables.push_back(join(run_of(0, 16), {20 + i}));
    batch.lengths.push_back(256 + 1 + i % 7);
  }
  check_batch<float>(batch, 1, 4, 1, 0, 0, 2, 2e-5);
}

// ---- the plan ------------------------------------------------------------------------------

/// What the items of a plan read, and whether every block of queries is written exactly once.
struct Coverage {
  std::size_t keys = 0;                        // over every item
  std::map<std::size_t, std::size_t> members;  // items by member count
};

template <class T>
Coverage check_plan(const detail::AttentionPlan& plan, std::span<const Segment<T>> segments,
                    const detail::PlanShape& shape) {
  Coverage c;
  const std::size_t blocks = (shape.queries + shape.block_queries - 1) / shape.block_queries;
  std::vector<std::size_t> direct(shape.batch * shape.kv_heads * blocks, 0);
  std::vector<std::size_t> written(plan.partial_slots, 0);
  std::vector<std::size_t> keys_of_unit(direct.size(), 0);
  for (const detail::AttentionItem& item : plan.items) {
    c.keys += item.key_end - item.key_begin;
    ++c.members[item.member_count()];
    EXPECT_LE(item.member_count() * item.queries * shape.group, std::max(plan.max_rows, std::size_t{1}));
    EXPECT_TRUE(item.slots.empty() || item.slots.size() == item.member_count());
    EXPECT_TRUE(item.member_count() == 1 || !item.slots.empty()) << "an item of several rows leaves their states";
    for (std::size_t m = 0; m < item.member_count(); ++m) {
      const std::size_t b = item.member(m);
      const std::size_t u = (b * shape.kv_heads + item.kv_head) * blocks + item.first_query / shape.block_queries;
      keys_of_unit[u] += item.key_end - item.key_begin;
      if (item.slots.empty()) {
        ++direct[u];
      } else {
        ++written[item.slots[m]];
      }
      // Members read what the item's walking row reads, segment by segment up to its last key.
      std::size_t seen = 0;
      for (const Segment<T>& s : segments) {
        if (seen >= item.key_end) break;
        EXPECT_EQ(s.tokens(b), s.tokens(item.batch));
        if (s.tokens(b) != 0) {
          EXPECT_EQ(s.stored_row(b), s.stored_row(item.batch));
        }
        seen += s.tokens(item.batch);
      }
    }
  }
  std::vector<std::size_t> merged(direct.size(), 0);
  for (const detail::MergeUnit& m : plan.merges) {
    const std::size_t u =
        (m.unit.batch * shape.kv_heads + m.unit.kv_head) * blocks + m.unit.first_query / shape.block_queries;
    merged[u] = 1;
    for (std::size_t i = 0; i < m.pieces; ++i)
      EXPECT_EQ(written[m.unit.partial + i], 1U) << "slot " << m.unit.partial + i;
  }
  for (std::size_t u = 0; u < direct.size(); ++u) {
    EXPECT_EQ(direct[u] + merged[u], 1U) << "unit " << u << " written " << direct[u] << " times directly";
    std::size_t keys = 0;
    const std::size_t b = u / blocks / shape.kv_heads;
    for (const Segment<T>& s : segments) keys += s.tokens(b);
    EXPECT_EQ(keys_of_unit[u], keys) << "unit " << u << " reads each of its keys once";
  }
  return c;
}

TEST(AttentionPlan, SharedRunsAreReadOnceAndEveryBlockOfQueriesIsWrittenOnce) {
  const Batch batch = mixed_batch();
  Blocks<float> store(2, 8, 16, 128, 1);
  const History<float> history = store.history(batch.tables, batch.lengths);
  std::size_t own = 0;  // keys read with no sharing
  for (const std::size_t n : batch.lengths) own += n;
  const detail::PlanShape shape{
      .batch = batch.tables.size(), .kv_heads = 2, .queries = 1, .block_queries = 1, .group = 4, .row_bytes = 32};
  const detail::AttentionPlan plan = detail::plan_attention(history.segments, shape, 1, 1);
  const Coverage c = check_plan(plan, history.segments, shape);
  // Read once: the prompt's 288 keys for its five rows (four samples and the repeated row), the
  // repeated row's own 13, the system prompt's 160 for five rows, the forks' 64 more for two.
  const std::size_t saved = 288 * 4 + 13 + 160 * 4 + 64;
  EXPECT_EQ(c.keys, 2 * (own - saved));
  EXPECT_EQ(c.members.at(5), 2U * 2);  // two kv heads: the prompt's and the system prompt's runs
  EXPECT_EQ(c.members.at(2), 2U * 2);  // the forks' run, and the repeated row's tail
}

TEST(AttentionPlan, ShortSharedRunsAreReadByEachRowAndLongOnesAreSplitOverThreads) {
  Blocks<float> store(1, 8, 16, 128, 1);
  // Two rows sharing 2 blocks (32 keys): below kMinSharedKeys, each reads them itself.
  const History<float> short_run = store.history({{0, 1, 2}, {0, 1, 3}}, {40, 40});
  const detail::PlanShape shape{
      .batch = 2, .kv_heads = 1, .queries = 1, .block_queries = 1, .group = 1, .row_bytes = 4};
  const detail::AttentionPlan plain = detail::plan_attention(short_run.segments, shape, 1, 1);
  EXPECT_EQ(check_plan(plain, short_run.segments, shape).keys, 80U);
  EXPECT_EQ(plain.items.size(), 2U);
  EXPECT_TRUE(plain.merges.empty()) << "each row's output written directly";

  // One row of 100 blocks (1,600 keys) among short ones: with two threads it is cut by keys.
  std::vector<std::vector<std::size_t>> tables{run_of(0, 100)};
  std::vector<std::size_t> lengths{1600};
  for (std::size_t i = 0; i < 4; ++i) {
    tables.push_back({110 + i});
    lengths.push_back(10);
  }
  const History<float> uneven = store.history(tables, lengths);
  const detail::PlanShape five{.batch = 5, .kv_heads = 1, .queries = 1, .block_queries = 1, .group = 1, .row_bytes = 4};
  const detail::AttentionPlan one = detail::plan_attention(uneven.segments, five, 1, 1);
  EXPECT_EQ(one.items.size(), 5U);
  const detail::AttentionPlan two = detail::plan_attention(uneven.segments, five, 2, 1);
  EXPECT_EQ(check_plan(two, uneven.segments, five).keys, 1600U + 40U);
  EXPECT_GT(two.items.size(), 5U);
  EXPECT_EQ(two.items.front().batch, 0U) << "largest first";
}

TEST(AttentionPlan, RandomTreesOfSharedBlocksAreCoveredExactly) {
  std::mt19937_64 rng(55);
  const auto pick = [&](std::size_t lo, std::size_t hi) {
    return std::uniform_int_distribution<std::size_t>(lo, hi)(rng);
  };
  Blocks<float> store(1, 4, 8, 512, 1);
  for (int round = 0; round < 200; ++round) {
    // Rows grow from earlier rows' tables: fork a prefix of one, then add blocks of their own.
    Batch batch;
    std::size_t next_block = 0;
    const std::size_t rows = pick(1, 12);
    for (std::size_t r = 0; r < rows; ++r) {
      std::vector<std::size_t> table;
      if (r != 0 && pick(0, 3) != 0) {
        const auto& parent = batch.tables[pick(0, r - 1)];
        table.assign(parent.begin(), parent.begin() + static_cast<std::ptrdiff_t>(pick(0, parent.size())));
      }
      for (std::size_t n = pick(0, 12); n > 0 && next_block < store.blocks; --n) table.push_back(next_block++);
      batch.lengths.push_back(table.empty() ? 0 : table.size() * 8 - pick(0, 7));
      batch.tables.push_back(std::move(table));
    }
    const History<float> history = store.history(batch.tables, batch.lengths);
    const detail::PlanShape shape{.batch = rows,
                                  .kv_heads = pick(1, 2),
                                  .queries = pick(1, 3),
                                  .block_queries = pick(1, 2),
                                  .group = pick(1, 4),
                                  .row_bytes = 16};
    SCOPED_TRACE("round " + std::to_string(round));
    (void)check_plan(detail::plan_attention(history.segments, shape, pick(1, 4), 1), history.segments, shape);
  }
}

}  // namespace
}  // namespace kvcache
