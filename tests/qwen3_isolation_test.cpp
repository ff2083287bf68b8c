// SPDX-License-Identifier: Apache-2.0
// No request affects another: the reference model serves several requests together, through a
// slot cache (batched, admitted at different steps, in different orders, slots reused) and
// through a block pool (sequences interleaved, blocks freed and taken again, a prompt prefix
// reused), in every storage format; each request's logits equal, bit for bit, its logits when
// it is served alone. The model computes each token on its own (ModelOptions::batch_invariant)
// and attention on the caller's thread alone ({.threads = 1}): a matrix product over the batch,
// or a split over threads that the batch's size decides, would otherwise round a request's
// numbers differently beside other requests, which is the model's arithmetic, not the cache's.

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kvcache/calibration.hpp"
#include "kvcache/kv_cache.hpp"
#include "kvcache/paged_kv_cache.hpp"
#include "kvcache/quantized.hpp"
#include "kvcache/slot_kv_cache.hpp"
#include "qwen3/model.hpp"
#include "support/format_matrix.hpp"

namespace {

using qwen3::Matrix;
using qwen3::TokenId;

qwen3::Model& model() {
  static qwen3::Model m(qwen3::random_weights(qwen3::Config{}), {.attention = {.threads = 1}, .batch_invariant = true});
  return m;
}

/// A request: its prompt and the tokens it decodes one at a time after it (teacher-forced).
struct Request {
  std::vector<TokenId> tokens;
  std::size_t prompt = 0;
};

std::vector<TokenId> ids(std::size_t n, std::uint64_t seed) {
  qwen3::SplitMix64 rng(seed);
  std::vector<TokenId> t(n);
  for (TokenId& id : t) id = static_cast<TokenId>(rng.next() % model().config().vocab);
  return t;
}

/// Five requests of other lengths; request 4 starts with request 0's first 8 tokens (two
/// blocks of 4: a prefix a pool can hand it).
const std::vector<Request>& requests() {
  static const std::vector<Request> all = [] {
    std::vector<Request> r = {{ids(13, 1), 7}, {ids(12, 2), 3}, {ids(16, 3), 12}, {ids(9, 4), 1}, {ids(14, 5), 10}};
    std::copy_n(r[0].tokens.begin(), 8, r[4].tokens.begin());
    return r;
  }();
  return all;
}

/// fp8_e4m3_heads' static scales, from a float run of another text: the engine's, shared by
/// every request (none for other formats).
template <class T>
kvcache::CalibratedScales scales() {
  if constexpr (kvcache::detail::has_head_scales<T>) {
    const qwen3::Config& c = model().config();
    kvcache::KvCache<float> probe({.layers = c.layers, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .capacity = 64});
    (void)model().forward(ids(64, 99), probe);
    return kvcache::calibrate_head_scales<T>(probe);
  } else {
    return {};
  }
}

bool same_bits(const Matrix& a, const Matrix& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.size()) * sizeof(float)) == 0;
}

/// Appends `more` below `logits`.
void append(Matrix& logits, const Matrix& more) {
  Matrix grown(logits.rows() + more.rows(), more.cols());
  grown << logits, more;
  logits = std::move(grown);
}

/// How many tokens request r feeds at its step `fed`: the prompt at once, then one a step.
std::size_t next_count(const Request& r, std::size_t fed) { return fed == 0 ? r.prompt : 1; }

template <class T>
class RequestIsolation : public ::testing::Test {
 protected:
  RequestIsolation() : scales_(scales<T>()) {}

  [[nodiscard]] kvcache::KvCacheConfig slot_config(std::size_t slots) const {
    const qwen3::Config& c = model().config();
    return {.layers = c.layers,
            .batch = slots,
            .kv_heads = c.kv_heads,
            .head_dim = c.head_dim,
            .capacity = 24,
            .key_scales = scales_.keys,
            .value_scales = scales_.values};
  }
  [[nodiscard]] kvcache::BlockPoolConfig pool_config(std::size_t blocks) const {
    const qwen3::Config& c = model().config();
    return {.layers = c.layers,
            .kv_heads = c.kv_heads,
            .head_dim = c.head_dim,
            .block_tokens = 4,
            .blocks = blocks,
            .key_scales = scales_.keys,
            .value_scales = scales_.values};
  }

