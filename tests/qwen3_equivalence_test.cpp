// SPDX-License-Identifier: Apache-2.0
// The proof that a cache changes nothing but speed: for fixed token ids, the tiny Qwen3 model's
// logits with no cache and through every cache variant, fed in prefix / chunk / single-token
// steps, agree at every position. Plus rollback (truncate and re-feed), and checks that the
// comparison could fail: the window and earlier tokens do change the logits.

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kvcache/calibration.hpp"
#include "kvcache/concat_kv_cache.hpp"
#include "kvcache/kv_cache.hpp"
#include "kvcache/paged_batch.hpp"
#include "kvcache/quantized.hpp"
#include "kvcache/ring_kv_cache.hpp"
#include "kvcache/slot_kv_cache.hpp"
#include "pooled_sequence.hpp"
#include "qwen3/model.hpp"
#include "support/format_matrix.hpp"
#include "support/tolerances.hpp"
#include "support/variants.hpp"

namespace {

using qwen3::Matrix;
using qwen3::TokenId;

constexpr std::size_t sequence_length = 48;

qwen3::Model& tiny_model() {
  static qwen3::Model model(qwen3::random_weights(qwen3::Config{}));
  return model;
}

/// Fixed token ids from a seed: never generated ones, so every run feeds the same inputs.
std::vector<TokenId> fixed_tokens(std::size_t n, std::uint64_t seed) {
  qwen3::SplitMix64 rng(seed);
  std::vector<TokenId> tokens(n);
  for (TokenId& t : tokens) t = static_cast<TokenId>(rng.next() % 256);
  return tokens;
}

std::span<const TokenId> slice(const std::vector<TokenId>& tokens, std::size_t first, std::size_t count) {
  return std::span<const TokenId>(tokens).subspan(first, count);
}

double max_abs_diff(const Matrix& a, const Matrix& b) {
  EXPECT_EQ(a.rows(), b.rows());
  EXPECT_EQ(a.cols(), b.cols());
  if (a.rows() != b.rows() || a.cols() != b.cols()) return INFINITY;
  return static_cast<double>((a - b).cwiseAbs().maxCoeff());
}

// ---- the cases: a cache variant, its element type and its window (tolerances: support/) ------

/// "SlotKvCache<int8_rows>": the variant's name from the list of variants, and the format's.
template <class Cache>
std::string cache_name() {
  return std::string(kvcache::testing::variant_name<Cache>) + "<" + kvcache::format_name<typename Cache::value_type>() +
         ">";
}

template <template <class> class CacheT, class T>
struct Dense {
  using Cache = CacheT<T>;
  using value_type = T;
  static constexpr qwen3::Window window{};
  static constexpr std::size_t slack = 0;
  static constexpr bool refuses(std::size_t /*position*/, std::size_t /*tokens*/) { return false; }
  static Cache make(std::size_t capacity, qwen3::HeadScales scales = {}) {
    const qwen3::Config& c = tiny_model().config();
    return Cache({.layers = c.layers,
                  .kv_heads = c.kv_heads,
                  .head_dim = c.head_dim,
                  .capacity = capacity,
                  .key_scales = scales.keys,
                  .value_scales = scales.values});
  }
  static std::string name() { return cache_name<Cache>(); }
};

template <class T, std::size_t Window, std::size_t Sinks, std::size_t Slack>
struct Ring {
  using Cache = kvcache::RingKvCache<T>;
  using value_type = T;
  static constexpr qwen3::Window window{Window, Sinks};
  static constexpr std::size_t slack = Slack;
  static constexpr bool refuses(std::size_t /*position*/, std::size_t /*tokens*/) { return false; }
  static Cache make(std::size_t /*capacity: a ring needs none*/, qwen3::HeadScales scales = {}) {
    const qwen3::Config& c = tiny_model().config();
    return Cache({.layers = c.layers,
                  .kv_heads = c.kv_heads,
                  .head_dim = c.head_dim,
                  .window = Window,
                  .sinks = Sinks,
                  .slack = Slack,
                  .key_scales = scales.keys,
                  .value_scales = scales.values});
  }
  static std::string name() {
    return cache_name<Cache>() + " window " + std::to_string(Window) + " sinks " + std::to_string(Sinks) + " slack " +
           std::to_string(Slack);
  }
};

/// A slot cache (one slot, through the protocol's update) or a paged sequence (blocks of 4) with
/// a window. A slot refuses a chunk that wraps its ring by more than slack + 1 tokens.
template <template <class> class CacheT, class T, std::size_t Window, std::size_t Sinks, std::size_t Slack>
struct Windowed {
  using Cache = CacheT<T>;
  using value_type = T;
  static constexpr qwen3::Window window{Window, Sinks};
  static constexpr std::size_t slack = Slack;
  static constexpr bool refuses(std::size_t position, std::size_t tokens) {
    return std::is_same_v<Cache, kvcache::SlotKvCache<T>> && tokens > Slack + 1 &&
           position + tokens > Sinks + Window + Slack;
  }
  static Cache make(std::size_t capacity, qwen3::HeadScales scales = {}) {
    const qwen3::Config& c = tiny_model().config();
    return Cache({.layers = c.layers,
                  .kv_heads = c.kv_heads,
                  .head_dim = c.head_dim,
                  .capacity = capacity,
                  .window = Window,
                  .sinks = Sinks,
                  .slack = Slack,
                  .key_scales = scales.keys,
                  .value_scales = scales.values});
  }
  static std::string name() {
    return cache_name<Cache>() + " window " + std::to_string(Window) + " sinks " + std::to_string(Sinks) + " slack " +
           std::to_string(Slack);
  }
};

/// The case of a cache variant over a format: without a window (a slot cache has one slot,
/// through the protocol's update; a paged sequence blocks of 4 tokens), a ring with a window.
template <class Cache>
struct case_of;
template <template <class> class CacheT, class T>
struct case_of<CacheT<T>> {
  using type = Dense<CacheT, T>;
};
template <class T>
struct case_of<kvcache::RingKvCache<T>> {
  using type = Ring<T, 7, 2, 1>;
};
template <class Cache>
using case_of_t = typename case_of<Cache>::type;

struct CaseName {
  template <class Case>
  static std::string GetName(int /*index*/) {
    std::string n = Case::name();
    std::replace_if(
        n.begin(), n.end(), [](char c) { return !std::isalnum(static_cast<unsigned char>(c)); }, '_');
    return n;
  }
};

// Every format through every variant, then the windows: a window of 7 over 48 tokens is several
// windows long; chunks of 9 to 20 tokens are longer than it, so a chunk after the wrap needs keys
// the ring had to stage rather than overwrite.
using Cases = kvcache::testing::gtest_types<kvcache::testing::concat<
    kvcache::testing::cache_variants::over<kvcache::testing::formats>::transform<case_of_t>,
    kvcache::type_list<Ring<float, 7, 0, 0>, Ring<float, 7, 3, 2>, Ring<float, 1, 2, 0>, Ring<float, 64, 0, 0>,
                       Windowed<kvcache::SlotKvCache, float, 7, 2, 15>, Windowed<kvcache::SlotKvCache, float, 1, 0, 15>,
                       Windowed<kvcache::SlotKvCache, Eigen::bfloat16, 7, 2, 15>,
                       Windowed<kvcache::testing::PooledSequence, float, 7, 0, 0>,
                       Windowed<kvcache::testing::PooledSequence, float, 7, 3, 2>,
                       Windowed<kvcache::testing::PooledSequence, float, 1, 2, 0>,
                       Windowed<kvcache::testing::PooledSequence, kvcache::int8_rows, 7, 2, 1>>>>;

template <class Case>
class Equivalence : public ::testing::Test {};
TYPED_TEST_SUITE(Equivalence, Cases, CaseName);

/// Chunk sizes, then single tokens to the end of the sequence.
struct Schedule {
  const char* what;
  std::vector<std::size_t> chunks;
};

const std::vector<Schedule>& schedules() {
  static const std::vector<Schedule> all = {
      {"prefix 9, chunk 13, singles", {9, 13}},
      {"prefix 1, chunk 20, singles", {1, 20}},
      {"prefix 30, chunk 2, singles", {30, 2}},
      {"prefix 3, singles, chunk 11 after the wrap, chunk 16, singles", {3, 1, 1, 1, 11, 1, 16}},
      {"prefix 6, singles, chunk 8 after a slot's wrap, chunk 5, singles",
       {6, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 8, 1, 5}},
  };
  return all;
}

TYPED_TEST(Equivalence, CachedLogitsEqualUncachedAtEveryPosition) {
  using Case = TypeParam;
  using T = typename Case::value_type;
  qwen3::Model& model = tiny_model();
  const std::vector<TokenId> tokens = fixed_tokens(sequence_length, 7);
  // Same mask, no cache, K and V exact in float: the reference every variant must reproduce.
  const Matrix reference = model.forward_uncached(tokens, Case::window);
  // fp8_e4m3_heads' static scales: what a float run of the whole sequence calibrates, shared by
  // every cache here and the rounded reference (none for formats without).
  kvcache::CalibratedScales calibrated;
  if constexpr (kvcache::detail::has_head_scales<T>) {
    const qwen3::Config& c = model.config();
    kvcache::KvCache<float> probe(
        {.layers = c.layers, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .capacity = sequence_length});
    (void)model.forward(tokens, probe);
    calibrated = kvcache::calibrate_head_scales<T>(probe, 1.0F);
  }
  const qwen3::HeadScales scales{calibrated.keys, calibrated.values};
  // Same mask and the same rounding of K and V to T: isolates the cache from the element type.
  const Matrix rounded = model.forward_uncached<T>(tokens, Case::window, qwen3::Logits::all, scales);

  double worst = 0.0;
  double worst_rounded = 0.0;
  for (std::size_t which = 0; which < schedules().size(); ++which) {
    // The element types ride on the float cases' coverage of every schedule: two suffice for
    // them (one with chunks longer than the window after it wrapped), and keep sanitizer runs short.
    if (!std::is_same_v<T, float> && which % 3 != 0) continue;
    const Schedule& schedule = schedules()[which];
    auto cache = Case::make(sequence_length, scales);
    std::size_t position = 0;
    std::size_t step = 0;
    while (position < sequence_length) {
      const std::size_t count =
          std::min(step < schedule.chunks.size() ? schedule.chunks[step] : 1, sequence_length - position);
      if (Case::refuses(position, count)) {  // a chunk too long for a slot's ring: the schedule ends
        EXPECT_THROW((void)model.forward(slice(tokens, position, count), cache), std::length_error);
        EXPECT_EQ(cache.length(), position);
        break;
      }
      const Matrix logits = model.forward(slice(tokens, position, count), cache);
      ASSERT_EQ(cache.length(), position + count);
      const auto ref = reference.middleRows(static_cast<Eigen::Index>(position), static_cast<Eigen::Index>(count));
      const double err = max_abs_diff(logits, ref);
      EXPECT_LE(err, kvcache::testing::logit_tolerance<T>().vs_float)
          << Case::name() << ", " << schedule.what << ": positions " << position << ".." << position + count - 1;
      worst = std::max(worst, err);
      worst_rounded =
          std::max(worst_rounded, max_abs_diff(logits, rounded.middleRows(static_cast<Eigen::Index>(position),
                                                                          static_cast<Eigen::Index>(count))));
      position += count;
      ++step;
    }
  }
  EXPECT_LE(worst_rounded, kvcache::testing::logit_tolerance<T>().vs_rounded) << Case::name();
  std::printf("[ max |dlogit| ] %-48s vs uncached float %.3g, vs uncached %s-rounded %.3g\n", Case::name().c_str(),
              worst, kvcache::format_name<T>(), worst_rounded);
}

// ---- a batch of sequences in the rows of a slot cache --------------------------------------

/// One sequence of the mixed batch: its tokens, how many of them its prompt is, and the step
/// it is admitted at; `finish`, the step it is released at (never, if 0) however long it is.
struct Request {
  std::vector<TokenId> tokens;
  std::size_t prompt = 0;
  std::size_t admit = 0;
  std::size_t finish = 0;
  std::size_t row = 0;
  std::size_t fed = 0;
  Matrix logits;  // of every position fed, in order
};

TEST(SlotBatch, EveryRowOfAMixedBatchGetsTheLogitsItsSequenceGetsAlone) {
  qwen3::Model& model = tiny_model();
  const qwen3::Config& c = model.config();
  kvcache::SlotKvCache<float> cache(
      {.layers = c.layers, .batch = 8, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .capacity = 40});
  // Prompts of different lengths admitted at different steps (two of equal length together);
  // requests 2 and 5 finish early and requests 8 and 9 take their slots.
  const std::vector<std::size_t> prompts = {7, 7, 13, 1, 22, 4, 9, 30, 5, 16};
  const std::vector<std::size_t> admits = {0, 0, 0, 1, 2, 2, 4, 6, 9, 12};
  std::vector<Request> requests;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    Request r;
    r.tokens = fixed_tokens(prompts[i] + 8, 100 + i);
    r.prompt = prompts[i];
    r.admit = admits[i];
    requests.push_back(std::move(r));
  }
  requests[2].finish = 7;
  requests[5].finish = 8;

