// SPDX-License-Identifier: Apache-2.0
// causal_attention against a naive reference (explicit mask, full softmax in double), over
// histories from every cache variant and every element type, plus the cases that matter by
// themselves: the prefix-plus-chunk rectangle, fully masked rows, threads, bad input.

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "cache_test_support.hpp"
#include "kvcache/kvcache.hpp"

namespace kvcache {
namespace {

// ---------------------------------------------------------------------------------------------
// Reference: every key of a sequence at positions 0..N-1, a mask written out per (query, key),
// a full softmax in double.

/// A window rule as the contract states it: 0 imposes nothing; sinks (positions 0 .. sinks - 1)
/// stay visible.
struct WindowRule {
  std::size_t window = 0;
  std::size_t sinks = 0;
  [[nodiscard]] bool allows(std::int64_t query, std::int64_t key) const {
    const bool sink = key >= 0 && key < static_cast<std::int64_t>(sinks);
    return window == 0 || sink || query - static_cast<std::int64_t>(window) < key;
  }
};

/// [B, H, T, D] values held in double, for the reference and for comparing.
struct Dense {
  Shape shape;
  std::vector<double> data;
  explicit Dense(const Shape& s) : shape(s), data(s.size(), 0.0) {}
  double& at(std::size_t b, std::size_t h, std::size_t t, std::size_t d) {
    return data[((b * shape.heads + h) * shape.tokens + t) * shape.head_dim + d];
  }
  [[nodiscard]] double at(std::size_t b, std::size_t h, std::size_t t, std::size_t d) const {
    return data[((b * shape.heads + h) * shape.tokens + t) * shape.head_dim + d];
  }
};

/// out[b, h, t] for queries at q_positions over keys at positions 0..N-1 ([B, H_kv, N, D]).
Dense reference_attention(const Dense& q, const std::vector<std::int64_t>& q_positions, const Dense& k, const Dense& v,
                          double scale, const std::vector<WindowRule>& rules) {
  Dense out(q.shape);
  const std::size_t group = q.shape.heads / k.shape.heads;
  const std::size_t keys = k.shape.tokens;
  const std::size_t dim = q.shape.head_dim;
  std::vector<double> scores(keys);
  std::vector<char> mask(keys);
  for (std::size_t b = 0; b < q.shape.batch; ++b) {
    for (std::size_t h = 0; h < q.shape.heads; ++h) {
      for (std::size_t t = 0; t < q.shape.tokens; ++t) {
        const std::int64_t p = q_positions[t];
        double max = -std::numeric_limits<double>::infinity();
        for (std::size_t j = 0; j < keys; ++j) {
          const auto key = static_cast<std::int64_t>(j);
          mask[j] = key <= p &&
                    std::all_of(rules.begin(), rules.end(), [&](const WindowRule& r) { return r.allows(p, key); });
          if (!mask[j]) continue;
          double s = 0;
          for (std::size_t d = 0; d < dim; ++d) s += q.at(b, h, t, d) * k.at(b, h / group, j, d);
          scores[j] = s * scale;
          max = std::max(max, scores[j]);
        }
        double sum = 0;
        for (std::size_t j = 0; j < keys; ++j) {
          if (!mask[j]) continue;
          scores[j] = std::exp(scores[j] - max);
          sum += scores[j];
        }
        for (std::size_t j = 0; j < keys; ++j) {
          if (!mask[j]) continue;
          for (std::size_t d = 0; d < dim; ++d) out.at(b, h, t, d) += scores[j] / sum * v.at(b, h / group, j, d);
        }
      }
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Seeded data in the element type under test, and its exact value in double.

template <class T>
double to_double(T x) {
  if constexpr (std::is_same_v<T, double>) {
    return x;
  } else {
    return static_cast<double>(static_cast<float>(x));
  }
}

using testing::arange;
using testing::Block;

/// A block's values as stored (already rounded to T), in double.
template <class T>
Dense exact(const Block<T>& block) {
  Dense d(block.shape);
  for (std::size_t i = 0; i < block.data.size(); ++i) d.data[i] = to_double(block.data[i]);
  return d;
}

/// Largest |a - b| over a view and its reference.
template <class Q>
double max_error(TensorView<const Q> got, const Dense& want) {
  double worst = 0;
  for (std::size_t b = 0; b < got.batch(); ++b)
    for (std::size_t h = 0; h < got.heads(); ++h)
      for (std::size_t t = 0; t < got.tokens(); ++t)
        for (std::size_t d = 0; d < got.head_dim(); ++d) {
          const double g = to_double(got(b, h, t, d));
          if (!std::isfinite(g)) return std::numeric_limits<double>::infinity();
          worst = std::max(worst, std::abs(g - want.at(b, h, t, d)));
        }
  return worst;
}

// ---------------------------------------------------------------------------------------------
// The sampled grid. Each case is one sequence of N tokens whose last T are the chunk being
// attended; the prefix goes in through several updates so rings wrap and stage.

struct Case {
  std::size_t batch;
  std::size_t kv_heads;
  std::size_t group;  // H_q / H_kv
  std::size_t head_dim;
  std::size_t chunk;   // T
  std::size_t tokens;  // N, the whole sequence including the chunk
  WindowRule option;   // AttentionOptions window/sinks, applied for every cache
  WindowRule ring;     // the RingKvCache's own window/sinks (window 0: N, which never wraps)
  std::size_t slack;   // the ring's slack: keys older than its window it keeps for truncate()
  float scale;         // 0: 1/sqrt(D)
};

// T in {1, 2, 7, 64}, N up to 4500, H_q/H_kv in {1, 2, 4, 8}, D in {32, 64, 128, 256}, with and
// without windows and sinks, on either side. A ring returns a chunk's first window, which its
// later queries must not read; a chunk longer than slack + 1 is staged as a segment of its own.
const std::vector<Case> kCases = {
    {1, 1, 1, 32, 1, 1, {}, {}, 0, 0.0F},
    {2, 2, 2, 64, 2, 37, {}, {16, 0}, 3, 0.0F},
    {1, 2, 4, 128, 7, 300, {}, {50, 3}, 2, 0.0F},
    {2, 1, 8, 32, 64, 200, {16, 0}, {40, 2}, 8, 0.0F},
    {1, 2, 1, 64, 64, 2048, {}, {}, 0, 0.0F},
    {1, 1, 4, 128, 1, 2048, {300, 4}, {512, 0}, 16, 0.0F},
    {1, 4, 2, 32, 7, 513, {}, {64, 4}, 0, 2.0F},
    {1, 1, 8, 128, 2, 1000, {0, 5}, {128, 1}, 4, 0.0F},
    {2, 2, 2, 64, 1, 129, {64, 2}, {100, 0}, 0, 0.0F},
    {1, 1, 2, 128, 64, 700, {100, 4}, {256, 4}, 70, 0.5F},
    {1, 2, 4, 32, 1, 4500, {}, {}, 0, 8.0F},       // peaked softmax over tiles: the running max
    {1, 1, 4, 256, 2, 300, {}, {64, 2}, 4, 0.0F},  // the largest head size read with a compile-time row
    // One query row per kv head: keys read one whole row after another, a partial last register.
    {1, 2, 1, 128, 1, 777, {}, {100, 2}, 5, 0.0F},
    {1, 1, 1, 64, 3, 261, {50, 1}, {}, 0, 0.0F},
    // Two query rows at D = 128 (one query of two heads a kv head, or two queries of one): under
    // AVX2 the pass over V from memory keeps both rows' sums in L1.
    {1, 2, 2, 128, 1, 1500, {}, {300, 2}, 3, 0.0F},
    {1, 1, 1, 128, 2, 600, {100, 0}, {}, 0, 0.0F},
    // Head dims that are not a whole number of vector registers at any width: the tails.
    {1, 2, 2, 40, 3, 150, {}, {}, 0, 0.0F},
    {1, 1, 4, 7, 1, 90, {}, {20, 2}, 3, 0.0F},
};

template <class T>
struct Tolerance;
// Float accumulation over up to 4500 keys of values in [-1, 1]; the reference reads the same
// rounded inputs, so the 16-bit types differ only by accumulation error.
template <>
struct Tolerance<float> {
  static constexpr double value = 2e-5;
};
template <>
struct Tolerance<double> {
  static constexpr double value = 1e-12;
};
template <>
struct Tolerance<Eigen::half> {
  static constexpr double value = 2e-5;
};
template <>
struct Tolerance<Eigen::bfloat16> {
  static constexpr double value = 2e-5;
};

/// The q/out type a test uses for storage type T: 16-bit caches are attended in float.
template <class T>
using QueryType = std::conditional_t<std::is_same_v<T, double>, double, float>;

enum class Variant { kDense, kConcat, kRing };

const char* name(Variant v) {
  return v == Variant::kDense ? "KvCache" : v == Variant::kConcat ? "ConcatKvCache" : "RingKvCache";
}

std::string describe(const Case& c, Variant variant) {
  std::ostringstream s;
  s << name(variant) << " B=" << c.batch << " H_kv=" << c.kv_heads << " G=" << c.group << " D=" << c.head_dim
    << " T=" << c.chunk << " N=" << c.tokens << " window=" << c.option.window << "/" << c.ring.window
    << " sinks=" << c.option.sinks << "/" << c.ring.sinks;
  return s.str();
}

/// The chunk's attention output when the sequence goes through a cache of `variant`: q and out
/// of type Q, the queries the same values whatever Q (those of T).
template <class T, class Q>
std::vector<Q> attend_case(const Case& c, Variant variant, std::uint64_t seed) {
  const std::size_t q_heads = c.kv_heads * c.group;
  const Block<T> k({c.batch, c.kv_heads, c.tokens, c.head_dim}, seed);
  const Block<T> v({c.batch, c.kv_heads, c.tokens, c.head_dim}, seed + 1);
  Block<T> q_stored({c.batch, q_heads, c.chunk, c.head_dim}, seed + 2);
  std::vector<Q> q_data(q_stored.data.size());
  for (std::size_t i = 0; i < q_data.size(); ++i) q_data[i] = static_cast<Q>(to_double(q_stored.data[i]));
  const TensorView<const Q> q(q_data.data(), q_stored.shape);

  const std::size_t ring_window = c.ring.window == 0 ? c.tokens : c.ring.window;
  const KvCacheConfig config{.layers = 1,
                             .batch = c.batch,
                             .kv_heads = c.kv_heads,
                             .head_dim = c.head_dim,
                             .capacity = c.tokens,
                             .window = variant == Variant::kRing ? ring_window : 0,
                             .sinks = variant == Variant::kRing ? c.ring.sinks : 0,
                             .slack = variant == Variant::kRing ? c.slack : 0};
  const std::vector<std::int64_t> q_positions = arange(c.tokens - c.chunk, c.chunk);
  std::vector<Q> out_data(q_data.size(), std::numeric_limits<Q>::quiet_NaN());
  const TensorView<Q> out(out_data.data(), q.shape());
  const AttentionOptions options{.scale = c.scale, .window = c.option.window, .sinks = c.option.sinks};
  const auto attend = [&](auto& cache) {
    // The prefix in uneven pieces: a third, single tokens, then the rest.
    const std::size_t prefix = c.tokens - c.chunk;
    std::size_t done = 0;
    for (std::size_t piece : {prefix / 3, std::size_t{1}, std::size_t{1}, prefix}) {
      piece = std::min(piece, prefix - done);
      if (piece == 0) continue;
      (void)cache.update(0, k.view().tokens(done, piece), v.view().tokens(done, piece), arange(done, piece));
      done += piece;
    }
    const auto history = cache.update(0, k.view().tokens(prefix, c.chunk), v.view().tokens(prefix, c.chunk),
                                      std::span<const std::int64_t>(q_positions));
    causal_attention(q, q_positions, history, out, options);
  };
  if (variant == Variant::kDense) {
    KvCache<T> cache(config);
    attend(cache);
  } else if (variant == Variant::kConcat) {
    ConcatKvCache<T> cache(config);
    attend(cache);
  } else {
    RingKvCache<T> cache(config);
    attend(cache);
  }
  return out_data;
}

/// The reference output for a case (what attend_case's caches must give).
template <class T>
Dense reference_case(const Case& c, Variant variant, std::uint64_t seed) {
  const Block<T> k({c.batch, c.kv_heads, c.tokens, c.head_dim}, seed);
  const Block<T> v({c.batch, c.kv_heads, c.tokens, c.head_dim}, seed + 1);
  const Block<T> q({c.batch, c.kv_heads * c.group, c.chunk, c.head_dim}, seed + 2);
  const std::size_t ring_window = c.ring.window == 0 ? c.tokens : c.ring.window;
  std::vector<WindowRule> rules{c.option};
  if (variant == Variant::kRing) rules.push_back({ring_window, c.ring.sinks});
  const double scale = c.scale != 0.0F ? static_cast<double>(c.scale) : 1.0 / std::sqrt(double(c.head_dim));
  return reference_attention(exact(q), arange(c.tokens - c.chunk, c.chunk), exact(k), exact(v), scale, rules);
}

/// Checks a case's output (q and out in QueryType<T>) against the reference.
template <class T>
void run_case(const Case& c, Variant variant, std::uint64_t seed) {
  using Q = QueryType<T>;
  const std::vector<Q> out_data = attend_case<T, Q>(c, variant, seed);
  const TensorView<const Q> out(out_data.data(), {c.batch, c.kv_heads * c.group, c.chunk, c.head_dim});
  EXPECT_LE(max_error<Q>(out, reference_case<T>(c, variant, seed)), Tolerance<T>::value) << describe(c, variant);
}

template <class T>
class AttentionTyped : public ::testing::Test {};

struct TypeName {
  template <class T>
  static std::string GetName(int) {
    return std::is_same_v<T, float>         ? "float"
           : std::is_same_v<T, double>      ? "double"
           : std::is_same_v<T, Eigen::half> ? "half"
                                            : "bfloat16";
  }
};

using ElementTypes = ::testing::Types<float, double, Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(AttentionTyped, ElementTypes, TypeName);

TYPED_TEST(AttentionTyped, MatchesReferenceOverEveryCacheVariant) {
  std::uint64_t seed = 1000;
  for (const Case& c : kCases) {
    for (Variant variant : {Variant::kDense, Variant::kConcat, Variant::kRing}) {
      run_case<TypeParam>(c, variant, seed);
      seed += 10;
    }
  }
}

// q and out in the storage type itself: the output is rounded once, at the end.
TYPED_TEST(AttentionTyped, QueriesInTheStorageType) {
  using T = TypeParam;
  const std::size_t heads = 4;
  const std::size_t kv_heads = 2;
  const std::size_t dim = 64;
  const std::size_t keys = 300;
  const std::size_t chunk = 3;
  const Block<T> k({1, kv_heads, keys, dim}, 7);
  const Block<T> v({1, kv_heads, keys, dim}, 8);
  Block<T> q({1, heads, chunk, dim}, 9);
  KvCache<T> cache({.layers = 1, .kv_heads = kv_heads, .head_dim = dim, .capacity = keys});
  const auto history = cache.update(0, k.view(), v.view(), arange(0, keys));
  const std::vector<std::int64_t> q_positions = arange(keys - chunk, chunk);
  const Dense want = reference_attention(exact(q), q_positions, exact(k), exact(v), 1.0 / 8.0, {});
  std::vector<T> out_data(q.data.size());
  const TensorView<T> out(out_data.data(), q.shape);
  causal_attention(q.mutable_view(), q_positions, history, out);
  // Rounding the output to T costs half an ulp of values below 1: 2^-8 (bfloat16), 2^-11 (half).
  const double tolerance = std::is_same_v<T, Eigen::bfloat16> ? 4e-3
                           : std::is_same_v<T, Eigen::half>   ? 5e-4
                           : std::is_same_v<T, float>         ? 2e-5
                                                              : 1e-12;
  EXPECT_LE(max_error<T>(out, want), tolerance);
}

// q and out in a 16-bit storage type, over every case of the grid: the queries hold the same
// values as the float ones of run_case, so the output is the float-query output rounded once to
// T. bfloat16 queries over bfloat16 keys are scored by products of bfloat16 pairs where the CPU
// has them (AVX-512 BF16, score_key_pairs) and they pay (detail::pair_products_pay), every other
// pair of types as float queries are.
// There four query rows a kv head also weigh V by pair products (accumulate_pairs_in_l1), with
// each weight rounded to bfloat16 (relative error e <= 2^-8) and the sum taken of the rounded
// weights: the output moves by sum_j w_j e_j (v_j - out) / sum_j w_j (1 + e_j), at most
// 2^-8 / (1 - 2^-8) times the largest |v_j - out|, 2 for values in [-1, 1].
template <class T>
class StoredQueries : public ::testing::Test {};
using SixteenBitTypes = ::testing::Types<Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(StoredQueries, SixteenBitTypes, TypeName);

TYPED_TEST(StoredQueries, GiveTheFloatQueryOutputRoundedOnce) {
  using T = TypeParam;
  const double roundoff = std::is_same_v<T, Eigen::bfloat16> ? 0x1p-8 : 0x1p-11;  // half an ulp, relative
  const double rounded_weights =
      std::is_same_v<T, Eigen::bfloat16> && KVCACHE_BF16_PAIRS ? 2 * 0x1p-8 / (1 - 0x1p-8) : 0;
  std::uint64_t seed = 5000;
  for (const Case& c : kCases) {
    for (Variant variant : {Variant::kDense, Variant::kConcat, Variant::kRing}) {
      const std::vector<T> got = attend_case<T, T>(c, variant, seed);
      const std::vector<float> wide = attend_case<T, float>(c, variant, seed);
      // Both within Tolerance<T> of the exact output; got then rounded once.
      std::size_t bad = got.size();
      for (std::size_t i = 0; i < got.size() && bad == got.size(); ++i) {
        const double w = wide[i];
        if (!(std::abs(to_double(got[i]) - w) <=
              roundoff * (std::abs(w) + rounded_weights) + rounded_weights + 2 * Tolerance<T>::value)) {
          bad = i;
        }
      }
      EXPECT_EQ(bad, got.size()) << describe(c, variant) << ": value " << bad << " is "
                                 << (bad < got.size() ? to_double(got[bad]) : 0.0) << ", float queries gave "
                                 << (bad < got.size() ? wide[bad] : 0.0F);
      seed += 10;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The rectangle: 3 cached tokens plus a chunk of 2. Every key is zero, so every visible key
// scores the same; value j is the one-hot e_j, so out[t] shows exactly which keys query t saw.

struct Rectangle {
  static constexpr std::size_t kDim = 8;
  std::vector<float> keys = std::vector<float>(5 * kDim, 0.0F);
  std::vector<float> values = std::vector<float>(5 * kDim, 0.0F);
  std::vector<float> q = std::vector<float>(2 * kDim, 0.25F);
  std::vector<float> out = std::vector<float>(2 * kDim, -1.0F);
  Rectangle() {
    for (std::size_t j = 0; j < 5; ++j) values[j * kDim + j] = 1.0F;
  }
};

TEST(AttentionRectangle, CachedPrefixPlusChunkSeesAllEarlierKeys) {
  Rectangle r;
  KvCache<float> cache({.layers = 1, .kv_heads = 1, .head_dim = Rectangle::kDim, .capacity = 8});
  const auto view = [](std::vector<float>& data, std::size_t first, std::size_t count) {
    return TensorView<const float>(data.data() + first * Rectangle::kDim, {1, 1, count, Rectangle::kDim});
  };
  (void)cache.update(0, view(r.keys, 0, 3), view(r.values, 0, 3), arange(0, 3));
  const std::vector<std::int64_t> chunk = arange(3, 2);
  const auto history = cache.update(0, view(r.keys, 3, 2), view(r.values, 3, 2), chunk);
  causal_attention(TensorView<const float>(r.q.data(), {1, 1, 2, Rectangle::kDim}), chunk, history,
                   TensorView<float>(r.out.data(), {1, 1, 2, Rectangle::kDim}));

  // Rows of the [T = 2, S = 5] mask: query 3 sees keys 0-3, query 4 sees keys 0-4.
  const std::vector<std::vector<float>> rectangle = {{0.25F, 0.25F, 0.25F, 0.25F, 0.0F},
                                                     {0.2F, 0.2F, 0.2F, 0.2F, 0.2F}};
  // A top-left triangle (query i sees keys 0..i of the chunk's own [T, S] matrix) would give these.
  const std::vector<std::vector<float>> triangle = {{1.0F, 0.0F, 0.0F, 0.0F, 0.0F}, {0.5F, 0.5F, 0.0F, 0.0F, 0.0F}};
  for (std::size_t t = 0; t < 2; ++t) {
    for (std::size_t d = 0; d < Rectangle::kDim; ++d) {
      const float want = d < 5 ? rectangle[t][d] : 0.0F;
      EXPECT_NEAR(r.out[t * Rectangle::kDim + d], want, 1e-6F) << "query " << t + 3 << " dim " << d;
    }
  }
  // The triangle differs from the rectangle in every row, so the checks above reject it.
  for (std::size_t t = 0; t < 2; ++t) {
    float differs = 0;
    for (std::size_t d = 0; d < 5; ++d) differs = std::max(differs, std::abs(triangle[t][d] - rectangle[t][d]));
    EXPECT_GT(differs, 0.1F) << "row " << t;
  }
}

TEST(AttentionRectangle, TopLeftTriangleReferenceFailsTheRectangle) {
  // The reference with a top-left mask (key index <= query index in the [T, S] matrix) does
  // not produce what causal_attention produces for the rectangle.
  Rectangle r;
  KvCache<float> cache({.layers = 1, .kv_heads = 1, .head_dim = Rectangle::kDim, .capacity = 8});
  const auto history = cache.update(0, TensorView<const float>(r.keys.data(), {1, 1, 5, Rectangle::kDim}),
                                    TensorView<const float>(r.values.data(), {1, 1, 5, Rectangle::kDim}), arange(0, 5));
  const std::vector<std::int64_t> chunk = arange(3, 2);
  causal_attention(TensorView<const float>(r.q.data(), {1, 1, 2, Rectangle::kDim}), chunk, history,
                   TensorView<float>(r.out.data(), {1, 1, 2, Rectangle::kDim}));
  // Top-left triangle: query i (0 or 1 within the chunk) averages values 0..i.
  for (std::size_t t = 0; t < 2; ++t) {
    float triangle_error = 0;
    for (std::size_t d = 0; d < 5; ++d) {
      const float triangle = d <= t ? 1.0F / static_cast<float>(t + 1) : 0.0F;
      triangle_error = std::max(triangle_error, std::abs(r.out[t * Rectangle::kDim + d] - triangle));
    }
    EXPECT_GT(triangle_error, 0.1F) << "query " << t + 3 << " looks like a top-left triangle";
    EXPECT_NEAR(r.out[t * Rectangle::kDim + t + 3], 1.0F / static_cast<float>(t + 4), 1e-6F);
  }
}

// ---------------------------------------------------------------------------------------------
// Masks that leave nothing visible, windows, sinks.

TEST(AttentionMask, FullyMaskedRowsGiveZeros) {
  const std::size_t dim = 16;
  const Block<float> k({1, 1, 10, dim}, 1);
  const Block<float> v({1, 1, 10, dim}, 2);
  const Block<float> q({1, 2, 3, dim}, 3);
  KvCache<float> cache({.layers = 1, .kv_heads = 1, .head_dim = dim, .capacity = 10});
  const auto history = cache.update(0, k.view(), v.view(), arange(0, 10));
  std::vector<float> out(q.data.size(), std::numeric_limits<float>::quiet_NaN());
  // Query -1 precedes every key; query 30 with a window of 5 reaches only 26-30, which are absent;
  // query 9 sees keys 5-9.
  const std::vector<std::int64_t> positions{-1, 30, 9};
  causal_attention(q.view(), positions, history, TensorView<float>(out.data(), q.shape), {.window = 5});
  for (std::size_t h = 0; h < 2; ++h) {
    for (std::size_t d = 0; d < dim; ++d) {
      EXPECT_EQ(out[(h * 3 + 0) * dim + d], 0.0F);
      EXPECT_EQ(out[(h * 3 + 1) * dim + d], 0.0F);
      EXPECT_TRUE(std::isfinite(out[(h * 3 + 2) * dim + d]));
    }
  }
  const Dense want = reference_attention(exact(q), {-1, 30, 9}, exact(k), exact(v), 0.25, {{5, 0}});
  EXPECT_LE(max_error<float>(TensorView<const float>(out.data(), q.shape), want), 2e-6);
  EXPECT_GT(std::abs(out[2 * dim]), 0.0F);  // the visible row is not zero by accident
}

TEST(AttentionMask, EmptyHistoryGivesZeros) {
  const Block<float> q({2, 4, 3, 32}, 3);
  std::vector<float> out(q.data.size(), std::numeric_limits<float>::quiet_NaN());
  causal_attention(q.view(), arange(0, 3), History<float>{}, TensorView<float>(out.data(), q.shape));
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 0.0F; }));
}

TEST(AttentionMask, RingHidesKeysOlderThanItsWindowAndKeepsSinks) {
  // A ring of window 4 and 2 sinks, given 16 tokens one at a time and then a chunk of 4, returns
  // positions 0, 1 and 13-19: query 16 reads 13-16, query 19 only 0, 1 and 16-19. Values are
  // one-hot per position (mod D).
  const std::size_t dim = 32;
  const std::size_t tokens = 20;
  std::vector<float> keys(tokens * dim, 0.0F);
  std::vector<float> values(tokens * dim, 0.0F);
  for (std::size_t j = 0; j < tokens; ++j) values[j * dim + j] = 1.0F;
  RingKvCache<float> cache({.layers = 1, .kv_heads = 1, .head_dim = dim, .window = 4, .sinks = 2});
  History<float> history;
  for (std::size_t j = 0; j < tokens;) {
    const std::size_t chunk = j < 16 ? 1 : 4;
    history = cache.update(0, TensorView<const float>(keys.data() + j * dim, {1, 1, chunk, dim}),
                           TensorView<const float>(values.data() + j * dim, {1, 1, chunk, dim}), arange(j, chunk));
    j += chunk;
  }
  ASSERT_EQ(history.tokens(), 9U) << "positions 0, 1 and 13-19";
  std::vector<float> q(dim, 0.0F);
  std::vector<float> out(dim, -1.0F);
  const std::vector<std::int64_t> position{19};
  causal_attention(TensorView<const float>(q.data(), {1, 1, 1, dim}), position, history,
                   TensorView<float>(out.data(), {1, 1, 1, dim}));
  for (std::size_t d = 0; d < dim; ++d) {
    const bool seen = d < 2 || (d >= 16 && d <= 19);
    EXPECT_NEAR(out[d], seen ? 1.0F / 6.0F : 0.0F, 1e-6F) << "position " << d;
  }
  // The caller's window applies on top: window 2 without sinks leaves 18 and 19.
  causal_attention(TensorView<const float>(q.data(), {1, 1, 1, dim}), position, history,
                   TensorView<float>(out.data(), {1, 1, 1, dim}), {.window = 2});
  for (std::size_t d = 0; d < dim; ++d) EXPECT_NEAR(out[d], d == 18 || d == 19 ? 0.5F : 0.0F, 1e-6F) << d;
}

/// `count` query positions `step` apart from 0: a chunk whose blocks each see a different part
/// of a long history.
std::vector<std::int64_t> spread(std::size_t count, std::size_t step) {
  std::vector<std::int64_t> positions(count);
  for (std::size_t t = 0; t < count; ++t) positions[t] = static_cast<std::int64_t>(t * step);
  return positions;
}

TEST(AttentionMask, KeysInAnyOrderGiveTheSameResult) {
  // Attention is a sum over keys: a history whose rows come in another order, each with its own
  // position, gives the same output. Over 5,000 keys (several tiles), in order, reversed and
  // shuffled: 300 queries at positions 0, 17, ..., 5,083 (most tiles partly visible to a block
  // of queries), and one decode query at 2,999, which sees the keys up to it.
  const std::size_t dim = 64;
  const std::size_t tokens = 5000;
  const Block<float> k({1, 1, tokens, dim}, 11);
  const Block<float> v({1, 1, tokens, dim}, 12);
  const Block<float> chunk_q({1, 2, 300, dim}, 13);
  const Block<float> decode_q({1, 4, 1, dim}, 14);
  const std::vector<std::int64_t> chunk_positions = spread(300, 17);
  const std::vector<std::int64_t> decode_positions{2999};
  struct Queries {
    const Block<float>& q;
    const std::vector<std::int64_t>& positions;
    Dense want;
  };
  const Queries queries[] = {
      {chunk_q, chunk_positions, reference_attention(exact(chunk_q), chunk_positions, exact(k), exact(v), 0.125, {{}})},
      {decode_q, decode_positions,
       reference_attention(exact(decode_q), decode_positions, exact(k), exact(v), 0.125, {{}})}};
  std::vector<std::size_t> order(tokens);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::vector<std::size_t> shuffled = order;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(5));
  const std::vector<std::size_t> reversed(order.rbegin(), order.rend());
  const std::vector<std::size_t>* const orders[] = {&order, &reversed, &shuffled};
  for (const std::vector<std::size_t>* rows : orders) {
    std::vector<float> keys(tokens * dim);
    std::vector<float> values(tokens * dim);
    std::vector<std::int64_t> positions(tokens);
    for (std::size_t j = 0; j < tokens; ++j) {
      const std::size_t from = (*rows)[j];
      std::copy_n(k.data.begin() + static_cast<std::ptrdiff_t>(from * dim), dim,
                  keys.begin() + static_cast<std::ptrdiff_t>(j * dim));
      std::copy_n(v.data.begin() + static_cast<std::ptrdiff_t>(from * dim), dim,
                  values.begin() + static_cast<std::ptrdiff_t>(j * dim));
      positions[j] = static_cast<std::int64_t>(from);
    }
    const Segment<float> segment{TensorView<const float>(keys.data(), {1, 1, tokens, dim}),
                                 TensorView<const float>(values.data(), {1, 1, tokens, dim}), positions};
    const char* name = rows == &order ? "in order" : rows == &reversed ? "reversed" : "shuffled";
    for (const Queries& c : queries) {
      std::vector<float> out(c.q.data.size(), std::numeric_limits<float>::quiet_NaN());
      causal_attention(c.q.view(), c.positions, History<float>{std::span(&segment, 1)},
                       TensorView<float>(out.data(), c.q.shape));
      EXPECT_LE(max_error<float>(TensorView<const float>(out.data(), c.q.shape), c.want), 2e-5)
          << name << ", T = " << c.positions.size();
    }
  }
}

TEST(AttentionMask, AWindowOverALongChunkReadsOnlyWhatEachQuerySees) {
  // 300 queries at positions 0, 17, ..., 5,083 over 5,000 keys with a window of 50 and 4 sinks:
  // each block of queries sees a few dozen keys of tiles that hold two thousand. The sinks come
  // as a segment of their own (as a ring returns them) or inside the one segment.
  const std::size_t dim = 32;
  const std::size_t tokens = 5000;
  const std::size_t chunk = 300;
  const std::size_t sinks = 4;
  const Block<float> k({1, 2, tokens, dim}, 21);
  const Block<float> v({1, 2, tokens, dim}, 22);
  const Block<float> q({1, 4, chunk, dim}, 23);
  const std::vector<std::int64_t> q_positions = spread(chunk, 17);
  const std::vector<std::int64_t> positions = arange(0, tokens);
  const std::span<const std::int64_t> all(positions);
  const Dense want = reference_attention(exact(q), q_positions, exact(k), exact(v), 0.25, {{50, sinks}});
  const std::vector<Segment<float>> split{
      {k.view().tokens(0, sinks), v.view().tokens(0, sinks), all.first(sinks)},
      {k.view().tokens(sinks, tokens - sinks), v.view().tokens(sinks, tokens - sinks), all.subspan(sinks)}};
  const std::vector<Segment<float>> whole{{k.view(), v.view(), all}};
  for (const auto* segments : {&split, &whole}) {
    std::vector<float> out(q.data.size(), std::numeric_limits<float>::quiet_NaN());
    causal_attention(q.view(), q_positions, History<float>{*segments}, TensorView<float>(out.data(), q.shape),
                     {.scale = 0.25F, .window = 50, .sinks = sinks});
    EXPECT_LE(max_error<float>(TensorView<const float>(out.data(), q.shape), want), 2e-5)
        << segments->size() << " segments";
  }
}

TEST(AttentionMask, KeysAtNegativePositionsAreNotSinks) {
  // A history built by hand may hold keys before position 0: sinks are positions 0 .. sinks - 1,
  // so with a window those keys age out like any other. Query 4 with window 2 and one sink
  // reads key 0 (a sink) and keys 3 and 4, never the keys at -5 and -1. Values are one-hot.
  const std::size_t dim = 8;
  const std::vector<std::int64_t> key_positions{-5, -1, 0, 1, 3, 4};
  const std::size_t tokens = key_positions.size();
  std::vector<float> keys(tokens * dim, 0.0F);
  std::vector<float> values(tokens * dim, 0.0F);
  for (std::size_t j = 0; j < tokens; ++j) values[j * dim + j] = 1.0F;
  const Segment<float> segment{TensorView<const float>(keys.data(), {1, 1, tokens, dim}),
                               TensorView<const float>(values.data(), {1, 1, tokens, dim}), key_positions};
  std::vector<float> q(dim, 0.0F);
  std::vector<float> out(dim, -1.0F);
  const std::vector<std::int64_t> position{4};
  causal_attention(TensorView<const float>(q.data(), {1, 1, 1, dim}), position, History<float>{std::span(&segment, 1)},
                   TensorView<float>(out.data(), {1, 1, 1, dim}), {.window = 2, .sinks = 1});
  for (std::size_t j = 0; j < tokens; ++j) {
    const bool seen = key_positions[j] == 0 || key_positions[j] >= 3;
    EXPECT_NEAR(out[j], seen ? 1.0F / 3.0F : 0.0F, 1e-6F) << "key at position " << key_positions[j];
  }
}

// ---------------------------------------------------------------------------------------------
// Layouts and calling conventions.

TEST(AttentionViews, StridedQueriesAndOutputs) {
  // q and out in the [B, T, H, D] layout an engine's projection produces, viewed with strides.
  const std::size_t batch = 2, heads = 4, kv_heads = 2, chunk = 5, dim = 32, keys = 40;
  const Block<float> k({batch, kv_heads, keys, dim}, 11);
  const Block<float> v({batch, kv_heads, keys, dim}, 12);
  const Block<float> q_bthd({batch, chunk, heads, dim}, 13);  // shape fields reused as [B, T, H, D]
  const Strides bthd{chunk * heads * dim, dim, heads * dim};
  const TensorView<const float> q(q_bthd.data.data(), {batch, heads, chunk, dim}, bthd);
  std::vector<float> out_data(q_bthd.data.size(), 0.0F);
  const TensorView<float> out(out_data.data(), {batch, heads, chunk, dim}, bthd);
  KvCache<float> cache({.layers = 1, .batch = batch, .kv_heads = kv_heads, .head_dim = dim, .capacity = keys});
  const auto history = cache.update(0, k.view(), v.view(), arange(0, keys));
  const std::vector<std::int64_t> positions = arange(keys - chunk, chunk);
  causal_attention(q, positions, history, out);
  Dense q_exact({batch, heads, chunk, dim});
  for (std::size_t b = 0; b < batch; ++b)
    for (std::size_t h = 0; h < heads; ++h)
      for (std::size_t t = 0; t < chunk; ++t)
        for (std::size_t d = 0; d < dim; ++d) q_exact.at(b, h, t, d) = q(b, h, t, d);
  const Dense want = reference_attention(q_exact, positions, exact(k), exact(v), 1.0 / std::sqrt(32.0), {});
  EXPECT_LE(max_error<float>(out, want), 2e-6);
}

TEST(AttentionViews, AcceptsConstAndMutableViewsAndVectors) {
  const std::size_t dim = 8;
  Block<float> q({1, 2, 1, dim}, 1);
  const Block<float> k({1, 1, 4, dim}, 2);
  KvCache<float> cache({.layers = 1, .kv_heads = 1, .head_dim = dim, .capacity = 4});
  const auto history = cache.update(0, k.view(), k.view(), arange(0, 4));
  std::vector<float> a(q.data.size()), b(q.data.size()), c(q.data.size());
  const std::vector<std::int64_t> positions{3};
  causal_attention(q.view(), positions, history, TensorView<float>(a.data(), q.shape));          // const q
  causal_attention(q.mutable_view(), positions, history, TensorView<float>(b.data(), q.shape));  // mutable q
  causal_attention(q.view(), std::span<const std::int64_t>(positions), history,                  // span
                   TensorView<float>(c.data(), q.shape), AttentionOptions{.threads = 1});
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, c);
  EXPECT_NE(a[0], 0.0F);
}

// An engine that overwrites its query buffer with the attention output: the same answer as into
// a buffer of its own, over blocks of several queries, a ring's wrapped segments, and keys split
// across threads (one batch row and one kv head: its 3,000 keys are divided); for bfloat16 q and
// out, through the pair scores of four query rows too.
template <class T>
void expect_out_may_be_q() {
  struct Shape4 {
    std::size_t batch, kv_heads, group, chunk, keys;
  };
  for (const Shape4& s : {Shape4{2, 2, 4, 7, 300}, Shape4{1, 1, 4, 1, 3000}}) {
    const std::size_t dim = 64;
    const Block<T> k({s.batch, s.kv_heads, s.keys, dim}, 31);
    const Block<T> v({s.batch, s.kv_heads, s.keys, dim}, 32);
    const Block<T> q({s.batch, s.kv_heads * s.group, s.chunk, dim}, 33);
    RingKvCache<T> ring(
        {.layers = 1, .batch = s.batch, .kv_heads = s.kv_heads, .head_dim = dim, .window = s.keys / 2, .sinks = 4});
    ring.update(0, k.view(), v.view(), arange(0, s.keys));
    const auto history =
        ring.update(0, k.view().tokens(0, s.chunk), v.view().tokens(0, s.chunk), arange(s.keys, s.chunk));
    ASSERT_GE(history.segments.size(), 2U);
    const std::vector<std::int64_t> positions = arange(s.keys, s.chunk);
    for (std::size_t threads : {std::size_t{1}, std::size_t{3}}) {
      std::vector<T> apart(q.data.size());
      causal_attention(q.view(), positions, history, TensorView<T>(apart.data(), q.shape), {.threads = threads});
      std::vector<T> in_place = q.data;
      const TensorView<T> both(in_place.data(), q.shape);
      causal_attention(both, positions, history, both, {.threads = threads});
      EXPECT_EQ(in_place, apart) << "threads " << threads << " keys " << s.keys;
      EXPECT_NE(in_place, q.data);
    }
  }
}

TEST(AttentionViews, OutMayBeQItself) {
  expect_out_may_be_q<float>();
  expect_out_may_be_q<Eigen::bfloat16>();
}

// ---------------------------------------------------------------------------------------------
// The tests above that speak of several tiles (4,500 and 5,000 keys at D = 32 and 64) do cross
// tiles, whatever the element type: at least two tile boundaries, so that the running max and
// sum are carried from tile to tile.

template <class T>
std::size_t tile_keys(std::size_t dim) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const std::size_t keys = 8;
  const Block<T> k({1, 1, keys, dim}, 41);
  const Block<float> q({1, 4, 1, dim}, 42);
  const std::vector<std::int64_t> positions = arange(0, keys);
  const Segment<T> segment{k.view(), k.view(), positions};
  std::vector<float> out(q.data.size());
  const std::vector<std::int64_t> q_positions{static_cast<std::int64_t>(keys)};
  const detail::AttentionKernel<T, float, Acc> kernel(q.view(), q_positions, History<T>{std::span(&segment, 1)},
                                                      TensorView<float>(out.data(), q.shape),
                                                      detail::VisibilityRule(0, 0, 0, 0), Acc{1});
  return kernel.tile();
}

template <class T>
void expect_long_cases_cross_tiles() {
  for (const std::size_t dim : {std::size_t{32}, std::size_t{64}}) {
    EXPECT_LT(2 * tile_keys<T>(dim), std::size_t{4500}) << "D " << dim;
  }
}

TEST(AttentionTiles, LongCasesCrossSeveralTilesForEveryType) {
  expect_long_cases_cross_tiles<float>();
  expect_long_cases_cross_tiles<double>();
  expect_long_cases_cross_tiles<Eigen::half>();
  expect_long_cases_cross_tiles<Eigen::bfloat16>();
}

// ---------------------------------------------------------------------------------------------
// The shuffle tree that sums W dot products at once, on the compiler's vector registers and on
// the plain arrays that stand in for them elsewhere, at every width.

template <class V, std::size_t W>
void expect_transpose_sum() {
  V a[W];
  for (std::size_t i = 0; i < W; ++i)
    for (std::size_t l = 0; l < W; ++l) a[i][l] = static_cast<std::remove_cvref_t<decltype(a[0][0])>>(i * 100 + l);
  V ordered[W];
  for (std::size_t l = 0; l < W; ++l) ordered[l] = a[detail::reverse_bits(l, W)];
  const V sums = detail::transpose_sum<W, W / 2>(ordered);
  for (std::size_t k = 0; k < W; ++k) {
    EXPECT_EQ(static_cast<double>(sums[k]), static_cast<double>(k * 100 * W + W * (W - 1) / 2))
        << "W " << W << " key " << k;
  }
}

TEST(AttentionMath, TransposeSumPutsKeyKInLaneK) {
  expect_transpose_sum<detail::Vector<float>, detail::kVector<float>>();
  expect_transpose_sum<detail::Vector<double>, detail::kVector<double>>();
  expect_transpose_sum<detail::LoopVector<float, 4>, 4>();
  expect_transpose_sum<detail::LoopVector<float, 8>, 8>();
  expect_transpose_sum<detail::LoopVector<float, 16>, 16>();
  expect_transpose_sum<detail::LoopVector<double, 2>, 2>();
}

// The softmax bookkeeping: largest and sum of a row of scores, folded in registers, at every
// length around the vector width (tails included) and with masked (-inf) scores.

template <class Acc>
void expect_max_and_sum() {
  constexpr std::size_t W = detail::kVector<Acc>;
  for (std::size_t n = 0; n <= 3 * W + 1; ++n) {
    std::vector<Acc> x(n);
    for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<Acc>((i * 37) % 11) - Acc{5};
    if (n > 2) x[n / 2] = -std::numeric_limits<Acc>::infinity();
    const Acc largest = n == 0 ? -std::numeric_limits<Acc>::infinity() : *std::max_element(x.begin(), x.end());
    EXPECT_EQ(detail::max_of(x.data(), n), largest) << "n " << n;
    for (Acc& v : x) v = v == -std::numeric_limits<Acc>::infinity() ? Acc{0} : v;
    EXPECT_EQ(detail::sum_of(x.data(), n), std::accumulate(x.begin(), x.end(), Acc{0}))
        << "n " << n;  // integers: exact
  }
}

TEST(AttentionMath, MaxAndSumOfScoresAtEveryLength) {
  expect_max_and_sum<float>();
  expect_max_and_sum<double>();
}

TEST(AttentionMath, FoldHalvesLeavesTheTotalInLaneZero) {
  detail::LoopVector<float, 8> v{};
  for (std::size_t l = 0; l < 8; ++l) v[l] = static_cast<float>(l == 5 ? 40 : l);
  const auto max = detail::fold_halves<4>(v, [](const auto& a, const auto& b) { return detail::lane_max(a, b); });
  const auto sum = detail::fold_halves<4>(v, [](const auto& a, const auto& b) { return a + b; });
  EXPECT_EQ(max[0], 40.0F);
  EXPECT_EQ(sum[0], 0.0F + 1 + 2 + 3 + 4 + 40 + 6 + 7);
}

#if KVCACHE_VECTOR_EXP
// Weights come out of the lane-wise exp for whole registers and the scalar one for a row's tail:
// the same value, bit for bit, within 1 ulp of e^x, and 0 (never a NaN) below -87 and for a
// masked score.
TEST(AttentionMath, LaneWiseExpMatchesTheScalarOne) {
  constexpr std::size_t W = detail::kVector<float>;
  std::vector<float> xs = {0.0F,   -0.0F,   -1e-30F, -86.9F,
                           -87.0F, -87.01F, -1e4F,   -std::numeric_limits<float>::infinity()};
  for (int i = 0; i <= 200000; ++i) xs.push_back(-90.0F * static_cast<float>(i) / 200000.0F);
  while (xs.size() % W != 0) xs.push_back(-1.5F);
  for (std::size_t first = 0; first < xs.size(); first += W) {
    const auto lanes = detail::exp_nonpositive(detail::load_vector<detail::Vector<float>>(xs.data() + first));
    for (std::size_t l = 0; l < W; ++l) {
      const float x = xs[first + l];
      const float scalar = detail::exp_nonpositive(x);
      EXPECT_EQ(std::bit_cast<std::uint32_t>(lanes[l]), std::bit_cast<std::uint32_t>(scalar)) << "x " << x;
      if (x < -87.0F) {
        EXPECT_EQ(scalar, 0.0F) << "x " << x;
        continue;
      }
      const double want = std::exp(static_cast<double>(x));
      const double ulp =
          std::nextafter(static_cast<float>(want), std::numeric_limits<float>::infinity()) - static_cast<float>(want);
      EXPECT_LE(std::abs(scalar - want), ulp) << "x " << x;
    }
  }
}
#endif

#if KVCACHE_VECTOR_EXTENSIONS
// Half rows widened by integer operations, where no instruction converts them: every one of the
// 65,536 bit patterns gives Eigen's float, bit for bit (a NaN for a NaN, with its sign).
TEST(AttentionMath, EveryHalfBitPatternWidensExactly) {
  using Bits = detail::Vector<std::uint32_t>;
  constexpr std::size_t W = detail::kVector<float>;
  for (std::uint32_t first = 0; first < 65536; first += W) {
    Bits bits;
    for (std::size_t l = 0; l < W; ++l) bits[l] = first + static_cast<std::uint32_t>(l);
    const detail::Vector<float> got = detail::floats_from_half_bits(bits);
    for (std::size_t l = 0; l < W; ++l) {
      const auto pattern = static_cast<std::uint16_t>(bits[l]);
      const float want = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(pattern));
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got[l])) << "half bits " << pattern;
        EXPECT_EQ(std::signbit(got[l]), std::signbit(want)) << "half bits " << pattern;
      } else {
        EXPECT_EQ(std::bit_cast<std::uint32_t>(got[l]), std::bit_cast<std::uint32_t>(want)) << "half bits " << pattern;
      }
    }
  }
}
#endif