  /// Request r's logits at every position, served alone through a slot cache of one slot.
  Matrix alone_in_slots(const Request& r) const {
    kvcache::SlotKvCache<T> cache(slot_config(1));
    const std::size_t row = cache.acquire();
    Matrix logits(0, static_cast<Eigen::Index>(model().config().vocab));
    for (std::size_t fed = 0; fed < r.tokens.size();) {
      const std::size_t n = next_count(r, fed);
      const std::vector<qwen3::Model::RowTokens> batch = {{row, std::span(r.tokens).subspan(fed, n)}};
      append(logits, model().forward(batch, cache)[0]);
      fed += n;
    }
    return logits;
  }

  /// Request r's logits at every position, served alone through a sequence of its own pool.
  Matrix alone_in_pool(const Request& r) const {
    kvcache::BlockPool<T> pool(pool_config(8));
    kvcache::PagedKvCache<T> seq(pool);
    Matrix logits(0, static_cast<Eigen::Index>(model().config().vocab));
    for (std::size_t fed = 0; fed < r.tokens.size();) {
      const std::size_t n = next_count(r, fed);
      append(logits, model().forward(std::span(r.tokens).subspan(fed, n), seq));
      fed += n;
    }
    return logits;
  }

  kvcache::CalibratedScales scales_;
};

using Formats = kvcache::testing::gtest_types<kvcache::testing::formats>;
using kvcache::testing::FormatName;
TYPED_TEST_SUITE(RequestIsolation, Formats, FormatName);

/// A slot-cache schedule: at which step each request is admitted (in the order listed, when
/// several are), and how many slots the cache has (fewer than requests: finished requests give
/// theirs to later ones).
struct SlotSchedule {
  const char* what;
  std::vector<std::size_t> order;
  std::vector<std::size_t> admit;  // per request
  std::size_t slots;
};

TYPED_TEST(RequestIsolation, EveryRequestServedInASlotBatchGetsItsLogitsAloneBitForBit) {
  const std::vector<Request>& all = requests();
  std::vector<Matrix> alone;
  for (const Request& r : all) alone.push_back(this->alone_in_slots(r));
  const std::vector<SlotSchedule> schedules = {
      {"all at once, prefills batched with each other", {0, 1, 2, 3, 4}, {0, 0, 0, 0, 0}, 5},
      {"staggered, in reverse, prefills batched with decodes", {4, 3, 2, 1, 0}, {8, 6, 4, 2, 0}, 5},
      {"two slots, each freed slot taken by the next request", {2, 0, 4, 1, 3}, {0, 0, 0, 0, 0}, 2},
  };
  for (const SlotSchedule& schedule : schedules) {
    kvcache::SlotKvCache<TypeParam> cache(this->slot_config(schedule.slots));
    std::vector<std::size_t> fed(all.size(), 0), row(all.size(), 0);
    std::vector<bool> active(all.size(), false), done(all.size(), false);
    std::vector<Matrix> logits(all.size(), Matrix(0, static_cast<Eigen::Index>(model().config().vocab)));
    std::set<std::size_t> rows_used;
    for (std::size_t step = 0; std::count(done.begin(), done.end(), true) < static_cast<long>(all.size()); ++step) {
      ASSERT_LT(step, 200U) << schedule.what;
      for (const std::size_t i : schedule.order) {  // admissions, while slots are free
        if (active[i] || done[i] || schedule.admit[i] > step || cache.free_slots() == 0) continue;
        row[i] = cache.acquire();
        rows_used.insert(row[i]);
        active[i] = true;
      }
      std::vector<qwen3::Model::RowTokens> batch;
      std::vector<std::size_t> who;
      for (const std::size_t i : schedule.order) {
        if (!active[i]) continue;
        batch.push_back({row[i], std::span(all[i].tokens).subspan(fed[i], next_count(all[i], fed[i]))});
        who.push_back(i);
      }
      if (batch.empty()) continue;
      const std::vector<Matrix> got = model().forward(batch, cache);
      for (std::size_t j = 0; j < who.size(); ++j) {
        const std::size_t i = who[j];
        append(logits[i], got[j]);
        fed[i] += batch[j].tokens.size();
        if (fed[i] == all[i].tokens.size()) {
          cache.release(row[i]);
          active[i] = false;
          done[i] = true;
        }
      }
    }
    for (std::size_t i = 0; i < all.size(); ++i) {
      EXPECT_TRUE(same_bits(logits[i], alone[i])) << schedule.what << ": request " << i;
    }
    if (schedule.slots < all.size()) {
      EXPECT_EQ(rows_used.size(), schedule.slots) << schedule.what;  // each slot served several requests
    }
  }
  // The comparison has teeth: a request's logits with another's tokens before its own differ.
  Request prefixed = all[1];
  prefixed.tokens.insert(prefixed.tokens.begin(), all[3].tokens.begin(), all[3].tokens.begin() + 2);
  prefixed.prompt += 2;
  const Matrix shifted = this->alone_in_slots(prefixed).bottomRows(alone[1].rows() - 1);
  EXPECT_FALSE(same_bits(shifted, alone[1].bottomRows(alone[1].rows() - 1)));
}