  std::vector<std::size_t> released;
  for (std::size_t step = 0; step < 24; ++step) {
    for (Request& r : requests) {
      if (r.finish == step && r.fed != 0) {
        cache.release(r.row);
        released.push_back(r.row);
        r.fed = r.tokens.size();  // done
      }
    }
    std::vector<qwen3::Model::RowTokens> batch;
    std::vector<Request*> in_batch;
    for (Request& r : requests) {
      if (step < r.admit || r.fed == r.tokens.size()) continue;
      if (step == r.admit) r.row = cache.acquire();
      const std::size_t count = r.fed == 0 ? r.prompt : 1;  // the whole prompt, then one token a step
      batch.push_back({r.row, slice(r.tokens, r.fed, count)});
      in_batch.push_back(&r);
    }
    if (batch.empty()) continue;
    const std::vector<Matrix> logits = model.forward(batch, cache);
    ASSERT_EQ(logits.size(), batch.size());
    for (std::size_t i = 0; i < batch.size(); ++i) {
      Request& r = *in_batch[i];
      ASSERT_EQ(logits[i].rows(), static_cast<Eigen::Index>(batch[i].tokens.size()));
      Matrix grown(r.logits.rows() + logits[i].rows(), logits[i].cols());
      grown << r.logits, logits[i];
      r.logits = std::move(grown);
      r.fed += batch[i].tokens.size();
      EXPECT_EQ(cache.row_length(r.row), r.fed);
    }
  }
  EXPECT_EQ(released, std::vector<std::size_t>({requests[8].row, requests[9].row}))
      << "requests 8 and 9 take the slots requests 2 and 5 left";

