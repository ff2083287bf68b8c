// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvcache/codec.hpp"
#include "kvcache/config.hpp"
#include "kvcache/detail/checks.hpp"
#include "kvcache/detail/row_store.hpp"
#include "kvcache/version.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

struct StateAccess;

/// The static scale per (layer, kv head) of formats with head scales, and the values that
/// saturated on their way in: what the caches that encode rows keep besides them (a paged
/// sequence's are its pool's). `name` in each call is the owner's, for messages.
class HeadScales {
 public:
  /// Values that saturated on their way into a format with head scales (fp8_e4m3_heads: beyond
  /// 448 times the head's scale), counted since construction; 0 for every other format.
  [[nodiscard]] std::size_t clipped() const noexcept {
    return std::accumulate(clipped_.begin(), clipped_.end(), std::size_t{0});
  }
  /// The K scale of every (layer, kv head), layer-major, for formats with head scales; empty for
  /// other formats.
  [[nodiscard]] std::vector<float> key_head_scales() const { return flatten(&LayerScales::keys); }
  /// The V scale of every (layer, kv head), as key_head_scales().
  [[nodiscard]] std::vector<float> value_head_scales() const { return flatten(&LayerScales::values); }

 protected:
  friend struct StateAccess;

  /// A layer's head scales, given in the config.
  struct LayerScales {
    std::vector<float> keys, values;
  };

  explicit HeadScales(std::size_t layers) : clipped_(layers, 0) {}
  // A moved-from owner has no scales and has clipped nothing.
  HeadScales(HeadScales&& other) noexcept
      : scales_(std::exchange(other.scales_, {})), clipped_(std::exchange(other.clipped_, {})) {}
  HeadScales& operator=(HeadScales&& other) noexcept {
    if (this != &other) {
      scales_ = std::exchange(other.scales_, {});
      clipped_ = std::exchange(other.clipped_, {});
    }
    return *this;
  }
  ~HeadScales() = default;

  /// Sets up the head scales of format T from the config: required for formats with head
  /// scales (layers x kv_heads each, positive and finite), refused for others.
  /// std::invalid_argument otherwise.
  template <class T>
  void init_scales(std::string_view name, const Geometry& geometry, const KvCacheConfig& config) {
    const auto check = [&](const char* field, std::span<const float> given) {
      const std::string what = std::string(name) + ": config." + field;
      if (given.empty() && has_head_scales<T>) {
        // What is stored for one sequence must not depend on another's values: the scale a
        // whole cache shares is the engine's to give, never set by whichever update came first.
        throw std::invalid_argument(expected_given(
            what,
            std::to_string(geometry.layers * geometry.kv_heads) + " scales (layers x kv_heads: " + format_name<T>() +
                " keeps a static scale per (layer, kv head); kvcache::calibrate_head_scales finds them, and "
                "fp8_e4m3 scales each row instead)",
            "none"));
      }
      if (given.empty()) return;
      if (!has_head_scales<T>) {
        throw std::invalid_argument(expected_given(
            what, "empty (" + std::string(format_name<T>()) + " keeps no scale per head; fp8_e4m3_heads does)",
            std::to_string(given.size()) + " scales"));
      }
      if (given.size() != geometry.layers * geometry.kv_heads) {
        throw std::invalid_argument(expected_given(what, geometry.layers * geometry.kv_heads, given.size()) +
                                    " scales (layers x kv_heads)");
      }
      for (std::size_t i = 0; i < given.size(); ++i) {
        if (!(given[i] > 0.0F) || !std::isfinite(given[i])) {
          throw std::invalid_argument(expected_given(what + "[" + std::to_string(i) + "]", "a positive finite scale",
                                                     std::to_string(given[i])));
        }
      }
    };
    check("key_scales", config.key_scales);
    check("value_scales", config.value_scales);
    if constexpr (has_head_scales<T>) {
      scales_.assign(geometry.layers, LayerScales{std::vector<float>(geometry.kv_heads, 0.0F),
                                                  std::vector<float>(geometry.kv_heads, 0.0F)});
      for (std::size_t l = 0; l < geometry.layers; ++l) {
        const std::size_t at = l * geometry.kv_heads;
        std::copy_n(config.key_scales.begin() + static_cast<std::ptrdiff_t>(at), geometry.kv_heads,
                    scales_[l].keys.begin());
        std::copy_n(config.value_scales.begin() + static_cast<std::ptrdiff_t>(at), geometry.kv_heads,
                    scales_[l].values.begin());
      }
    }
  }

