// SPDX-License-Identifier: Apache-2.0
#pragma once

// Precondition checks shared by every cache variant. Each throws a standard exception whose
// message names the call, what was expected and what was given; none of them writes anything.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/version.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

/// The shape every update of a cache must have, the token count aside.
struct Geometry {
  std::size_t layers = 0;
  std::size_t batch = 0;
  std::size_t kv_heads = 0;
  std::size_t head_dim = 0;
};

inline std::string expected_given(const std::string& what, const std::string& expected, const std::string& given) {
  return what + ": expected " + expected + ", given " + given;
}

inline std::string expected_given(const std::string& what, std::size_t expected, std::size_t given) {
  return expected_given(what, std::to_string(expected), std::to_string(given));
}

/// "layers 0-1 hold 6, layer 2 holds 5": tokens by layer, for the message of a length() that
/// finds the layers disagree.
inline std::string describe_layer_lengths(std::span<const std::size_t> lengths) {
  std::string runs;
  for (std::size_t begin = 0; begin < lengths.size();) {
    std::size_t end = begin;
    while (end + 1 < lengths.size() && lengths[end + 1] == lengths[begin]) ++end;
    if (!runs.empty()) runs += ", ";
    runs += begin == end ? "layer " + std::to_string(begin) + " holds "
                         : "layers " + std::to_string(begin) + "-" + std::to_string(end) + " hold ";
    runs += std::to_string(lengths[begin]);
    begin = end + 1;
  }
  return runs;
}

/// Checks the fields every variant needs and returns the geometry they describe.
inline Geometry check_config(std::string_view cache, const KvCacheConfig& c) {
  auto require_positive = [&](const char* field, std::size_t value) {
    if (value == 0) throw std::invalid_argument(std::string(cache) + ": config." + field + ": expected > 0, given 0");
  };
  require_positive("layers", c.layers);
  require_positive("batch", c.batch);
  require_positive("kv_heads", c.kv_heads);
  require_positive("head_dim", c.head_dim);
  return {c.layers, c.batch, c.kv_heads, c.head_dim};
}

/// Checks a config for a cache that keeps every position (no window, sinks or slack).
inline Geometry check_dense_config(std::string_view cache, const KvCacheConfig& c) {
  const Geometry g = check_config(cache, c);
  if (c.capacity == 0) throw std::invalid_argument(std::string(cache) + ": config.capacity: expected > 0, given 0");
  if (c.window != 0 || c.sinks != 0 || c.slack != 0) {
    throw std::invalid_argument(std::string(cache) +
                                ": config.window/sinks/slack: expected 0 (this cache keeps every position; " +
                                "use RingKvCache for a window), given " + std::to_string(c.window) + "/" +
                                std::to_string(c.sinks) + "/" + std::to_string(c.slack));
  }
  return g;
}

/// Checks that K and V for `tokens` positions of every layer, `value_bytes` each, fit in a
/// std::size_t; std::length_error otherwise (the product would wrap and allocate too little).
/// Returns `tokens`.
inline std::size_t check_footprint(std::string_view cache, const Geometry& g, std::size_t tokens,
                                   std::size_t value_bytes) {
  const std::initializer_list<std::size_t> factors = {g.layers, g.batch, g.kv_heads, g.head_dim, tokens, value_bytes};
  std::size_t bytes = 2;
  for (const std::size_t factor : factors) {
    if (factor != 0 && bytes > std::numeric_limits<std::size_t>::max() / factor) {
      long double total = 2;  // the product that does not fit, for the message
      for (const std::size_t f : factors) total *= static_cast<long double>(f);
      char given[32];
      std::snprintf(given, sizeof given, "%.3Le", total);
      throw std::length_error(std::string(cache) + ": config: K and V bytes (2 x layers " + std::to_string(g.layers) +
                              " x batch " + std::to_string(g.batch) + " x kv_heads " + std::to_string(g.kv_heads) +
                              " x head_dim " + std::to_string(g.head_dim) + " x tokens " + std::to_string(tokens) +
                              " x " + std::to_string(value_bytes) + "): expected at most " +
                              std::to_string(std::numeric_limits<std::size_t>::max()) + ", given " + given);
    }
    bytes *= factor;
  }
  return tokens;
}

