// SPDX-License-Identifier: Apache-2.0
#pragma once

// The key cursor: walks one (batch row, kv head)'s keys across a history's segments in runs of
// consecutive keys of one segment, each a base address and a stride for K, V and their scales,
// so the passes over a run address rows as a contiguous history's, whatever the segments are (a
// page is a run; a ring's wrap starts a new one). Keys no query of the block may see are left
// out where positions ascend; elsewhere the mask leaves them out. Where a segment row's
// positions are consecutive (every cache's are), they are known from the first, found once a
// call, and no position is read while K and V stream past.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

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

/// The first position of segment s's row b where its keys' positions are consecutive (p, p + 1,
/// ...), kScattered where they are not, at s * batch + b.
inline constexpr std::int64_t kScattered = std::numeric_limits<std::int64_t>::min();

template <class T>
std::vector<std::int64_t> consecutive_starts(std::span<const Segment<T>> segments, std::size_t batch) {
  std::vector<std::int64_t> starts(segments.size() * batch, kScattered);
  for (std::size_t s = 0; s < segments.size(); ++s) {
    const Segment<T>& seg = segments[s];
    for (std::size_t b = 0; b < batch; ++b) {
      const std::int64_t* p = seg.positions.row(seg.stored_row(b)).data();
      const std::size_t n = seg.tokens(b);
      if (n == 0) continue;
      unsigned gaps = 0;                   // counted, not short-circuited: the loop vectorizes
      for (std::size_t i = 1; i < n; ++i)  // unsigned: any two positions subtract without overflow
        gaps |= static_cast<unsigned>(static_cast<std::uint64_t>(p[i]) - static_cast<std::uint64_t>(p[i - 1]) != 1);
      if (gaps == 0 && p[0] != kScattered &&
          p[0] <= std::numeric_limits<std::int64_t>::max() - 1 - static_cast<std::int64_t>(n))
        starts[s * batch + b] = p[0];
    }
  }
  return starts;
}

/// Consecutive keys of one segment's row: key i's K row at keys + i * key_stride (units), its
/// V row likewise, its position positions[i], its scales (formats that keep them) at
/// key_scales[i * key_scale_stride] (a stride of 0: one scale for every key).
template <class Unit>
struct KeyRun {
  const Unit* keys = nullptr;
  const Unit* values = nullptr;
  std::size_t key_stride = 0;
  std::size_t value_stride = 0;
  const std::int64_t* positions = nullptr;
  const float* key_scales = nullptr;  // null for formats without scales
  const float* value_scales = nullptr;
  std::size_t key_scale_stride = 0;
  std::size_t value_scale_stride = 0;
  std::size_t count = 0;
  std::int64_t lowest = 0;  // of the positions
  std::int64_t highest = 0;
  bool ascending = true;    // positions[i] <= positions[i + 1] throughout
  bool consecutive = true;  // positions[i] = lowest + i: the mask needs not read them

  [[nodiscard]] const Unit* key(std::size_t i) const noexcept { return keys + i * key_stride; }
  [[nodiscard]] const Unit* value(std::size_t i) const noexcept { return values + i * value_stride; }
  [[nodiscard]] float key_scale(std::size_t i) const noexcept { return key_scales[i * key_scale_stride]; }
  [[nodiscard]] float value_scale(std::size_t i) const noexcept { return value_scales[i * value_scale_stride]; }
};

/// Walks keys [first, first + count) of batch row b, kv head h, in the history's order (segment
/// by segment, row b reading segment s's first tokens(b) keys).
template <class T>
class KeyCursor {
 public:
  using Unit = typename Segment<T>::unit;

  /// Over `segments`, their consecutive_starts for `batch` rows.
  KeyCursor(std::span<const Segment<T>> segments, const std::int64_t* starts, std::size_t batch, std::size_t b,
            std::size_t h, std::size_t first, std::size_t count) noexcept
      : segments_(segments), starts_(starts), batch_(batch), b_(b), h_(h), left_(count) {
    while (segment_ < segments_.size() && first >= segments_[segment_].tokens(b_)) {
      first -= segments_[segment_].tokens(b_);
      ++segment_;
    }
    key_ = first;
  }

  /// The next run of up to `room` keys that `bounds` keeps; false once no key is left.
  bool next(KeyRun<Unit>& run, std::size_t room, const KeyBounds& bounds) noexcept {
    while (left_ != 0 && segment_ < segments_.size()) {
      const Segment<T>& s = segments_[segment_];
      const std::size_t available = std::min(s.tokens(b_) - key_, left_);
      if (available == 0) {
        next_segment();
        continue;
      }
      std::size_t used = std::min(available, room);
      const bool kept = take(s, key_, used, run, bounds);
      advance(s, used);
      if (kept) return true;
    }
    return false;
  }

