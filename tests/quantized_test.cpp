// SPDX-License-Identifier: Apache-2.0
// The quantized formats: their conversions against plain references, their round-trip bounds,
// the rotation int4_rotated applies, the input every variant refuses for them, FP8's row and head
// scales, and attention reading them in place at every head size.

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

/// Calls check.template operator()<B>() for every register width B the build has.
template <class Check>
void for_each_register_width(const Check& check) {
  check.template operator()<16>();
#if defined(__AVX__)
  check.template operator()<32>();
#endif
#if defined(__AVX512F__)
  check.template operator()<64>();
#endif
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
  for_each_register_width([&]<std::size_t B>() {
    for (std::size_t d = 0; d + B / 4 <= 256; d += B / 4) {
      const std::vector<float> lanes = load_lanes<fp8_e4m3, B>(codes.data(), d);
      for (std::size_t i = 0; i < lanes.size(); ++i) {
        if ((codes[d + i] & 0x7F) == 0x7F) continue;
        EXPECT_EQ(static_cast<double>(lanes[i]), ocp_e4m3(codes[d + i])) << B << "-byte register, code " << d + i;
      }
    }
  });
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

TEST(Fp8Rows, EachRowIsScaledByItsOwnLargestMagnitudeAndKeepsE4M3sRelativeStep) {
  using Codec = storage_codec<fp8_e4m3>;
  for (const std::size_t dim : {8U, 64U, 72U, 128U}) {
    for (const std::vector<float>& row : sample_rows(dim)) {
      std::vector<std::uint8_t> stored(Codec::units(dim));
      const float scale = Codec::encode(row.data(), stored.data(), dim, 1.0F).scale;
      float amax = 0.0F;
      for (const float x : row) amax = std::max(amax, std::fabs(x));
      EXPECT_FLOAT_EQ(scale, amax / 448.0F > 0 ? amax / 448.0F : 1.0F);
      for (std::size_t d = 0; d < dim; ++d) {
        EXPECT_EQ(stored[d], detail::e4m3_of(row[d] / scale)) << "dim " << dim << ", index " << d;
        EXPECT_NE(stored[d] & 0x7F, 0x7F) << "no NaN";
        const float back = Codec::value(stored.data(), d) * scale;
        // Half of E4M3's step: 2^-4 of the value, or of 2^-6 (its subnormals' step is 2^-9).
        const float bound = std::max(std::fabs(row[d]), 0x1p-6F * scale) * 0x1p-4F * (1 + 1e-5F);
        EXPECT_LE(std::fabs(back - row[d]), bound) << "dim " << dim << ", value " << row[d];
      }
    }
  }
}

TEST(Int8Rows, EveryValueIsWithinHalfAStepOfItsRow) {
  using Codec = storage_codec<int8_rows>;
  for (const std::size_t dim : {8U, 64U, 72U, 128U}) {
    for (const std::vector<float>& row : sample_rows(dim)) {
      std::vector<std::int8_t> stored(Codec::units(dim));
      const float scale = Codec::encode(row.data(), stored.data(), dim, 1.0F).scale;
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

/// Every value of an int4 row of format T, in groups of G, is within half a step of the value
/// encoded (the row rotated, for int4_rotated), and the step is tight around its group's range.
template <class T, std::size_t G>
void expect_int4_groups_within_half_a_step() {
  using Codec = storage_codec<T>;
  constexpr std::size_t kGroupBytes = 4 + G / 2;
  for (const std::size_t dim : {8U, 16U, 32U, 40U, 48U, 128U, 200U}) {
    EXPECT_EQ(Codec::units(dim), (dim + G - 1) / G * kGroupBytes);
    for (std::vector<float> row : sample_rows(dim)) {
      if constexpr (detail::is_rotated<T>) {
        for (float& x : row) x = std::clamp(x, -Codec::max_magnitude, Codec::max_magnitude);
      }
      std::vector<std::uint8_t> stored(Codec::units(dim));
      Codec::encode(row.data(), stored.data(), dim, 1.0F);
      if constexpr (detail::is_rotated<T>) Codec::rotate(row.data(), dim);  // what the groups hold
      for (std::size_t g0 = 0; g0 < dim; g0 += G) {
        const std::size_t n = std::min<std::size_t>(G, dim - g0);
        std::uint16_t bits[2];
        std::memcpy(bits, stored.data() + g0 / G * kGroupBytes, 4);
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
              << Codec::name << ", dim " << dim << ", index " << g0 + i;
        }
      }
    }
  }
}

TEST(Int4Groups, EveryValueIsWithinHalfAStepOfItsGroupAndTheStepIsTight) {
  expect_int4_groups_within_half_a_step<int4_groups, 32>();
}

TEST(Int4Rotated, EveryRotatedValueIsWithinHalfAStepOfItsGroupAndTheStepIsTight) {
  expect_int4_groups_within_half_a_step<int4_rotated, 16>();
}

/// The register forms of an int4 format's load against its scalar value(), at every width.
template <class T>
void expect_loads_match_values(std::size_t dim) {
  using Codec = storage_codec<T>;
  std::vector<float> row(dim);
  std::mt19937_64 rng(dim);
  std::normal_distribution<float> normal(0.0F, 3.0F);
  for (float& x : row) x = normal(rng);
  std::vector<std::uint8_t> stored(Codec::units(dim));
  Codec::encode(row.data(), stored.data(), dim, 1.0F);
  for_each_register_width([&]<std::size_t B>() {
    for (std::size_t d = 0; d + B / 4 <= dim; d += B / 4) {
      const std::vector<float> lanes = load_lanes<T, B>(stored.data(), d);
      for (std::size_t i = 0; i < lanes.size(); ++i) {
        EXPECT_EQ(lanes[i], Codec::value(stored.data(), d + i))
            << Codec::name << ", " << B << " bytes, index " << d + i;
      }
    }
  });
}

TEST(Int4Rotated, RegistersReadTheValuesScalarCodeReads) {
  for (const std::size_t dim : {16U, 48U, 64U, 128U}) {
    expect_loads_match_values<int4_groups>(dim);
    expect_loads_match_values<int4_rotated>(dim);
  }
}

TEST(Int4Rotated, TheRotationIsOrthogonalAndMixesTheLargestPowerOfTwoBlock) {
  EXPECT_EQ(detail::rotation_block(16), 16U);
  EXPECT_EQ(detail::rotation_block(48), 16U);
  EXPECT_EQ(detail::rotation_block(40), 8U);
  EXPECT_EQ(detail::rotation_block(128), 128U);
  EXPECT_EQ(detail::rotation_block(512), 256U);
  EXPECT_EQ(detail::rotation_block(7), 1U);
  using Codec = storage_codec<int4_rotated>;
  for (const std::size_t dim : {7U, 16U, 40U, 48U, 128U, 512U}) {
    std::mt19937_64 rng(dim);
    std::normal_distribution<float> normal;
    std::vector<float> x(dim), y(dim);
    for (std::size_t i = 0; i < dim; ++i) {
      x[i] = normal(rng);
      y[i] = normal(rng);
    }
    std::vector<float> rx = x, ry = y;
    Codec::rotate(rx.data(), dim);
    Codec::rotate(ry.data(), dim);
    double dot = 0, rotated_dot = 0, scale = 0;
    for (std::size_t i = 0; i < dim; ++i) {
      dot += double{x[i]} * y[i];
      rotated_dot += double{rx[i]} * ry[i];
      scale += std::fabs(double{x[i]} * y[i]);
    }
    EXPECT_NEAR(rotated_dot, dot, 1e-6 * scale) << "dim " << dim;  // q . k is unchanged
    std::vector<float> back = rx;
    Codec::unrotate(back.data(), dim);
    for (std::size_t i = 0; i < dim; ++i) EXPECT_NEAR(back[i], x[i], 1e-6F * (1 + std::fabs(x[i]))) << i;
    // One channel spreads over its block alone: a unit vector's image has block values of
    // magnitude 1 / sqrt(block), and zeros elsewhere.
    const std::size_t block = detail::rotation_block(dim);
    std::vector<float> unit(dim, 0.0F);
    unit[dim - 1] = 1.0F;
    Codec::rotate(unit.data(), dim);
    for (std::size_t i = 0; i < dim; ++i) {
      const float expected = i >= dim - block ? 1.0F / std::sqrt(static_cast<float>(block)) : 0.0F;
      EXPECT_NEAR(std::fabs(unit[i]), expected, 1e-6F) << "dim " << dim << ", index " << i;
    }
  }
}

TEST(Int4Rotated, AnOutsizedChannelCostsItsNeighboursLessThanInGroupsOfTheirOwn) {
  // A row with one channel 40x the others' spread: int4_groups' group that holds it spends its
  // 16 levels on that channel; rotated, it is spread over every channel of the block.
  constexpr std::size_t dim = 128;
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> row(dim);
  for (float& x : row) x = normal(rng);
  row[5] = 40.0F;
  const auto error_besides_the_outlier = [&]<class T>() {
    std::vector<std::uint8_t> stored(storage_codec<T>::units(dim));
    storage_codec<T>::encode(row.data(), stored.data(), dim, 1.0F);
    std::vector<float> back(dim);
    for (std::size_t d = 0; d < dim; ++d) back[d] = storage_codec<T>::value(stored.data(), d);
    if constexpr (detail::is_rotated<T>) storage_codec<T>::unrotate(back.data(), dim);
    double squared = 0;
    for (std::size_t d = 0; d < dim; ++d) squared += d == 5 ? 0.0 : (back[d] - row[d]) * (back[d] - row[d]);
    return squared;
  };
  const double groups = error_besides_the_outlier.template operator()<int4_groups>();
  const double rotated = error_besides_the_outlier.template operator()<int4_rotated>();
  EXPECT_LT(rotated, 0.5 * groups) << "int4_groups " << groups << ", int4_rotated " << rotated;
}

// ---- what every variant refuses for the quantized formats ----------------------------------

template <class Cache>
class QuantizedCaches : public ::testing::Test {};
using QuantizedCacheTypes = gtest_types<cache_variants::over<quantized_formats>>;
TYPED_TEST_SUITE(QuantizedCaches, QuantizedCacheTypes, CacheName);

TYPED_TEST(QuantizedCaches, NonFiniteInputIsRefusedNamingLayerHeadAndTokenWithTheCacheUnchanged) {
  using Cache = TypeParam;
  using T = typename Cache::value_type;
  constexpr std::size_t B = batch_of<Cache>, H = 2, D = 40;
  KvCacheConfig config{.layers = 2, .batch = B, .kv_heads = H, .head_dim = D, .capacity = 32};
  if constexpr (is_ring<Cache>) config.window = 8;
  Cache cache(test_config<T>(config));
  const Block<float> first({B, H, 3, D}, 5);
  Block<float> bad({B, H, 4, D}, 6);
  const auto refused = [&](std::size_t layer, float value, const std::vector<std::string>& words) {
    const auto before_history = flatten(cache.update(layer, first.view().tokens(0, 0), first.view().tokens(0, 0),
                                                     arange(layer_length(cache, layer), 0)));
    const std::size_t length = layer_length(cache, layer), bytes = cache.bytes(), clipped = cache.clipped();
    const std::vector<float> key_scales = cache.key_head_scales(), value_scales = cache.value_head_scales();
    bad.mutable_view()(B - 1, 1, 2, 3) = value;
    try {
      cache.update(layer, bad.view(), bad.view(), arange(length, 4));
      ADD_FAILURE() << "no exception for " << value;
    } catch (const std::invalid_argument& e) {
      for (const std::string& w : words) EXPECT_THAT(e.what(), HasSubstr(w));
    }
    bad.mutable_view()(B - 1, 1, 2, 3) = 0.25F;
    EXPECT_EQ(layer_length(cache, layer), length);
    EXPECT_EQ(cache.bytes(), bytes);
    EXPECT_EQ(cache.clipped(), clipped);
    EXPECT_EQ(cache.key_head_scales(), key_scales);
    EXPECT_EQ(cache.value_head_scales(), value_scales);
    EXPECT_EQ(flatten(cache.update(layer, first.view().tokens(0, 0), first.view().tokens(0, 0), arange(length, 0))),
              before_history);
  };
  const std::string name = storage_codec<T>::name;
  refused(1, std::numeric_limits<float>::quiet_NaN(), {"layer 1", "kv head 1", "token 2", "index 3", "nan", name});
  cache.update(1, first.view(), first.view(), arange(0, 3));
  refused(1, std::numeric_limits<float>::infinity(), {"layer 1", "k[", "kv head 1", "token 2", "inf"});
  refused(1, -std::numeric_limits<float>::infinity(), {"layer 1", "-inf"});
  if constexpr (std::is_same_v<T, int4_groups>) refused(1, 70000.0F, {"65504", "70000"});
  if constexpr (std::is_same_v<T, int4_rotated>) refused(1, 4500.0F, {"4000", "4500"});
  // And a good update still goes in after all of them.
  cache.update(1, bad.view(), bad.view(), arange(3, 4));
  EXPECT_EQ(layer_length(cache, 1), 7U);
}

// ---- FP8's scales ------------------------------------------------------------------------------

TEST(Fp8Rows, NeedNoCalibrationAndNothingSaturatesWhateverTheFirstUpdateHeld) {
  // A first token of small values, then tokens 1000x larger and 1000x smaller: each row keeps
  // its own scale, so nothing saturates and the small ones keep E4M3's relative step.
  KvCache<fp8_e4m3> cache({.layers = 1, .kv_heads = 2, .head_dim = 8, .capacity = 8});
  Block<float> k({1, 2, 3, 8}, 1), v({1, 2, 3, 8}, 2);
  for (std::size_t d = 0; d < 8; ++d) {
    for (std::size_t h = 0; h < 2; ++h) {
      k.mutable_view()(0, h, 1, d) *= 1000.0F;
      k.mutable_view()(0, h, 2, d) *= 1e-3F;
    }
  }
  cache.update(0, k.view().tokens(0, 1), v.view().tokens(0, 1), arange(0, 1));
  const auto history = cache.update(0, k.view().tokens(1, 2), v.view().tokens(1, 2), arange(1, 2));
  EXPECT_EQ(cache.clipped(), 0U);
  EXPECT_TRUE(cache.key_head_scales().empty());
  const Segment<fp8_e4m3>& s = history.segments[0];
  for (std::size_t h = 0; h < 2; ++h) {
    for (std::size_t t = 0; t < 3; ++t) {
      float amax = 0.0F;
      for (std::size_t d = 0; d < 8; ++d) amax = std::max(amax, std::fabs(k.view()(0, h, t, d)));
      EXPECT_FLOAT_EQ(*s.key_scales.at(0, h, t), amax / 448.0F) << "head " << h << ", token " << t;
      for (std::size_t d = 0; d < 8; ++d) {
        const float x = k.view()(0, h, t, d);
        const float back = storage_codec<fp8_e4m3>::value(s.keys.row(0, h, t), d) * *s.key_scales.at(0, h, t);
        EXPECT_LE(std::fabs(back - x), std::max(std::fabs(x), amax * 0x1p-6F / 448.0F) * 0x1p-4F * 1.0001F);
      }
    }
  }
  // 4 bytes of scale a row beside its codes.
  EXPECT_EQ(cache.bytes(), 2U * 2 * 8 * (8 + 4));
}

TEST(Fp8HeadScales, AreRequiredInTheConfigNamingWhereToFindThem) {
  const KvCacheConfig config{.layers = 2, .kv_heads = 3, .head_dim = 8, .capacity = 8};
  expect_throw_naming([&] { KvCache<fp8_e4m3_heads> cache(config); }, Throws::invalid_argument,
                      {"key_scales", "6 scales", "calibrate_head_scales", "fp8_e4m3", "none"});
  expect_throw_naming([&] { SlotKvCache<fp8_e4m3_heads> cache(config); }, Throws::invalid_argument,
                      {"SlotKvCache", "key_scales"});
  expect_throw_naming([&] { BlockPool<fp8_e4m3_heads> pool({.layers = 2, .kv_heads = 3, .head_dim = 8, .blocks = 4}); },
                      Throws::invalid_argument, {"BlockPool", "key_scales"});
}

TEST(Fp8HeadScales, TheGivenScalesEncodeEveryUpdateAndValuesBeyondThemSaturateAndAreCounted) {
  const std::vector<float> key_scales{2.0F / 448, 1.0F / 448, 1.0F / 448, 1.0F / 448};
  const std::vector<float> value_scales(4, 1.0F / 448);
  KvCache<fp8_e4m3_heads> cache({.layers = 2,
                                 .kv_heads = 2,
                                 .head_dim = 8,
                                 .capacity = 8,
                                 .key_scales = key_scales,
                                 .value_scales = value_scales});
  const Block<float> k({1, 2, 2, 8}, 1), v({1, 2, 2, 8}, 2);  // in [-1, 1]: within every scale
  cache.update(0, k.view(), v.view(), arange(0, 2));
  EXPECT_EQ(cache.clipped(), 0U);
  // 2.0 x 1.03 rounds to 448 x scale, within the format's rounding; 3.0 is beyond it.
  Block<float> later({1, 2, 1, 8}, 3);
  later.mutable_view()(0, 0, 0, 0) = 2.0F * 1.03F;
  later.mutable_view()(0, 0, 0, 1) = -3.0F;
  const auto history = cache.update(0, later.view(), v.view().tokens(0, 1), arange(2, 1));
  EXPECT_EQ(cache.clipped(), 1U);
  const Segment<fp8_e4m3_heads>& s = history.segments[0];
  EXPECT_EQ(s.keys.row(0, 0, 2)[0], 0x7E);
  EXPECT_EQ(s.keys.row(0, 0, 2)[1], 0xFE);
  for (std::size_t t = 0; t < 3; ++t) EXPECT_EQ(*s.key_scales.at(0, 0, t), key_scales[0]);
  for (std::size_t d = 2; d < 8; ++d)
    EXPECT_EQ(s.keys.row(0, 0, 2)[d], detail::e4m3_of(later.view()(0, 0, 0, d) * 224));
  EXPECT_EQ(cache.key_head_scales(), key_scales);  // an update never changes a scale
  cache.reset();
  EXPECT_EQ(cache.key_head_scales(), key_scales);
  EXPECT_EQ(cache.value_head_scales(), value_scales);
  EXPECT_EQ(cache.clipped(), 1U);  // counted since construction
}

TEST(Fp8HeadScales, TheSmallestScalesStoreNoNaN) {
  const std::vector<float> tiny{1e-44F};
  KvCache<fp8_e4m3_heads> cache(
      {.layers = 1, .kv_heads = 1, .head_dim = 8, .capacity = 8, .key_scales = tiny, .value_scales = tiny});
  Block<float> k({1, 1, 1, 8}, 1);
  k.data[0] = 0.0F;
  const auto history = cache.update(0, k.view(), k.view(), arange(0, 1));
  EXPECT_EQ(history.segments[0].keys.row(0, 0, 0)[0], 0x00);
  for (std::size_t d = 1; d < 8; ++d) EXPECT_EQ(history.segments[0].keys.row(0, 0, 0)[d] & 0x7F, 0x7E) << d;
  EXPECT_EQ(cache.clipped(), 14U);
  // Rows of values whose amax / 127 (or / 448) is 0 in float store as zeros with a scale of 1.
  const std::vector<float> row(8, 1e-44F);
  std::vector<std::int8_t> stored(8, 1);
  EXPECT_EQ(storage_codec<int8_rows>::encode(row.data(), stored.data(), 8, 1.0F).scale, 1.0F);
  EXPECT_EQ(stored, std::vector<std::int8_t>(8, 0));
  std::vector<std::uint8_t> codes(8, 1);
  EXPECT_EQ(storage_codec<fp8_e4m3>::encode(row.data(), codes.data(), 8, 1.0F).scale, 1.0F);
  EXPECT_EQ(codes, std::vector<std::uint8_t>(8, 0));
}

TEST(Fp8HeadScales, BadScalesInTheConfigAreRefusedNamingTheField) {
  const std::vector<float> two{0.1F, 0.1F}, three{0.1F, 0.1F, 0.1F}, zero{0.1F, 0.0F}, nan{0.1F, std::nanf("")};
  const auto refused = [](const KvCacheConfig& c, const std::vector<std::string>& words) {
    expect_throw_naming([&] { KvCache<fp8_e4m3_heads> cache(c); }, Throws::invalid_argument, words);
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
  refused(c, {"value_scales", "none"});
  c.value_scales = two;
  // The formats that scale each row keep no scale per head.
  expect_throw_naming([&] { KvCache<int8_rows> cache(c); }, Throws::invalid_argument, {"key_scales", "empty"});
  expect_throw_naming([&] { KvCache<fp8_e4m3> cache(c); }, Throws::invalid_argument,
                      {"key_scales", "fp8_e4m3_heads does"});
  EXPECT_NO_THROW(KvCache<fp8_e4m3_heads>{c});
}

// ---- attention reads the formats in place ------------------------------------------------------

/// A history of format T decoded to float (rotated back, for a rotated format): what attention
/// must read.
template <class T>
std::vector<float> decoded(const TensorView<const typename storage_codec<T>::unit>& rows, const RowScales& scales,
                           std::size_t dim) {
  std::vector<float> out;
  for (std::size_t h = 0; h < rows.heads(); ++h) {
    for (std::size_t t = 0; t < rows.tokens(); ++t) {
      const float scale = detail::reads_scales<storage_codec<T>> ? *scales.at(0, h, t) : 1.0F;
      for (std::size_t d = 0; d < dim; ++d) out.push_back(storage_codec<T>::value(rows.row(0, h, t), d) * scale);
      if constexpr (detail::is_rotated<T>) storage_codec<T>::unrotate(out.data() + out.size() - dim, dim);
    }
  }
  return out;
}

/// Keys and values of magnitude up to `kv`, queries up to `query`.
template <class T>
void expect_in_place_read_equals_decoded_rows(std::size_t dim, float kv = 1, float query = 1) {
  constexpr std::size_t H = 2, G = 2, S = 37, chunk = 3;
  KvCache<T> cache(test_config<T>({.layers = 1, .kv_heads = H, .head_dim = dim, .capacity = S}));
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
    expect_in_place_read_equals_decoded_rows<fp8_e4m3_heads>(dim);
    expect_in_place_read_equals_decoded_rows<int8_rows>(dim);
    expect_in_place_read_equals_decoded_rows<int4_groups>(dim);
    expect_in_place_read_equals_decoded_rows<int4_rotated>(dim);
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
  EXPECT_EQ(kv_bytes_per_token<fp8_e4m3_heads>(28, 8, 128) * tokens, GiB + 3 * GiB / 4);
  EXPECT_EQ(kv_bytes_per_token<fp8_e4m3>(28, 8, 128), 2U * 28 * 8 * (128 + 4));
  EXPECT_EQ(kv_bytes_per_token<int8_rows>(28, 8, 128), 2U * 28 * 8 * (128 + 4));
  EXPECT_EQ(kv_bytes_per_token<int4_groups>(28, 8, 128), 2U * 28 * 8 * 80);
  EXPECT_EQ(kv_bytes_per_token<int4_rotated>(28, 8, 128), 2U * 28 * 8 * 96);
  // A head of 16: one short group of 32 for int4_groups, one group of 16 for int4_rotated.
  EXPECT_EQ(kv_bytes_per_token<int4_groups>(1, 1, 16), 2U * 20);
  EXPECT_EQ(kv_bytes_per_token<int4_rotated>(1, 1, 16), 2U * 12);
  const KvCacheConfig config{.layers = 3, .batch = 2, .kv_heads = 2, .head_dim = 40, .capacity = 16};
  EXPECT_EQ(KvCache<fp8_e4m3_heads>(test_config<fp8_e4m3_heads>(config)).bytes(),
            2 * 16 * kv_bytes_per_token<fp8_e4m3_heads>(3, 2, 40) + 2 * 3 * 2 * 4);
  EXPECT_EQ(KvCache<fp8_e4m3>(config).bytes(), 2 * 16 * kv_bytes_per_token<fp8_e4m3>(3, 2, 40));
  EXPECT_EQ(KvCache<int8_rows>(config).bytes(), 2 * 16 * kv_bytes_per_token<int8_rows>(3, 2, 40));
  EXPECT_EQ(KvCache<int4_groups>(config).bytes(), 2 * 16 * kv_bytes_per_token<int4_groups>(3, 2, 40));
  EXPECT_EQ(KvCache<int4_rotated>(config).bytes(), 2 * 16 * kv_bytes_per_token<int4_rotated>(3, 2, 40));
}

}  // namespace
}  // namespace kvcache::testing