  for (std::size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    // The same sequence alone through a KvCache, prompt then single tokens.
    kvcache::KvCache<float> alone({.layers = c.layers, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .capacity = 40});
    Matrix expected = model.forward(slice(r.tokens, 0, r.prompt), alone);
    for (std::size_t p = r.prompt; p < static_cast<std::size_t>(r.logits.rows()); ++p) {
      Matrix grown(expected.rows() + 1, expected.cols());
      grown << expected, model.forward(slice(r.tokens, p, 1), alone);
      expected = std::move(grown);
    }
    ASSERT_GE(r.logits.rows(), static_cast<Eigen::Index>(r.prompt + 1)) << "request " << i;
    EXPECT_LE(max_abs_diff(r.logits, expected), 1e-5) << "request " << i;
  }
}

TEST(SlotBatch, AFailedBatchLeavesEveryRowWhereItWas) {
  qwen3::Model& model = tiny_model();
  const qwen3::Config& c = model.config();
  kvcache::SlotKvCache<float> cache(
      {.layers = c.layers, .batch = 3, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .capacity = 16});
  const std::vector<TokenId> tokens = fixed_tokens(16, 3);
  const std::size_t a = cache.acquire(), b = cache.acquire();
  const std::vector<qwen3::Model::RowTokens> prompts = {{a, slice(tokens, 0, 5)}, {b, slice(tokens, 0, 12)}};
  (void)model.forward(prompts, cache);
  // Row a's single token goes in first (the smaller group); row b's 5 tokens pass its capacity
  // in layer 0, so row a is rolled back through every layer it had reached.
  const std::vector<qwen3::Model::RowTokens> bad = {{b, slice(tokens, 0, 5)}, {a, slice(tokens, 5, 1)}};
  EXPECT_THROW((void)model.forward(bad, cache), std::length_error);
  EXPECT_EQ(cache.row_length(a), 5U);
  EXPECT_EQ(cache.row_length(b), 12U);
  const std::vector<qwen3::Model::RowTokens> twice = {{a, slice(tokens, 5, 1)}, {a, slice(tokens, 6, 1)}};
  EXPECT_THROW((void)model.forward(twice, cache), std::invalid_argument);
  EXPECT_EQ(cache.row_length(a), 5U);
  // And the rows go on to the logits they would have had.
  const std::vector<qwen3::Model::RowTokens> next = {{a, slice(tokens, 5, 1)}};
  EXPECT_LE(max_abs_diff(model.forward(next, cache)[0], model.forward_uncached(slice(tokens, 0, 6)).bottomRows(1)),
            1e-5);
}

