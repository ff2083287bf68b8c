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

/// Saves and loads a cache's state (kvcache/state_file.hpp): a friend of CacheBase and of every
/// variant, which reads and restores their private state.
struct StateAccess;

/// What every variant keeps the same way: its geometry and the tokens each layer holds, with
/// the accessors and checks on them. Variants derive from it for that state alone; the protocol
/// they follow is the kv_cache_protocol concept, and nothing here is virtual.
class CacheBase {
 public:
  /// Tokens held by every layer; std::runtime_error naming the layers if they disagree (a
  /// forward pass stopped part-way).
  [[nodiscard]] std::size_t length() const {
    if (lengths_.empty()) return 0;  // moved from
    const std::size_t first = lengths_.front();
    if (std::all_of(lengths_.begin(), lengths_.end(), [&](std::size_t n) { return n == first; })) return first;
    throw std::runtime_error(std::string(name_) +
                             "::length: layers disagree (a forward pass stopped part-way): expected every layer to " +
                             "hold the same number of tokens, given " + describe_layer_lengths(lengths_) +
                             "; truncate() or reset() repairs it");
  }
  /// Tokens held by one layer; std::out_of_range for a bad layer.
  [[nodiscard]] std::size_t length(std::size_t layer) const {
    if (layer >= geometry_.layers) check_layer(std::string(name_) + "::length", layer, geometry_.layers);
    return lengths_[layer];
  }
  [[nodiscard]] std::size_t layers() const noexcept { return geometry_.layers; }
  [[nodiscard]] std::size_t batch() const noexcept { return geometry_.batch; }
  [[nodiscard]] std::size_t kv_heads() const noexcept { return geometry_.kv_heads; }
  [[nodiscard]] std::size_t head_dim() const noexcept { return geometry_.head_dim; }

  /// Values that saturated on their way into a format with head scales (fp8_e4m3_heads: beyond
  /// 448 times the head's scale), counted since construction; 0 for every other format.
  [[nodiscard]] std::size_t clipped() const noexcept {
    return std::accumulate(clipped_.begin(), clipped_.end(), std::size_t{0});
  }
  /// The K (or V) scale of every (layer, kv head), layer-major, for formats with head scales;
  /// empty for other formats.
  [[nodiscard]] std::vector<float> head_scales(bool values) const {
    std::vector<float> all;
    for (const LayerScales& l : scales_)
      all.insert(all.end(), (values ? l.values : l.keys).begin(), (values ? l.values : l.keys).end());
    return all;
  }

 protected:
  friend struct StateAccess;

  /// A layer's head scales, given in the config.
  struct LayerScales {
    std::vector<float> keys, values;
  };

