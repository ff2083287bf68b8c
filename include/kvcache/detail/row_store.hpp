// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>

#include "kvcache/codec.hpp"
#include "kvcache/detail/aligned_buffer.hpp"
#include "kvcache/detail/assert.hpp"
#include "kvcache/version.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

/// A layer's K and V scales per kv head, for formats with head scales (null otherwise).
struct HeadScaleView {
  const float* keys = nullptr;
  const float* values = nullptr;
};

/// K and V rows of format T for a [batch, heads, tokens] block, with their scales where the
/// format has them: what every cache variant keeps its tokens in. Rows are written once from
/// the engine's values through the codec (encode) and afterwards only copied as stored bytes,
/// never converted again.
template <class T>
class RowStore {
 public:
  using Codec = storage_codec<T>;
  using Unit = typename Codec::unit;

  RowStore() = default;
  RowStore(std::size_t batch, std::size_t heads, std::size_t head_dim, std::size_t tokens, BufferOptions options = {})
      : batch_(batch),
        heads_(heads),
        head_dim_(head_dim),
        units_(Codec::units(head_dim)),
        tokens_(tokens),
        keys_(batch * heads * tokens * units_, options),
        values_(batch * heads * tokens * units_, options),
        key_scales_(kRowScales ? batch * heads * tokens : 0, options),
        value_scales_(kRowScales ? batch * heads * tokens : 0, options) {}

  /// for_each_run's and release()'s row that stands for every stored row.
  static constexpr std::size_t kEveryRow = ~std::size_t{0};

  /// Tokens each (batch row, head) holds.
  [[nodiscard]] std::size_t tokens() const noexcept { return tokens_; }
  [[nodiscard]] std::size_t bytes() const noexcept {
    return keys_.bytes() + values_.bytes() + key_scales_.bytes() + value_scales_.bytes();
  }

  /// Stores tokens [first, first + count) of k and v ([B, H, T, D]) at tokens [at, at + count),
  /// with the layer's head scales where the format has them (a 0 scale encodes as 1: the head
  /// has seen only zeros). Batch row b of k goes to stored row rows[b] (empty: to row b).
  /// Returns the values that saturated.
  template <class In>
  std::size_t encode(const TensorView<const In>& k, const TensorView<const In>& v, std::size_t first, std::size_t count,
                     std::size_t at, HeadScaleView head_scales = {}, std::span<const std::size_t> rows = {}) noexcept {
    std::size_t clipped = 0;
    for (std::size_t b = 0; b < k.batch(); ++b) {
      const std::size_t stored = rows.empty() ? b : rows[b];
      for (std::size_t h = 0; h < heads_; ++h) {
        for (std::size_t i = 0; i < count; ++i) {
          const std::size_t row = index(stored, h, at + i);
          float key_scale = 1.0F, value_scale = 1.0F;
          if constexpr (has_head_scales<T>) {
            if (head_scales.keys[h] != 0.0F) key_scale = head_scales.keys[h];
            if (head_scales.values[h] != 0.0F) value_scale = head_scales.values[h];
          }
          const EncodedRow key =
              Codec::encode(k.row(b, h, first + i), keys_.data() + row * units_, head_dim_, key_scale);
          const EncodedRow value =
              Codec::encode(v.row(b, h, first + i), values_.data() + row * units_, head_dim_, value_scale);
          if constexpr (kRowScales) {
            key_scales_.data()[row] = key.scale;
            value_scales_.data()[row] = value.scale;
          }
          clipped += key.clipped + value.clipped;
        }
      }
    }
    return clipped;
  }

  /// Copies the stored rows of tokens [from_at, from_at + count) of `from` to [at, ...).
  void copy(const RowStore& from, std::size_t from_at, std::size_t count, std::size_t at) noexcept {
    for (std::size_t b = 0; b < batch_; ++b) {
      for (std::size_t h = 0; h < heads_; ++h) {
        const std::size_t src = from.index(b, h, from_at);
        const std::size_t dst = index(b, h, at);
        std::memcpy(static_cast<void*>(keys_.data() + dst * units_), from.keys_.data() + src * units_,
                    count * units_ * sizeof(Unit));
        std::memcpy(static_cast<void*>(values_.data() + dst * units_), from.values_.data() + src * units_,
                    count * units_ * sizeof(Unit));
        if constexpr (kRowScales) {
          std::copy_n(from.key_scales_.data() + src, count, key_scales_.data() + dst);
          std::copy_n(from.value_scales_.data() + src, count, value_scales_.data() + dst);
        }
      }
    }
  }

