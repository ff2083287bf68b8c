// SPDX-License-Identifier: Apache-2.0
#pragma once

// The key cursor: walks one (batch row, kv head)'s keys across a history's segments and gathers
// them into tiles of row addresses, positions and scales. A tile spans segment boundaries, so a
// history of many short segments (pages, slots) is read in tiles as long as a contiguous one;
// the passes over a tile never see a segment. Keys no query of the block may see are left out.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>

#include "kvcache/detail/simd.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

/// Which positions a block of queries may read, as bounds: keys after `latest` are invisible to
/// all of them, and so are keys before `oldest` that are not sinks (positions [0, sinks_end)).
struct KeyBounds {
  std::int64_t latest = std::numeric_limits<std::int64_t>::max();
  std::int64_t oldest = std::numeric_limits<std::int64_t>::min();
  std::int64_t sinks_end = 0;

  [[nodiscard]] bool keeps(std::int64_t p) const noexcept {
    return p <= latest && (p >= oldest || (p >= 0 && p < sinks_end));
  }
};

/// A tile's keys, in the order read: where each K and V row is, its position and its scales.
template <class Unit>
struct TileKeys {
  const Unit** keys = nullptr;
  const Unit** values = nullptr;
  std::int64_t* positions = nullptr;
  float* key_scales = nullptr;  // null for formats without scales
  float* value_scales = nullptr;
  std::size_t count = 0;
  std::int64_t lowest = 0;  // of the positions gathered
  std::int64_t highest = 0;
  bool ascending = true;  // positions[i] <= positions[i + 1] throughout
};

/// Walks keys [first, first + count) of batch row b, kv head h, in the history's order (segment
/// by segment, row b reading segment s's first tokens(b) keys).
template <class T>
class KeyCursor {
 public:
  using Unit = typename Segment<T>::unit;

  KeyCursor(std::span<const Segment<T>> segments, std::size_t b, std::size_t h, std::size_t first,
            std::size_t count) noexcept
      : segments_(segments), b_(b), h_(h), left_(count) {
    while (segment_ < segments_.size() && first >= segments_[segment_].tokens(b_)) {
      first -= segments_[segment_].tokens(b_);
      ++segment_;
    }
    key_ = first;
  }

  [[nodiscard]] bool done() const noexcept { return left_ == 0 || segment_ >= segments_.size(); }

  /// Gathers the next keys that `bounds` keeps into `tile`, up to `room` of them; returns false
  /// once no key is left.
  bool next(TileKeys<Unit>& tile, std::size_t room, const KeyBounds& bounds) noexcept {
    tile.count = 0;
    tile.ascending = true;
    tile.lowest = std::numeric_limits<std::int64_t>::max();
    tile.highest = std::numeric_limits<std::int64_t>::min();
    while (tile.count < room && !done()) {
      const Segment<T>& s = segments_[segment_];
      const std::size_t n = std::min({s.tokens(b_) - key_, left_, room - tile.count});
      gather(s, key_, n, tile, bounds);
      key_ += n;
      left_ -= n;
      if (key_ == s.tokens(b_)) {
        ++segment_;
        key_ = 0;
      }
    }
    return tile.count != 0 || !done();
  }

 private:
  /// n scales `stride` apart (0: one scale for every row) into `to`.
  static void copy_scales(const float* from, std::size_t stride, std::size_t n, float* __restrict to) noexcept {
    if (stride == 0) {
      std::fill_n(to, n, *from);
    } else {
      for (std::size_t i = 0; i < n; ++i) to[i] = from[i * stride];
    }
  }

  /// Adds the kept keys among [from, from + n) of segment s.
  void gather(const Segment<T>& s, std::size_t from, std::size_t n, TileKeys<Unit>& tile,
              const KeyBounds& bounds) const noexcept {
    const std::size_t r = s.stored_row(b_);
    const std::int64_t* p = s.positions.row(r).data() + from;
    std::int64_t low = p[0];
    std::int64_t high = p[0];
    unsigned descents = 0;  // counted, not short-circuited: the loop vectorizes
    for (std::size_t i = 1; i < n; ++i) {
      low = std::min(low, p[i]);
      high = std::max(high, p[i]);
      descents |= static_cast<unsigned>(p[i - 1] > p[i]);
    }
    const bool ascending = descents == 0;
    if (high < bounds.oldest && (low >= bounds.sinks_end || high < 0)) return;  // before every window, no sink
    if (low > bounds.latest) return;
    const bool all = bounds.keeps(low) && bounds.keeps(high) && (low >= bounds.oldest || high < bounds.sinks_end);
    const Unit* k = s.keys.row(r, h_, from);
    const Unit* v = s.values.row(r, h_, from);
    const std::size_t ks = s.keys.strides().tokens;
    const std::size_t vs = s.values.strides().tokens;
    std::size_t t = tile.count;
    const auto add = [&](std::size_t i) KVCACHE_ALWAYS_INLINE {
      tile.keys[t] = k + i * ks;
      tile.values[t] = v + i * vs;
      tile.positions[t] = p[i];
      if (tile.key_scales != nullptr) {
        tile.key_scales[t] = *s.key_scales.at(r, h_, from + i);
        tile.value_scales[t] = *s.value_scales.at(r, h_, from + i);
      }
      ++t;
    };
    if (all) {
      // A loop per array, each writing one and reading nothing it writes: they vectorize.
      const Unit** __restrict keys = tile.keys + t;
      const Unit** __restrict values = tile.values + t;
      for (std::size_t i = 0; i < n; ++i) keys[i] = k + i * ks;
      for (std::size_t i = 0; i < n; ++i) values[i] = v + i * vs;
      std::copy_n(p, n, tile.positions + t);
      if (tile.key_scales != nullptr) {
        copy_scales(s.key_scales.at(r, h_, from), s.key_scales.strides.tokens, n, tile.key_scales + t);
        copy_scales(s.value_scales.at(r, h_, from), s.value_scales.strides.tokens, n, tile.value_scales + t);
      }
      t += n;
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        if (bounds.keeps(p[i])) add(i);
      }
    }
    if (t == tile.count) return;
    tile.ascending = tile.ascending && ascending && (tile.count == 0 || tile.positions[tile.count - 1] <= p[0]);
    tile.lowest = std::min(tile.lowest, low);
    tile.highest = std::max(tile.highest, high);
    tile.count = t;
  }

  std::span<const Segment<T>> segments_;
  std::size_t b_;
  std::size_t h_;
  std::size_t left_;
  std::size_t segment_ = 0;
  std::size_t key_ = 0;
};

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
