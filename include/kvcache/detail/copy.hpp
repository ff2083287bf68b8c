// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstring>
#include <type_traits>

#include "kvcache/detail/assert.hpp"
#include "kvcache/views.hpp"

namespace kvcache::detail {

/// Copies a [B, H, T, D] block between views of the same shape: one memcpy per (b, h) slice
/// when both sides hold its rows back to back, one per row otherwise.
template <class T>
void copy_block(const std::type_identity_t<TensorView<const T>>& from, const TensorView<T>& to) noexcept {
  KVCACHE_ASSERT(from.shape() == to.shape(), "copy_block: shapes differ");
  const std::size_t tokens = from.tokens();
  const std::size_t dim = from.head_dim();
  if (tokens == 0 || dim == 0) return;
  const bool dense = from.strides().tokens == dim && to.strides().tokens == dim;
  for (std::size_t b = 0; b < from.batch(); ++b) {
    for (std::size_t h = 0; h < from.heads(); ++h) {
      if (dense) {
        std::memcpy(static_cast<void*>(to.row(b, h, 0)), from.row(b, h, 0), tokens * dim * sizeof(T));
        continue;
      }
      for (std::size_t t = 0; t < tokens; ++t) {
        std::memcpy(static_cast<void*>(to.row(b, h, t)), from.row(b, h, t), dim * sizeof(T));
      }
    }
  }
}

}  // namespace kvcache::detail
