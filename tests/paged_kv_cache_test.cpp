// SPDX-License-Identifier: Apache-2.0
// The paged cache's own contract, over every storage format: sequences in a pool of blocks,
// fork with copy-on-write, prefix reuse by a hash chain of token ids, blocks freed and reused in
// least-recently-freed order, running out of blocks; and a seeded differential test of all of
// it against a trivial reference, with the pool's invariants checked after every operation.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <random>
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
class Paged : public ::testing::Test {
 protected:
  using In = input_t<T>;
  static constexpr std::size_t layers = 2, kv_heads = 2, head_dim = 8, block = 4;

  static BlockPool<T> make_pool(std::size_t blocks, std::size_t window = 0, std::size_t sinks = 0,
                                std::size_t slack = 0) {
    return BlockPool<T>(test_pool_config(blocks, window, sinks, slack));
  }
  static BlockPoolConfig test_pool_config(std::size_t blocks, std::size_t window = 0, std::size_t sinks = 0,
                                          std::size_t slack = 0) {
    const KvCacheConfig c = test_config<T>({.layers = layers, .kv_heads = kv_heads, .head_dim = head_dim});
    return {.layers = layers,
            .kv_heads = kv_heads,
            .head_dim = head_dim,
            .block_tokens = block,
            .blocks = blocks,
            .capacity = 64,
            .window = window,
            .sinks = sinks,
            .slack = slack,
            .key_scales = c.key_scales,
            .value_scales = c.value_scales};
  }

  /// The K and V rows of the token at position p after `ids[0..p]`: a function of that whole
  /// prefix, as a model's are, so a sequence that reuses a prefix gets what recomputing gives.
  static Block<In> rows_after(std::span<const TokenId> ids, std::size_t p, std::uint64_t salt) {
    std::uint64_t h = salt;
    for (std::size_t i = 0; i <= p; ++i) h = h * 1000003U + static_cast<std::uint64_t>(ids[i]) + 1;
    return Block<In>({1, kv_heads, 1, head_dim}, h);
  }

  /// Feeds ids[from, to) into every layer of `seq` (the first `stop` layers only, if given).
  static void feed(PagedKvCache<T>& seq, std::span<const TokenId> ids, std::size_t from, std::size_t to,
                   std::size_t stop = layers) {
    for (std::size_t layer = 0; layer < stop; ++layer) {
      for (std::size_t p = from; p < to; ++p) {
        const Block<In> k = rows_after(ids, p, 2 * layer), v = rows_after(ids, p, 2 * layer + 1);
        const std::int64_t at = static_cast<std::int64_t>(p);
        seq.update(layer, k.view(), v.view(), at);
      }
    }
  }

  /// What a sequence fed ids[0, n) must hold in `layer`, by position.
  static std::map<std::int64_t, Row> expected(std::span<const TokenId> ids, std::size_t n, std::size_t layer) {
    std::map<std::int64_t, Row> rows;
    for (std::size_t p = 0; p < n; ++p) {
      const Block<In> k = rows_after(ids, p, 2 * layer), v = rows_after(ids, p, 2 * layer + 1);
      rows[static_cast<std::int64_t>(p)] = row_of<T>(k.view(), v.view(), 0);
    }
    return rows;
  }

  static void expect_holds(PagedKvCache<T>& seq, std::span<const TokenId> ids, std::size_t n) {
    ASSERT_EQ(seq.length(), n);
    for (std::size_t layer = 0; layer < layers; ++layer)
      EXPECT_EQ(flatten(seq.history(layer)), expected(ids, n, layer));
  }

  /// Checks what a history of `layer` holds against a sequence fed ids[0, n): the rows of the
  /// positions it returns, and every position a query at n reads (the sinks and the window).
  static void expect_window(const std::map<std::int64_t, Row>& held, std::span<const TokenId> ids, std::size_t n,
                            std::size_t layer, std::size_t window, std::size_t sinks) {
    const auto want = expected(ids, n, layer);
    for (const auto& [p, row] : held) {
      ASSERT_TRUE(want.count(p)) << "position " << p << " of " << n;
      ASSERT_EQ(row, want.at(p)) << "position " << p;
    }
    for (std::size_t p = 0; p < n; ++p) {
      if (WindowRule{window, sinks}.reads(n, p)) {
        ASSERT_TRUE(held.count(static_cast<std::int64_t>(p))) << "position " << p << " of " << n;
      }
    }
  }
};

