// SPDX-License-Identifier: Apache-2.0
// The quantized formats: their conversions against plain references, their round-trip bounds,
// the input every variant refuses for them, FP8's head scales, and attention reading them in
// place at every head size.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "cache_test_support.hpp"
#include "kvcache/attention.hpp"
#include "kvcache/quantized.hpp"
#include "kvcache/size.hpp"

namespace kvcache::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// ---- FP8 E4M3 ------------------------------------------------------------------------------

/// The OCP e4m3fn value of a code, from its fields: bias 7, subnormals at exponent 0, NaN only
/// at S.1111.111.
double ocp_e4m3(std::uint8_t code) {
  const int sign = (code & 0x80) != 0 ? -1 : 1;
  const int exponent = (code >> 3) & 0xF;
  const int mantissa = code & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return std::numeric_limits<double>::quiet_NaN();
  if (exponent == 0) return sign * std::ldexp(mantissa / 8.0, -6);
  return sign * std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
}

/// The code a plain search picks for x: the nearest finite value, ties to the even code (the
/// even mantissa), magnitudes beyond 448 saturated.
std::uint8_t nearest_e4m3(float x) {
  const auto sign = static_cast<std::uint8_t>(std::signbit(x) ? 0x80 : 0);
  const double magnitude = std::fabs(static_cast<double>(x));
  if (magnitude > 448.0) return sign | 0x7E;
  std::uint8_t best = 0;
  for (std::uint8_t c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(ocp_e4m3(c) - magnitude);
    const double best_d = std::fabs(ocp_e4m3(best) - magnitude);
    if (d < best_d || (d == best_d && (c & 1) == 0)) best = c;
  }
  return sign | best;
}

/// A register of B bytes of format T's values from d on, as floats (with the power of two its
/// load leaves out put back).
template <class T, std::size_t B>
std::vector<float> load_lanes(const typename storage_codec<T>::unit* row, std::size_t d) {
  std::vector<float> lanes(B / 4);
  detail::store(lanes.data(), storage_codec<T>::template load<B>(row, d));
  for (float& x : lanes) x = std::ldexp(x, detail::load_exponent<T>());
  return lanes;
}

TEST(Fp8E4M3, EveryCodeDecodesToItsOcpValueScalarAndInRegisters) {
  std::vector<std::uint8_t> codes(256);
  for (std::size_t c = 0; c < 256; ++c) codes[c] = static_cast<std::uint8_t>(c);
  EXPECT_EQ(ocp_e4m3(0x7E), 448.0);
  EXPECT_EQ(ocp_e4m3(0x01), std::ldexp(1.0, -9));
  for (std::size_t c = 0; c < 256; ++c) {
    const double expected = ocp_e4m3(codes[c]);
    const float got = storage_codec<fp8_e4m3>::value(codes.data(), c);
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), expected) << "code " << c;
    EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code " << c;
  }
  // The register forms, at every width, for every code but the two NaNs (never stored).
  const auto check_width = [&]<std::size_t B>() {
    for (std::size_t d = 0; d + B / 4 <= 256; d += B / 4) {
      const std::vector<float> lanes = load_lanes<fp8_e4m3, B>(codes.data(), d);
      for (std::size_t i = 0; i < lanes.size(); ++i) {
        if ((codes[d + i] & 0x7F) == 0x7F) continue;
        EXPECT_EQ(static_cast<double>(lanes[i]), ocp_e4m3(codes[d + i])) << B << "-byte register, code " << d + i;
      }
    }
  };
  check_width.template operator()<16>();
#if defined(__AVX__)
  check_width.template operator()<32>();
#endif
#if defined(__AVX512F__)
  check_width.template operator()<64>();
#endif
}

