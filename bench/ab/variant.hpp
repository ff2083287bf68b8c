// SPDX-License-Identifier: Apache-2.0
#pragma once

// What bench/ab/ab_attention.cpp hands each revision's build (bench/ab/variant.cpp).

#include <cstddef>
#include <cstdint>
#include <span>

namespace kvcache_ab {

enum class Type { kFloat, kBfloat16, kHalf };

/// One decode step (T = 1, batch 1) over `tokens` keys at positions 0 .. tokens - 1, K and V
/// [1, kv_heads, tokens, head_dim] contiguous; q and out [1, q_heads, 1, head_dim] floats,
/// handed to causal_attention as they are or, where `stored_queries`, rounded to the storage
/// type (a model whose activations are bfloat16 or half) and the output widened back.
struct DecodeCall {
  Type type;
  const void* keys;
  const void* values;
  std::span<const std::int64_t> positions;
  std::size_t kv_heads, q_heads, tokens, head_dim, threads;
  const float* q;
  float* out;
  bool stored_queries;
};

}  // namespace kvcache_ab
