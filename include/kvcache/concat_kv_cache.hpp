// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include "kvcache/concepts.hpp"
#include "kvcache/config.hpp"
#include "kvcache/detail/aligned_buffer.hpp"
#include "kvcache/detail/cache_base.hpp"
#include "kvcache/detail/checks.hpp"
#include "kvcache/detail/copy.hpp"
#include "kvcache/views.hpp"

namespace kvcache {

/// The baseline to measure against: every update allocates a new buffer and copies the whole
/// history plus the new tokens into it (concatenate on every step), O(T) per token and O(N^2)
/// for a generation. Results are identical to KvCache; only the cost differs. Use it in
/// benchmarks, not in engines.
///
///   kvcache::ConcatKvCache<float> cache({.layers = 4, .kv_heads = 2, .head_dim = 32, .capacity = 1024});
///   auto history = cache.update(layer, k, v, positions);
template <class T>
class ConcatKvCache : public detail::CacheBase {
 public:
  using value_type = T;

  /// Allocates nothing yet; throws std::invalid_argument for a zero size or ring fields,
  /// std::length_error for a capacity whose bytes overflow std::size_t (as KvCache does).
  explicit ConcatKvCache(const KvCacheConfig& config)
      : CacheBase("ConcatKvCache", detail::check_dense_config("ConcatKvCache", config)),
        capacity_(detail::check_footprint("ConcatKvCache", geometry(), config.capacity, sizeof(T))),
        layers_(layers()) {}

  /// Same contract as KvCache::update; reallocates the layer's K and V every time.
  History<T> update(std::size_t layer, TensorView<const T> k, TensorView<const T> v,
                    std::span<const std::int64_t> positions) {
    const std::size_t length = check_update(layer, k, v, positions, capacity_);
    Layer& old = layers_[layer];
    const std::size_t total = length + k.tokens();
    // Plain pages, as a framework's allocator gives a concatenation (this is the baseline).
    constexpr detail::BufferOptions kPlain{.zero_fill = false, .huge_pages = false};
    Layer grown{detail::AlignedBuffer<T>(elements(total), kPlain), detail::AlignedBuffer<T>(elements(total), kPlain),
                std::vector<std::int64_t>(total), total};
    // The allocations above are the only steps that can throw; from here on nothing does.
    detail::copy_block(view(old.keys, old.tokens).tokens(0, length), view(grown.keys, total).tokens(0, length));
    detail::copy_block(view(old.values, old.tokens).tokens(0, length), view(grown.values, total).tokens(0, length));
    detail::copy_block(k, view(grown.keys, total).tokens(length, k.tokens()));
    detail::copy_block(v, view(grown.values, total).tokens(length, v.tokens()));
    std::iota(grown.positions.begin(), grown.positions.end(), std::int64_t{0});
    old = std::move(grown);
    set_length(layer, total);
    old.segment = Segment<T>{view(old.keys, total), view(old.values, total), old.positions};
    return {std::span<const Segment<T>>(&old.segment, 1)};
  }

  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  /// Bytes allocated for K and V now (grows with the sequence).
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t total = 0;
    for (const Layer& l : layers_) total += l.keys.bytes() + l.values.bytes();
    return total;
  }

  /// Forgets everything after `length` tokens (also repairs a forward pass stopped part-way); the
  /// buffers keep their size until the next update. std::out_of_range if a layer holds fewer.
  void truncate(std::size_t length) {
    check_truncate(length);
    set_all_lengths(length);
  }
  void reset() noexcept { set_all_lengths(0); }

 private:
  struct Layer {
    detail::AlignedBuffer<T> keys;
    detail::AlignedBuffer<T> values;
    std::vector<std::int64_t> positions;
    std::size_t tokens = 0;  // tokens the buffers were allocated for
    Segment<T> segment{};
  };

  [[nodiscard]] std::size_t elements(std::size_t tokens) const noexcept {
    return batch() * kv_heads() * tokens * head_dim();
  }
  [[nodiscard]] TensorView<T> view(detail::AlignedBuffer<T>& buffer, std::size_t tokens) const noexcept {
    return {buffer.data(), {batch(), kv_heads(), tokens, head_dim()}};
  }

  std::size_t capacity_;
  std::vector<Layer> layers_;
};

static_assert(kv_cache_protocol<ConcatKvCache<float>>);

}  // namespace kvcache