using Formats = gtest_types<formats>;
TYPED_TEST_SUITE(Paged, Formats, FormatName);

std::vector<TokenId> ids(std::initializer_list<int> values) { return {values.begin(), values.end()}; }

/// The tokens every layer of a sequence holds.
template <class T>
std::size_t l_length(const PagedKvCache<T>& seq) {
  std::size_t n = seq.length(0);
  for (std::size_t layer = 1; layer < seq.layers(); ++layer) n = std::min(n, seq.length(layer));
  return n;
}

TYPED_TEST(Paged, ASequenceHoldsItsTokensInBlocksAndGivesThemBackWhenTruncatedOrGone) {
  auto pool = this->make_pool(8);
  const auto prompt = ids({5, 1, 4, 1, 5, 9, 2, 6, 5, 3});
  {
    PagedKvCache<TypeParam> seq(pool);
    this->feed(seq, prompt, 0, 10);
    this->expect_holds(seq, prompt, 10);
    EXPECT_EQ(seq.block_table().size(), 3U);
    EXPECT_EQ(seq.history(0).segments.size(), 3U);  // read in place, a segment a block
    EXPECT_EQ(pool.free_blocks(), 5U);
    EXPECT_EQ(seq.bytes(), 3 * pool.block_bytes());
    seq.truncate(4);
    EXPECT_EQ(pool.free_blocks(), 7U);
    this->feed(seq, prompt, 4, 6);
    this->expect_holds(seq, prompt, 6);
    pool.check_invariants();
  }
  EXPECT_EQ(pool.free_blocks(), 8U);
  pool.check_invariants();
}

TYPED_TEST(Paged, ForkedSequencesContinuedDifferentlyEqualEachComputedFromScratch) {
  auto pool = this->make_pool(12);
  const auto a = ids({3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8});
  auto b = a;
  b[6] = 7;  // diverges inside the second block, which the fork shares partly filled
  PagedKvCache<TypeParam> first(pool);
  this->feed(first, a, 0, 6);
  PagedKvCache<TypeParam> second = first.fork();
  EXPECT_EQ(std::vector<std::size_t>(second.block_table().begin(), second.block_table().end()),
            std::vector<std::size_t>(first.block_table().begin(), first.block_table().end()));
  EXPECT_EQ(pool.free_blocks(), 10U);  // shared, not copied
  pool.check_invariants();
  this->feed(second, b, 6, 12);  // copies the shared partial block before writing it
  this->feed(first, a, 6, 9);
  pool.check_invariants();
  EXPECT_EQ(first.block_table()[0], second.block_table()[0]);  // the full block stays shared
  EXPECT_NE(first.block_table()[1], second.block_table()[1]);
  this->expect_holds(first, a, 9);
  this->expect_holds(second, b, 12);
}

TYPED_TEST(Paged, APrefixHitSkipsWholeBlocksOfTheSharedPrefixAndHoldsWhatRecomputingGives) {
  auto pool = this->make_pool(16);
  const auto prompt = ids({7, 7, 1, 2, 3, 4, 5, 6, 8, 9, 10});
  auto other = prompt;
  other[9] = 42;  // shares 9 tokens: two whole blocks of 4
  PagedKvCache<TypeParam> first(pool);
  EXPECT_EQ(first.reuse_prefix(prompt), 0U);
  this->feed(first, prompt, 0, prompt.size());
  EXPECT_EQ(pool.keyed_blocks(), 2U);  // full blocks whose ids are known
  PagedKvCache<TypeParam> second(pool);
  const std::size_t skip = second.reuse_prefix(other);
  EXPECT_EQ(skip, 8U);
  EXPECT_EQ(second.length(), 8U);
  EXPECT_EQ(second.block_table()[1], first.block_table()[1]);
  pool.check_invariants();
  this->feed(second, other, skip, other.size());
  this->expect_holds(second, other, other.size());
  this->expect_holds(first, prompt, prompt.size());
  pool.check_invariants();
  // A prompt no longer than a block, or sharing less than one, skips nothing.
  PagedKvCache<TypeParam> third(pool);
  EXPECT_EQ(third.reuse_prefix(ids({7, 7, 1})), 0U);
  PagedKvCache<TypeParam> fourth(pool);
  EXPECT_EQ(fourth.reuse_prefix(ids({7, 7, 1, 9, 2, 3, 4, 5})), 0U);
  // Only an empty sequence takes a prefix.
  EXPECT_THROW((void)first.reuse_prefix(prompt), std::logic_error);
}

