// SPDX-License-Identifier: Apache-2.0
#pragma once

// Static head scales for a format that keeps them (fp8_e4m3_heads), from a calibration run: the
// engine runs representative tokens through a float or bfloat16 cache, and each (layer, kv
// head)'s largest |K| and |V| there, times a margin, sets that head's scale. The values come
// from the model as it is, not from a cache whose scales were already set, so the result does
// not depend on whatever a first update happened to hold.
//
//   kvcache::KvCache<float> probe({.layers = 28, .kv_heads = 8, .head_dim = 128, .capacity = 4096});
//   // ... the model runs representative prompts through probe ...
//   const auto scales = kvcache::calibrate_head_scales<kvcache::fp8_e4m3_heads>(probe);
//   kvcache::KvCache<kvcache::fp8_e4m3_heads> cache(
//       {.layers = 28, .kv_heads = 8, .head_dim = 128, .capacity = 4096, .key_scales = scales.keys,
//        .value_scales = scales.values});

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcache/codec.hpp"
#include "kvcache/detail/checks.hpp"
#include "kvcache/version.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// K and V scales per (layer, kv head), layer-major, as KvCacheConfig's key_scales and
/// value_scales take them.
struct CalibratedScales {
  std::vector<float> keys;
  std::vector<float> values;
};

/// The margin calibrate_head_scales leaves by default: a later value up to 1.25 times the
/// largest the calibration run saw is stored without saturating.
inline constexpr float kDefaultCalibrationMargin = 1.25F;

/// The scales of format T (one with head scales, fp8_e4m3_heads) that map each (layer, kv
/// head)'s largest |K| and |V| held by `cache`, times `margin`, to T's largest value. `cache`
/// holds the calibration run in any format without rotation (float or bfloat16 keep the values
/// as the model made them); a head whose values were all 0 gets scale 1. Throws
/// std::invalid_argument for a margin that is not finite and at least 1, or a layer that holds no
/// token.
template <class T, class Cache>
[[nodiscard]] CalibratedScales calibrate_head_scales(Cache& cache, float margin = kDefaultCalibrationMargin) {
  static_assert(detail::has_head_scales<T>,
                "calibrate_head_scales<T>: T must keep a scale per (layer, kv head), as fp8_e4m3_heads does.");
  using Stored = typename Cache::value_type;
  using Codec = storage_codec<Stored>;
  static_assert(!detail::is_rotated<Stored>,
                "calibrate_head_scales: the calibration cache's rows must not be rotated.");
  if (!(margin >= 1.0F) || !std::isfinite(margin)) {
    throw std::invalid_argument(detail::expected_given("kvcache::calibrate_head_scales: margin", "a finite factor >= 1",
                                                       std::to_string(margin)));
  }
  CalibratedScales out;
  const std::size_t dim = cache.head_dim();
  for (std::size_t layer = 0; layer < cache.layers(); ++layer) {
    const History<Stored> history = cache.history(layer);
    if (history.tokens() == 0) {
      throw std::invalid_argument(
          detail::expected_given("kvcache::calibrate_head_scales: layer " + std::to_string(layer) + " tokens",
                                 "at least 1 (the calibration run's)", "0"));
    }
    const std::size_t heads = history.segments.front().keys.heads();
    std::vector<float> key_amax(heads, 0.0F), value_amax(heads, 0.0F);
    for (const Segment<Stored>& s : history.segments) {
      for (std::size_t b = 0; b < s.batch(); ++b) {
        const std::size_t r = s.stored_row(b);
        for (std::size_t h = 0; h < heads; ++h) {
          for (std::size_t j = 0; j < s.tokens(b); ++j) {
            const auto largest = [&](const auto& rows, const RowScales& scales) {
              float top = 0.0F;
              for (std::size_t d = 0; d < dim; ++d) {
                top = std::max(top, std::fabs(static_cast<float>(Codec::value(rows.row(r, h, j), d))));
              }
              return detail::reads_scales<Codec> ? top * *scales.at(r, h, j) : top;
            };
            key_amax[h] = std::max(key_amax[h], largest(s.keys, s.key_scales));
            value_amax[h] = std::max(value_amax[h], largest(s.values, s.value_scales));
          }
        }
      }
    }
    const auto scale = [&](float amax) { return amax > 0.0F ? storage_codec<T>::scale_for(amax * margin) : 1.0F; };
    for (std::size_t h = 0; h < heads; ++h) {
      out.keys.push_back(scale(key_amax[h]));
      out.values.push_back(scale(value_amax[h]));
    }
  }
  return out;
}

}  // namespace KVCACHE_ABI
}  // namespace kvcache
