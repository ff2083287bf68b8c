// SPDX-License-Identifier: Apache-2.0
// One build of the library for bench/ab/run.sh: compiled once per revision with
// -Dkvcache=<a namespace of its own> and -DKVCACHE_AB_NAME=<name>, so that several revisions'
// kernels link into one program and are timed in turn on the same memory.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "kvcache/kvcache.hpp"
#include "variant.hpp"

// The quantized formats a revision may or may not have: declared here, complete only where its
// headers define them (inside the versioned inline namespace of a revision that has one).
namespace kvcache {
#if defined(KVCACHE_ABI)
inline namespace KVCACHE_ABI {
#endif
struct fp8_e4m3;
struct fp8_e4m3_heads;
struct int8_rows;
struct int4_groups;
struct int4_rotated;
#if defined(KVCACHE_ABI)
}  // namespace KVCACHE_ABI
#endif
}  // namespace kvcache

namespace {

#if KVCACHE_AB_NO_CODECS
// A revision from before storage codecs: rows of the dense types only, stored as the type itself.
template <class T>
concept known_format = false;
template <class T>
using unit_of = T;
#else
/// Whether this revision defines format T.
template <class T>
concept known_format = requires {
  sizeof(kvcache::storage_codec<T>);
};
template <class T>
using unit_of = typename kvcache::storage_codec<T>::unit;  // Eigen's 16-bit types are stored as kvcache's

/// The history of a KvCache<T> holding the call's K and V (floats), encoded on the first call
/// with these buffers and kept for the next ones, so that a timed call only reads.
template <class T>
const kvcache::History<T>& encoded(const kvcache_ab::DecodeCall& call) {
  struct Held {
    const void* keys = nullptr;
    const void* values = nullptr;
    std::size_t kv_heads = 0, tokens = 0, head_dim = 0;
    std::vector<float> key_scales, value_scales;
    std::optional<kvcache::KvCache<T>> cache;
    kvcache::History<T> history;
  };
  static Held held;
  if (held.keys == call.keys && held.values == call.values && held.kv_heads == call.kv_heads &&
      held.tokens == call.tokens && held.head_dim == call.head_dim) {
    return held.history;
  }
  const kvcache::Shape shape{1, call.kv_heads, call.tokens, call.head_dim};
  const auto* keys = static_cast<const float*>(call.keys);
  const auto* values = static_cast<const float*>(call.values);
  kvcache::KvCacheConfig config{
      .layers = 1, .kv_heads = call.kv_heads, .head_dim = call.head_dim, .capacity = call.tokens};
  held.key_scales.clear();
  held.value_scales.clear();
  if constexpr (kvcache::detail::has_head_scales<T>) {  // each head's largest magnitude maps to the largest code
    for (std::size_t h = 0; h < call.kv_heads; ++h) {
      float k = 0.0F, v = 0.0F;
      for (std::size_t i = h * call.tokens * call.head_dim; i < (h + 1) * call.tokens * call.head_dim; ++i) {
        k = std::max(k, std::fabs(keys[i]));
        v = std::max(v, std::fabs(values[i]));
      }
      held.key_scales.push_back(kvcache::storage_codec<T>::scale_for(k));
      held.value_scales.push_back(kvcache::storage_codec<T>::scale_for(v));
    }
    config.key_scales = held.key_scales;
    config.value_scales = held.value_scales;
  }
  held.cache.emplace(config);
  held.history = held.cache->update(0, kvcache::TensorView<const float>(keys, shape),
                                    kvcache::TensorView<const float>(values, shape), call.positions);
  held.keys = call.keys;
  held.values = call.values;
  held.kv_heads = call.kv_heads;
  held.tokens = call.tokens;
  held.head_dim = call.head_dim;
  return held.history;
}

#endif

template <class T>
void decode_quantized(const kvcache_ab::DecodeCall& call) {
  if constexpr (!known_format<T>) {
    *call.missing = true;
  } else {
#if !KVCACHE_AB_NO_CODECS
    const kvcache::History<T>& history = encoded<T>(call);
    const kvcache::Shape q_shape{1, call.q_heads, 1, call.head_dim};
    const std::int64_t position = static_cast<std::int64_t>(call.tokens);
    kvcache::causal_attention(kvcache::TensorView<const float>(call.q, q_shape), std::span(&position, 1), history,
                              kvcache::TensorView<float>(call.out, q_shape), {.threads = call.threads});
#endif
  }
}

template <class T>
void decode(const kvcache_ab::DecodeCall& call) {
  const kvcache::Shape kv_shape{1, call.kv_heads, call.tokens, call.head_dim};
  using Unit = unit_of<T>;
  const kvcache::Segment<T> segment{kvcache::TensorView<const Unit>(static_cast<const Unit*>(call.keys), kv_shape),
                                    kvcache::TensorView<const Unit>(static_cast<const Unit*>(call.values), kv_shape),
                                    call.positions};
  const kvcache::History<T> history{std::span<const kvcache::Segment<T>>(&segment, 1)};
  const kvcache::Shape q_shape{1, call.q_heads, 1, call.head_dim};
  const std::int64_t position = static_cast<std::int64_t>(call.tokens);
  const kvcache::AttentionOptions options{.threads = call.threads};
  if constexpr (!std::is_same_v<T, float>) {
    if (call.stored_queries) {
      std::vector<T> q(q_shape.size());
      std::vector<T> out(q.size());
      for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<T>(call.q[i]);
      kvcache::causal_attention(kvcache::TensorView<const T>(q.data(), q_shape), std::span(&position, 1), history,
                                kvcache::TensorView<T>(out.data(), q_shape), options);
      for (std::size_t i = 0; i < q.size(); ++i) call.out[i] = static_cast<float>(out[i]);
      return;
    }
  }
  kvcache::causal_attention(kvcache::TensorView<const float>(call.q, q_shape), std::span(&position, 1), history,
                            kvcache::TensorView<float>(call.out, q_shape), options);
}

}  // namespace

#define KVCACHE_AB_JOIN2(a, b) a##b
#define KVCACHE_AB_JOIN(a, b) KVCACHE_AB_JOIN2(a, b)

void KVCACHE_AB_JOIN(kvcache_ab_decode_, KVCACHE_AB_NAME)(const kvcache_ab::DecodeCall& call) {
  switch (call.type) {
    case kvcache_ab::Type::kFloat:
      return decode<float>(call);
    case kvcache_ab::Type::kBfloat16:
      return decode<Eigen::bfloat16>(call);
    case kvcache_ab::Type::kHalf:
      return decode<Eigen::half>(call);
    case kvcache_ab::Type::kFp8:
      return decode_quantized<kvcache::fp8_e4m3>(call);
    case kvcache_ab::Type::kFp8Heads:
      return decode_quantized<kvcache::fp8_e4m3_heads>(call);
    case kvcache_ab::Type::kInt8:
      return decode_quantized<kvcache::int8_rows>(call);
    case kvcache_ab::Type::kInt4:
      return decode_quantized<kvcache::int4_groups>(call);
    case kvcache_ab::Type::kInt4Rotated:
      return decode_quantized<kvcache::int4_rotated>(call);
  }
}