TYPED_TEST(Paged, FreedKeyedBlocksStayReusableUntilThePoolNeedsThemLeastRecentlyFreedFirst) {
  auto pool = this->make_pool(4);
  const auto a = ids({1, 2, 3, 4}), b = ids({5, 6, 7, 8});
  for (const auto* prompt : {&a, &b}) {  // a's block is freed first, then b's
    PagedKvCache<TypeParam> seq(pool);
    (void)seq.reuse_prefix(*prompt);
    this->feed(seq, *prompt, 0, 4);
  }
  EXPECT_EQ(pool.free_blocks(), 4U);
  EXPECT_EQ(pool.keyed_blocks(), 2U);
  {
    // Two fresh blocks come from the never-keyed ones; the third evicts a's, the oldest freed.
    PagedKvCache<TypeParam> filler(pool);
    this->feed(filler, ids({9, 9, 9, 9, 9, 9, 9, 9, 9}), 0, 9);
    EXPECT_EQ(pool.keyed_blocks(), 1U);
    pool.check_invariants();
  }
  PagedKvCache<TypeParam> again_a(pool), again_b(pool);
  EXPECT_EQ(again_a.reuse_prefix(a), 0U);
  EXPECT_EQ(again_b.reuse_prefix(b), 3U);  // the whole prompt: its last token is left to feed
  this->expect_holds(again_b, b, 3);
  pool.check_invariants();
}

// ---- prefix hits hand out only the rows of the tokens their keys name ------------------------

TYPED_TEST(Paged, AWholePromptHitLeavesItsLastTokenToFeedAndGeneratedIdsKeyTheBlocksTheirTokensFill) {
  auto pool = this->make_pool(16);
  const auto prompt = ids({1, 2, 3, 4, 5, 6, 7, 8});
  const auto generated = ids({100, 101, 102, 103});
  auto all = prompt;
  all.insert(all.end(), generated.begin(), generated.end());
  // Serves the prompt as an engine does: the skipped tokens, the rest of the prompt, then each
  // generated token's id given before the token is fed.
  const auto serve = [&](PagedKvCache<TypeParam>& seq, std::size_t expected_skip) {
    const std::size_t skip = seq.reuse_prefix(prompt);
    EXPECT_EQ(skip, expected_skip);
    this->expect_holds(seq, prompt, skip);
    this->feed(seq, prompt, skip, prompt.size());
    for (std::size_t i = 0; i < generated.size(); ++i) {
      seq.add_token_ids(std::span(generated).subspan(i, 1));
      this->feed(seq, all, prompt.size() + i, prompt.size() + i + 1);
      pool.check_invariants();
    }
    this->expect_holds(seq, all, all.size());
  };
  PagedKvCache<TypeParam> first(pool);
  serve(first, 0);
  {
    PagedKvCache<TypeParam> shared(pool);  // while the first holds the blocks: the last is copied
    serve(shared, 7);
    EXPECT_EQ(shared.block_table()[0], first.block_table()[0]);
    EXPECT_NE(shared.block_table()[1], first.block_table()[1]);
  }
  first = PagedKvCache<TypeParam>(pool);
  for (int again = 0; again < 3; ++again) {  // alone in the pool: the block is rewritten in place
    PagedKvCache<TypeParam> seq(pool);
    serve(seq, 7);
  }
  // A prompt that continues with the first generated token where the prompt's last stood
  // shares one block, not two: no block is keyed [5 6 7 100].
  auto other = ids({1, 2, 3, 4, 5, 6, 7, 100, 9, 9});
  PagedKvCache<TypeParam> third(pool);
  EXPECT_EQ(third.reuse_prefix(other), 4U);
  this->feed(third, other, 4, other.size());
  this->expect_holds(third, other, other.size());
  pool.check_invariants();
}

