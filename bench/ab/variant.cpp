// SPDX-License-Identifier: Apache-2.0
// One build of the library for bench/ab/run.sh: compiled once per revision with
// -Dkvcache=<a namespace of its own> and -DKVCACHE_AB_NAME=<name>, so that several revisions'
// kernels link into one program and are timed in turn on the same memory.

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "kvcache/kvcache.hpp"
#include "variant.hpp"

namespace {

template <class T>
void decode(const kvcache_ab::DecodeCall& call) {
  const kvcache::Shape kv_shape{1, call.kv_heads, call.tokens, call.head_dim};
  const kvcache::Segment<T> segment{kvcache::TensorView<const T>(static_cast<const T*>(call.keys), kv_shape),
                                    kvcache::TensorView<const T>(static_cast<const T*>(call.values), kv_shape),
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
  }
}
