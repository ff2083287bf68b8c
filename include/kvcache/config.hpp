// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <concepts>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "kvcache/version.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

namespace detail {

/// A config field's name as a template argument, so that a bad value's message can name it.
template <std::size_t N>
struct FieldName {
  char text[N];
  constexpr FieldName(const char (&name)[N]) {  // NOLINT(google-explicit-constructor)
    for (std::size_t i = 0; i < N; ++i) text[i] = name[i];
  }
};

/// The integer types a count takes: every one but bool.
template <class I>
concept CountInteger = std::integral<I> && !std::same_as<I, bool>;

}  // namespace detail

/// A count in a config or a shape (Name: "KvCacheConfig.layers", "Shape.tokens"): takes any
/// integer type, so an engine's `int`s go in braces without narrowing, and reads as
/// std::size_t. A negative value throws std::invalid_argument naming the field and the value.
template <detail::FieldName Name>
class Count {
 public:
  constexpr Count() = default;

  template <detail::CountInteger I>
  constexpr Count(I value) : value_(checked(value)) {}  // NOLINT(google-explicit-constructor)
  /// Another field's count (a shape's head_dim as a stride, say).
  template <detail::FieldName Other>
  constexpr Count(Count<Other> other) noexcept : value_(other) {}  // NOLINT(google-explicit-constructor)

  constexpr operator std::size_t() const noexcept { return value_; }  // NOLINT(google-explicit-constructor)

 private:
  template <std::integral I>
  static constexpr std::size_t checked(I value) {
    if (!std::in_range<std::size_t>(value)) {
      throw std::invalid_argument(std::string(Name.text) + ": expected a count >= 0, given " + std::to_string(value));
    }
    return static_cast<std::size_t>(value);
  }

  std::size_t value_ = 0;
};

/// How a cache is sized, with designated initializers of any integer type:
///
///   kvcache::KvCache<float> cache({.layers = 28, .kv_heads = 8, .head_dim = 128, .capacity = 4096});
///   kvcache::RingKvCache<float> ring({.layers = 28, .kv_heads = 8, .head_dim = 128, .window = 4096, .sinks = 4});
///
/// `capacity` is the most tokens a sequence may reach (required for KvCache and ConcatKvCache;
/// for RingKvCache 0 means unbounded). `window`, `sinks` and `slack` are the ring's: it keeps
/// the last `window` positions, the first `sinks` positions forever, and `slack` older
/// positions so that truncate() can roll back that far after the ring has wrapped.
struct KvCacheConfig {
  Count<"KvCacheConfig.layers"> layers = 0;
  Count<"KvCacheConfig.batch"> batch = 1;
  Count<"KvCacheConfig.kv_heads"> kv_heads = 0;
  Count<"KvCacheConfig.head_dim"> head_dim = 0;
  Count<"KvCacheConfig.capacity"> capacity = 0;
  Count<"KvCacheConfig.window"> window = 0;
  Count<"KvCacheConfig.sinks"> sinks = 0;
  Count<"KvCacheConfig.slack"> slack = 0;
  /// For formats with a static scale per (layer, kv head) (fp8_e4m3_heads), required: K and V
  /// scales, layers x kv_heads each, layer-major, copied at construction
  /// (kvcache::calibrate_head_scales finds them from a float run). Empty for every other format.
  std::span<const float> key_scales{};
  std::span<const float> value_scales{};
};

namespace detail {

/// Sets the count of `config` named `name` ("window") to `value`: how a state file's settings,
/// named by the variant that wrote them, become the config that builds a cache to load it.
/// Returns false for a name that is no count of the config.
inline bool set_config_count(KvCacheConfig& config, std::string_view name, std::size_t value) {
  const auto set = [&](std::string_view field, auto& count) {
    if (name == field) count = value;
    return name == field;
  };
  return set("layers", config.layers) || set("batch", config.batch) || set("kv_heads", config.kv_heads) ||
         set("head_dim", config.head_dim) || set("capacity", config.capacity) || set("window", config.window) ||
         set("sinks", config.sinks) || set("slack", config.slack);
}

}  // namespace detail

}  // namespace KVCACHE_ABI
}  // namespace kvcache