// ---- sequences sharing blocks ---------------------------------------------------------------

TEST(PagedSequences, APrefixHitAndForksContinuedDifferentlyGiveTheLogitsOfRecomputing) {
  qwen3::Model& model = tiny_model();
  const qwen3::Config& c = model.config();
  kvcache::BlockPool<float> pool(
      {.layers = c.layers, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .block_tokens = 4, .blocks = 64});
  const std::vector<TokenId> a = fixed_tokens(23, 11);
  std::vector<TokenId> b = a;
  b[10] = static_cast<TokenId>((b[10] + 1) % 256);  // shares 10 tokens: two whole blocks
  const auto expect_uncached = [&](const Matrix& got, const std::vector<TokenId>& tokens, std::size_t from) {
    const Matrix all = model.forward_uncached(tokens);
    EXPECT_LE(max_abs_diff(got, all.bottomRows(all.rows() - static_cast<Eigen::Index>(from))), 1e-5);
  };
  kvcache::PagedKvCache<float> first(pool);
  EXPECT_EQ(first.reuse_prefix(a), 0U);
  expect_uncached(model.forward(a, first), a, 0);

  kvcache::PagedKvCache<float> second(pool);
  const std::size_t skip = second.reuse_prefix(b);
  EXPECT_EQ(skip, 8U);
  expect_uncached(model.forward(slice(b, skip, b.size() - skip), second), b, skip);
  pool.check_invariants();

  // A fork of the first, mid-block, continued with other tokens than the first's.
  kvcache::PagedKvCache<float> fork = first.fork();
  std::vector<TokenId> a_more = a, fork_more = a;
  for (TokenId t : fixed_tokens(6, 12)) a_more.push_back(t);
  for (TokenId t : fixed_tokens(6, 13)) fork_more.push_back(t);
  expect_uncached(model.forward(slice(fork_more, 23, 6), fork), fork_more, 23);
  expect_uncached(model.forward(slice(a_more, 23, 6), first), a_more, 23);
  pool.check_invariants();

  // A prompt found whole: its last token is fed for the logits that start generation.
  const std::vector<TokenId> whole(a.begin(), a.begin() + 20);
  kvcache::PagedKvCache<float> again(pool);
  EXPECT_EQ(again.reuse_prefix(whole), 19U);
  expect_uncached(model.forward(slice(whole, 19, 1), again), whole, 19);
  pool.check_invariants();
}

// ---- batches of paged sequences: one attention call per layer --------------------------------

/// Rows [from, end) of the uncached logits of `tokens`, with `window`.
Matrix uncached_from(const std::vector<TokenId>& tokens, std::size_t from, qwen3::Window window = {}) {
  const Matrix all = tiny_model().forward_uncached(tokens, window);
  return all.bottomRows(all.rows() - static_cast<Eigen::Index>(from));
}

/// Appends `more` to `rows`.
void append_rows(Matrix& rows, const Matrix& more) {
  Matrix grown(rows.rows() + more.rows(), more.cols());
  grown << rows, more;
  rows = std::move(grown);
}

