// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvcache/codec.hpp"
#include "kvcache/version.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

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
/// by default, double for double storage): a KvCache<kvcache::bfloat16> is a
/// kv_cache_protocol<KvCache<kvcache::bfloat16>, float>.
template <class C, class In = default_input<typename C::value_type>>
concept kv_cache_protocol = requires(C& cache, const C& view, std::size_t n, TensorView<const In> kv,
                                     Positions positions) {
  typename C::value_type;
  requires storage_format<typename C::value_type>;
  { cache.update(n, kv, kv, positions) } -> std::same_as<History<typename C::value_type>>;
  { cache.history(n) } -> std::same_as<History<typename C::value_type>>;
  { view.length() } -> std::same_as<std::size_t>;
  { view.capacity() } -> std::same_as<std::size_t>;
  { view.layers() } -> std::same_as<std::size_t>;
  { view.bytes() } -> std::same_as<std::size_t>;
  cache.truncate(n);
  cache.reset();
};

/// A cache whose batch rows advance on their own (SlotKvCache): besides the protocol, an update
/// of listed rows with positions per row, each row's length, and each row's rollback. Model
/// code that serves a batch of sequences is a template over it:
///
///   auto history = cache.update(layer, k, v, positions, rows);  // k [rows, H_kv, T, D]
///   std::size_t held = cache.row_length(row);
///   cache.truncate(row, held);
template <class C, class In = default_input<typename C::value_type>>
concept row_cache_protocol = kv_cache_protocol<C, In> &&
    requires(C& cache, const C& view, std::size_t n, TensorView<const In> kv, Positions positions, Rows rows) {
  { cache.update(n, kv, kv, positions, rows) } -> std::same_as<History<typename C::value_type>>;
  { view.row_length(n) } -> std::same_as<std::size_t>;
  cache.truncate(n, n);
};

}  // namespace KVCACHE_ABI
}  // namespace kvcache