TYPED_TEST(RequestIsolation, EverySequenceOfAPoolGetsItsLogitsAloneBitForBit) {
  const std::vector<Request>& all = requests();
  std::vector<Matrix> alone;
  for (const Request& r : all) alone.push_back(this->alone_in_pool(r));
  // Orders of taking steps: round robin, reversed, and request 0 twice a round, so that request 4
  // finds its prompt's first blocks filled and takes them (its own logits start after them).
  const std::vector<std::vector<std::size_t>> orders = {{0, 1, 2, 3, 4}, {4, 3, 2, 1, 0}, {0, 0, 1, 2, 3, 4}};
  for (std::size_t o = 0; o < orders.size(); ++o) {
    const bool reuse = o == 2;
    // Just enough blocks for every request at once: those a finished request gives back, later
    // ones take.
    kvcache::BlockPool<TypeParam> pool(this->pool_config(18));
    std::vector<std::unique_ptr<kvcache::PagedKvCache<TypeParam>>> seqs;
    for (std::size_t i = 0; i < all.size(); ++i)
      seqs.push_back(std::make_unique<kvcache::PagedKvCache<TypeParam>>(pool));
    std::vector<std::size_t> fed(all.size(), 0), skipped(all.size(), 0);
    std::vector<std::set<std::size_t>> blocks(all.size());
    std::vector<Matrix> logits(all.size(), Matrix(0, static_cast<Eigen::Index>(model().config().vocab)));
    const auto step = [&](std::size_t i) {
      const Request& r = all[i];
      if (fed[i] == r.tokens.size()) return;
      if (fed[i] == 0 && reuse) {
        skipped[i] = seqs[i]->reuse_prefix(std::span(r.tokens).first(r.prompt));
        fed[i] = skipped[i];
      }
      const std::size_t n = fed[i] < r.prompt ? r.prompt - fed[i] : 1;
      const auto tokens = std::span(r.tokens).subspan(fed[i], n);
      // A generated token's id before it is fed, so that the blocks it fills are keyed.
      if (reuse && fed[i] >= r.prompt) seqs[i]->add_token_ids(tokens);
      append(logits[i], model().forward(tokens, *seqs[i]));
      fed[i] += n;
      blocks[i].insert(seqs[i]->block_table().begin(), seqs[i]->block_table().end());
      if (fed[i] == r.tokens.size()) seqs[i]->reset();  // its blocks go back to the pool
      pool.check_invariants();
    };
    for (std::size_t round = 0; round < 20; ++round) {
      for (const std::size_t i : orders[o]) step(i);
    }
    for (std::size_t i = 0; i < all.size(); ++i) {
      ASSERT_EQ(fed[i], all[i].tokens.size()) << "order " << o << ", request " << i;
      const Matrix& want = alone[i];
      const Eigen::Index from = static_cast<Eigen::Index>(skipped[i]);
      if (skipped[i] == 0) {
        EXPECT_TRUE(same_bits(logits[i], want)) << "order " << o << ", request " << i;
      } else {
        // Its prefix's rows are request 0's, computed from the same tokens in other chunks (7
        // tokens, then 1) than its own alone (10): equal within float rounding, not bit for bit,
        // since a chunk's length moves the kernel's order of summing; a value that moved by float
        // rounding may then round the other way into a 16-bit or quantized row. What the check
        // shows is that the rows are the prefix's tokens' (another prompt's differ by far more).
        const float tolerance = std::is_floating_point_v<TypeParam> ? 1e-5F : 1e-3F;
        EXPECT_LE((logits[i] - want.bottomRows(want.rows() - from)).cwiseAbs().maxCoeff(), tolerance)
            << "order " << o << ", request " << i;
      }
    }
    if (reuse) {
      EXPECT_EQ(skipped[4], 8U) << "request 4 takes request 0's prompt blocks";
    }
    // Blocks one request gave back, another wrote (or, reused, read) after it.
    std::size_t shared = 0;
    for (std::size_t i = 0; i < all.size(); ++i)
      for (std::size_t j = i + 1; j < all.size(); ++j)
        for (const std::size_t b : blocks[i]) shared += blocks[j].count(b);
    EXPECT_GT(shared, 0U) << "order " << o;
  }
}

}  // namespace