#if KVCACHE_BF16_PAIRS
// Scores by products of bfloat16 pairs (AVX-512 BF16): small integers, whose products and sums
// float holds exactly, so every score must be the exact dot product times the scale, in the
// lane of its own query row and key.
template <std::size_t R, std::size_t Dim>
void expect_pair_scores() {
  constexpr std::size_t K = detail::kVector<float> / R;
  std::mt19937 rng(static_cast<unsigned>(R * Dim));
  std::uniform_int_distribution<int> value(-15, 15);
  std::vector<Eigen::bfloat16> queries(R * Dim), key_rows(K * Dim);
  for (auto& x : queries) x = static_cast<Eigen::bfloat16>(static_cast<float>(value(rng)));
  for (auto& x : key_rows) x = static_cast<Eigen::bfloat16>(static_cast<float>(value(rng)));
  const Eigen::bfloat16* q[R];
  float scores[R][K];
  float* out[R];
  for (std::size_t r = 0; r < R; ++r) {
    q[r] = queries.data() + r * Dim;
    out[r] = scores[r];
  }
  const Eigen::bfloat16* keys[K];
  for (std::size_t k = 0; k < K; ++k) keys[k] = key_rows.data() + k * Dim;
  detail::score_key_pairs<R, Dim>(q, keys, 0.25F, out);
  for (std::size_t r = 0; r < R; ++r) {
    for (std::size_t k = 0; k < K; ++k) {
      float dot = 0;
      for (std::size_t d = 0; d < Dim; ++d) dot += static_cast<float>(q[r][d]) * static_cast<float>(keys[k][d]);
      EXPECT_EQ(scores[r][k], 0.25F * dot) << "R " << R << " Dim " << Dim << " row " << r << " key " << k;
    }
  }
}

