// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "kvcache/codec.hpp"
#include "kvcache/concepts.hpp"
#include "kvcache/config.hpp"
#include "kvcache/detail/cache_base.hpp"
#include "kvcache/detail/checks.hpp"
#include "kvcache/detail/row_store.hpp"
#include "kvcache/version.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// The default cache: K and V preallocated to `capacity` at construction, 64-byte aligned,
/// [batch, kv_heads, capacity, head_dim] per layer, stored in format T (float, double,
/// kvcache::half, kvcache::bfloat16, Eigen's, a quantized format, or any format with a
/// storage_codec; kvcache::storage_formats lists kvcache's). It takes k and v in the
/// engine's compute type and rounds them into T once. An update copies only the new tokens and
/// never reallocates, so a generation of N tokens costs O(N) copying in all.
///
///   kvcache::KvCache<kvcache::bfloat16> cache({.layers = 4, .kv_heads = 2, .head_dim = 32, .capacity = 1024});
///   for (std::size_t layer = 0; layer < cache.layers(); ++layer) {
///     auto history = cache.update(layer, k, v, positions);  // float k, v; positions continue cache.length()
///     kvcache::causal_attention(q, positions, history, out);
///   }
template <class T>
class KvCache : public detail::LayerLengths,
                public detail::HeadScales,
                public detail::ComputeTypeUpdates<KvCache<T>, T> {
  static_assert(detail::check_codec<T>(), "KvCache<T>: T must be a storage format (a type with a storage_codec).");

 public:
  using value_type = T;

  /// Allocates every layer's K and V; throws std::invalid_argument for a zero size or ring fields,
  /// std::length_error for a size whose bytes overflow std::size_t.
  explicit KvCache(const KvCacheConfig& config)
      : LayerLengths("KvCache", detail::check_dense_config("KvCache", config)),
        HeadScales(layers()),
        capacity_(
            detail::check_footprint("KvCache", geometry(), config.capacity, sizeof(typename storage_codec<T>::unit))),
        positions_(capacity_),
        segments_(layers()) {
    std::iota(positions_.begin(), positions_.end(), std::int64_t{0});
    init_scales<T>(name(), geometry(), config);
    rows_.reserve(layers());
    for (std::size_t l = 0; l < layers(); ++l) rows_.emplace_back(batch(), kv_heads(), head_dim(), capacity_);
  }

  // update(layer, k, v, positions), from ComputeTypeUpdates: writes k, v [B, H_kv, T, D] in any
  // compute type the format accepts for `positions` (which must continue this layer's length)
  // and returns the layer's whole history. Throws std::out_of_range (layer),
  // std::invalid_argument (shapes, positions) or std::length_error (capacity); the cache is
  // unchanged then.
  using detail::ComputeTypeUpdates<KvCache<T>, T>::update;

  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  /// Bytes allocated for K and V (and their scales, for formats that have them).
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t total = scale_bytes();
    for (const auto& r : rows_) total += r.bytes();
    return total;
  }

  /// Forgets everything after `length` tokens in every layer, copying nothing (rollback; also
  /// repairs a forward pass stopped part-way). std::out_of_range if a layer holds fewer.
  void truncate(std::size_t length) {
    check_truncate(length);
    set_all_lengths(length);
  }
  void reset() noexcept { set_all_lengths(0); }

  /// Gives the memory of the positions past each layer's length back to the system (whole pages;
  /// Linux), which backs it again as later updates write there: after a reset() or a truncate,
  /// for a cache kept for a later sequence. Addresses, capacity() and bytes() stay the same.
  void shrink_to_fit() noexcept {
    for (std::size_t l = 0; l < layers(); ++l) rows_[l].release(length(l), capacity_ - length(l));
  }

  /// The layer's history as update() returns it, without writing: [B, H_kv, length(layer), D].
  /// Valid until the next mutating call on that layer; std::out_of_range for a bad layer.
  [[nodiscard]] History<T> history(std::size_t layer) {
    const std::size_t end = length(layer);
    segments_[layer] = rows_[layer].segment(0, end, Positions(positions_.data(), end), head_scale_view(layer));
    return {std::span<const Segment<T>>(&segments_[layer], 1)};
  }

 private:
  friend class detail::ComputeTypeUpdates<KvCache<T>, T>;
  friend struct detail::StateAccess;

  // State files (state_file.hpp): each layer's rows; BASE has the lengths.
  template <class Settings>
  void state_settings(Settings& settings) const {
    settings.may_differ("capacity", capacity_);  // the file's tokens must fit it
  }
  template <class Out>
  void save_sections(Out& out) const {
    for (std::size_t l = 0; l < layers(); ++l) out.rows("ROWS", l, rows_[l], 0, length(l));
  }
  template <class In>
  auto load_sections(In& in) {
    // Into the rows themselves: the loader reads them first where they hold tokens.
    for (std::size_t l = 0; l < layers(); ++l) in.rows("ROWS", l, rows_[l], 0, in.lengths()[l]);
    return []() noexcept {};
  }

  template <class In>
  History<T> store(std::size_t layer, const TensorView<const In>& k, const TensorView<const In>& v,
                   const Positions& positions) {
    const std::size_t start = check_update(layer, k, v, positions, capacity_);
    check_values<T>(name(), layer, k, v);
    count_clipped(layer, rows_[layer].encode(k, v, 0, k.tokens(), start, head_scale_view(layer)));
    set_length(layer, start + k.tokens());
    return history(layer);
  }

  std::size_t capacity_;
  std::vector<detail::RowStore<T>> rows_;  // per layer
  std::vector<std::int64_t> positions_;    // 0, 1, ..., capacity - 1: every layer's key positions
  std::vector<Segment<T>> segments_;       // per layer, what the last update returned
};

static_assert(kv_cache_protocol<KvCache<float>>);

}  // namespace KVCACHE_ABI
}  // namespace kvcache