// One prompt forked into four continuations decoded a token a step as one batch: each step is one
// update and one attention call per layer, which reads the prompt's blocks once for all four.
// With a window, each sequence gives back the prompt's blocks as its window passes them.
TEST(PagedBatch, ParallelSamplingGivesEachContinuationTheLogitsItGetsAlone) {
  qwen3::Model& model = tiny_model();
  const qwen3::Config& c = model.config();
  for (const qwen3::Window window : {qwen3::Window{}, qwen3::Window{.size = 24, .sinks = 4}}) {
    SCOPED_TRACE("window " + std::to_string(window.size));
    kvcache::BlockPool<float> pool({.layers = c.layers,
                                    .kv_heads = c.kv_heads,
                                    .head_dim = c.head_dim,
                                    .block_tokens = 16,
                                    .blocks = 64,
                                    .window = window.size,
                                    .sinks = window.sinks});
    const std::vector<TokenId> prompt = fixed_tokens(100, 21);  // 6 whole blocks and 4 tokens
    kvcache::PagedKvCache<float> first(pool);
    EXPECT_LE(max_abs_diff(model.forward(prompt, first), uncached_from(prompt, 0, window)), 1e-5);
    kvcache::PagedKvCache<float> second = first.fork(), third = first.fork(), fourth = first.fork();
    kvcache::PagedBatch<float> batch({&first, &second, &third, &fourth});
    EXPECT_EQ(batch.bytes(), first.bytes()) << "four sequences, one prompt's blocks";

    constexpr std::size_t steps = 40;
    std::vector<std::vector<TokenId>> full(4, prompt);
    std::vector<Matrix> logits(4, Matrix(0, static_cast<Eigen::Index>(c.vocab)));
    for (std::size_t i = 0; i < 4; ++i) {
      for (const TokenId t : fixed_tokens(steps, 30 + i)) full[i].push_back(t);
    }
    for (std::size_t step = 0; step < steps; ++step) {
      std::vector<qwen3::Model::RowTokens> rows;
      for (std::size_t i = 0; i < 4; ++i) rows.push_back({i, slice(full[i], prompt.size() + step, 1)});
      const std::vector<Matrix> out = model.forward(rows, batch);
      for (std::size_t i = 0; i < 4; ++i) append_rows(logits[i], out[i]);
      ASSERT_NO_THROW(pool.check_invariants());
    }
    for (std::size_t i = 0; i < 4; ++i) {
      EXPECT_LE(max_abs_diff(logits[i], uncached_from(full[i], prompt.size(), window)), 1e-5) << "sequence " << i;
    }
    if (window.size != 0) {
      // Each holds the sinks' block and its window's (three): the prompt's other blocks went back.
      EXPECT_LE(first.bytes(), 4 * pool.block_bytes());
    } else {
      EXPECT_LT(batch.bytes(), first.bytes() + second.bytes() + third.bytes() + fourth.bytes());
    }
  }
}

// A system prompt whose blocks eight questions reuse: the questions' prompts (of different
// lengths) go in as one forward pass, a call per group of equal length, then every step's tokens
// as one call per layer over all eight.
TEST(PagedBatch, ASharedSystemPromptGivesEachQuestionTheLogitsItGetsAlone) {
  qwen3::Model& model = tiny_model();
  const qwen3::Config& c = model.config();
  kvcache::BlockPool<float> pool(
      {.layers = c.layers, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .block_tokens = 16, .blocks = 96});
  const std::vector<TokenId> system = fixed_tokens(96, 41);
  kvcache::PagedKvCache<float> warm(pool);
  EXPECT_EQ(warm.reuse_prefix(system), 0U);
  (void)model.forward(system, warm);

  std::vector<std::unique_ptr<kvcache::PagedKvCache<float>>> seqs;
  std::vector<std::vector<TokenId>> full;
  std::vector<qwen3::Model::RowTokens> questions;
  for (std::size_t i = 0; i < 8; ++i) {
    std::vector<TokenId> prompt = system;
    for (const TokenId t : fixed_tokens(3 + 2 * (i % 4), 50 + i)) prompt.push_back(t);
    seqs.push_back(std::make_unique<kvcache::PagedKvCache<float>>(pool));
    EXPECT_EQ(seqs.back()->reuse_prefix(prompt), system.size());
    for (std::size_t j = 0; j < 6; ++j) EXPECT_EQ(seqs.back()->block_table()[j], warm.block_table()[j]);
    full.push_back(prompt);
  }
  std::vector<kvcache::PagedKvCache<float>*> members;
  for (const auto& s : seqs) members.push_back(s.get());
  kvcache::PagedBatch<float> batch(members);
  for (std::size_t i = 0; i < 8; ++i) questions.push_back({i, slice(full[i], system.size(), full[i].size() - 96)});
  std::vector<Matrix> logits = model.forward(questions, batch);
  const std::vector<std::size_t> prompt_lengths = [&] {
    std::vector<std::size_t> n;
    for (const auto& f : full) n.push_back(f.size());
    return n;
  }();
  for (std::size_t i = 0; i < 8; ++i) {
    for (const TokenId t : fixed_tokens(6, 70 + i)) full[i].push_back(t);
  }
  for (std::size_t step = 0; step < 6; ++step) {
    std::vector<qwen3::Model::RowTokens> rows;
    for (std::size_t i = 0; i < 8; ++i) rows.push_back({i, slice(full[i], prompt_lengths[i] + step, 1)});
    const std::vector<Matrix> out = model.forward(rows, batch);
    for (std::size_t i = 0; i < 8; ++i) append_rows(logits[i], out[i]);
  }
  ASSERT_NO_THROW(pool.check_invariants());
  for (std::size_t i = 0; i < 8; ++i) {
    EXPECT_LE(max_abs_diff(logits[i], uncached_from(full[i], system.size())), 1e-5) << "question " << i;
  }
  EXPECT_LT(batch.bytes(), 3 * warm.bytes()) << "the system prompt's blocks once for eight";
}