TEST(AttentionMath, PairScoresAreExactDotProductsInTheirOwnLanes) {
  expect_pair_scores<2, 64>();
  expect_pair_scores<2, 128>();
  expect_pair_scores<4, 128>();
  expect_pair_scores<4, 256>();
}

// The kernel with bfloat16 pair products and without: which one causal_attention takes is the
// processor's (detail::pair_products_pay), so both are run here, over four bfloat16 query rows
// per kv head at D = 128, a chunk of five queries over keys that span two tiles, one and three
// threads. Each output is within the reference's accumulation tolerance plus half a bfloat16
// ulp of rounding, and with pair products the rounded weights' term (see StoredQueries).
TEST(PairProducts, AndKeysWidenedToFloatBothMatchTheReference) {
  using T = Eigen::bfloat16;
  const std::size_t kv_heads = 2, group = 4, keys = 2500, chunk = 5, dim = 128;
  const Block<T> k({1, kv_heads, keys, dim}, 61);
  const Block<T> v({1, kv_heads, keys, dim}, 62);
  const Block<T> q({1, kv_heads * group, chunk, dim}, 63);
  const std::vector<std::int64_t> key_positions = arange(0, keys);
  const std::vector<std::int64_t> q_positions = arange(keys - chunk, chunk);
  const Segment<T> segment{k.view(), v.view(), key_positions};
  const History<T> history{std::span<const Segment<T>>(&segment, 1)};
  const float scale = 1.0F / std::sqrt(static_cast<float>(dim));
  const Dense want = reference_attention(exact(q), q_positions, exact(k), exact(v), scale, {});
  for (const bool pairs : {false, true}) {
    for (const std::size_t threads : {std::size_t{1}, std::size_t{3}}) {
      std::vector<T> out(q.data.size());
      const TensorView<T> out_view(out.data(), q.shape);
      detail::AttentionForms forms = detail::AttentionForms::of_this_processor();
      forms.pair_products = pairs;
      const detail::AttentionKernel<T, T, float> kernel(q.view(), q_positions, history, out_view,
                                                        detail::VisibilityRule(0, 0, 0, 0), scale, forms);
      detail::run_attention(kernel, 1, kv_heads, chunk, threads);
      // Rounded weights move an output by at most 2^-8 / (1 - 2^-8) of |v - out| <= 2.
      const double weights = pairs ? 2 * 0x1p-8 / (1 - 0x1p-8) : 0;
      std::size_t bad = out.size();
      for (std::size_t i = 0; i < out.size() && bad == out.size(); ++i) {
        const double w = want.data[i];
        if (!(std::abs(to_double(out[i]) - w) <= 0x1p-8 * (std::abs(w) + weights) + weights + Tolerance<T>::value)) {
          bad = i;
        }
      }
      EXPECT_EQ(bad, out.size()) << "pair products " << pairs << ", threads " << threads << ": value " << bad;
    }
  }
}