TEST(Fp8E4M3, EncodingRoundsToNearestEvenAndSaturatesOnEveryHalfValue) {
  std::size_t checked = 0;
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float x = detail::float_of_half_bits(static_cast<std::uint16_t>(bits));
    if (!std::isfinite(x)) continue;
    ASSERT_EQ(detail::e4m3_of(x), nearest_e4m3(x)) << "half bits " << bits << " = " << x;
    ++checked;
  }
  EXPECT_EQ(checked, 63488U);
  // Boundaries: the largest finite, the midpoint to the next (464, which rounds to 448),
  // beyond it, ties between subnormals and at the normal boundary, float's extremes.
  for (const float x : {448.0F,
                        449.0F,
                        464.0F,
                        std::nextafter(464.0F, 1000.0F),
                        480.0F,
                        1e9F,
                        std::numeric_limits<float>::max(),
                        0x1p-9F,
                        0x1p-10F,
                        3 * 0x1p-10F,
                        5 * 0x1p-10F,
                        0x1p-6F - 0x1p-10F,
                        0x1p-6F,
                        0x1.1p-6F,
                        0x1.18p-6F,
                        1.0625F,
                        1.1875F,
                        0x1p-149F,
                        std::numeric_limits<float>::min(),
                        0.0F,
                        -0.0F,
                        240.0F,
                        248.0F,
                        256.0F}) {
    EXPECT_EQ(detail::e4m3_of(x), nearest_e4m3(x)) << x;
    EXPECT_EQ(detail::e4m3_of(-x), nearest_e4m3(-x)) << -x;
  }
  EXPECT_EQ(detail::e4m3_of(464.0F), 0x7E);
  EXPECT_EQ(detail::e4m3_of(-1e30F), 0xFE);
  EXPECT_EQ(detail::e4m3_of(0x1p-10F), 0x00);      // a tie rounds to the even code, zero
  EXPECT_EQ(detail::e4m3_of(3 * 0x1p-10F), 0x02);  // and between 1 and 2 steps, to 2
  EXPECT_EQ(detail::e4m3_of(std::numeric_limits<float>::quiet_NaN()) & 0x7F, 0x7F);
}

// ---- int8 and int4 round trips -------------------------------------------------------------

/// Rows of a few shapes and magnitudes, a row of zeros and a constant row among them.
std::vector<std::vector<float>> sample_rows(std::size_t dim) {
  std::mt19937_64 rng(dim);
  std::vector<std::vector<float>> rows;
  for (const float magnitude : {1e-30F, 1e-3F, 1.0F, 300.0F, 6e4F}) {
    for (int shape = 0; shape < 3; ++shape) {
      std::vector<float> row(dim);
      std::normal_distribution<float> normal(0.0F, magnitude);
      std::uniform_real_distribution<float> uniform(-magnitude, magnitude);
      for (float& x : row) {
        x = shape == 0 ? normal(rng) : shape == 1 ? uniform(rng) : magnitude * 0.5F + uniform(rng) * 1e-3F;
        x = std::clamp(x, -65504.0F, 65504.0F);  // what every format takes
      }
      rows.push_back(row);
    }
  }
  rows.emplace_back(dim, 0.0F);
  rows.emplace_back(dim, -2.5F);
  return rows;
}

TEST(Int8Rows, EveryValueIsWithinHalfAStepOfItsRow) {
  using Codec = storage_codec<int8_rows>;
  for (const std::size_t dim : {8U, 64U, 72U, 128U}) {
    for (const std::vector<float>& row : sample_rows(dim)) {
      std::vector<std::int8_t> stored(Codec::units(dim));
      const float scale = Codec::encode(row.data(), stored.data(), dim);
      float amax = 0.0F;
      for (const float x : row) amax = std::max(amax, std::fabs(x));
      EXPECT_FLOAT_EQ(scale, amax > 0 ? amax / 127.0F : 1.0F);
      for (std::size_t d = 0; d < dim; ++d) {
        EXPECT_LE(std::abs(static_cast<int>(stored[d])), 127);
        const float back = Codec::value(stored.data(), d) * scale;
        EXPECT_LE(std::fabs(back - row[d]), 0.5F * scale * (1 + 1e-5F)) << "dim " << dim << ", value " << row[d];
      }
    }
  }
}