// ---- the comparison can fail ---------------------------------------------------------------

TEST(EquivalenceIsMeaningful, LogitsAreSpreadAndWindowChangesThem) {
  qwen3::Model& model = tiny_model();
  const std::vector<TokenId> tokens = fixed_tokens(sequence_length, 7);
  const Matrix full = model.forward_uncached(tokens);
  const Matrix windowed = model.forward_uncached(tokens, {.size = 7});
  // Logits spread over units, so a 1e-5 bound is ~1e-6 relative: a real bound, not slack.
  const Eigen::ArrayXf row = full.row(20).transpose().array();
  EXPECT_GT(std::sqrt((row - row.mean()).square().mean()), 0.3F);
  // A query before the window's edge sees the same keys either way; after it, fewer.
  EXPECT_LE(max_abs_diff(full.topRows(7), windowed.topRows(7)), 1e-5);
  for (Eigen::Index p = 8; p < full.rows(); ++p) {
    EXPECT_GT(max_abs_diff(full.row(p), windowed.row(p)), 1e-2) << "position " << p;
  }
  const Matrix with_sinks = model.forward_uncached(tokens, {.size = 7, .sinks = 2});
  for (Eigen::Index p = 8; p < full.rows(); ++p) {
    EXPECT_GT(max_abs_diff(with_sinks.row(p), windowed.row(p)), 1e-3) << "position " << p;
  }
}

TEST(EquivalenceIsMeaningful, EarlierTokensReachLaterPositionsOnlyThroughTheWindow) {
  qwen3::Model& model = tiny_model();
  std::vector<TokenId> tokens = fixed_tokens(sequence_length, 7);
  std::vector<TokenId> changed = tokens;
  changed[0] = static_cast<TokenId>((changed[0] + 1) % 256);
  // Full attention: token 0 reaches every position.
  const Matrix a = model.forward_uncached(tokens);
  const Matrix b = model.forward_uncached(changed);
  for (Eigen::Index p = 0; p < a.rows(); ++p) EXPECT_GT(max_abs_diff(a.row(p), b.row(p)), 1e-4) << "position " << p;
  // Window w: each layer carries information w - 1 positions further, so with L layers
  // position p depends on no token before p - L (w - 1).
  const std::size_t w = 4;
  const auto reach = static_cast<Eigen::Index>(tiny_model().config().layers * (w - 1));
  const Matrix wa = model.forward_uncached(tokens, {.size = w});
  const Matrix wb = model.forward_uncached(changed, {.size = w});
  for (Eigen::Index p = 0; p < a.rows(); ++p) {
    if (p <= reach) {
      EXPECT_GT(max_abs_diff(wa.row(p), wb.row(p)), 1e-4) << "position " << p;
    } else {
      EXPECT_LE(max_abs_diff(wa.row(p), wb.row(p)), 1e-5) << "position " << p;
    }
  }
}

// ---- an independent, loop-by-loop reference of the forward pass ----------------------------

