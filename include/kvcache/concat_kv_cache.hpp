// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <utility>
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

/// The baseline to measure against: every update allocates a new buffer and copies the whole
/// history plus the new tokens into it (concatenate on every step), O(T) per token and O(N^2)
/// for a generation. Results are identical to KvCache; only the cost differs. Use it in
/// benchmarks, not in engines.
///
///   kvcache::ConcatKvCache<float> cache({.layers = 4, .kv_heads = 2, .head_dim = 32, .capacity = 1024});
///   auto history = cache.update(layer, k, v, positions);
template <class T>
class ConcatKvCache : public detail::LayerLengths,
                      public detail::HeadScales,
                      public detail::ComputeTypeUpdates<ConcatKvCache<T>, T> {
  static_assert(detail::check_codec<T>(),
                "ConcatKvCache<T>: T must be a storage format (a type with a storage_codec).");

 public:
  using value_type = T;

  /// Allocates nothing yet; throws std::invalid_argument for a zero size or ring fields,
  /// std::length_error for a capacity whose bytes overflow std::size_t (as KvCache does).
  explicit ConcatKvCache(const KvCacheConfig& config)
      : LayerLengths("ConcatKvCache", detail::check_dense_config("ConcatKvCache", config)),
        HeadScales(layers()),
        capacity_(detail::check_footprint("ConcatKvCache", geometry(), config.capacity,
                                          sizeof(typename storage_codec<T>::unit))),
        layers_(layers()) {
    init_scales<T>(name(), geometry(), config);
  }

  // update(layer, k, v, positions): same contract as KvCache::update; reallocates the layer's
  // K and V every time.
  using detail::ComputeTypeUpdates<ConcatKvCache<T>, T>::update;

  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  /// Bytes allocated for K and V now (grows with the sequence).
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t total = scale_bytes();
    for (const Layer& l : layers_) total += l.rows.bytes();
    return total;
  }

  /// Forgets everything after `length` tokens (also repairs a forward pass stopped part-way); the
  /// buffers keep their size until the next update. std::out_of_range if a layer holds fewer.
  void truncate(std::size_t length) {
    check_truncate(length);
    set_all_lengths(length);
  }
  void reset() noexcept { set_all_lengths(0); }

  /// Reallocates each layer's K and V to what it holds (none for an empty layer), giving back
  /// what a truncate() or reset() left: bytes() falls to the tokens held. std::bad_alloc leaves
  /// the cache as it was.
  void shrink_to_fit() {
    std::vector<std::pair<std::size_t, Layer>> shrunk;
    for (std::size_t l = 0; l < layers(); ++l) {
      const std::size_t held = length(l);
      if (layers_[l].rows.tokens() == held) continue;
      Layer fitted;
      if (held != 0) {
        fitted.rows = detail::RowStore<T>(batch(), kv_heads(), head_dim(), held, kPlain);
        fitted.rows.copy(layers_[l].rows, 0, held, 0);
        fitted.positions.assign(layers_[l].positions.begin(),
                                layers_[l].positions.begin() + static_cast<std::ptrdiff_t>(held));
      }
      shrunk.emplace_back(l, std::move(fitted));
    }
    for (auto& [l, fitted] : shrunk) layers_[l] = std::move(fitted);  // nothing here throws
  }

  /// The layer's history as update() returns it, without writing: [B, H_kv, length(layer), D]
  /// (no segment before the first update). Valid until the next mutating call on that layer;
  /// std::out_of_range for a bad layer.
  [[nodiscard]] History<T> history(std::size_t layer) {
    const std::size_t total = length(layer);
    Layer& l = layers_[layer];
    if (l.positions.empty()) return {};
    l.segment = l.rows.segment(0, total, Positions(l.positions.data(), total), head_scale_view(layer));
    return {std::span<const Segment<T>>(&l.segment, 1)};
  }

 private:
  friend class detail::ComputeTypeUpdates<ConcatKvCache<T>, T>;
  friend struct detail::StateAccess;

  struct Layer {
    detail::RowStore<T> rows;
    std::vector<std::int64_t> positions;
    Segment<T> segment{};
  };

  // Plain pages, as a framework's allocator gives a concatenation (this is the baseline).
  static constexpr detail::BufferOptions kPlain{.zero_fill = false, .huge_pages = false};

  // State files (state_file.hpp): each layer's rows; BASE has the lengths.
  template <class Settings>
  void state_settings(Settings& settings) const {
    settings.may_differ("capacity", capacity_);  // the file's tokens must fit it
  }
  template <class Out>
  void save_sections(Out& out) const {
    for (std::size_t l = 0; l < layers(); ++l) out.rows("ROWS", l, layers_[l].rows, 0, length(l));
  }
  template <class In>
  auto load_sections(In& in) {
    // Buffers of the loaded lengths, as the updates that made them would have left them.
    std::vector<Layer> loaded(layers());
    for (std::size_t l = 0; l < layers(); ++l) {
      const std::size_t tokens = in.lengths()[l];
      if (tokens != 0) {
        loaded[l].rows = detail::RowStore<T>(batch(), kv_heads(), head_dim(), tokens, kPlain);
        loaded[l].positions.resize(tokens);
        std::iota(loaded[l].positions.begin(), loaded[l].positions.end(), std::int64_t{0});
      }
      in.rows("ROWS", l, loaded[l].rows, 0, tokens);
    }
    return [this, loaded = std::move(loaded)]() mutable noexcept { layers_ = std::move(loaded); };
  }

  template <class In>
  History<T> store(std::size_t layer, const TensorView<const In>& k, const TensorView<const In>& v,
                   const Positions& positions) {
    const std::size_t length = check_update(layer, k, v, positions, capacity_);
    check_values<T>(name(), layer, k, v);
    Layer& old = layers_[layer];
    const std::size_t total = length + k.tokens();
    Layer grown{detail::RowStore<T>(batch(), kv_heads(), head_dim(), total, kPlain), std::vector<std::int64_t>(total)};
    // The allocations above are the only steps that can throw; from here on nothing does.
    if (length != 0) grown.rows.copy(old.rows, 0, length, 0);
    count_clipped(layer, grown.rows.encode(k, v, 0, k.tokens(), length, head_scale_view(layer)));
    std::iota(grown.positions.begin(), grown.positions.end(), std::int64_t{0});
    old = std::move(grown);
    set_length(layer, total);
    return history(layer);
  }

  std::size_t capacity_;
  std::vector<Layer> layers_;
};

static_assert(kv_cache_protocol<ConcatKvCache<float>>);

}  // namespace KVCACHE_ABI
}  // namespace kvcache
