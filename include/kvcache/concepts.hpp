// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvcache/codec.hpp"
#include "kvcache/views.hpp"

namespace kvcache {

/// The one protocol every cache variant follows. Model code is a template over it and never
/// names a variant:
///
///   template <kvcache::kv_cache_protocol Cache>
///   void attend(Cache& cache, std::size_t layer, ...) {
///     auto history = cache.update(layer, k, v, positions);
///     kvcache::causal_attention(q, positions, history, out);
///   }
///
/// value_type is the stored format; In is the compute type the model hands k and v in (float
/// by default, double for double storage): a KvCache<Eigen::bfloat16> is a
/// kv_cache_protocol<KvCache<Eigen::bfloat16>, float>.
template <class C, class In = default_input<typename C::value_type>>
concept kv_cache_protocol = requires(C& cache, const C& view, std::size_t n, TensorView<const In> kv,
                                     Positions positions) {
  typename C::value_type;
  requires storage_format<typename C::value_type>;
  { cache.update(n, kv, kv, positions) } -> std::same_as<History<typename C::value_type>>;
  { cache.history(n) } -> std::same_as<History<typename C::value_type>>;
  { view.length() } -> std::same_as<std::size_t>;
  { view.length(n) } -> std::same_as<std::size_t>;
  { view.capacity() } -> std::same_as<std::size_t>;
  { view.layers() } -> std::same_as<std::size_t>;
  { view.bytes() } -> std::same_as<std::size_t>;
  cache.truncate(n);
  cache.reset();
};

}  // namespace kvcache