/// The model written out as plainly as possible, in double: embedding, per layer RMSNorm, q/k/v
/// projections, per-head RMSNorm on q and k, rotate-half rotary embedding, grouped-query causal
/// attention, o projection, residual, RMSNorm, SwiGLU MLP, residual; final norm; tied logits.
Matrix naive_forward(const qwen3::Weights& w, const std::vector<TokenId>& tokens) {
  const qwen3::Config& c = w.config;
  const std::size_t n = tokens.size();
  const std::size_t dim = c.head_dim;
  using Rows = std::vector<std::vector<double>>;
  const auto linear = [](const Rows& x, const Matrix& m) {  // x [n, in], m [out, in]
    Rows y(x.size(), std::vector<double>(static_cast<std::size_t>(m.rows())));
    for (std::size_t t = 0; t < x.size(); ++t) {
      for (Eigen::Index o = 0; o < m.rows(); ++o) {
        double s = 0;
        for (Eigen::Index i = 0; i < m.cols(); ++i) s += x[t][static_cast<std::size_t>(i)] * m(o, i);
        y[t][static_cast<std::size_t>(o)] = s;
      }
    }
    return y;
  };
  const auto rms = [&](std::vector<double> v, std::size_t from, std::size_t count, const qwen3::Vector& weight) {
    double ss = 0;
    for (std::size_t i = 0; i < count; ++i) ss += v[from + i] * v[from + i];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(count) + static_cast<double>(c.rms_eps));
    for (std::size_t i = 0; i < count; ++i) v[from + i] *= inv * weight[static_cast<Eigen::Index>(i)];
    return v;
  };
  const auto rotate = [&](std::vector<double>& v, std::size_t from, std::size_t position) {
    std::vector<double> out(dim);
    for (std::size_t i = 0; i < dim; ++i) {
      const std::size_t k = i % (dim / 2);
      const double angle = static_cast<double>(position) *
                           std::pow(c.rope_theta, -2.0 * static_cast<double>(k) / static_cast<double>(dim));
      const double rotated = i < dim / 2 ? -v[from + i + dim / 2] : v[from + i - dim / 2];  // rotate_half
      out[i] = v[from + i] * std::cos(angle) + rotated * std::sin(angle);
    }
    std::copy(out.begin(), out.end(), v.begin() + static_cast<std::ptrdiff_t>(from));
  };
  Rows x(n, std::vector<double>(c.hidden));
  for (std::size_t t = 0; t < n; ++t) {
    for (std::size_t i = 0; i < c.hidden; ++i) x[t][i] = w.embed(tokens[t], static_cast<Eigen::Index>(i));
  }
  for (const qwen3::LayerWeights& lw : w.layers) {
    Rows h(n);
    for (std::size_t t = 0; t < n; ++t) h[t] = rms(x[t], 0, c.hidden, lw.input_norm);
    Rows q = linear(h, lw.q_proj);
    Rows k = linear(h, lw.k_proj);
    const Rows v = linear(h, lw.v_proj);
    for (std::size_t t = 0; t < n; ++t) {
      for (std::size_t head = 0; head < c.q_heads; ++head) {
        q[t] = rms(q[t], head * dim, dim, lw.q_norm);
        rotate(q[t], head * dim, t);
      }
      for (std::size_t head = 0; head < c.kv_heads; ++head) {
        k[t] = rms(k[t], head * dim, dim, lw.k_norm);
        rotate(k[t], head * dim, t);
      }
    }
    Rows attn(n, std::vector<double>(c.q_width()));
    for (std::size_t head = 0; head < c.q_heads; ++head) {
      const std::size_t kv = head / (c.q_heads / c.kv_heads);
      for (std::size_t t = 0; t < n; ++t) {
        std::vector<double> scores(t + 1);
        for (std::size_t j = 0; j <= t; ++j) {
          double s = 0;
          for (std::size_t d = 0; d < dim; ++d) s += q[t][head * dim + d] * k[j][kv * dim + d];
          scores[j] = s / std::sqrt(static_cast<double>(dim));
        }
        const double top = *std::max_element(scores.begin(), scores.end());
        double sum = 0;
        for (double& s : scores) sum += (s = std::exp(s - top));
        for (std::size_t j = 0; j <= t; ++j) {
          for (std::size_t d = 0; d < dim; ++d) attn[t][head * dim + d] += scores[j] / sum * v[j][kv * dim + d];
        }
      }
    }
    const Rows o = linear(attn, lw.o_proj);
    for (std::size_t t = 0; t < n; ++t) {
      for (std::size_t i = 0; i < c.hidden; ++i) x[t][i] += o[t][i];
    }
    for (std::size_t t = 0; t < n; ++t) h[t] = rms(x[t], 0, c.hidden, lw.post_norm);
    Rows gate = linear(h, lw.gate_proj);
    const Rows up = linear(h, lw.up_proj);
    for (std::size_t t = 0; t < n; ++t) {
      for (std::size_t i = 0; i < c.mlp; ++i) gate[t][i] = gate[t][i] / (1.0 + std::exp(-gate[t][i])) * up[t][i];
    }
    const Rows down = linear(gate, lw.down_proj);
    for (std::size_t t = 0; t < n; ++t) {
      for (std::size_t i = 0; i < c.hidden; ++i) x[t][i] += down[t][i];
    }
  }
  Rows h(n);
  for (std::size_t t = 0; t < n; ++t) h[t] = rms(x[t], 0, c.hidden, w.final_norm);
  const Rows logits = linear(h, c.tied ? w.embed : w.lm_head);
  Matrix out(static_cast<Eigen::Index>(n), static_cast<Eigen::Index>(c.vocab));
  for (std::size_t t = 0; t < n; ++t) {
    for (std::size_t i = 0; i < c.vocab; ++i) {
      out(static_cast<Eigen::Index>(t), static_cast<Eigen::Index>(i)) = static_cast<float>(logits[t][i]);
    }
  }
  return out;
}

TEST(Reference, ModelMatchesANaiveDoublePrecisionForwardPass) {
  const std::vector<TokenId> tokens = fixed_tokens(12, 3);
  EXPECT_LE(max_abs_diff(tiny_model().forward_uncached(tokens), naive_forward(tiny_model().weights(), tokens)), 1e-4);
  // An untied model reads lm_head, not the embedding.
  qwen3::Config untied;
  untied.tied = false;
  untied.layers = 2;
  qwen3::Model model(qwen3::random_weights(untied, 11));
  EXPECT_LE(max_abs_diff(model.forward_uncached(tokens), naive_forward(model.weights(), tokens)), 1e-4);
}