// The weights the pair-product V pass applies: each rounded to the nearest bfloat16 (ties to
// even) as Eigen rounds it, at every length around the vector width, and the sum returned is
// the sum of the rounded values.
TEST(AttentionMath, RoundedWeightsAreEigensBfloat16AndTheirSum) {
  constexpr std::size_t W = detail::kVector<float>;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> unit(0.0F, 1.0F);
  for (std::size_t n = 0; n <= 3 * W + 1; ++n) {
    std::vector<float> weights(n);
    for (std::size_t j = 0; j < n; ++j) weights[j] = unit(rng);
    // Ties: halfway between two bfloat16 values, below an even and below an odd one.
    if (n > 1) weights[1] = std::bit_cast<float>(0x3F808000U);
    if (n > 2) weights[2] = std::bit_cast<float>(0x3F818000U);
    if (n > 3) weights[3] = 0.0F;
    std::vector<std::uint16_t> rounded(n);
    const float sum = detail::round_weights(weights.data(), n, rounded.data());
    double want_sum = 0;
    for (std::size_t j = 0; j < n; ++j) {
      const auto want = Eigen::numext::bit_cast<std::uint16_t>(static_cast<Eigen::bfloat16>(weights[j]));
      EXPECT_EQ(rounded[j], want) << "n " << n << " weight " << j << " = " << weights[j];
      want_sum += static_cast<double>(static_cast<float>(static_cast<Eigen::bfloat16>(weights[j])));
    }
    EXPECT_NEAR(sum, want_sum, 1e-6 * static_cast<double>(n)) << "n " << n;
  }
}