  /// Calls run(pointer, bytes) on each contiguous run of the stored bytes of tokens
  /// [first, first + count): the keys of every (b, h) in order, then the values, then their row
  /// scales where kept here. What a state file holds of the rows (state_file.hpp); `self` is a
  /// RowStore or a const one, and the pointers are as const as it. `row` other than kEveryRow:
  /// that stored row's alone (a slot cache's slot, for release()), rather than every b.
  template <class Self, class Run>
  static void for_each_run(Self& self, std::size_t first, std::size_t count, const Run& run,
                           std::size_t row = kEveryRow) {
    KVCACHE_ASSERT(first <= self.tokens_ && count <= self.tokens_ - first,
                   "RowStore::for_each_run: tokens out of range");
    KVCACHE_ASSERT(row == kEveryRow || row < self.batch_, "RowStore::for_each_run: row out of range");
    const std::size_t from = row == kEveryRow ? 0 : row, end = row == kEveryRow ? self.batch_ : row + 1;
    const auto runs = [&](auto& buffer, std::size_t per_token) {
      if (count == 0 || buffer.size() == 0) return;
      for (std::size_t b = from; b < end; ++b) {
        for (std::size_t h = 0; h < self.heads_; ++h) {
          run(buffer.data() + self.index(b, h, first) * per_token, count * per_token * sizeof(*buffer.data()));
        }
      }
    };
    runs(self.keys_, self.units_);
    runs(self.values_, self.units_);
    runs(self.key_scales_, 1);
    runs(self.value_scales_, 1);
  }

  /// Gives back the memory of tokens [first, first + count) (of stored row `row` alone, or of
  /// every row), which hold none: whole pages only, which read as zeros until written again.
  void release(std::size_t first, std::size_t count, std::size_t row = kEveryRow) noexcept {
    for_each_run(
        *this, first, count, [](auto* data, std::size_t bytes) { release_pages(data, bytes); }, row);
  }

  /// Tokens [first, first + count) as a segment with the given positions (and the layer's head
  /// scales, for formats that have them).
  [[nodiscard]] Segment<T> segment(std::size_t first, std::size_t count, Positions positions,
                                   HeadScaleView head_scales = {}) const noexcept {
    const Shape shape{batch_, heads_, count, units_};
    const Strides strides{heads_ * tokens_ * units_, tokens_ * units_, units_};
    Segment<T> s{TensorView<const Unit>(keys_.data() + first * units_, shape, strides),
                 TensorView<const Unit>(values_.data() + first * units_, shape, strides), positions};
    if constexpr (has_head_scales<T>) {
      const Strides per_head{0, 1, 0};
      s.key_scales = RowScales{head_scales.keys, per_head};
      s.value_scales = RowScales{head_scales.values, per_head};
    } else if constexpr (kRowScales) {
      const Strides scale_strides{heads_ * tokens_, tokens_, 1};
      s.key_scales = RowScales{key_scales_.data() + first, scale_strides};
      s.value_scales = RowScales{value_scales_.data() + first, scale_strides};
    }
    return s;
  }

  /// Every token as [tokens / block_tokens, heads, block_tokens] rows, for a store of one batch
  /// row whose tokens are blocks of `block_tokens` (a BlockPool's layer): stored row r is block r.
  /// `positions` gives each block's (a list per stored row); a segment's `rows` pick blocks.
  [[nodiscard]] Segment<T> block_segment(std::size_t block_tokens, Positions positions,
                                         HeadScaleView head_scales = {}) const noexcept {
    KVCACHE_ASSERT(batch_ == 1 && block_tokens != 0 && tokens_ % block_tokens == 0, "a store of whole blocks");
    const Shape shape{tokens_ / block_tokens, heads_, block_tokens, units_};
    const Strides strides{block_tokens * units_, tokens_ * units_, units_};
    Segment<T> s{TensorView<const Unit>(keys_.data(), shape, strides),
                 TensorView<const Unit>(values_.data(), shape, strides), positions};
    if constexpr (has_head_scales<T>) {
      const Strides per_head{0, 1, 0};
      s.key_scales = RowScales{head_scales.keys, per_head};
      s.value_scales = RowScales{head_scales.values, per_head};
    } else if constexpr (kRowScales) {
      const Strides scale_strides{block_tokens, tokens_, 1};
      s.key_scales = RowScales{key_scales_.data(), scale_strides};
      s.value_scales = RowScales{value_scales_.data(), scale_strides};
    }
    return s;
  }

 private:
  static constexpr bool kRowScales = has_row_scales<T>;  // kept here, a scale a row

  [[nodiscard]] std::size_t index(std::size_t b, std::size_t h, std::size_t t) const noexcept {
    return (b * heads_ + h) * tokens_ + t;
  }

  std::size_t batch_ = 0;
  std::size_t heads_ = 0;
  std::size_t head_dim_ = 0;
  std::size_t units_ = 0;
  std::size_t tokens_ = 0;
  AlignedBuffer<Unit> keys_;
  AlignedBuffer<Unit> values_;
  AlignedBuffer<float> key_scales_;
  AlignedBuffer<float> value_scales_;
};

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