TEST(Int4Groups, EveryValueIsWithinHalfAStepOfItsGroupAndTheStepIsTight) {
  using Codec = storage_codec<int4_groups>;
  for (const std::size_t dim : {8U, 32U, 40U, 128U, 200U}) {
    EXPECT_EQ(Codec::units(dim), (dim + 31) / 32 * 20);
    for (const std::vector<float>& row : sample_rows(dim)) {
      std::vector<std::uint8_t> stored(Codec::units(dim));
      Codec::encode(row.data(), stored.data(), dim);
      for (std::size_t g0 = 0; g0 < dim; g0 += 32) {
        const std::size_t n = std::min<std::size_t>(32, dim - g0);
        std::uint16_t bits[2];
        std::memcpy(bits, stored.data() + g0 / 32 * 20, 4);
        const float step = detail::float_of_half_bits(bits[0]);
        const float min = detail::float_of_half_bits(bits[1]);
        float lo = row[g0], hi = row[g0];
        for (std::size_t i = 0; i < n; ++i) {
          lo = std::min(lo, row[g0 + i]);
          hi = std::max(hi, row[g0 + i]);
        }
        EXPECT_LE(min, lo);
        // The step covers the group, and is not much more than (hi - lo) / 15: the minimum and
        // step each round outward by at most one half-precision step.
        EXPECT_GE(min + 15 * step, hi - 1e-6F * std::fabs(hi));
        const float slack = std::ldexp(1.0F, std::ilogb(std::max({std::fabs(lo), std::fabs(hi), 6.2e-5F})) - 10);
        EXPECT_LE(step, (hi - lo) / 15 + slack) << "group at " << g0 << " of dim " << dim;
        for (std::size_t i = 0; i < n; ++i) {
          const float back = Codec::value(stored.data(), g0 + i);
          EXPECT_LE(std::fabs(back - row[g0 + i]), 0.5F * step + 1e-6F * std::fabs(row[g0 + i]) + 1e-37F)
              << "dim " << dim << ", index " << g0 + i;
        }
      }
    }
  }
}

// ---- what every variant refuses for the quantized formats ----------------------------------

template <class Cache>
class QuantizedCaches : public ::testing::Test {};
using QuantizedCacheTypes =
    ::testing::Types<KvCache<fp8_e4m3>, KvCache<int8_rows>, KvCache<int4_groups>, ConcatKvCache<fp8_e4m3>,
                     ConcatKvCache<int8_rows>, ConcatKvCache<int4_groups>, RingKvCache<fp8_e4m3>,
                     RingKvCache<int8_rows>, RingKvCache<int4_groups>, SlotKvCache<fp8_e4m3>, SlotKvCache<int8_rows>,
                     SlotKvCache<int4_groups>>;
TYPED_TEST_SUITE(QuantizedCaches, QuantizedCacheTypes, CacheName);

TYPED_TEST(QuantizedCaches, NonFiniteInputIsRefusedNamingLayerHeadAndTokenWithTheCacheUnchanged) {
  using Cache = TypeParam;
  using T = typename Cache::value_type;
  constexpr std::size_t B = batch_of<Cache>, H = 2, D = 40;
  KvCacheConfig config{.layers = 2, .batch = B, .kv_heads = H, .head_dim = D, .capacity = 32};
  if constexpr (is_ring<Cache>) config.window = 8;
  // Scales from the first update: a refused first update must not set them either.
  Cache cache(config);
  const Block<float> first({B, H, 3, D}, 5);
  Block<float> bad({B, H, 4, D}, 6);
  const auto refused = [&](std::size_t layer, float value, const std::vector<std::string>& words) {
    const auto before_history = flatten(cache.update(layer, first.view().tokens(0, 0), first.view().tokens(0, 0),
                                                     arange(layer_length(cache, layer), 0)));
    const std::size_t length = layer_length(cache, layer), bytes = cache.bytes(), clipped = cache.clipped();
    const std::vector<float> key_scales = cache.head_scales(false), value_scales = cache.head_scales(true);
    bad.mutable_view()(1, 1, 2, 3) = value;
    try {
      cache.update(layer, bad.view(), bad.view(), arange(length, 4));
      ADD_FAILURE() << "no exception for " << value;
    } catch (const std::invalid_argument& e) {
      for (const std::string& w : words) EXPECT_THAT(e.what(), HasSubstr(w));
    }
    bad.mutable_view()(1, 1, 2, 3) = 0.25F;
    EXPECT_EQ(layer_length(cache, layer), length);
    EXPECT_EQ(cache.bytes(), bytes);
    EXPECT_EQ(cache.clipped(), clipped);
    EXPECT_EQ(cache.head_scales(false), key_scales);
    EXPECT_EQ(cache.head_scales(true), value_scales);
    EXPECT_EQ(flatten(cache.update(layer, first.view().tokens(0, 0), first.view().tokens(0, 0), arange(length, 0))),
              before_history);
  };
  const std::string name = storage_codec<T>::name;
  refused(1, std::numeric_limits<float>::quiet_NaN(), {"layer 1", "kv head 1", "token 2", "index 3", "nan", name});
  cache.update(1, first.view(), first.view(), arange(0, 3));
  refused(1, std::numeric_limits<float>::infinity(), {"layer 1", "k[", "kv head 1", "token 2", "inf"});
  refused(1, -std::numeric_limits<float>::infinity(), {"layer 1", "-inf"});
  if constexpr (std::is_same_v<T, int4_groups>) refused(1, 70000.0F, {"65504", "70000"});
  // And a good update still goes in after all of them.
  cache.update(1, bad.view(), bad.view(), arange(3, 4));
  EXPECT_EQ(layer_length(cache, 1), 7U);
}