TYPED_TEST(Paged, IdsGivenAfterTheirTokensAreRefusedAndChangeNothing) {
  auto pool = this->make_pool(8);
  const auto prompt = ids({1, 2, 3, 4, 5, 6});
  PagedKvCache<TypeParam> seq(pool);
  EXPECT_EQ(seq.reuse_prefix(prompt), 0U);
  auto all = prompt;
  all.push_back(9);
  this->feed(seq, all, 0, all.size());  // token 6 fed before its id was given
  try {
    seq.add_token_ids(ids({9}));
    ADD_FAILURE() << "no exception";
  } catch (const std::logic_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("add_token_ids"), HasSubstr("before the tokens"), HasSubstr("7 tokens"),
                                HasSubstr("6 ids known")));
  }
  EXPECT_EQ(seq.token_ids().size(), 6U);
  EXPECT_EQ(pool.keyed_blocks(), 1U);
  pool.check_invariants();
  // After a truncate the ids past it are forgotten; given again before their tokens, they key.
  seq.truncate(6);
  seq.add_token_ids(ids({9, 10}));
  all.push_back(10);
  this->feed(seq, all, 6, all.size());
  EXPECT_EQ(pool.keyed_blocks(), 2U);
  this->expect_holds(seq, all, all.size());
  PagedKvCache<TypeParam> reuser(pool);
  EXPECT_EQ(reuser.reuse_prefix(all), 7U);
  this->expect_holds(reuser, all, 7);
  pool.check_invariants();
}

/// How a sequence gives back every block at once.
enum class GiveBack { destroyed, moved_over, reset, truncated };

TYPED_TEST(Paged, EverySequenceGivesItsBlocksBackLastFirstSoEvictionTakesAPrefixsTailBeforeItsRoot) {
  for (const GiveBack how : {GiveBack::destroyed, GiveBack::moved_over, GiveBack::reset, GiveBack::truncated}) {
    SCOPED_TRACE(static_cast<int>(how));
    auto pool = this->make_pool(4);
    const auto prompt = ids({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13});
    {
      auto seq = std::make_unique<PagedKvCache<TypeParam>>(pool);
      (void)seq->reuse_prefix(prompt);
      this->feed(*seq, prompt, 0, 12);  // three full blocks, keyed
      ASSERT_EQ(pool.keyed_blocks(), 3U);
      if (how == GiveBack::destroyed) seq.reset();
      if (how == GiveBack::moved_over) *seq = PagedKvCache<TypeParam>(pool);
      if (how == GiveBack::reset) seq->reset();
      if (how == GiveBack::truncated) seq->truncate(0);
      ASSERT_EQ(pool.free_blocks(), 4U);
      // Two blocks for another prompt: the never-keyed one, then the oldest freed.
      PagedKvCache<TypeParam> filler(pool);
      this->feed(filler, ids({9, 9, 9, 9, 9}), 0, 5);
      EXPECT_EQ(pool.keyed_blocks(), 2U);
      pool.check_invariants();
    }
    PagedKvCache<TypeParam> again(pool);
    EXPECT_EQ(again.reuse_prefix(prompt), 8U);  // the prefix's first two blocks survive
    this->expect_holds(again, prompt, 8);
    pool.check_invariants();
  }
}

TYPED_TEST(Paged, OutOfBlocksThrowsNamingNeededAndFreeWithNothingChanged) {
  auto pool = this->make_pool(3);
  const auto prompt = ids({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14});
  PagedKvCache<TypeParam> seq(pool);
  this->feed(seq, prompt, 0, 6);
  PagedKvCache<TypeParam> other = seq.fork();
  const std::size_t free = pool.free_blocks();
  // 7 more tokens from position 6: a copy of the shared second block and two new ones.
  Block<typename TestFixture::In> k({1, TestFixture::kv_heads, 7, TestFixture::head_dim}, 1);
  try {
    seq.update(0, k.view(), k.view(), arange(6, 7));
    ADD_FAILURE() << "no exception";
  } catch (const std::length_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("blocks"), HasSubstr("the 1 free"), HasSubstr("3 needed")));
  }
  EXPECT_EQ(pool.free_blocks(), free);
  EXPECT_EQ(seq.length(0), 6U);
  pool.check_invariants();
  this->expect_holds(seq, prompt, 6);
  this->expect_holds(other, prompt, 6);
}

// ---- seeded random operation sequences against a trivial reference --------------------------