  /// Checks every value of an update of `layer` for formats that refuse some
  /// (std::invalid_argument naming the layer, head and token). Changes nothing.
  template <class T, class In>
  void check_values(std::string_view name, std::size_t layer, const TensorView<const In>& k,
                    const TensorView<const In>& v) const {
    if constexpr (checks_input<T>) {
      scan_values<T>(name, layer, "k", k);
      scan_values<T>(name, layer, "v", v);
    }
  }

  /// Counts the values an update of `layer` saturated.
  void count_clipped(std::size_t layer, std::size_t clipped) noexcept { clipped_[layer] += clipped; }

  /// A layer's head scales as segments read them (null for formats without).
  [[nodiscard]] HeadScaleView head_scale_view(std::size_t layer) const noexcept {
    if (scales_.empty()) return {};
    return {scales_[layer].keys.data(), scales_[layer].values.data()};
  }

  /// Bytes of the head scales.
  [[nodiscard]] std::size_t scale_bytes() const noexcept {
    return scales_.empty() ? 0 : scales_.size() * scales_.front().keys.size() * 2 * sizeof(float);
  }

 private:
  [[nodiscard]] std::vector<float> flatten(std::vector<float> LayerScales::*which) const {
    std::vector<float> all;
    for (const LayerScales& l : scales_) all.insert(all.end(), (l.*which).begin(), (l.*which).end());
    return all;
  }

  /// Checks every value of k (or v) where format T refuses some.
  template <class T, class In>
  void scan_values(std::string_view name, std::size_t layer, const char* which, const TensorView<const In>& x) const {
    for (std::size_t b = 0; b < x.batch(); ++b) {
      for (std::size_t h = 0; h < x.heads(); ++h) {
        for (std::size_t t = 0; t < x.tokens(); ++t) {
          const In* row = x.row(b, h, t);
          // A row's largest magnitude as float bits (NaN's above infinity's): one pass that
          // vectorizes; the value to name is looked for only when one is refused.
          const std::uint32_t top = max_magnitude_bits(row, x.head_dim());
          if (top <= std::bit_cast<std::uint32_t>(storage_codec<T>::max_magnitude)) continue;
          for (std::size_t d = 0; d < x.head_dim(); ++d) {
            const auto value = static_cast<float>(widen(row[d]));
            if (std::fabs(value) <= storage_codec<T>::max_magnitude) continue;
            throw std::invalid_argument(
                expected_given(std::string(name) + "::update: layer " + std::to_string(layer) + ", " + which +
                                   "[batch row " + std::to_string(b) + ", kv head " + std::to_string(h) + ", token " +
                                   std::to_string(t) + ", index " + std::to_string(d) + "]",
                               std::string("a finite value") +
                                   (storage_codec<T>::max_magnitude < std::numeric_limits<float>::max()
                                        ? " of magnitude <= " + std::to_string(storage_codec<T>::max_magnitude)
                                        : std::string()) +
                                   " (" + format_name<T>() + " stores no other)",
                               std::to_string(value)));
          }
        }
      }
    }
  }

  std::vector<LayerScales> scales_;   // per layer, for formats with head scales
  std::vector<std::size_t> clipped_;  // per layer, so that updates of distinct layers write apart
};

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
