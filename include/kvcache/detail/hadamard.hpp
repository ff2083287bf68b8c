// SPDX-License-Identifier: Apache-2.0
#pragma once

// A fixed orthogonal transform of a head's values: random signs, then a normalized
// Walsh-Hadamard transform of each block of the largest power of two (at most 256) that
// divides the head size. It spreads a channel of outsized values over its block, so that a
// format with a range per group of values no longer spends its levels on one channel; being
// orthogonal, it leaves every dot product as it was (attention rotates the queries alike).

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kvcache/version.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

/// The largest block the transform mixes.
inline constexpr std::size_t kMaxRotationBlock = 256;

/// The block the transform of a head of `head_dim` values mixes: the largest power of two
/// that divides it, at most kMaxRotationBlock (1 for an odd head size: no mixing).
constexpr std::size_t rotation_block(std::size_t head_dim) noexcept {
  std::size_t block = 1;
  while (block < kMaxRotationBlock && head_dim % (2 * block) == 0) block *= 2;
  return block;
}

/// The sign the transform gives channel d: a fixed pseudo-random +-1 (part of what a rotated
/// format's stored rows mean, so it never changes). Signs keep a row's common offset from
/// gathering in a block's first channel, where a plain Walsh-Hadamard transform would put it.
constexpr float rotation_sign(std::size_t d) noexcept {
  return ((0x9E3779B97F4A7C15ULL * (static_cast<std::uint64_t>(d) + 1)) >> 63) != 0 ? -1.0F : 1.0F;
}

/// x := H x / sqrt(n) for a power of two n: its own inverse.
inline void walsh_hadamard(float* x, std::size_t n) noexcept {
  for (std::size_t h = 1; h < n; h *= 2) {
    for (std::size_t i = 0; i < n; i += 2 * h) {
      for (std::size_t j = i; j < i + h; ++j) {
        const float a = x[j];
        const float b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const float norm = 1.0F / std::sqrt(static_cast<float>(n));
  for (std::size_t i = 0; i < n; ++i) x[i] *= norm;
}

/// x := R x for the `count` values of a head from channel `first` on (whole blocks).
inline void rotate_head(float* x, std::size_t first, std::size_t count, std::size_t head_dim) noexcept {
  const std::size_t block = rotation_block(head_dim);
  for (std::size_t i = 0; i < count; ++i) x[i] *= rotation_sign(first + i);
  for (std::size_t b = 0; b < count; b += block) walsh_hadamard(x + b, block);
}

/// x := R^T x, the inverse of rotate_head.
inline void unrotate_head(float* x, std::size_t first, std::size_t count, std::size_t head_dim) noexcept {
  const std::size_t block = rotation_block(head_dim);
  for (std::size_t b = 0; b < count; b += block) walsh_hadamard(x + b, block);
  for (std::size_t i = 0; i < count; ++i) x[i] *= rotation_sign(first + i);
}

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