// ---- FP8's head scales -----------------------------------------------------------------------

TEST(Fp8Scales, TheFirstUpdateSetsEachHeadsScaleAndLaterValuesBeyondItSaturateAndAreCounted) {
  KvCache<fp8_e4m3> cache({.layers = 2, .kv_heads = 2, .head_dim = 8, .capacity = 8});
  Block<float> k({1, 2, 2, 8}, 1), v({1, 2, 2, 8}, 2);
  k.mutable_view()(0, 0, 1, 4) = -2.0F;  // head 0's largest magnitude
  k.mutable_view()(0, 1, 0, 0) = 0.5F;   // inputs are in [-1, 1]: head 1's is 1 at most
  cache.update(0, k.view(), v.view(), arange(0, 2));
  float head1 = 0.0F;
  for (std::size_t t = 0; t < 2; ++t)
    for (std::size_t d = 0; d < 8; ++d) head1 = std::max(head1, std::fabs(k.view()(0, 1, t, d)));
  const std::vector<float> keys = cache.head_scales(false);
  ASSERT_EQ(keys.size(), 4U);
  EXPECT_FLOAT_EQ(keys[0], 2.0F / 448);
  EXPECT_FLOAT_EQ(keys[1], head1 / 448);
  EXPECT_EQ(keys[2], 0.0F);  // layer 1 has had no update
  EXPECT_EQ(cache.clipped(), 0U);

  // 2.0 x 1.04 rounds to 448 x scale, within the format's rounding; 3.0 is beyond it.
  Block<float> later({1, 2, 1, 8}, 3);
  for (float& x : later.data) x *= 0.5F;  // within every head's range
  later.mutable_view()(0, 0, 0, 0) = 2.0F * 1.03F;
  later.mutable_view()(0, 0, 0, 1) = -3.0F;
  Block<float> quiet({1, 2, 1, 8}, 4);
  for (float& x : quiet.data) x *= 0.5F;
  const auto history = cache.update(0, later.view(), quiet.view(), arange(2, 1));
  EXPECT_EQ(cache.clipped(), 1U);
  const Segment<fp8_e4m3>& s = history.segments[0];
  EXPECT_EQ(s.keys.row(0, 0, 2)[0], 0x7E);
  EXPECT_EQ(s.keys.row(0, 0, 2)[1], 0xFE);
  EXPECT_FLOAT_EQ(*s.key_scales.at(0, 0, 2), 2.0F / 448);
  EXPECT_EQ(cache.head_scales(false)[0], keys[0]);  // a later update never changes a scale

  cache.reset();
  EXPECT_EQ(cache.head_scales(false), std::vector<float>(4, 0.0F));
  EXPECT_EQ(cache.clipped(), 1U);  // counted since construction
}

TEST(Fp8Scales, CalibratedScalesAreUsedAndKeptThroughReset) {
  const std::vector<float> key_scales{0.01F, 0.02F}, value_scales{0.03F, 0.04F};
  KvCache<fp8_e4m3> cache({.layers = 2,
                           .kv_heads = 1,
                           .head_dim = 8,
                           .capacity = 8,
                           .key_scales = key_scales,
                           .value_scales = value_scales});
  const Block<float> k({1, 1, 1, 8}, 1), v({1, 1, 1, 8}, 2);
  for (int round = 0; round < 2; ++round) {
    const auto history = cache.update(1, k.view(), v.view(), arange(0, 1));
    for (std::size_t d = 0; d < 8; ++d) {
      EXPECT_EQ(history.segments[0].keys.row(0, 0, 0)[d], detail::e4m3_of(k.view()(0, 0, 0, d) / 0.02F));
      EXPECT_EQ(history.segments[0].values.row(0, 0, 0)[d], detail::e4m3_of(v.view()(0, 0, 0, d) / 0.04F));
    }
    EXPECT_EQ(cache.clipped(), 0U);
    cache.reset();
  }
  EXPECT_EQ(cache.head_scales(false), key_scales);
  EXPECT_EQ(cache.head_scales(true), value_scales);
}