TYPED_TEST(Paged, RandomOperationSequencesMatchTheReferenceAndKeepThePoolConsistent) {
  using Seq = PagedKvCache<TypeParam>;
  std::mt19937_64 rng(20261204);
  const auto pick = [&](std::size_t lo, std::size_t hi) {
    return std::uniform_int_distribution<std::size_t>(lo, hi)(rng);
  };
  // Prompts and generated tokens from a small alphabet, so prefixes repeat across sequences,
  // and a prompt often is the whole of one served before.
  const std::vector<std::vector<TokenId>> prompts = {ids({1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9}),
                                                     ids({1, 2, 3, 4, 5, 6, 7, 8, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4}),
                                                     ids({1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9}),
                                                     ids({6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6}),
                                                     ids({1, 2, 3, 4, 5, 6, 7, 8}),
                                                     ids({1, 2, 3, 4})};
  const auto token = [&] { return static_cast<TokenId>(pick(1, 3)); };
  std::size_t hits = 0, whole = 0, out_of_blocks = 0, forks = 0, generated = 0, refused = 0;  // what the runs reached
  std::size_t batches = 0, given_back = 0, refused_truncates = 0;
  for (int run = 0; run < 40; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    // Every other run in a pool with a window: its sequences give back the blocks before it.
    const std::size_t window = run % 2 == 1 ? pick(2, 9) : 0, sinks = window != 0 ? pick(0, 2) : 0;
    const std::size_t slack = window != 0 ? pick(0, 3) : 0;
    auto pool = this->make_pool(pick(5, 12), window, sinks, slack);
    struct Live {
      std::unique_ptr<Seq> seq;
      std::vector<TokenId> ids;  // the tokens it holds and will be fed, position by position
    };
    std::vector<Live> live;
    // Served sequences' tokens, as later prompts: a prefix hit must hand out exactly their rows.
    std::vector<std::vector<TokenId>> served = prompts;
    const auto held = [](const Seq& seq) { return std::max(seq.length(0), seq.length(1)); };
    for (int op = 0; op < 80; ++op) {
      const std::size_t kind = pick(0, 12);
      if (kind <= 1 && live.size() < 4) {  // a new sequence, through a prefix hit where there is one
        Live l{std::make_unique<Seq>(pool), served[pick(0, served.size() - 1)]};
        l.ids.resize(pick(1, l.ids.size()));
        const std::size_t skip = l.seq->reuse_prefix(l.ids);
        ASSERT_LT(skip, l.ids.size()) << "the last prompt token is always fed";
        ASSERT_TRUE(skip % TestFixture::block == 0 || skip + 1 == l.ids.size());
        ASSERT_EQ(l.seq->length(), skip);
        if (skip != 0) ++hits;
        if (skip != 0 && skip + 1 == l.ids.size()) ++whole;
        live.push_back(std::move(l));
      } else if ((kind <= 5 || kind == 10) && !live.empty()) {  // feed tokens, the pass maybe stopped part-way
        Live& l = live[pick(0, live.size() - 1)];
        std::size_t from = 0;
        try {
          from = l.seq->length();
        } catch (const std::runtime_error&) {
          continue;  // part-way: the next truncate repairs it
        }
        if (from == l.ids.size()) {  // generate: the id given first, or (1 in 5) never
          l.ids.push_back(token());
          if (l.seq->token_ids().size() == from && pick(0, 4) != 0) {
            l.seq->add_token_ids(std::span(l.ids).subspan(from));
            ++generated;
          }
        }
        const std::size_t to = std::min(l.ids.size(), from + pick(1, 5));
        const std::size_t stop = pick(0, 4) == 0 ? 1 : TestFixture::layers;
        try {
          this->feed(*l.seq, l.ids, from, to, stop);
        } catch (const std::length_error&) {
          ++out_of_blocks;  // whatever went in before stays; the reference below reads lengths
        }
      } else if (kind == 6 && !live.empty() && live.size() < 4) {  // fork, continued another way
        Live& l = live[pick(0, live.size() - 1)];
        const std::size_t free = pool.free_blocks();
        Live f{std::make_unique<Seq>(l.seq->fork()), l.ids};
        ASSERT_EQ(pool.free_blocks(), free) << "a fork copies no block";
        ++forks;
        const std::size_t n = held(*l.seq);
        f.ids.resize(n);
        if (f.seq->token_ids().size() == n) {
          for (std::size_t extra = pick(0, 6); extra > 0; --extra) f.ids.push_back(token());
          f.seq->add_token_ids(std::span(f.ids).subspan(n));
        }
        live.push_back(std::move(f));
      } else if (kind == 7 && !live.empty()) {  // roll back, then continue the same way or another
        Live& l = live[pick(0, live.size() - 1)];
        const std::size_t n = pick(0, std::min(l.seq->length(0), l.seq->length(1)));
        const std::size_t known = l.seq->token_ids().size();
        if (window != 0) {  // it may have given back what a query at n reads: then nothing changes
          const std::size_t free = pool.free_blocks(), length0 = l.seq->length(0);
          try {
            l.seq->truncate(n);
          } catch (const std::out_of_range&) {
            ASSERT_EQ(pool.free_blocks(), free);
            ASSERT_EQ(l.seq->length(0), length0);
            ++refused_truncates;
            continue;
          }
        } else {
          l.seq->truncate(n);
        }
        ASSERT_EQ(l.seq->token_ids().size(), std::min(n, known));
        if (pick(0, 1) == 0) {
          for (std::size_t p = n; p < l.ids.size(); ++p) l.ids[p] = token();
        }
        if (known >= n) l.seq->add_token_ids(std::span(l.ids).subspan(std::min(n, l.ids.size())));
      } else if (kind == 8 && !live.empty()) {  // ids given after their tokens: refused
        Live& l = live[pick(0, live.size() - 1)];
        if (l.seq->token_ids().size() < held(*l.seq)) {
          const std::size_t keyed = pool.keyed_blocks();
          EXPECT_THROW(l.seq->add_token_ids(ids({1})), std::logic_error);
          ASSERT_EQ(pool.keyed_blocks(), keyed);
          ++refused;
        }
      } else if (kind >= 11 && live.size() > 1) {  // several sequences a token each, in one batch update
        std::vector<PagedKvCache<TypeParam>*> members;
        std::vector<Live*> fed;
        for (Live& l : live) {
          const std::size_t n = l.seq->length(0);
          if (l.seq->length(1) != n || pick(0, 3) == 0) continue;
          if (n == l.ids.size()) {  // its next token, with its id given first
            l.ids.push_back(token());
            if (l.seq->token_ids().size() == n) l.seq->add_token_ids(std::span(l.ids).subspan(n));
          }
          members.push_back(l.seq.get());
          fed.push_back(&l);
        }
        if (members.empty()) continue;
        PagedBatch<TypeParam> batch(members);
        for (std::size_t layer = 0; layer < TestFixture::layers; ++layer) {
          Block<typename TestFixture::In> k({members.size(), TestFixture::kv_heads, 1, TestFixture::head_dim}, 0);
          Block<typename TestFixture::In> v = k;
          std::vector<std::int64_t> positions;
          for (std::size_t i = 0; i < fed.size(); ++i) {
            const std::size_t p = fed[i]->seq->length(layer);
            const auto rows_k = this->rows_after(fed[i]->ids, p, 2 * layer);
            const auto rows_v = this->rows_after(fed[i]->ids, p, 2 * layer + 1);
            std::copy(rows_k.data.begin(), rows_k.data.end(),
                      k.data.begin() + static_cast<std::ptrdiff_t>(i * rows_k.data.size()));
            std::copy(rows_v.data.begin(), rows_v.data.end(),
                      v.data.begin() + static_cast<std::ptrdiff_t>(i * rows_v.data.size()));
            positions.push_back(static_cast<std::int64_t>(p));
          }
          History<TypeParam> history;
          try {
            history = batch.update(layer, k.view(), v.view(), Positions(positions.data(), 1, 1));
          } catch (const std::length_error&) {
            ++out_of_blocks;  // no sequence changed in this layer; earlier layers stay written
            for (std::size_t i = 0; i < fed.size(); ++i)
              ASSERT_EQ(fed[i]->seq->length(layer), static_cast<std::size_t>(positions[i]));
            break;
          }
          for (std::size_t i = 0; i < fed.size(); ++i) {
            this->expect_window(flatten_row(history, i), fed[i]->ids, fed[i]->seq->length(layer), layer, window, sinks);
          }
          ++batches;
        }
      } else if (kind == 9 && !live.empty()) {  // finish: the sequence goes, its tokens a prompt
        const std::size_t i = pick(0, live.size() - 1);
        const std::size_t n = std::min(l_length(*live[i].seq), live[i].ids.size());
        if (n != 0) served.emplace_back(live[i].ids.begin(), live[i].ids.begin() + static_cast<std::ptrdiff_t>(n));
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      }
      ASSERT_NO_THROW(pool.check_invariants());
      for (Live& l : live) {
        for (std::size_t layer = 0; layer < TestFixture::layers; ++layer) {
          SCOPED_TRACE("layer " + std::to_string(layer));
          this->expect_window(flatten(l.seq->history(layer)), l.ids, l.seq->length(layer), layer, window, sinks);
        }
        given_back += static_cast<std::size_t>(
            std::count(l.seq->block_table().begin(), l.seq->block_table().end(), PagedKvCache<TypeParam>::kReleased));
      }
    }
  }
  EXPECT_GT(batches, 50U);
  EXPECT_GT(given_back, 50U);
  EXPECT_GT(refused_truncates, 3U);
  EXPECT_GT(hits, 20U);
  EXPECT_GT(whole, 5U);
  EXPECT_GT(out_of_blocks, 10U);
  EXPECT_GT(forks, 10U);
  EXPECT_GT(generated, 20U);
  EXPECT_GT(refused, 3U);
}