TEST(Reference, LastOnlyLogitsAreTheLastRow) {
  const std::vector<TokenId> tokens = fixed_tokens(10, 5);
  const Matrix all = tiny_model().forward_uncached(tokens);
  const Matrix last = tiny_model().forward_uncached(tokens, {}, qwen3::Logits::last);
  ASSERT_EQ(last.rows(), 1);
  // Within float rounding, not bit for bit: attention may tile one query differently from many.
  EXPECT_LE(max_abs_diff(last, all.bottomRows(1)), 1e-5);
}

// ---- rollback: truncate back k tokens and re-feed -------------------------------------------

using RollbackCases = ::testing::Types<Dense<kvcache::KvCache, float>, Dense<kvcache::ConcatKvCache, float>,
                                       Ring<float, 7, 0, 3>, Ring<float, 7, 2, 3>>;

template <class Case>
class Rollback : public ::testing::Test {};
TYPED_TEST_SUITE(Rollback, RollbackCases, CaseName);

TYPED_TEST(Rollback, TruncateAndRefeedGivesTheLogitsOfNeverHavingGoneForward) {
  using Case = TypeParam;
  qwen3::Model& model = tiny_model();
  const std::vector<TokenId> tokens = fixed_tokens(sequence_length, 9);
  const Matrix reference = model.forward_uncached(tokens, Case::window);
  // Drafts of up to slack + 1 tokens can be taken back from a ring: its slack keeps the window
  // before the rollback point. Dense caches keep everything, so they take back any count.
  const std::size_t k = Case::slack + 1 + (Case::window.size == 0 ? 3 : 0);
  for (const bool drafts_as_one_chunk : {false, true}) {
    auto cache = Case::make(sequence_length + k);
    auto straight = Case::make(sequence_length + k);
    (void)model.forward(slice(tokens, 0, 5), cache);
    (void)model.forward(slice(tokens, 0, 5), straight);
    for (std::size_t position = 5; position < sequence_length; ++position) {
      // Every 6th step (well after the ring wrapped), speculate k wrong tokens, then reject them.
      if (position % 6 == 0) {
        const std::vector<TokenId> drafts = fixed_tokens(k, position);
        if (drafts_as_one_chunk) {
          (void)model.forward(drafts, cache);
        } else {
          for (std::size_t i = 0; i < k; ++i) (void)model.forward(slice(drafts, i, 1), cache);
        }
        ASSERT_EQ(cache.length(), position + k);
        cache.truncate(position);
        ASSERT_EQ(cache.length(), position);
      }
      const Matrix got = model.forward(slice(tokens, position, 1), cache);
      const Matrix never = model.forward(slice(tokens, position, 1), straight);
      // A rolled-back ring may hold the same keys in other slots, so attention may sum them in
      // another order: equal within float rounding, not bit for bit.
      EXPECT_LE(max_abs_diff(got, never), 1e-5) << Case::name() << ", position " << position;
      EXPECT_LE(max_abs_diff(got, reference.row(static_cast<Eigen::Index>(position))), 1e-5)
          << Case::name() << ", position " << position;
    }
  }
}

TEST(Rollback, RingRefusesToTruncatePastItsSlackAndStaysUsable) {
  using Case = Ring<float, 7, 0, 2>;
  qwen3::Model& model = tiny_model();
  const std::vector<TokenId> tokens = fixed_tokens(30, 4);
  const Matrix reference = model.forward_uncached(tokens, Case::window);
  auto cache = Case::make(0);
  for (std::size_t p = 0; p < 25; ++p) (void)model.forward(slice(tokens, p, 1), cache);
  EXPECT_THROW(cache.truncate(25 - (Case::slack + 2)), std::out_of_range);
  EXPECT_EQ(cache.length(), 25U);
  cache.truncate(25 - (Case::slack + 1));
  for (std::size_t p = 25 - (Case::slack + 1); p < 30; ++p) {
    EXPECT_LE(max_abs_diff(model.forward(slice(tokens, p, 1), cache), reference.row(static_cast<Eigen::Index>(p))),
              1e-5);
  }
}

// ---- failed calls leave the cache as it was -------------------------------------------------

TEST(ForwardErrors, BadTokenOrFullCacheLeavesTheCacheUnchanged) {
  qwen3::Model& model = tiny_model();
  const std::vector<TokenId> tokens = fixed_tokens(10, 2);
  auto cache = Dense<kvcache::KvCache, float>::make(8);
  (void)model.forward(slice(tokens, 0, 6), cache);
  const std::vector<TokenId> bad = {1, 2, 256};
  EXPECT_THROW((void)model.forward(bad, cache), std::out_of_range);
  EXPECT_EQ(cache.length(), 6U);
  EXPECT_THROW((void)model.forward(slice(tokens, 6, 3), cache), std::length_error);
  EXPECT_EQ(cache.length(), 6U);
  const Matrix reference = model.forward_uncached(slice(tokens, 0, 8));
  EXPECT_LE(max_abs_diff(model.forward(slice(tokens, 6, 2), cache), reference.bottomRows(2)), 1e-5);
}

}  // namespace