TEST(Fp8Scales, TheSmallestScalesStoreNoNaN) {
  const std::vector<float> tiny{1e-44F};
  KvCache<fp8_e4m3> cache(
      {.layers = 1, .kv_heads = 1, .head_dim = 8, .capacity = 8, .key_scales = tiny, .value_scales = tiny});
  Block<float> k({1, 1, 1, 8}, 1);
  k.data[0] = 0.0F;
  const auto history = cache.update(0, k.view(), k.view(), arange(0, 1));
  EXPECT_EQ(history.segments[0].keys.row(0, 0, 0)[0], 0x00);
  for (std::size_t d = 1; d < 8; ++d) EXPECT_EQ(history.segments[0].keys.row(0, 0, 0)[d] & 0x7F, 0x7E) << d;
  EXPECT_EQ(cache.clipped(), 14U);
  // int8 rows of values whose amax / 127 is 0 in float store as zeros with a scale of 1.
  const std::vector<float> row(8, 1e-44F);
  std::vector<std::int8_t> stored(8, 1);
  EXPECT_EQ(storage_codec<int8_rows>::encode(row.data(), stored.data(), 8), 1.0F);
  EXPECT_EQ(stored, std::vector<std::int8_t>(8, 0));
}

TEST(Fp8Scales, BadScalesInTheConfigAreRefusedNamingTheField) {
  const std::vector<float> two{0.1F, 0.1F}, three{0.1F, 0.1F, 0.1F}, zero{0.1F, 0.0F}, nan{0.1F, std::nanf("")};
  const auto refused = [](const KvCacheConfig& c, const std::vector<std::string>& words) {
    try {
      KvCache<fp8_e4m3> cache(c);
      ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
      for (const std::string& w : words) EXPECT_THAT(e.what(), HasSubstr(w));
    }
  };
  const KvCacheConfig base{.layers = 2, .kv_heads = 1, .head_dim = 8, .capacity = 8};
  KvCacheConfig c = base;
  c.key_scales = three;
  c.value_scales = two;
  refused(c, {"key_scales", "expected 2", "given 3"});
  c.key_scales = zero;
  refused(c, {"key_scales[1]", "positive", "given 0"});
  c.key_scales = two;
  c.value_scales = nan;
  refused(c, {"value_scales[1]", "nan"});
  c.value_scales = {};
  refused(c, {"both"});
  c.value_scales = two;
  EXPECT_THROW(KvCache<int8_rows>{c}, std::invalid_argument);  // int8 keeps a scale a row, not a head
  EXPECT_NO_THROW(KvCache<fp8_e4m3>{c});
}

// ---- attention reads the formats in place ------------------------------------------------------

/// A history of format T decoded to float: what attention must read.
template <class T>
std::vector<float> decoded(const TensorView<const typename storage_codec<T>::unit>& rows, const RowScales& scales,
                           std::size_t dim) {
  std::vector<float> out;
  for (std::size_t h = 0; h < rows.heads(); ++h) {
    for (std::size_t t = 0; t < rows.tokens(); ++t) {
      const float scale = storage_codec<T>::row_scales ? *scales.at(0, h, t) : 1.0F;
      for (std::size_t d = 0; d < dim; ++d) out.push_back(storage_codec<T>::value(rows.row(0, h, t), d) * scale);
    }
  }
  return out;
}

