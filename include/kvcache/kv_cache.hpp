// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "kvcache/concepts.hpp"
#include "kvcache/config.hpp"
#include "kvcache/detail/aligned_buffer.hpp"
#include "kvcache/detail/cache_base.hpp"
#include "kvcache/detail/checks.hpp"
#include "kvcache/detail/copy.hpp"
#include "kvcache/views.hpp"

namespace kvcache {

/// The default cache: K and V preallocated to `capacity` at construction, 64-byte aligned,
/// [batch, kv_heads, capacity, head_dim] per layer. An update copies only the new tokens and
/// never reallocates, so a generation of N tokens costs O(N) copying in all.
///
///   kvcache::KvCache<float> cache({.layers = 4, .kv_heads = 2, .head_dim = 32, .capacity = 1024});
///   for (std::size_t layer = 0; layer < cache.layers(); ++layer) {
///     auto history = cache.update(layer, k, v, positions);  // positions continue cache.length()
///     kvcache::causal_attention(q, positions, history, out);
///   }
template <class T>
class KvCache : public detail::CacheBase {
 public:
  using value_type = T;

  /// Allocates every layer's K and V; throws std::invalid_argument for a zero size or ring fields,
  /// std::length_error for a size whose bytes overflow std::size_t.
  explicit KvCache(const KvCacheConfig& config)
      : CacheBase("KvCache", detail::check_dense_config("KvCache", config)),
        capacity_(detail::check_footprint("KvCache", geometry(), config.capacity, sizeof(T))),
        keys_(layer_elements() * layers()),
        values_(layer_elements() * layers()),
        positions_(capacity_),
        segments_(layers()) {
    std::iota(positions_.begin(), positions_.end(), std::int64_t{0});
  }

  /// Writes k, v [B, H_kv, T, D] for `positions` (which must continue this layer's length) and
  /// returns the layer's whole history. Throws std::out_of_range (layer), std::invalid_argument
  /// (shapes, positions) or std::length_error (capacity); the cache is unchanged then.
  History<T> update(std::size_t layer, TensorView<const T> k, TensorView<const T> v,
                    std::span<const std::int64_t> positions) {
    const std::size_t start = check_update(layer, k, v, positions, capacity_);
    detail::copy_block(k, storage(keys_, layer).tokens(start, k.tokens()));
    detail::copy_block(v, storage(values_, layer).tokens(start, v.tokens()));
    const std::size_t end = start + k.tokens();
    set_length(layer, end);
    segments_[layer] = Segment<T>{storage(keys_, layer).tokens(0, end), storage(values_, layer).tokens(0, end),
                                  std::span<const std::int64_t>(positions_.data(), end)};
    return {std::span<const Segment<T>>(&segments_[layer], 1)};
  }

  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  /// Bytes allocated for K and V.
  [[nodiscard]] std::size_t bytes() const noexcept { return keys_.bytes() + values_.bytes(); }

  /// Forgets everything after `length` tokens in every layer, copying nothing (rollback; also
  /// repairs a forward pass stopped part-way). std::out_of_range if a layer holds fewer.
  void truncate(std::size_t length) {
    check_truncate(length);
    set_all_lengths(length);
  }
  void reset() noexcept { set_all_lengths(0); }

 private:
  [[nodiscard]] std::size_t layer_elements() const noexcept { return batch() * kv_heads() * capacity_ * head_dim(); }
  [[nodiscard]] TensorView<T> storage(detail::AlignedBuffer<T>& buffer, std::size_t layer) noexcept {
    return {buffer.data() + layer * layer_elements(), {batch(), kv_heads(), capacity_, head_dim()}};
  }

  std::size_t capacity_;
  detail::AlignedBuffer<T> keys_;
  detail::AlignedBuffer<T> values_;
  std::vector<std::int64_t> positions_;  // 0, 1, ..., capacity - 1: every layer's key positions
  std::vector<Segment<T>> segments_;     // per layer, what the last update returned
};

static_assert(kv_cache_protocol<KvCache<float>>);

}  // namespace kvcache
