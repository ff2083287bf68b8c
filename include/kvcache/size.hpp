// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>

#include "kvcache/codec.hpp"
#include "kvcache/version.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// Bytes of K and V for `tokens` positions: 2 x layers x batch x tokens x kv_heads x head_dim x bytes.
[[nodiscard]] constexpr std::size_t kv_cache_bytes(std::size_t layers, std::size_t batch, std::size_t tokens,
                                                   std::size_t kv_heads, std::size_t head_dim,
                                                   std::size_t bytes_per_value) noexcept {
  return 2 * layers * batch * tokens * kv_heads * head_dim * bytes_per_value;
}

/// Bytes one token takes in format T, K and V over every layer and kv head of one batch row,
/// its row scales included (a format's scales per (layer, kv head) are not per token: a cache
/// adds 2 x layers x kv_heads floats for them once).
template <storage_format T>
[[nodiscard]] constexpr std::size_t kv_bytes_per_token(std::size_t layers, std::size_t kv_heads,
                                                       std::size_t head_dim) noexcept {
  using Codec = storage_codec<T>;
  const std::size_t scale = detail::has_row_scales<T> ? sizeof(float) : 0;
  return 2 * layers * kv_heads * (Codec::units(head_dim) * sizeof(typename Codec::unit) + scale);
}

}  // namespace KVCACHE_ABI
}  // namespace kvcache