/// Keys and values of magnitude up to `kv`, queries up to `query`.
template <class T>
void expect_in_place_read_equals_decoded_rows(std::size_t dim, float kv = 1, float query = 1) {
  constexpr std::size_t H = 2, G = 2, S = 37, chunk = 3;
  KvCache<T> cache({.layers = 1, .kv_heads = H, .head_dim = dim, .capacity = S});
  Block<float> k({1, H, S, dim}, dim), v({1, H, S, dim}, dim + 1), q({1, H * G, chunk, dim}, dim + 2);
  for (float& x : k.data) x *= kv;
  for (float& x : v.data) x *= kv;
  for (float& x : q.data) x *= query;
  const History<T> history = cache.update(0, k.view(), v.view(), arange(0, S));
  const Segment<T>& s = history.segments[0];
  const std::vector<float> keys = decoded<T>(s.keys, s.key_scales, dim),
                           values = decoded<T>(s.values, s.value_scales, dim);
  const auto positions = arange(0, S);
  const Segment<float> plain{TensorView<const float>(keys.data(), {1, H, S, dim}),
                             TensorView<const float>(values.data(), {1, H, S, dim}), positions};
  const auto q_positions = arange(S - chunk, chunk);
  std::vector<float> got(q.data.size()), want(q.data.size());
  causal_attention(q.view(), q_positions, history, TensorView<float>(got.data(), q.shape));
  causal_attention(q.view(), q_positions, History<float>{std::span(&plain, 1)},
                   TensorView<float>(want.data(), q.shape));
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 2e-6F * (kv + std::fabs(want[i]))) << storage_codec<T>::name << ", dim " << dim;
  }
}

TEST(QuantizedAttention, ReadsRowsInPlaceAsTheirDecodedValuesAtEveryHeadSize) {
  for (std::size_t dim = 8; dim <= 256; dim += 8) {
    expect_in_place_read_equals_decoded_rows<fp8_e4m3>(dim);
    expect_in_place_read_equals_decoded_rows<int8_rows>(dim);
    expect_in_place_read_equals_decoded_rows<int4_groups>(dim);
  }
}

#if defined(__SSE__)
/// Sets the calling thread's flush-to-zero mode for its lifetime.
class FlushToZero {
 public:
  FlushToZero() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | _MM_FLUSH_ZERO_ON); }
  ~FlushToZero() { _mm_setcsr(saved_); }
  FlushToZero(const FlushToZero&) = delete;
  FlushToZero& operator=(const FlushToZero&) = delete;

 private:
  unsigned int saved_;
};

TEST(QuantizedAttention, SmallQueriesAgainstLargeKeysSurviveFlushToZero) {
  // Each product q x k is then small: the kernel must keep fp8's load exponent out of them, or
  // an engine running with flush-to-zero would read scores of 0.
  const FlushToZero mode;
  for (const std::size_t dim : {std::size_t{16}, std::size_t{40}, std::size_t{128}})
    expect_in_place_read_equals_decoded_rows<fp8_e4m3>(dim, 1e6F, 1e-6F);
}
#endif

// ---- sizes ---------------------------------------------------------------------------------------

TEST(QuantizedSizes, BytesPerTokenForQwen3At32kAndWhatACacheAllocates) {
  constexpr std::size_t GiB = std::size_t{1} << 30, tokens = 32 * 1024;
  EXPECT_EQ(kv_bytes_per_token<Eigen::bfloat16>(28, 8, 128) * tokens, 3 * GiB + GiB / 2);
  EXPECT_EQ(kv_bytes_per_token<fp8_e4m3>(28, 8, 128) * tokens, GiB + 3 * GiB / 4);
  EXPECT_EQ(kv_bytes_per_token<int8_rows>(28, 8, 128), 2U * 28 * 8 * (128 + 4));
  EXPECT_EQ(kv_bytes_per_token<int4_groups>(28, 8, 128), 2U * 28 * 8 * 80);
  const KvCacheConfig config{.layers = 3, .batch = 2, .kv_heads = 2, .head_dim = 40, .capacity = 16};
  EXPECT_EQ(KvCache<fp8_e4m3>(config).bytes(), 2 * 16 * kv_bytes_per_token<fp8_e4m3>(3, 2, 40) + 2 * 3 * 2 * 4);
  EXPECT_EQ(KvCache<int8_rows>(config).bytes(), 2 * 16 * kv_bytes_per_token<int8_rows>(3, 2, 40));
  EXPECT_EQ(KvCache<int4_groups>(config).bytes(), 2 * 16 * kv_bytes_per_token<int4_groups>(3, 2, 40));
}

}  // namespace
}  // namespace kvcache::testing
