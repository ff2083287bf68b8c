// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

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
template <class C>
concept kv_cache_protocol = requires(C& cache, const C& view, std::size_t n,
                                     TensorView<const typename C::value_type> kv,
                                     std::span<const std::int64_t> positions) {
  typename C::value_type;
  { cache.update(n, kv, kv, positions) } -> std::same_as<History<typename C::value_type>>;
  { view.length() } -> std::same_as<std::size_t>;
  { view.length(n) } -> std::same_as<std::size_t>;
  { view.capacity() } -> std::same_as<std::size_t>;
  { view.layers() } -> std::same_as<std::size_t>;
  { view.bytes() } -> std::same_as<std::size_t>;
  cache.truncate(n);
  cache.reset();
};

}  // namespace kvcache