// The V pass by pair products: small integers and weights in sixteenths, whose products and
// sums float holds exactly, so every sum must be exact, in lane_of order, for held rows and
// rows summed in L1 alike, at even and odd key counts (the last key then paired with zeros).
TEST(AttentionMath, PairSumsAreExactWeightedSumsInRegisterOrder) {
  constexpr std::size_t R = 4;
  constexpr std::size_t Dim = 128;
  constexpr std::size_t kStride = Dim + 2 * detail::kVector<float>;
  std::mt19937 rng(12);
  std::uniform_int_distribution<int> value(-15, 15);
  for (const std::size_t count : {std::size_t{1}, std::size_t{2}, std::size_t{7}, std::size_t{40}}) {
    std::vector<Eigen::bfloat16> rows(count * kStride);
    for (auto& x : rows) x = static_cast<Eigen::bfloat16>(static_cast<float>(value(rng)));
    std::vector<std::uint16_t> weight_bits(R * count);
    std::vector<float> start(R * Dim);
    for (auto& x : start) x = static_cast<float>(value(rng));
    std::vector<float> sums = start;
    for (auto& bits : weight_bits) {
      bits = Eigen::numext::bit_cast<std::uint16_t>(
          static_cast<Eigen::bfloat16>(static_cast<float>(value(rng) + 15) / 16));
    }
    float* acc[R];
    const std::uint16_t* weights[R];
    for (std::size_t r = 0; r < R; ++r) {
      acc[r] = sums.data() + r * Dim;
      weights[r] = weight_bits.data() + r * count;
    }
    detail::accumulate_pairs_in_l1<R, Dim, 2>(acc, weights, rows.data(), kStride, count, detail::RowFetcher{});
    for (std::size_t r = 0; r < R; ++r) {
      for (std::size_t d = 0; d < Dim; ++d) {
        const std::size_t lane = detail::lane_of<Eigen::bfloat16, float>(d, Dim);
        float want = start[r * Dim + lane];
        for (std::size_t j = 0; j < count; ++j) {
          const float w = static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(weights[r][j]));
          want += w * static_cast<float>(rows[j * kStride + d]);
        }
        EXPECT_EQ(sums[r * Dim + lane], want) << "count " << count << " row " << r << " d " << d;
      }
    }
  }
}
#endif

