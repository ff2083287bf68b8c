// SPDX-License-Identifier: Apache-2.0
#pragma once

// What bench/ab/ab_attention.cpp hands each revision's build (bench/ab/variant.cpp).

#include <cstddef>
#include <cstdint>
#include <span>

namespace kvcache_ab {

/// The storage format of a call: the dense ones, read from the caller's K and V as they are, and
/// the quantized ones, whose K and V the caller gives as floats.
enum class Type { kFloat, kBfloat16, kHalf, kFp8, kFp8Heads, kInt8, kInt4, kInt4Rotated };

/// Whether a call of this type hands K and V as floats for the revision to encode.
constexpr bool quantized(Type type) noexcept { return type >= Type::kFp8; }

/// One decode step (T = 1, batch 1) over `tokens` keys at positions 0 .. tokens - 1, K and V
/// [1, kv_heads, tokens, head_dim] contiguous (floats for a quantized type: the revision encodes
/// them once, into a KvCache of the format it keeps between calls on the same buffers); q and out
/// [1, q_heads, 1, head_dim] floats, handed to causal_attention as they are or, where
/// `stored_queries`, rounded to the storage type (a model whose activations are bfloat16 or
/// half) and the output widened back. A revision without the format sets *missing.
struct DecodeCall {
  Type type;
  const void* keys;
  const void* values;
  std::span<const std::int64_t> positions;
  std::size_t kv_heads, q_heads, tokens, head_dim, threads;
  const float* q;
  float* out;
  bool stored_queries;
  bool* missing;
};

}  // namespace kvcache_ab