inline void check_layer(std::string_view call, std::size_t layer, std::size_t layers) {
  if (layer >= layers) {
    throw std::out_of_range(
        expected_given(std::string(call) + ": layer", "< " + std::to_string(layers), std::to_string(layer)));
  }
}

/// Checks the shapes of an update's k and v ([batch, kv_heads, T, head_dim], v as k), its
/// positions count and that its data is there. `call` names the call for messages.
template <class T, class Call>
void check_update_shapes(const Call& call, const Geometry& g, std::size_t batch, const TensorView<const T>& k,
                         const TensorView<const T>& v, const Positions& positions) {
  const auto check_dim = [&](const char* name, const char* dim, std::size_t expected, std::size_t given) {
    if (expected != given) {
      throw std::invalid_argument(expected_given(call() + ": " + name + " " + dim, expected, given) + " (shape " +
                                  (name[0] == 'k' ? k : v).shape().str() + ")");
    }
  };
  check_dim("k", "batch", batch, k.batch());
  check_dim("k", "kv_heads", g.kv_heads, k.heads());
  check_dim("k", "head_dim", g.head_dim, k.head_dim());
  if (v.shape() != k.shape()) {
    throw std::invalid_argument(
        expected_given(call() + ": v shape", k.shape().str() + " (the shape of k)", v.shape().str()));
  }
  const std::size_t tokens = k.tokens();
  if (positions.tokens() != tokens) {
    throw std::invalid_argument(expected_given(call() + ": positions count", "k's tokens " + std::to_string(tokens),
                                               std::to_string(positions.tokens())));
  }
  if (k.shape().size() != 0 && (k.data() == nullptr || v.data() == nullptr || positions.data() == nullptr)) {
    throw std::invalid_argument(call() + ": k, v and positions data: expected non-null pointers for " +
                                std::to_string(tokens) + " tokens, given null");
  }
}

/// Checks that `positions` continue `length` tokens of `where()` ("layer 2", "row 5 in layer 2")
/// and that `capacity` has room for them.
template <class Call, class Where>
void check_continues(const Call& call, std::span<const std::int64_t> positions, std::size_t length,
                     std::size_t capacity, const Where& where) {
  for (std::size_t i = 0; i < positions.size(); ++i) {
    const auto expected = static_cast<std::int64_t>(length + i);
    if (positions[i] != expected) {
      throw std::invalid_argument(
          expected_given(call() + ": positions[" + std::to_string(i) + "]",
                         std::to_string(expected) + " (" + where() + " holds " + std::to_string(length) + " tokens)",
                         std::to_string(positions[i])));
    }
  }
  if (positions.size() > capacity - length) {
    throw std::length_error(expected_given(call() + ": tokens after update", "<= capacity " + std::to_string(capacity),
                                           std::to_string(length) + " + " + std::to_string(positions.size())));
  }
}

/// Validates one update's arguments against the cache's geometry, `length` tokens already in
/// `layer`, and the most tokens the layer may reach. Messages start "<cache>::update".
template <class T>
void check_update(std::string_view cache, const Geometry& g, std::size_t layer, const TensorView<const T>& k,
                  const TensorView<const T>& v, const Positions& positions, std::size_t length, std::size_t capacity) {
  const auto call = [&] { return std::string(cache) + "::update"; };  // built only for a message
  if (layer >= g.layers) check_layer(call(), layer, g.layers);
  check_update_shapes(call, g, g.batch, k, v, positions);
  if (positions.per_row()) {
    throw std::invalid_argument(call() + ": positions: expected one list shared by every batch row (this cache's " +
                                "rows advance together), given a list per row");
  }
  check_continues(call, positions.row(0), length, capacity, [&] { return "layer " + std::to_string(layer); });
}

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