  /// Sets up the head scales of format T from the config: required for formats with head
  /// scales (layers x kv_heads each, positive and finite), refused for others.
  /// std::invalid_argument otherwise.
  template <class T>
  void init_scales(const KvCacheConfig& config) {
    const auto check = [&](const char* field, std::span<const float> given) {
      const std::string what = std::string(name_) + ": config." + field;
      if (given.empty() && has_head_scales<T>) {
        // What is stored for one sequence must not depend on another's values: the scale a
        // whole cache shares is the engine's to give, never set by whichever update came first.
        throw std::invalid_argument(expected_given(
            what,
            std::to_string(geometry_.layers * geometry_.kv_heads) + " scales (layers x kv_heads: " + format_name<T>() +
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
      if (given.size() != geometry_.layers * geometry_.kv_heads) {
        throw std::invalid_argument(expected_given(what, geometry_.layers * geometry_.kv_heads, given.size()) +
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
      scales_.assign(geometry_.layers, LayerScales{std::vector<float>(geometry_.kv_heads, 0.0F),
                                                   std::vector<float>(geometry_.kv_heads, 0.0F)});
      for (std::size_t l = 0; l < geometry_.layers; ++l) {
        const std::size_t at = l * geometry_.kv_heads;
        std::copy_n(config.key_scales.begin() + static_cast<std::ptrdiff_t>(at), geometry_.kv_heads,
                    scales_[l].keys.begin());
        std::copy_n(config.value_scales.begin() + static_cast<std::ptrdiff_t>(at), geometry_.kv_heads,
                    scales_[l].values.begin());
      }
    }
  }

  /// Checks every value of an update of `layer` for formats that refuse some
  /// (std::invalid_argument naming the layer, head and token). Changes nothing.
  template <class T, class In>
  void check_values(std::size_t layer, const TensorView<const In>& k, const TensorView<const In>& v) const {
    if constexpr (checks_input<T>) {
      scan_values<T>(layer, "k", k);
      scan_values<T>(layer, "v", v);
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
    return scales_.size() * geometry_.kv_heads * 2 * sizeof(float);
  }

  CacheBase(std::string_view name, const Geometry& geometry)
      : name_(name), geometry_(geometry), lengths_(geometry.layers, 0), clipped_(geometry.layers, 0) {}
  // A moved-from cache holds no layers: length() is 0, update() and length(layer) throw
  // std::out_of_range, truncate(0) and reset() do nothing, bytes() is 0; assigning to it works.
  CacheBase(CacheBase&& other) noexcept
      : name_(other.name_),
        geometry_(other.geometry_),
        lengths_(std::move(other.lengths_)),
        scales_(std::move(other.scales_)),
        clipped_(std::move(other.clipped_)) {
    other.forget_layers();
  }
  CacheBase& operator=(CacheBase&& other) noexcept {
    if (this != &other) {
      name_ = other.name_;
      geometry_ = other.geometry_;
      lengths_ = std::move(other.lengths_);
      scales_ = std::move(other.scales_);
      clipped_ = std::move(other.clipped_);
      other.forget_layers();
    }
    return *this;
  }
  CacheBase(const CacheBase&) = default;
  CacheBase& operator=(const CacheBase&) = default;
  ~CacheBase() = default;

  [[nodiscard]] const Geometry& geometry() const noexcept { return geometry_; }

  /// Validates an update of `layer` against the geometry, its length and `capacity`; returns
  /// the layer's length (the first new position).
  template <class T>
  [[nodiscard]] std::size_t check_update(std::size_t layer, const TensorView<const T>& k, const TensorView<const T>& v,
                                         const Positions& positions, std::size_t capacity) const {
    const std::size_t start = layer < geometry_.layers ? lengths_[layer] : 0;
    detail::check_update(name_, geometry_, layer, k, v, positions, start, capacity);
    return start;
  }

  /// Checks a truncate target against what every layer holds; std::out_of_range otherwise.
  void check_truncate(std::size_t length) const {
    const std::size_t held = lengths_.empty() ? 0 : *std::min_element(lengths_.begin(), lengths_.end());
    if (length > held) {
      throw std::out_of_range(expected_given(std::string(name_) + "::truncate: length",
                                             "<= " + std::to_string(held) + " (tokens held)", std::to_string(length)));
    }
  }

  void set_length(std::size_t layer, std::size_t length) noexcept { lengths_[layer] = length; }
  void set_all_lengths(std::size_t length) noexcept { std::fill(lengths_.begin(), lengths_.end(), length); }

 private:
  void forget_layers() noexcept {
    geometry_.layers = 0;
    lengths_.clear();
    scales_.clear();
    clipped_.clear();
  }

  /// Checks every value of k (or v) where format T refuses some.
  template <class T, class In>
  void scan_values(std::size_t layer, const char* which, const TensorView<const In>& x) const {
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
                expected_given(std::string(name_) + "::update: layer " + std::to_string(layer) + ", " + which +
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

  std::string_view name_;  // a string literal: the variant's name for messages
  Geometry geometry_;
  std::vector<std::size_t> lengths_;
  std::vector<LayerScales> scales_;   // per layer, for formats with head scales
  std::vector<std::size_t> clipped_;  // per layer, so that updates of distinct layers write apart
};

/// update() for every compute type a format accepts, as plain overloads (not a template), so
/// that mutable views and Eigen tensors convert on the way in, and positions come in any integer
/// type (PositionsArg). Each forwards to the variant's `store<In>(layer, k, v, positions)`.
template <class Cache, class T>
class ComputeTypeUpdates {
 public:
  History<T> update(std::size_t layer, TensorView<const float> k, TensorView<const float> v,
                    const PositionsArg& positions) requires accepts_input<T, float> {
    return forward(layer, k, v, positions);
  }
  History<T> update(std::size_t layer, TensorView<const double> k, TensorView<const double> v,
                    const PositionsArg& positions) requires accepts_input<T, double> {
    return forward(layer, k, v, positions);
  }
  History<T> update(std::size_t layer, TensorView<const bfloat16> k, TensorView<const bfloat16> v,
                    const PositionsArg& positions) requires accepts_input<T, bfloat16> {
    return forward(layer, k, v, positions);
  }
  History<T> update(std::size_t layer, TensorView<const half> k, TensorView<const half> v,
                    const PositionsArg& positions) requires accepts_input<T, half> {
    return forward(layer, k, v, positions);
  }
  History<T> update(std::size_t layer, TensorView<const Eigen::bfloat16> k, TensorView<const Eigen::bfloat16> v,
                    const PositionsArg& positions) requires accepts_input<T, Eigen::bfloat16> {
    return forward(layer, k, v, positions);
  }
  History<T> update(std::size_t layer, TensorView<const Eigen::half> k, TensorView<const Eigen::half> v,
                    const PositionsArg& positions) requires accepts_input<T, Eigen::half> {
    return forward(layer, k, v, positions);
  }

 private:
  template <class In>
  History<T> forward(std::size_t layer, const TensorView<const In>& k, const TensorView<const In>& v,
                     const PositionsArg& positions) {
    require_complete<In>();
    return static_cast<Cache&>(*this).store(layer, k, v, positions.view());
  }
};

/// update(layer, k, v, positions, rows) for every compute type a format accepts, as
/// ComputeTypeUpdates gives the protocol's form, for caches whose rows advance on their own; rows
/// come in any integer type (RowsArg). Each forwards to the variant's
/// `store<In>(layer, k, v, positions, rows)`.
template <class Cache, class T>
class RowUpdates {
 public:
  History<T> update(std::size_t layer, TensorView<const float> k, TensorView<const float> v,
                    const PositionsArg& positions, const RowsArg& rows) requires accepts_input<T, float> {
    return forward(layer, k, v, positions, rows);
  }
  History<T> update(std::size_t layer, TensorView<const double> k, TensorView<const double> v,
                    const PositionsArg& positions, const RowsArg& rows) requires accepts_input<T, double> {
    return forward(layer, k, v, positions, rows);
  }
  History<T> update(std::size_t layer, TensorView<const bfloat16> k, TensorView<const bfloat16> v,
                    const PositionsArg& positions, const RowsArg& rows) requires accepts_input<T, bfloat16> {
    return forward(layer, k, v, positions, rows);
  }
  History<T> update(std::size_t layer, TensorView<const half> k, TensorView<const half> v,
                    const PositionsArg& positions, const RowsArg& rows) requires accepts_input<T, half> {
    return forward(layer, k, v, positions, rows);
  }
  History<T> update(std::size_t layer, TensorView<const Eigen::bfloat16> k, TensorView<const Eigen::bfloat16> v,
                    const PositionsArg& positions, const RowsArg& rows) requires accepts_input<T, Eigen::bfloat16> {
    return forward(layer, k, v, positions, rows);
  }
  History<T> update(std::size_t layer, TensorView<const Eigen::half> k, TensorView<const Eigen::half> v,
                    const PositionsArg& positions, const RowsArg& rows) requires accepts_input<T, Eigen::half> {
    return forward(layer, k, v, positions, rows);
  }

 private:
  template <class In>
  History<T> forward(std::size_t layer, const TensorView<const In>& k, const TensorView<const In>& v,
                     const PositionsArg& positions, const RowsArg& rows) {
    require_complete<In>();
    return static_cast<Cache&>(*this).store(layer, k, v, positions.view(), rows.view());
  }
};

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