// The forms of the kernel a processor may choose between, each run here whatever this processor
// is: one query row per kv head read as plain streams (no row asked for ahead, weights made
// before the pass over V, bfloat16 lines loaded by each operation that uses them) or as the
// other processors read it (detail::plain_one_row_passes); four 16-bit query rows scoring the K
// rows they read from memory in order or W / 4 keys at a time (detail::four_rows_in_order_pay);
// tiles of the usual length or longer (detail::long_tiles_pay); and vectors of the build's width
// or, where that is 64 bytes, of 32 (detail::narrow_vectors_pay).
// For every 16-bit type and float, one, two, four and eight query rows per kv head (at eight, the
// first four read the tile from memory, the other four from cache), D = 128 and one with a tail
// (72), over keys that span several tiles, one and three threads, decode and a chunk of three.
template <class T, std::size_t B>
void expect_kernel_form_matches_the_reference(std::size_t group, std::size_t dim) {
  const std::size_t kv_heads = 2, keys = 9000;  // more than a long tile of 8,192 keys
  const Block<T> k({1, kv_heads, keys, dim}, 71);
  const Block<T> v({1, kv_heads, keys, dim}, 72);
  const std::vector<std::int64_t> key_positions = arange(0, keys);
  const Segment<T> segment{k.view(), v.view(), key_positions};
  const History<T> history{std::span<const Segment<T>>(&segment, 1)};
  const float scale = 1.0F / std::sqrt(static_cast<float>(dim));
  for (const std::size_t chunk : {std::size_t{1}, std::size_t{3}}) {
    const Block<float> q({1, kv_heads * group, chunk, dim}, 73);
    const std::vector<std::int64_t> q_positions = arange(keys - chunk, chunk);
    const Dense want = reference_attention(exact(q), q_positions, exact(k), exact(v), scale, {});
    for (const bool chosen : {false, true}) {  // each form a processor may choose, taken or not
      for (const std::size_t threads : {std::size_t{1}, std::size_t{3}}) {
        std::vector<float> out(q.data.size());
        const detail::AttentionForms forms{.pair_products = detail::pair_products_pay(),
                                           .plain_one_row = chosen,
                                           .four_rows_in_order = chosen,
                                           .long_tiles = chosen};
        const detail::AttentionKernel<T, float, float, B> kernel(q.view(), q_positions, history,
                                                                 TensorView<float>(out.data(), q.shape),
                                                                 detail::VisibilityRule(0, 0, 0, 0), scale, forms);
        detail::run_attention(kernel, 1, kv_heads, chunk, threads);
        std::size_t bad = out.size();
        for (std::size_t i = 0; i < out.size() && bad == out.size(); ++i) {
          if (!(std::abs(static_cast<double>(out[i]) - want.data[i]) <= Tolerance<T>::value)) bad = i;
        }
        EXPECT_EQ(bad, out.size()) << B << "-byte vectors, G " << group << ", D " << dim << ", chunk " << chunk
                                   << ", forms chosen " << chosen << ", threads " << threads << ": value " << bad;
      }
    }
  }
}