  /// The rows of up to `n` keys that follow the last run returned, in its segment or the next
  /// one that has keys: where to ask for rows ahead. Bounds are not applied.
  [[nodiscard]] KeyRun<Unit> upcoming(std::size_t n) const noexcept {
    std::size_t segment = segment_;
    std::size_t key = key_;
    while (segment < segments_.size() && key >= segments_[segment].tokens(b_)) {
      ++segment;
      key = 0;
    }
    KeyRun<Unit> run;
    if (segment >= segments_.size() || left_ == 0) return run;
    const Segment<T>& s = segments_[segment];
    const std::size_t r = s.stored_row(b_);
    run.keys = s.keys.row(r, h_, key);
    run.values = s.values.row(r, h_, key);
    run.key_stride = s.keys.strides().tokens;
    run.value_stride = s.values.strides().tokens;
    run.count = std::min({n, s.tokens(b_) - key, left_});
    return run;
  }

 private:
  void next_segment() noexcept {
    ++segment_;
    key_ = 0;
  }
  void advance(const Segment<T>& s, std::size_t n) noexcept {
    key_ += n;
    left_ -= n;
    if (key_ == s.tokens(b_)) next_segment();
  }

  /// Makes `run` the keys of [from, from + n) of segment s that bounds keeps; false if none.
  /// Over ascending positions those are a range: a run ends at a gap between sinks and the
  /// window, and n becomes the keys used, those after the gap left to the next call. Over
  /// other positions all n stay, for the mask.
  bool take(const Segment<T>& s, std::size_t from, std::size_t& n, KeyRun<Unit>& run,
            const KeyBounds& bounds) const noexcept {
    const std::size_t r = s.stored_row(b_);
    const std::int64_t* p = s.positions.row(r).data() + from;
    const std::int64_t start = starts_[segment_ * batch_ + b_];
    const bool consecutive = start != kScattered;
    std::int64_t low = 0;
    std::int64_t high = 0;
    unsigned descents = 0;  // counted, not short-circuited: the loop vectorizes
    if (consecutive) {
      low = start + static_cast<std::int64_t>(from);
      high = low + static_cast<std::int64_t>(n) - 1;
    } else {
      low = p[0];
      high = p[0];
      for (std::size_t i = 1; i < n; ++i) {
        low = std::min(low, p[i]);
        high = std::max(high, p[i]);
        descents |= static_cast<unsigned>(p[i - 1] > p[i]);
      }
    }
    if (high < bounds.oldest && (low >= bounds.sinks_end || high < 0)) return false;  // before every window, no sink
    if (low > bounds.latest) return false;
    std::size_t first = 0;
    std::size_t count = n;
    const bool all = bounds.keeps(low) && bounds.keeps(high) && (low >= bounds.oldest || high < bounds.sinks_end);
    if (!all && descents == 0) {
      const auto position = [&](std::size_t i) { return consecutive ? low + static_cast<std::int64_t>(i) : p[i]; };
      while (first < n && !bounds.keeps(position(first))) ++first;
      if (first == n) return false;
      count = 1;
      while (first + count < n && bounds.keeps(position(first + count))) ++count;
      n = first + count;  // keys past a gap are the next call's
      high = position(first + count - 1);
      low = position(first);
    }
    run.keys = s.keys.row(r, h_, from + first);
    run.values = s.values.row(r, h_, from + first);
    run.key_stride = s.keys.strides().tokens;
    run.value_stride = s.values.strides().tokens;
    run.positions = p + first;
    if constexpr (reads_scales<storage_codec<T>>) {
      run.key_scales = s.key_scales.at(r, h_, from + first);
      run.value_scales = s.value_scales.at(r, h_, from + first);
      run.key_scale_stride = s.key_scales.strides.tokens;
      run.value_scale_stride = s.value_scales.strides.tokens;
    }
    run.count = count;
    run.lowest = low;
    run.highest = high;
    run.ascending = descents == 0;
    run.consecutive = consecutive;
    return true;
  }

  std::span<const Segment<T>> segments_;
  const std::int64_t* starts_;
  std::size_t batch_;
  std::size_t b_;
  std::size_t h_;
  std::size_t left_;
  std::size_t segment_ = 0;
  std::size_t key_ = 0;
};

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
