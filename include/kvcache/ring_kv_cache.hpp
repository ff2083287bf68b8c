// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvcache/codec.hpp"
#include "kvcache/concepts.hpp"
#include "kvcache/config.hpp"
#include "kvcache/detail/assert.hpp"
#include "kvcache/detail/cache_base.hpp"
#include "kvcache/detail/checks.hpp"
#include "kvcache/detail/row_store.hpp"
#include "kvcache/version.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// Sliding-window cache: keeps the last `window` positions, the first `sinks` positions forever
/// (attention sinks), and `slack` positions older than the window so that truncate() can roll
/// back after the ring has wrapped. Memory is bounded by sinks + window + slack rows, plus a
/// staging area as large as the largest chunk, however long the sequence runs.
///
/// Query p sees the sinks and the keys k with p - window < k <= p; the returned History says
/// so (window, sinks), and causal_attention applies it. A chunk too long to write without
/// overwriting keys its own first queries need is staged and returned as a segment of its
/// own; its tail is folded into the ring at the next update of that layer.
///
///   kvcache::RingKvCache<float> cache({.layers = 4, .kv_heads = 2, .head_dim = 32, .window = 512, .sinks = 4});
///   auto history = cache.update(layer, k, v, positions);  // up to 4 segments
///   kvcache::causal_attention(q, positions, history, out);
template <class T>
class RingKvCache : public detail::LayerLengths,
                    public detail::HeadScales,
                    public detail::ComputeTypeUpdates<RingKvCache<T>, T> {
  static_assert(detail::check_codec<T>(), "RingKvCache<T>: T must be a storage format (a type with a storage_codec).");

 public:
  using value_type = T;

  /// Allocates the ring; throws std::invalid_argument for a zero size or a zero window,
  /// std::length_error for sinks + window + slack rows whose bytes overflow std::size_t.
  explicit RingKvCache(const KvCacheConfig& config)
      : LayerLengths("RingKvCache", detail::check_config("RingKvCache", config)),
        HeadScales(layers()),
        window_(config.window),
        sinks_(config.sinks),
        ring_(config.window + config.slack),
        capacity_(config.capacity == 0 ? std::numeric_limits<std::size_t>::max() : std::size_t{config.capacity}) {
    if (window_ == 0) throw std::invalid_argument("RingKvCache: config.window: expected > 0, given 0");
    constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
    if (config.slack > max - config.window || config.sinks > max - ring_) {
      throw std::length_error("RingKvCache: config.sinks + window + slack: expected to fit in std::size_t, given " +
                              std::to_string(config.sinks) + " + " + std::to_string(config.window) + " + " +
                              std::to_string(config.slack));
    }
    detail::check_footprint("RingKvCache", geometry(), stored_rows(), sizeof(typename storage_codec<T>::unit));
    init_scales<T>(name(), geometry(), config);
    layers_.reserve(layers());
    for (std::size_t l = 0; l < layers(); ++l) {
      layers_.push_back(
          Layer{Store(batch(), kv_heads(), head_dim(), stored_rows()), std::vector<std::int64_t>(stored_rows(), -1)});
    }
  }

  // update(layer, k, v, positions), from ComputeTypeUpdates: writes k, v [B, H_kv, T, D] in any
  // compute type the format accepts for `positions` (which must continue this layer's length)
  // and returns what attention may read: the sinks, the ring's keys from the first query's
  // window on (one or two segments) and, for a long chunk, the chunk itself. Throws
  // std::out_of_range (layer), std::invalid_argument (shapes, positions) or std::length_error
  // (capacity); the cache is unchanged then.
  using detail::ComputeTypeUpdates<RingKvCache<T>, T>::update;

  /// The most tokens a sequence may reach (config.capacity, or unbounded).
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  [[nodiscard]] std::size_t window() const noexcept { return window_; }
  [[nodiscard]] std::size_t sinks() const noexcept { return sinks_; }
  /// Rows the ring stores per layer and batch row: sinks + window + slack, a position each.
  [[nodiscard]] std::size_t stored_rows() const noexcept { return sinks_ + ring_; }
  /// Bytes allocated for K and V: the ring and the staging areas.
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t total = scale_bytes();
    for (const Layer& l : layers_) total += l.rows.bytes() + l.staging.rows.bytes();
    return total;
  }

  /// Forgets everything after `length` tokens, copying nothing. Works while every layer still
  /// holds the positions a query at `length` needs (the window before it): `slack` guarantees
  /// that for any `length` at most slack + 1 tokens short of the furthest length the layer has
  /// reached (a rollback does not give back the rows the forgotten tokens overwrote), and any
  /// rollback into the last chunk. Throws std::out_of_range otherwise, or if a layer holds
  /// fewer than `length` tokens, leaving the cache unchanged.
  void truncate(std::size_t length) {
    check_truncate(length);
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      // A query at `length` reads the positions [needed_from, length), sinks aside.
      const std::size_t held_from = std::max(sinks_, layers_[l].oldest);
      const std::size_t needed_from = std::max(sinks_, length + 1 > window_ ? length + 1 - window_ : 0);
      if (needed_from < length && held_from > needed_from) {
        throw std::out_of_range(detail::expected_given(
            "RingKvCache::truncate: length",
            ">= " + std::to_string(held_from + window_ - 1) + " or <= " + std::to_string(sinks_) + " (layer " +
                std::to_string(l) + " holds positions from " + std::to_string(held_from) + " on; a query reads the " +
                std::to_string(window_) + " positions up to itself)",
            std::to_string(length)));
      }
    }
    for (Layer& state : layers_) {
      state.stored_end = std::min(state.stored_end, length);
      state.oldest = std::min(state.oldest, length);
    }
    set_all_lengths(length);
  }

  /// Empties every layer and gives back the staging areas long chunks grew.
  void reset() noexcept {
    for (Layer& state : layers_) {
      state.stored_end = state.oldest = 0;
      state.staging = Staging{};
    }
    set_all_lengths(0);
  }

  /// Moves a staged chunk into the ring and gives back the staging areas (bytes() falls to the
  /// ring's), and the memory of the rows no position reaches yet (whole pages; Linux), which
  /// later updates take again. A mutating call on every layer; a truncate() after it rolls back
  /// as far as `slack` allows (a staged chunk no longer can be).
  void shrink_to_fit() noexcept {
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      Layer& state = layers_[l];
      fold_staged(state, length(l));
      state.staging = Staging{};
      // The rows after the last one a held position is in: a ring that has not wrapped yet.
      std::size_t unused = stored_rows();
      while (unused > 0 && (state.positions[unused - 1] < 0 ||
                            static_cast<std::size_t>(state.positions[unused - 1]) >= state.stored_end)) {
        --unused;
      }
      state.rows.release(unused, stored_rows() - unused);
    }
  }

  /// Every position the layer holds (sinks, ring, a staged chunk), without writing; attention
  /// applies the window. Valid until the next mutating call on that layer, and leaves what
  /// update() returned intact; std::out_of_range for a bad layer.
  [[nodiscard]] History<T> history(std::size_t layer) {
    const std::size_t length = this->length(layer);
    Layer& state = layers_[layer];
    return history(state, state.read_segments, head_scale_view(layer), 0, length);
  }

 private:
  friend class detail::ComputeTypeUpdates<RingKvCache<T>, T>;
  using Store = detail::RowStore<T>;

  struct Staging {
    Staging() = default;
    Staging(const detail::Geometry& g, std::size_t count)
        : rows(g.batch, g.kv_heads, g.head_dim, count, {.zero_fill = false}), positions(count) {}
    Store rows;
    std::vector<std::int64_t> positions;  // as many as the staging area holds tokens
  };

  struct Layer {
    Store rows;                           // [B, H, rows]
    std::vector<std::int64_t> positions;  // the position each row holds
    std::size_t stored_end = 0;           // positions below this are in rows (if not overwritten)
    std::size_t oldest = 0;               // no position >= max(sinks, oldest) below stored_end is overwritten
    Staging staging{};                    // positions [stored_end, length) when a chunk was staged
    std::array<Segment<T>, 4> segments{};
    std::array<Segment<T>, 4> read_segments{};  // history(layer)'s, apart from update()'s
  };

  friend struct detail::StateAccess;

  // State files (state_file.hpp): per layer, RING (where the ring stands, the position each
  // row holds, the staged chunk's positions), ROWS (every row) and STAG (the staged rows).
  template <class Settings>
  void state_settings(Settings& settings) const {
    settings.may_differ("capacity", capacity_ == std::numeric_limits<std::size_t>::max() ? 0 : capacity_);
    settings.must_match("window", window_);
    settings.must_match("sinks", sinks_);
    settings.must_match("slack", ring_ - window_);
  }
  template <class Out>
  void save_sections(Out& out) const {
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      const Layer& state = layers_[l];
      const std::size_t staged = length(l) - state.stored_end;
      out.section("RING", l, [&](auto& fields) {
        fields.u64(state.stored_end);
        fields.u64(state.oldest);
        fields.u64(state.staging.positions.size());
        fields.i64s(state.positions);
        fields.i64s(std::span<const std::int64_t>(state.staging.positions.data(), staged));
      });
      out.rows("ROWS", l, state.rows, 0, stored_rows());
      out.rows("STAG", l, state.staging.rows, 0, staged);
    }
  }
  template <class In>
  auto load_sections(In& in) {
    struct Loaded {
      std::size_t stored_end, oldest;
      std::vector<std::int64_t> positions;
      Staging staging;
    };
    std::vector<Loaded> loaded;
    loaded.reserve(layers_.size());
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      const std::size_t length = in.lengths()[l];
      auto fields = in.section("RING", l, 3 * 8 + (stored_rows() + length) * 8);
      const auto check = [&](const char* field, bool ok, const std::string& expected, auto found) {
        fields.require(ok, field, expected, std::to_string(found));
      };
      const std::size_t stored_end = fields.u64("stored_end");
      check("stored_end", stored_end <= length, "<= the layer's length " + std::to_string(length), stored_end);
      const std::size_t oldest = fields.u64("oldest");
      check("oldest", oldest <= stored_end, "<= stored_end " + std::to_string(stored_end), oldest);
      const std::size_t staging_tokens = fields.u64("staging tokens");
      const std::size_t staged = length - stored_end;
      check("staging tokens", staging_tokens >= staged, ">= the staged tokens " + std::to_string(staged),
            staging_tokens);
      // The staging area is as large as the largest chunk, which no capacity lets exceed it: a
      // larger one is allocated for nothing (or for a lying file).
      check("staging tokens", staging_tokens <= capacity_,
            "<= the capacity " + std::to_string(capacity_) + " of the cache loaded into", staging_tokens);
      // Without a capacity nothing bounds the saved area but the file's own staged tokens: those
      // are allocated, and a later larger chunk grows the area as it would have.
      const std::size_t area = capacity_ == std::numeric_limits<std::size_t>::max() ? staged : staging_tokens;
      std::vector<std::int64_t> positions = fields.i64s("row positions", stored_rows());
      for (std::size_t row = 0; row < positions.size(); ++row) {
        const std::int64_t p = positions[row];  // -1: never written
        check("row positions", p == -1 || (p >= 0 && row_of(static_cast<std::size_t>(p)) == row),
              "-1 or a position that row " + std::to_string(row) + " holds", p);
      }
      // What a history reads from the rows (the sinks, and from oldest on) must be there: each
      // of those positions in its own row, so no more of them than the ring has rows.
      const std::size_t held_from = std::max(sinks_, oldest);
      check("oldest", stored_end <= held_from || stored_end - held_from <= ring_,
            ">= stored_end - " + std::to_string(ring_) + " (the rows after the sinks)", oldest);
      const auto expect_held = [&](std::size_t p) {
        check("row positions", positions[row_of(p)] == static_cast<std::int64_t>(p),
              std::to_string(p) + " in row " + std::to_string(row_of(p)) + ", which a history reads",
              positions[row_of(p)]);
      };
      for (std::size_t p = 0; p < std::min(sinks_, stored_end); ++p) expect_held(p);
      for (std::size_t p = held_from; p < stored_end; ++p) expect_held(p);
      const std::vector<std::int64_t> staged_positions = fields.i64s("staged positions", staged);
      for (std::size_t i = 0; i < staged; ++i) {
        check("staged positions", staged_positions[i] == static_cast<std::int64_t>(stored_end + i),
              std::to_string(stored_end + i), staged_positions[i]);
      }
      fields.finish();
      Staging staging;
      if (area != 0) {
        detail::check_footprint("RingKvCache", geometry(), area, sizeof(typename storage_codec<T>::unit));
        staging = Staging(geometry(), area);
        std::copy(staged_positions.begin(), staged_positions.end(), staging.positions.begin());
      }
      loaded.push_back({stored_end, oldest, std::move(positions), std::move(staging)});
      // The ring's own rows directly: the loader reads them first where they hold tokens.
      in.rows("ROWS", l, layers_[l].rows, 0, stored_rows());
      in.rows("STAG", l, loaded.back().staging.rows, 0, staged);
    }
    return [this, loaded = std::move(loaded)]() mutable noexcept {
      for (std::size_t l = 0; l < layers_.size(); ++l) {
        layers_[l].stored_end = loaded[l].stored_end;
        layers_[l].oldest = loaded[l].oldest;
        layers_[l].positions = std::move(loaded[l].positions);
        layers_[l].staging = std::move(loaded[l].staging);
      }
    };
  }

  template <class In>
  History<T> store(std::size_t layer, const TensorView<const In>& k, const TensorView<const In>& v,
                   const Positions& positions) {
    const std::size_t length = check_update(layer, k, v, positions, capacity_);
    check_values<T>(name(), layer, k, v);
    Layer& state = layers_[layer];
    const std::size_t tokens = k.tokens();
    // Writing position p overwrites p - ring: safe while that is older than the chunk's first
    // query's window, that is for chunks of at most slack + 1 tokens.
    const bool direct = tokens <= ring_ - window_ + 1;
    Staging grown;
    if (!direct && tokens > state.staging.positions.size()) grown = Staging(geometry(), tokens);  // may throw
    // Nothing below throws.
    fold_staged(state, length);
    if (!grown.positions.empty()) state.staging = std::move(grown);
    std::size_t clipped = 0;
    if (direct) {
      write(state, length, tokens, [&](std::size_t from, std::size_t count, std::size_t row) {
        clipped += state.rows.encode(k, v, from, count, row, head_scale_view(layer));
      });
    } else {
      clipped = state.staging.rows.encode(k, v, 0, tokens, 0, head_scale_view(layer));
      std::copy(positions.begin(), positions.end(), state.staging.positions.begin());
    }
    count_clipped(layer, clipped);
    set_length(layer, length + tokens);
    return history(state, state.segments, head_scale_view(layer), length, length + tokens);
  }

  [[nodiscard]] std::size_t row_of(std::size_t position) const noexcept {
    return position < sinks_ ? position : sinks_ + (position - sinks_) % ring_;
  }

  /// Stores `tokens` positions from `first` on in their rows, skipping those that later
  /// positions of the same block would overwrite: put(i, count, row) stores the block's tokens
  /// [i, i + count) in rows [row, row + count).
  template <class Put>
  void write(Layer& state, std::size_t first, std::size_t tokens, const Put& put) {
    const std::size_t end = first + tokens;
    const auto store_run = [&](std::size_t from, std::size_t to) {  // contiguous rows
      const std::size_t row = row_of(from);
      const std::size_t count = to - from;
      put(from - first, count, row);
      for (std::size_t i = 0; i < count; ++i) state.positions[row + i] = static_cast<std::int64_t>(from + i);
    };
    if (first < sinks_) store_run(first, std::min(end, sinks_));
    std::size_t from = std::max({first, sinks_, end > ring_ ? end - ring_ : 0});
    while (from < end) {
      const std::size_t until_wrap = sinks_ + ring_ - row_of(from);
      const std::size_t to = std::min(end, from + until_wrap);
      store_run(from, to);
      from = to;
    }
    if (end > ring_) state.oldest = std::max(state.oldest, end - ring_);
    state.stored_end = end;
  }

  /// Moves a staged chunk's positions into the ring before the next write.
  void fold_staged(Layer& state, std::size_t length) {
    const std::size_t staged = length - state.stored_end;
    if (staged == 0) return;
    write(state, state.stored_end, staged, [&](std::size_t from, std::size_t count, std::size_t row) {
      state.rows.copy(state.staging.rows, from, count, row);
    });
  }

  /// The segments attention may read for a layer holding `length` tokens whose queries start at
  /// position `first_query`, oldest first: the sinks, then the held positions from the first
  /// query's window on (older ones, kept for truncate() or overwritten later, no query reads).
  History<T> history(Layer& state, std::array<Segment<T>, 4>& segments, detail::HeadScaleView scales,
                     std::size_t first_query, std::size_t length) {
    std::size_t count = 0;
    const auto add_rows = [&](std::size_t row, std::size_t tokens) {
      segments[count++] = state.rows.segment(row, tokens, Positions(state.positions.data() + row, tokens), scales);
    };
    if (const std::size_t sink_count = std::min(sinks_, state.stored_end); sink_count != 0) add_rows(0, sink_count);
    const std::size_t window_start = first_query + 1 > window_ ? first_query + 1 - window_ : 0;
    const std::size_t from = std::max({sinks_, state.oldest, window_start});
    if (state.stored_end > from) {
      const std::size_t held = state.stored_end - from;
      const std::size_t first_row = row_of(from);
      const std::size_t before_wrap = std::min(held, sinks_ + ring_ - first_row);
      add_rows(first_row, before_wrap);
      if (held > before_wrap) add_rows(sinks_, held - before_wrap);
    }
    if (length > state.stored_end) {
      const std::size_t staged = length - state.stored_end;
      segments[count++] =
          state.staging.rows.segment(0, staged, Positions(state.staging.positions.data(), staged), scales);
    }
    KVCACHE_ASSERT(count <= segments.size(), "RingKvCache: more segments than expected");
    return {std::span<const Segment<T>>(segments.data(), count), window_, sinks_};
  }

  std::size_t window_;
  std::size_t sinks_;
  std::size_t ring_;  // window + slack: rows after the sinks
  std::size_t capacity_;
  std::vector<Layer> layers_;
};

static_assert(kv_cache_protocol<RingKvCache<float>>);

}  // namespace KVCACHE_ABI
}  // namespace kvcache