template <class T>
void expect_every_kernel_form_matches_the_reference() {
  for (const std::size_t group : {std::size_t{1}, std::size_t{2}, std::size_t{4}, std::size_t{8}}) {
    for (const std::size_t dim : {std::size_t{128}, std::size_t{72}}) {
      expect_kernel_form_matches_the_reference<T, detail::kVectorBytes>(group, dim);
      if constexpr (detail::kVectorBytes == 64) expect_kernel_form_matches_the_reference<T, 32>(group, dim);
    }
  }
}

TEST(KernelForms, EveryFormMatchesTheReference) {
  expect_every_kernel_form_matches_the_reference<Eigen::bfloat16>();
  expect_every_kernel_form_matches_the_reference<Eigen::half>();
  expect_every_kernel_form_matches_the_reference<float>();
}

// The register order of a row (queries in, outputs out): reorder_row puts every value where
// lane_of names, at every length around a group (tails included), and puts it back.
template <class T, class Acc>
void expect_lanes() {
  for (std::size_t dim = 0; dim <= 4 * detail::kVector<Acc> + 3; ++dim) {
    std::vector<Acc> row(dim);
    for (std::size_t d = 0; d < dim; ++d) row[d] = static_cast<Acc>(d);
    detail::reorder_row<T, Acc, true>(row.data(), dim);
    for (std::size_t d = 0; d < dim; ++d) {
      EXPECT_EQ(row[(detail::lane_of<T, Acc>(d, dim))], static_cast<Acc>(d)) << "dim " << dim << " d " << d;
    }
    detail::reorder_row<T, Acc, false>(row.data(), dim);
    for (std::size_t d = 0; d < dim; ++d) EXPECT_EQ(row[d], static_cast<Acc>(d)) << "back, dim " << dim << " d " << d;
  }
}