// ---- a window: blocks wholly before it go back to the pool ---------------------------------------

// A windowed sequence decoded far past its window holds the sinks' block and its window's, the
// rest back in the pool; a fork taken early keeps the blocks it shares; a truncate into what the
// sequence gave back is refused naming it, changing nothing.
TEST(PagedWindows, BlocksBeforeTheWindowGoBackExceptThoseAnotherSequenceHolds) {
  constexpr std::size_t block = 4, window = 6, sinks = 2, slack = 1;
  BlockPool<float> pool({.layers = 1,
                         .kv_heads = 1,
                         .head_dim = 8,
                         .block_tokens = block,
                         .blocks = 16,
                         .window = window,
                         .sinks = sinks,
                         .slack = slack});
  EXPECT_EQ(pool.capacity(), std::numeric_limits<std::size_t>::max()) << "no bound on a windowed sequence's tokens";
  PagedKvCache<float> seq(pool);
  const auto step = [&](PagedKvCache<float>& s) {
    const Block<float> k({1, 1, 1, 8}, 100 + s.length());
    return s.update(0, k.view(), k.view(), arange(s.length(), 1));
  };
  for (int i = 0; i < 9; ++i) (void)step(seq);
  const PagedKvCache<float> early = seq.fork();  // holds blocks 0-2 with seq
  const std::vector<std::size_t> shared(early.block_table().begin(), early.block_table().end());
  for (int i = 0; i < 200; ++i) {
    const History<float> history = step(seq);
    ASSERT_NO_THROW(pool.check_invariants());
    // The sinks' block and at most the window's, its slack and the block being written.
    ASSERT_LE(seq.bytes(), (1 + (window + slack + block - 1) / block + 1) * pool.block_bytes()) << "step " << i;
    const auto held = flatten(history);
    for (std::size_t p = 0; p < seq.length(); ++p) {
      if (WindowRule{window, sinks}.reads(seq.length() - 1, p)) {
        ASSERT_TRUE(held.count(static_cast<std::int64_t>(p))) << "position " << p;
      }
    }
  }
  // The fork's blocks stayed with it; seq's other blocks went back: 16 less the fork's three,
  // less what seq holds past them.
  EXPECT_EQ(std::vector<std::size_t>(early.block_table().begin(), early.block_table().end()), shared);
  EXPECT_EQ(seq.block_table()[1], PagedKvCache<float>::kReleased);
  EXPECT_EQ(seq.block_table()[0], shared[0]) << "the sinks' block stays";
  EXPECT_EQ(pool.free_blocks(), 16 - 3 - (seq.bytes() / pool.block_bytes() - 1));

  const std::size_t free = pool.free_blocks(), length = seq.length();
  const std::vector<std::size_t> table(seq.block_table().begin(), seq.block_table().end());
  expect_throw_naming([&] { seq.truncate(length - 20); }, Throws::out_of_range,
                      {"PagedKvCache::truncate", "were given back", std::to_string(length - 20)});
  EXPECT_EQ(pool.free_blocks(), free);
  EXPECT_EQ(seq.length(), length);
  EXPECT_EQ(std::vector<std::size_t>(seq.block_table().begin(), seq.block_table().end()), table);
  seq.truncate(length - slack);  // within the slack
  seq.truncate(sinks);           // back to the sinks
  EXPECT_EQ(seq.length(), sinks);
  ASSERT_NO_THROW(pool.check_invariants());
}

}  // namespace
}  // namespace kvcache::testing
