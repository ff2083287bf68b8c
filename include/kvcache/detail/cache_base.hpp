// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvcache/codec.hpp"
#include "kvcache/config.hpp"
#include "kvcache/detail/checks.hpp"
#include "kvcache/detail/head_scales.hpp"
#include "kvcache/detail/row_store.hpp"
#include "kvcache/version.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

/// Saves and loads a cache's state (kvcache/state_file.hpp): a friend of the shared pieces and
/// of every variant, which reads and restores their private state.
struct StateAccess;

/// What every variant has: its name for messages and its geometry. Nothing here is virtual:
/// the protocol variants follow is the kv_cache_protocol concept.
class CacheGeometry {
 public:
  [[nodiscard]] std::size_t layers() const noexcept { return geometry_.layers; }
  [[nodiscard]] std::size_t batch() const noexcept { return geometry_.batch; }
  [[nodiscard]] std::size_t kv_heads() const noexcept { return geometry_.kv_heads; }
  [[nodiscard]] std::size_t head_dim() const noexcept { return geometry_.head_dim; }

 protected:
  friend struct StateAccess;

  CacheGeometry(std::string_view name, const Geometry& geometry) : name_(name), geometry_(geometry) {}
  // A moved-from cache holds no layers: update() and length(layer) throw std::out_of_range,
  // truncate(0) and reset() do nothing, bytes() is 0; assigning to it works.
  CacheGeometry(CacheGeometry&& other) noexcept : name_(other.name_), geometry_(other.geometry_) {
    other.geometry_.layers = 0;
  }
  CacheGeometry& operator=(CacheGeometry&& other) noexcept {
    if (this != &other) {
      name_ = other.name_;
      geometry_ = other.geometry_;
      other.geometry_.layers = 0;
    }
    return *this;
  }
  ~CacheGeometry() = default;

  [[nodiscard]] const Geometry& geometry() const noexcept { return geometry_; }
  /// The variant's name, for messages.
  [[nodiscard]] std::string_view name() const noexcept { return name_; }

 private:
  std::string_view name_;  // a string literal
  Geometry geometry_;
};

/// The tokens each layer holds, with the accessors and checks on them: what the variants whose
/// batch rows advance together keep (a slot cache's rows each have their own).
class LayerLengths : public CacheGeometry {
 public:
  /// Tokens held by every layer; std::runtime_error naming the layers if they disagree (a
  /// forward pass stopped part-way).
  [[nodiscard]] std::size_t length() const {
    if (lengths_.empty()) return 0;  // moved from
    const std::size_t first = lengths_.front();
    if (std::all_of(lengths_.begin(), lengths_.end(), [&](std::size_t n) { return n == first; })) return first;
    throw std::runtime_error(std::string(name()) +
                             "::length: layers disagree (a forward pass stopped part-way): expected every layer to " +
                             "hold the same number of tokens, given " + describe_layer_lengths(lengths_) +
                             "; truncate() or reset() repairs it");
  }
  /// Tokens held by one layer; std::out_of_range for a bad layer.
  [[nodiscard]] std::size_t length(std::size_t layer) const {
    if (layer >= layers()) check_layer(std::string(name()) + "::length", layer, layers());
    return lengths_[layer];
  }

 protected:
  friend struct StateAccess;

  LayerLengths(std::string_view name, const Geometry& geometry)
      : CacheGeometry(name, geometry), lengths_(geometry.layers, 0) {}
  // A moved-from cache's length() is 0.
  LayerLengths(LayerLengths&& other) noexcept
      : CacheGeometry(std::move(other)), lengths_(std::exchange(other.lengths_, {})) {}
  LayerLengths& operator=(LayerLengths&& other) noexcept {
    if (this != &other) {
      CacheGeometry::operator=(std::move(other));
      lengths_ = std::exchange(other.lengths_, {});
    }
    return *this;
  }
  ~LayerLengths() = default;

  /// Validates an update of `layer` against the geometry, its length and `capacity`; returns
  /// the layer's length (the first new position).
  template <class T>
  [[nodiscard]] std::size_t check_update(std::size_t layer, const TensorView<const T>& k, const TensorView<const T>& v,
                                         const Positions& positions, std::size_t capacity) const {
    const std::size_t start = layer < layers() ? lengths_[layer] : 0;
    detail::check_update(name(), geometry(), layer, k, v, positions, start, capacity);
    return start;
  }

  /// Checks a truncate target against what every layer holds; std::out_of_range otherwise.
  void check_truncate(std::size_t length) const {
    const std::size_t held = lengths_.empty() ? 0 : *std::min_element(lengths_.begin(), lengths_.end());
    if (length > held) {
      throw std::out_of_range(expected_given(std::string(name()) + "::truncate: length",
                                             "<= " + std::to_string(held) + " (tokens held)", std::to_string(length)));
    }
  }

  void set_length(std::size_t layer, std::size_t length) noexcept { lengths_[layer] = length; }
  void set_all_lengths(std::size_t length) noexcept { std::fill(lengths_.begin(), lengths_.end(), length); }

 private:
  std::vector<std::size_t> lengths_;
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
