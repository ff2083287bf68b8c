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
#include "kvcache/detail/checks.hpp"
#include "kvcache/views.hpp"

namespace kvcache::detail {

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
    throw std::runtime_error(
        std::string(name_) + "::length: layers disagree (a forward pass stopped part-way): expected every layer to " +
        "hold the same number of tokens, given " + describe_lengths() + "; truncate() or reset() repairs it");
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

 protected:
  CacheBase(std::string_view name, const Geometry& geometry)
      : name_(name), geometry_(geometry), lengths_(geometry.layers, 0) {}
  // A moved-from cache holds no layers: length() is 0, update() and length(layer) throw
  // std::out_of_range, truncate(0) and reset() do nothing, bytes() is 0; assigning to it works.
  CacheBase(CacheBase&& other) noexcept
      : name_(other.name_), geometry_(other.geometry_), lengths_(std::move(other.lengths_)) {
    other.forget_layers();
  }
  CacheBase& operator=(CacheBase&& other) noexcept {
    if (this != &other) {
      name_ = other.name_;
      geometry_ = other.geometry_;
      lengths_ = std::move(other.lengths_);
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
  }

  /// "layers 0-1 hold 6, layer 2 holds 5" for the message of length().
  [[nodiscard]] std::string describe_lengths() const {
    std::string runs;
    for (std::size_t begin = 0; begin < lengths_.size();) {
      std::size_t end = begin;
      while (end + 1 < lengths_.size() && lengths_[end + 1] == lengths_[begin]) ++end;
      if (!runs.empty()) runs += ", ";
      runs += begin == end ? "layer " + std::to_string(begin) + " holds "
                           : "layers " + std::to_string(begin) + "-" + std::to_string(end) + " hold ";
      runs += std::to_string(lengths_[begin]);
      begin = end + 1;
    }
    return runs;
  }

  std::string_view name_;  // a string literal: the variant's name for messages
  Geometry geometry_;
  std::vector<std::size_t> lengths_;
};

/// update() for every compute type a format accepts, as plain overloads (not a template), so
/// that mutable views and Eigen tensors convert on the way in. Each forwards to the variant's
/// `store<In>(layer, k, v, positions)`.
template <class Cache, class T>
class ComputeTypeUpdates {
 public:
  History<T> update(std::size_t layer, TensorView<const float> k, TensorView<const float> v,
                    const Positions& positions) requires accepts_input<T, float> {
    return self().store(layer, k, v, positions);
  }
  History<T> update(std::size_t layer, TensorView<const double> k, TensorView<const double> v,
                    const Positions& positions) requires accepts_input<T, double> {
    return self().store(layer, k, v, positions);
  }
  History<T> update(std::size_t layer, TensorView<const Eigen::half> k, TensorView<const Eigen::half> v,
                    const Positions& positions) requires accepts_input<T, Eigen::half> {
    return self().store(layer, k, v, positions);
  }
  History<T> update(std::size_t layer, TensorView<const Eigen::bfloat16> k, TensorView<const Eigen::bfloat16> v,
                    const Positions& positions) requires accepts_input<T, Eigen::bfloat16> {
    return self().store(layer, k, v, positions);
  }

 private:
  Cache& self() noexcept { return static_cast<Cache&>(*this); }
};

}  // namespace kvcache::detail
