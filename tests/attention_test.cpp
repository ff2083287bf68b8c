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
// T.
template <class T>
class StoredQueries : public ::testing::Test {};
using SixteenBitTypes = ::testing::Types<Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(StoredQueries, SixteenBitTypes, TypeName);

TYPED_TEST(StoredQueries, GiveTheFloatQueryOutputRoundedOnce) {
  using T = TypeParam;
  const double roundoff = std::is_same_v<T, Eigen::bfloat16> ? 0x1p-8 : 0x1p-11;  // half an ulp, relative
  const double rounded_weights = 0;  // queries of every type are widened: the same sums as float queries
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
// Runs: the shortest runs the tuning allows (one key) give what the default
// ones give, for every format, so the running max and sum carry across every boundary.

template <class T>
void expect_run_length_changes_nothing() {
  for (const std::size_t dim : {std::size_t{24}, std::size_t{64}}) {
    const std::size_t keys = 700;
    const Block<T> k({1, 2, keys, dim}, 41);
    const Block<T> v({1, 2, keys, dim}, 42);
    const Block<float> q({1, 8, 3, dim}, 43);
    KvCache<T> cache({.layers = 1, .kv_heads = 2, .head_dim = dim, .capacity = keys});
    const auto history = cache.update(0, k.view(), v.view(), arange(0, keys));
    const std::vector<std::int64_t> positions = arange(keys - 3, 3);
    std::vector<float> whole(q.data.size());
    std::vector<float> short_runs(q.data.size());
    causal_attention(q.view(), positions, history, TensorView<float>(whole.data(), q.shape));
    causal_attention(q.view(), positions, history, TensorView<float>(short_runs.data(), q.shape),
                     {.tuning = {.run_keys = 1, .prefetch_bytes = 256, .in_cache_bytes = 0}});
    const Dense want = reference_attention(exact(q), positions, exact(k), exact(v), 1.0 / std::sqrt(double(dim)), {});
    EXPECT_LE(max_error<float>(TensorView<const float>(short_runs.data(), q.shape), want), 2e-5) << "D " << dim;
    EXPECT_LE(max_error<float>(TensorView<const float>(whole.data(), q.shape), want), 2e-5) << "D " << dim;
  }
}

TEST(AttentionRuns, ShortRunsAndPrefetchGiveTheSameResultForEveryFormat) {
  expect_run_length_changes_nothing<float>();
  expect_run_length_changes_nothing<double>();
  expect_run_length_changes_nothing<Eigen::half>();
  expect_run_length_changes_nothing<Eigen::bfloat16>();
}

// A decode step of 8 to 16 query rows per kv head read from memory takes the kernel's widest row
// groups (at the native width); read so or as from cache, every format gives the same result
// but for where the online softmax folds (the runs' lengths differ).
template <class T>
void expect_many_rows_read_from_memory_as_from_cache() {
  using In = testing::input_t<T>;
  const std::size_t keys = 300;
  for (const std::size_t dim : {std::size_t{24}, std::size_t{64}, std::size_t{128}}) {
    const Block<In> k({1, 2, keys, dim}, 51);
    const Block<In> v({1, 2, keys, dim}, 52);
    KvCache<T> cache(testing::test_config<T>({.layers = 1, .kv_heads = 2, .head_dim = dim, .capacity = keys}));
    const auto history = cache.update(0, k.view(), v.view(), arange(0, keys));
    for (const std::size_t group : {std::size_t{8}, std::size_t{11}, std::size_t{16}}) {
      const Block<float> q({1, 2 * group, 1, dim}, 53 + group);
      const std::vector<std::int64_t> at = arange(keys, 1);
      std::vector<float> cached(q.data.size());
      std::vector<float> from_memory(q.data.size());
      causal_attention(q.view(), at, history, TensorView<float>(cached.data(), q.shape));
      causal_attention(q.view(), at, history, TensorView<float>(from_memory.data(), q.shape),
                       {.tuning = {.in_cache_bytes = 0}});
      float worst = 0;
      for (std::size_t i = 0; i < cached.size(); ++i) worst = std::max(worst, std::abs(cached[i] - from_memory[i]));
      EXPECT_LE(worst, 2e-6F) << format_name<T>() << ", D " << dim << ", " << group << " query rows a kv head";
    }
  }
}

TEST(AttentionRuns, ManyRowsReadFromMemoryGiveWhatTheyGiveFromCacheForEveryFormat) {
  for_each_format([]<class T>() { expect_many_rows_read_from_memory_as_from_cache<T>(); });
}

// ---------------------------------------------------------------------------------------------
// No head-size cliff: every multiple of 8 from 8 to 256, every format, one and four query rows
// per kv head, decode and a short chunk.

template <class T>
void expect_every_head_size() {
  std::uint64_t seed = 300;
  for (std::size_t dim = 8; dim <= 256; dim += 8) {
    for (const std::size_t group : {std::size_t{1}, std::size_t{4}}) {
      const Case c{1, 2, group, dim, dim % 16 == 0 ? std::size_t{1} : std::size_t{3}, 90, {}, {}, 0, 0.0F};
      run_case<T>(c, Variant::kDense, seed++);
    }
  }
}

TEST(AttentionHeadSizes, EveryMultipleOfEightFrom8To256) {
  expect_every_head_size<float>();
  expect_every_head_size<double>();
  expect_every_head_size<Eigen::half>();
  expect_every_head_size<Eigen::bfloat16>();
}

// ---------------------------------------------------------------------------------------------
// Inputs in the engine's compute type, stored in the cache's format: every (input, stored) pair
// stores what rounding the input once to the format gives, and attention over it matches the
// reference on those rounded values.

template <class T, class In>
void expect_input_rounded_once_and_attended() {
  const std::size_t dim = 32;
  const std::size_t keys = 150;
  const Block<In> k({1, 2, keys, dim}, 51);
  const Block<In> v({1, 2, keys, dim}, 52);
  const Block<float> q({1, 4, 2, dim}, 53);
  KvCache<T> cache({.layers = 1, .kv_heads = 2, .head_dim = dim, .capacity = keys});
  const auto history = cache.update(0, k.view(), v.view(), arange(0, keys));
  Block<T> k_stored({1, 2, keys, dim}, 0);
  Block<T> v_stored({1, 2, keys, dim}, 0);
  for (std::size_t i = 0; i < k.data.size(); ++i) {
    k_stored.data[i] = static_cast<T>(static_cast<double>(detail::widen(k.data[i])));
    v_stored.data[i] = static_cast<T>(static_cast<double>(detail::widen(v.data[i])));
  }
  const Segment<T>& s = history.segments[0];
  std::size_t differ = 0;
  for (std::size_t h = 0; h < 2; ++h)
    for (std::size_t t = 0; t < keys; ++t)
      for (std::size_t d = 0; d < dim; ++d) {
        differ += std::memcmp(&s.keys(0, h, t, d), &k_stored.data[(h * keys + t) * dim + d], sizeof(T)) != 0;
        differ += std::memcmp(&s.values(0, h, t, d), &v_stored.data[(h * keys + t) * dim + d], sizeof(T)) != 0;
      }
  EXPECT_EQ(differ, 0U) << "values not rounded once from the input";
  const std::vector<std::int64_t> positions = arange(keys - 2, 2);
  std::vector<float> out(q.data.size());
  causal_attention(q.view(), positions, history, TensorView<float>(out.data(), q.shape));
  const Dense want =
      reference_attention(exact(q), positions, exact(k_stored), exact(v_stored), 1.0 / std::sqrt(double(dim)), {});
  EXPECT_LE(max_error<float>(TensorView<const float>(out.data(), q.shape), want), 2e-5);
}

template <class T>
void expect_every_input_type() {
  expect_input_rounded_once_and_attended<T, float>();
  expect_input_rounded_once_and_attended<T, Eigen::half>();
  expect_input_rounded_once_and_attended<T, Eigen::bfloat16>();
  if constexpr (std::is_same_v<T, double>) expect_input_rounded_once_and_attended<T, double>();
}

TEST(AttentionInputs, EveryComputeTypeIntoEveryFormat) {
  expect_every_input_type<float>();
  expect_every_input_type<double>();
  expect_every_input_type<Eigen::half>();
  expect_every_input_type<Eigen::bfloat16>();
}

// Rounding to the 16-bit formats is Eigen's (to nearest even, NaN kept) for floats of every
// exponent, the halfway cases and the edges of each format's range.
TEST(AttentionInputs, NarrowingRoundsToNearestEvenAsEigenDoes) {
  std::vector<float> xs = {0.0F,
                           -0.0F,
                           65504.0F,
                           65519.0F,
                           65520.0F,
                           1e-8F,
                           6e-8F,
                           3e-8F,
                           1e38F,
                           -1e38F,
                           3.4e38F,
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity()};
  std::mt19937 rng(5);
  for (int i = 0; i < 200000; ++i) {
    const auto bits = static_cast<std::uint32_t>(rng());
    const float x = std::bit_cast<float>(bits);
    if (!std::isnan(x)) xs.push_back(x);
  }
  for (std::uint32_t h = 0; h < 65536; ++h) {  // every half and bfloat16 value, and the midpoints after them
    for (const std::uint32_t bits : {h << 16, (h << 16) | 0x8000U, (h << 16) | 0x8001U, (h << 16) | 0x7FFFU}) {
      const float x = std::bit_cast<float>(bits);
      if (!std::isnan(x)) xs.push_back(x);
    }
    const float half_value = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(static_cast<std::uint16_t>(h)));
    if (!std::isnan(half_value)) xs.push_back(half_value);
  }
  std::size_t bad = 0;
  for (const float x : xs) {
    bad += detail::bits_of(detail::narrow<Eigen::bfloat16>(x)) != detail::bits_of(Eigen::bfloat16(x));
    bad += detail::bits_of(detail::narrow<Eigen::half>(x)) != detail::bits_of(Eigen::half(x));
  }
  EXPECT_EQ(bad, 0U);
  EXPECT_TRUE(std::isnan(detail::widen(detail::narrow<Eigen::half>(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(detail::widen(detail::narrow<Eigen::bfloat16>(std::numeric_limits<float>::quiet_NaN()))));
}

template <std::size_t B>
void expect_every_half_pattern_widens_exactly() {
  constexpr std::size_t W = B / 4;
  std::size_t bad = 0;
  for (std::uint32_t first = 0; first < 65536; first += W) {
    std::uint16_t bits[W];
    for (std::size_t l = 0; l < W; ++l) bits[l] = static_cast<std::uint16_t>(first + l);
    const auto got = detail::widen_half<B>(bits);
    for (std::size_t l = 0; l < W; ++l) {
      const float want = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(bits[l]));
      const float scalar = detail::float_of_half_bits(bits[l]);
      if (std::isnan(want)) {
        bad += !std::isnan(got[l]) || !std::isnan(scalar);
      } else {
        bad += std::bit_cast<std::uint32_t>(got[l]) != std::bit_cast<std::uint32_t>(want);
        bad += std::bit_cast<std::uint32_t>(scalar) != std::bit_cast<std::uint32_t>(want);
      }
    }
  }
  EXPECT_EQ(bad, 0U) << "B " << B;
}

TEST(AttentionInputs, EveryHalfBitPatternWidensExactlyAtEveryWidth) {
  expect_every_half_pattern_widens_exactly<16>();
  if constexpr (detail::kNativeBytes >= 32) expect_every_half_pattern_widens_exactly<32>();
  if constexpr (detail::kNativeBytes >= 64) expect_every_half_pattern_widens_exactly<64>();
}

// The shuffle tree that sums W dot products at once puts register l's sum in lane l.
template <class V>
void expect_transpose_sum() {
  constexpr std::size_t W = detail::kLanes<V>;
  V a[W];
  for (std::size_t i = 0; i < W; ++i)
    for (std::size_t l = 0; l < W; ++l) a[i][l] = static_cast<std::remove_cvref_t<decltype(a[0][0])>>(i * 100 + l);
  const V sums = detail::transpose_sum(a);
  for (std::size_t k = 0; k < W; ++k) {
    EXPECT_EQ(static_cast<double>(sums[k]), static_cast<double>(k * 100 * W + W * (W - 1) / 2)) << "W " << W;
  }
}

TEST(AttentionMath, TransposeSumPutsRegisterKInLaneK) {
  expect_transpose_sum<detail::Vec<float, 16>>();
  expect_transpose_sum<detail::Vec<double, 16>>();
  if constexpr (detail::kNativeBytes >= 32) expect_transpose_sum<detail::Vec<float, 32>>();
  if constexpr (detail::kNativeBytes >= 64) expect_transpose_sum<detail::Vec<float, 64>>();
}

TEST(AttentionMath, LaneWiseExpMatchesStdExp) {
  using V = detail::Vec<float, 16>;
  for (float x = -100.0F; x <= 0.0F; x += 0.013F) {
    const V got = detail::exp_nonpositive(detail::splat<V>(x));
    const float want = x < -87.0F ? 0.0F : std::exp(x);
    EXPECT_NEAR(got[0], want, 2e-7F * want + 1e-38F) << x;
    EXPECT_EQ(got[0], detail::exp_nonpositive(x)) << x;
  }
  EXPECT_EQ(detail::exp_nonpositive(-std::numeric_limits<float>::infinity()), 0.0F);
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
  EXPECT_EQ(detail::attention_threads(3, 0, kMiB), 3U);
  EXPECT_EQ(detail::attention_threads(1, 1024 * kMiB, kMiB), 1U);
  // Automatic: one thread per `per_thread` bytes of K and V, at least one, at most the hardware's.
  for (const std::size_t per_thread : {kMiB, kMiB / 2}) {
    EXPECT_EQ(detail::attention_threads(0, 0, per_thread), 1U);
    EXPECT_EQ(detail::attention_threads(0, 2 * per_thread - 1, per_thread), 1U);
    EXPECT_EQ(detail::attention_threads(0, 2 * per_thread, per_thread), std::min<std::size_t>(2, hardware));
    EXPECT_EQ(detail::attention_threads(0, 3 * per_thread - 1, per_thread), std::min<std::size_t>(2, hardware));
    EXPECT_EQ(detail::attention_threads(0, per_thread * 1000, per_thread), std::min<std::size_t>(1000, hardware));
  }
  // By default a MiB of K and V per thread, on every processor.
  EXPECT_EQ(AttentionTuning{}.bytes_per_thread, kMiB);
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
