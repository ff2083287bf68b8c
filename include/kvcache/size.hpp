// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>

namespace kvcache {

/// Bytes of K and V for `tokens` positions: 2 x layers x batch x tokens x kv_heads x head_dim x bytes.
[[nodiscard]] constexpr std::size_t kv_cache_bytes(std::size_t layers, std::size_t batch, std::size_t tokens,
                                                   std::size_t kv_heads, std::size_t head_dim,
                                                   std::size_t bytes_per_value) noexcept {
  return 2 * layers * batch * tokens * kv_heads * head_dim * bytes_per_value;
}

}  // namespace kvcache
