// SPDX-License-Identifier: Apache-2.0
// calibrate_head_scales: each (layer, kv head)'s largest |K| and |V| in a calibration cache,
// times the margin, mapped to the format's largest value; what it refuses.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <vector>

#include "cache_test_support.hpp"
#include "kvcache/calibration.hpp"

namespace kvcache::testing {
namespace {

/// K and V of [batch, 2 heads, tokens, 8] where (layer l, head h)'s largest magnitude is
/// known: every value in [-1, 1], and one of them (l + 1) x (h + 2) (negative for V).
struct Calibration {
  static constexpr std::size_t layers = 2, heads = 2, dim = 8;

  static float key_amax(std::size_t l, std::size_t h) { return static_cast<float>((l + 1) * (h + 2)); }

  template <class Cache>
  static void feed(Cache& cache, std::size_t batch, std::size_t tokens) {
    for (std::size_t l = 0; l < layers; ++l) {
      Block<float> k({batch, heads, tokens, dim}, 10 + l), v({batch, heads, tokens, dim}, 20 + l);
      for (std::size_t h = 0; h < heads; ++h) {
        k.mutable_view()(batch - 1, h, tokens - 1, 3) = key_amax(l, h);
        v.mutable_view()(0, h, 0, 5) = -2.0F * key_amax(l, h);
      }
      cache.update(l, k.view(), v.view(), arange(0, tokens));
    }
  }
};

TEST(Calibration, EachHeadsLargestValueTimesTheMarginMapsTo448) {
  KvCache<float> probe({.layers = 2, .batch = 2, .kv_heads = 2, .head_dim = 8, .capacity = 8});
  Calibration::feed(probe, 2, 5);
  for (const float margin : {1.0F, kDefaultCalibrationMargin, 3.0F}) {
    const CalibratedScales s = calibrate_head_scales<fp8_e4m3_heads>(probe, margin);
    ASSERT_EQ(s.keys.size(), 4U);
    ASSERT_EQ(s.values.size(), 4U);
    for (std::size_t l = 0; l < 2; ++l) {
      for (std::size_t h = 0; h < 2; ++h) {
        EXPECT_FLOAT_EQ(s.keys[l * 2 + h], Calibration::key_amax(l, h) * margin / 448.0F) << l << " " << h;
        EXPECT_FLOAT_EQ(s.values[l * 2 + h], 2.0F * Calibration::key_amax(l, h) * margin / 448.0F) << l << " " << h;
      }
    }
  }
  // A cache built with them stores the calibration run without saturating.
  const CalibratedScales s = calibrate_head_scales<fp8_e4m3_heads>(probe);
  KvCache<fp8_e4m3_heads> cache({.layers = 2,
                                 .batch = 2,
                                 .kv_heads = 2,
                                 .head_dim = 8,
                                 .capacity = 8,
                                 .key_scales = s.keys,
                                 .value_scales = s.values});
  Calibration::feed(cache, 2, 5);
  EXPECT_EQ(cache.clipped(), 0U);
}

TEST(Calibration, ReadsAnyFormatAndLayoutItsRowsInPlace) {
  // bfloat16 rows, scaled int8 rows, a slot cache's scattered slots and a ring: the values the
  // rows hold, each within its format's rounding of the float run's.
  KvCache<float> exact({.layers = 2, .kv_heads = 2, .head_dim = 8, .capacity = 8});
  KvCache<Eigen::bfloat16> bf16({.layers = 2, .kv_heads = 2, .head_dim = 8, .capacity = 8});
  KvCache<int8_rows> int8({.layers = 2, .kv_heads = 2, .head_dim = 8, .capacity = 8});
  SlotKvCache<float> slots({.layers = 2, .batch = 3, .kv_heads = 2, .head_dim = 8, .capacity = 8});
  RingKvCache<float> ring({.layers = 2, .kv_heads = 2, .head_dim = 8, .window = 8});
  Calibration::feed(exact, 1, 6);
  Calibration::feed(bf16, 1, 6);
  Calibration::feed(int8, 1, 6);
  Calibration::feed(slots, 3, 6);
  Calibration::feed(ring, 1, 6);
  const CalibratedScales want = calibrate_head_scales<fp8_e4m3_heads>(exact);
  for (const CalibratedScales& got :
       {calibrate_head_scales<fp8_e4m3_heads>(bf16), calibrate_head_scales<fp8_e4m3_heads>(int8),
        calibrate_head_scales<fp8_e4m3_heads>(slots), calibrate_head_scales<fp8_e4m3_heads>(ring)}) {
    ASSERT_EQ(got.keys.size(), want.keys.size());
    for (std::size_t i = 0; i < want.keys.size(); ++i) {
      EXPECT_NEAR(got.keys[i], want.keys[i], want.keys[i] * 4e-3F) << i;
      EXPECT_NEAR(got.values[i], want.values[i], want.values[i] * 4e-3F) << i;
    }
  }
}

TEST(Calibration, RefusesABadMarginAndALayerWithoutTokens) {
  KvCache<float> probe({.layers = 2, .kv_heads = 2, .head_dim = 8, .capacity = 8});
  expect_throw_naming([&] { (void)calibrate_head_scales<fp8_e4m3_heads>(probe); }, Throws::invalid_argument,
                      {"layer 0 tokens", "at least 1", "0"});
  Calibration::feed(probe, 1, 3);
  for (const float bad : {0.5F, 0.0F, -1.0F, std::nanf(""), INFINITY}) {
    expect_throw_naming([&] { (void)calibrate_head_scales<fp8_e4m3_heads>(probe, bad); }, Throws::invalid_argument,
                        {"margin", "a finite factor >= 1"});
  }
  // A head whose values are all zero gets scale 1 (any scale stores zeros exactly).
  KvCache<float> zeros({.layers = 1, .kv_heads = 1, .head_dim = 8, .capacity = 8});
  const std::vector<float> none(8, 0.0F);
  const TensorView<const float> z(none.data(), {1, 1, 1, 8});
  zeros.update(0, z, z, arange(0, 1));
  EXPECT_EQ(calibrate_head_scales<fp8_e4m3_heads>(zeros).keys, std::vector<float>{1.0F});
}

}  // namespace
}  // namespace kvcache::testing