TEST(AttentionMath, ReorderRowPutsEveryValueInRegisterOrderAndBack) {
  expect_lanes<float, float>();
  expect_lanes<double, double>();
  expect_lanes<Eigen::bfloat16, float>();
  if constexpr (detail::kConvertsInRegisters<Eigen::half, float>) expect_lanes<Eigen::half, float>();
}

// ---------------------------------------------------------------------------------------------
// Threads: every split of the work gives the same answer as the caller's thread alone.

TEST(AttentionThreads, ThreadCountsAgree) {
  struct Shape4 {
    std::size_t batch, kv_heads, group, chunk, keys;
  };
  // The last two have a single (batch, kv head) and so split the keys themselves across threads;
  // the first reads 16 MiB, enough for automatic threading (threads = 0) to start a second thread.
  for (const Shape4& s : {Shape4{1, 8, 2, 1, 2048}, Shape4{2, 4, 2, 1, 600}, Shape4{1, 2, 4, 7, 1200},
                          Shape4{1, 1, 4, 1, 3000}, Shape4{1, 1, 2, 9, 2500}}) {
    const std::size_t dim = 128;
    const Block<float> k({s.batch, s.kv_heads, s.keys, dim}, 21);
    const Block<float> v({s.batch, s.kv_heads, s.keys, dim}, 22);
    const Block<float> q({s.batch, s.kv_heads * s.group, s.chunk, dim}, 23);
    KvCache<float> cache({.layers = 1, .batch = s.batch, .kv_heads = s.kv_heads, .head_dim = dim, .capacity = s.keys});
    const auto history = cache.update(0, k.view(), v.view(), arange(0, s.keys));
    const std::vector<std::int64_t> positions = arange(s.keys - s.chunk, s.chunk);
    std::vector<float> one(q.data.size());
    causal_attention(q.view(), positions, history, TensorView<float>(one.data(), q.shape), {.threads = 1});
    const Dense want = reference_attention(exact(q), positions, exact(k), exact(v), 1.0 / std::sqrt(128.0), {});
    EXPECT_LE(max_error<float>(TensorView<const float>(one.data(), q.shape), want), 2e-5);
    for (std::size_t threads : {std::size_t{0}, std::size_t{2}, std::size_t{3}}) {
      std::vector<float> many(q.data.size(), std::numeric_limits<float>::quiet_NaN());
      causal_attention(q.view(), positions, history, TensorView<float>(many.data(), q.shape), {.threads = threads});
      double worst = 0;
      for (std::size_t i = 0; i < one.size(); ++i) worst = std::max(worst, double(std::abs(one[i] - many[i])));
      EXPECT_LE(worst, 1e-6) << "threads " << threads << " keys " << s.keys;
    }
  }
}

TEST(AttentionThreads, AutomaticCountFollowsTheWork) {
  const std::size_t hardware = std::max<std::size_t>(std::thread::hardware_concurrency(), 1);
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  // A requested count is taken as it is, whatever the work.
  EXPECT_EQ(detail::attention_threads(3, 0), 3U);
  EXPECT_EQ(detail::attention_threads(1, 1024 * kMiB), 1U);
  // Automatic: one thread per `per_thread` bytes of K and V, at least one, at most the hardware's.
  for (const std::size_t per_thread : {kMiB, kMiB / 2}) {
    EXPECT_EQ(detail::attention_threads(0, 0, per_thread), 1U);
    EXPECT_EQ(detail::attention_threads(0, 2 * per_thread - 1, per_thread), 1U);
    EXPECT_EQ(detail::attention_threads(0, 2 * per_thread, per_thread), std::min<std::size_t>(2, hardware));
    EXPECT_EQ(detail::attention_threads(0, 3 * per_thread - 1, per_thread), std::min<std::size_t>(2, hardware));
    EXPECT_EQ(detail::attention_threads(0, per_thread * 1000, per_thread), std::min<std::size_t>(1000, hardware));
  }
  // By default this processor's measured amount: half a MiB on Intel, a MiB elsewhere.
  EXPECT_EQ(detail::bytes_per_thread(), detail::cpu_is_intel() ? kMiB / 2 : kMiB);
  EXPECT_EQ(detail::attention_threads(0, 2 * detail::bytes_per_thread()), std::min<std::size_t>(2, hardware));
}

// ---------------------------------------------------------------------------------------------
// Bad input: std::invalid_argument naming both values, before anything is written.

struct BadInput : ::testing::Test {
  static constexpr std::size_t kDim = 16;
  Block<float> k{{2, 2, 6, kDim}, 1};
  Block<float> v{{2, 2, 6, kDim}, 2};
  Block<float> q{{2, 4, 3, kDim}, 3};
  std::vector<std::int64_t> key_positions = arange(0, 6);
  std::vector<std::int64_t> q_positions = arange(3, 3);
  std::vector<float> out = std::vector<float>(q.data.size(), 42.0F);

  /// Expects std::invalid_argument whose message holds every one of `parts`, and `out` untouched.
  void expect_rejected(const TensorView<const float>& query, std::span<const std::int64_t> positions,
                       const History<float>& history, const TensorView<float>& result,
                       const std::vector<std::string>& parts) {
    try {
      causal_attention(query, positions, history, result);
      ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
      for (const std::string& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 42.0F; })) << "out was written";
  }
  [[nodiscard]] TensorView<float> out_view() { return {out.data(), q.shape}; }
};

TEST_F(BadInput, HeadsNotAMultipleOfKvHeads) {
  const Block<float> q3({2, 3, 3, kDim}, 4);
  const Segment<float> segment{k.view(), v.view(), key_positions};
  expect_rejected(q3.view(), q_positions, {std::span(&segment, 1)}, {out.data(), q3.shape}, {"kv_heads 2", "given 3"});
}

TEST_F(BadInput, HeadDimMismatch) {
  const Block<float> k8({2, 2, 6, 8}, 4);
  const Segment<float> segment{k8.view(), k8.view(), key_positions};
  expect_rejected(q.view(), q_positions, {std::span(&segment, 1)}, out_view(), {"head_dim", "16", "given 8"});
  // out's head_dim differs from q's.
  const Segment<float> good{k.view(), v.view(), key_positions};
  expect_rejected(q.view(), q_positions, {std::span(&good, 1)}, {out.data(), {2, 4, 3, 8}},
                  {"out shape", "[2, 4, 3, 16]", "given [2, 4, 3, 8]"});
}

TEST_F(BadInput, BatchMismatch) {
  const Block<float> k1({1, 2, 6, kDim}, 4);
  const Segment<float> segment{k1.view(), k1.view(), key_positions};
  expect_rejected(q.view(), q_positions, {std::span(&segment, 1)}, out_view(), {"batch", "2", "given 1"});
}

TEST_F(BadInput, PositionsCount) {
  const Segment<float> segment{k.view(), v.view(), key_positions};
  const std::vector<std::int64_t> two = arange(3, 2);
  expect_rejected(q.view(), two, {std::span(&segment, 1)}, out_view(), {"q_positions", "3", "given 2"});
}

TEST_F(BadInput, OutShape) {
  const Segment<float> segment{k.view(), v.view(), key_positions};
  expect_rejected(q.view(), q_positions, {std::span(&segment, 1)}, {out.data(), {2, 4, 2, kDim}},
                  {"out shape", "[2, 4, 3, 16]", "given [2, 4, 2, 16]"});
}

TEST_F(BadInput, SegmentsThatDisagree) {
  // Values shorter than keys; positions shorter than keys; a second segment with other kv_heads.
  const Segment<float> short_values{k.view(), v.view().tokens(0, 5), key_positions};
  expect_rejected(q.view(), q_positions, {std::span(&short_values, 1)}, out_view(),
                  {"values shape", "[2, 2, 6, 16]", "given [2, 2, 5, 16]"});
  const Segment<float> short_positions{k.view(), v.view(), std::span(key_positions).first(4)};
  expect_rejected(q.view(), q_positions, {std::span(&short_positions, 1)}, out_view(),
                  {"positions count", "6", "given 4"});
  const Block<float> k4({2, 4, 6, kDim}, 5);
  const std::vector<Segment<float>> mixed{{k.view(), v.view(), key_positions}, {k4.view(), k4.view(), key_positions}};
  expect_rejected(q.view(), q_positions, {mixed}, out_view(), {"segments[1]", "kv_heads", "2", "given 4"});
}

}  // namespace
}  // namespace kvcache
