// SPDX-License-Identifier: Apache-2.0
#pragma once

// Non-owning views of the caller's data and of what a cache returns.
//
// TensorView<T> is a [batch, heads, tokens, head_dim] block: pointer + shape + strides, in
// elements, shaped like std::mdspan with a strided layout. The innermost dimension is always
// contiguous (stride 1), so every (batch, head, token) row of head_dim values is one span.
// Use TensorView<const T> for read-only data; a TensorView<T> converts to it.
//
// History<T> is what update() returns: everything attention may read for one layer, as one
// or more segments (a wrapped ring is two, pages would be many), each with the absolute
// position of every key it holds.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <ranges>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kvcache/codec.hpp"
#include "kvcache/config.hpp"
#include "kvcache/version.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// Extents of a [batch, heads, tokens, head_dim] block, from any integer type (an engine's
/// `int`s in braces: `{1, n_kv_heads, tokens, head_size}`); std::invalid_argument if negative.
struct Shape {
  Count<"Shape.batch"> batch = 0;
  Count<"Shape.heads"> heads = 0;
  Count<"Shape.tokens"> tokens = 0;
  Count<"Shape.head_dim"> head_dim = 0;

  friend constexpr bool operator==(const Shape&, const Shape&) = default;

  /// Number of elements in the block.
  [[nodiscard]] constexpr std::size_t size() const noexcept { return batch * heads * tokens * head_dim; }

  /// "[B, H, T, D]" for error messages.
  [[nodiscard]] std::string str() const {
    // Built with append: GCC 12 warns (-Wrestrict, falsely) on chained operator+ at -O3.
    std::string s = "[";
    for (const std::size_t extent :
         {std::size_t{batch}, std::size_t{heads}, std::size_t{tokens}, std::size_t{head_dim}}) {
      if (s.size() > 1) s.append(", ");
      s.append(std::to_string(extent));
    }
    return s.append("]");
  }
};

/// Element strides of the batch, heads and tokens dimensions, from any integer type; head_dim
/// always has stride 1. std::invalid_argument if negative.
struct Strides {
  Count<"Strides.batch"> batch = 0;
  Count<"Strides.heads"> heads = 0;
  Count<"Strides.tokens"> tokens = 0;

  friend constexpr bool operator==(const Strides&, const Strides&) = default;

  /// Strides of a dense row-major block of this shape.
  [[nodiscard]] static constexpr Strides row_major(const Shape& s) noexcept {
    return {s.heads * s.tokens * s.head_dim, s.tokens * s.head_dim, s.head_dim};
  }
};

namespace detail {
// Duck-typed Eigen shapes, so this header needs no Eigen include: a rank-4 row-major
// Tensor/TensorMap, and a row-major 2-D Matrix/Map (one head: [tokens, head_dim]).
template <class E>
concept RowMajorTensor4 = requires(E& e) {
  {e.data()};
  {e.dimension(0)};
  requires std::remove_cvref_t<E>::NumIndices == 4;
  requires static_cast<int>(std::remove_cvref_t<E>::Layout) == 1;  // Eigen::RowMajor
};
template <class E>
concept RowMajorMatrix = requires(E& e) {
  {e.data()};
  {e.rows()};
  {e.cols()};
  {e.outerStride()};
  {e.innerStride()};
  requires static_cast<bool>(std::remove_cvref_t<E>::IsRowMajor);
};
}  // namespace detail

/// A non-owning [batch, heads, tokens, head_dim] view; head_dim is contiguous.
///
///   std::vector<float> k(1 * 8 * 5 * 64);
///   kvcache::TensorView<const float> kv(k.data(), {.batch = 1, .heads = 8, .tokens = 5, .head_dim = 64});
///   Eigen::Tensor<float, 4, Eigen::RowMajor> t(1, 8, 5, 64);
///   kvcache::TensorView<const float> tv(t);  // from Eigen, no copy
template <class T>
class TensorView {
 public:
  using element_type = T;
  using value_type = std::remove_cv_t<T>;

  constexpr TensorView() noexcept = default;

  /// A dense row-major block at `data`.
  constexpr TensorView(T* data, const Shape& shape) noexcept
      : data_(data), shape_(shape), strides_(Strides::row_major(shape)) {}

  /// A strided block at `data` (strides in elements; head_dim is contiguous).
  constexpr TensorView(T* data, const Shape& shape, const Strides& strides) noexcept
      : data_(data), shape_(shape), strides_(strides) {}

  /// The read-only view of a mutable one.
  template <class U>
  requires(std::is_const_v<T>&& std::is_same_v<const U, T>) constexpr TensorView(
      const TensorView<U>& other) noexcept  // NOLINT(google-explicit-constructor)
      : data_(other.data()), shape_(other.shape()), strides_(other.strides()) {}

  /// A view of a rank-4 row-major Eigen Tensor or TensorMap [B, H, T, D].
  template <class E>
  requires detail::RowMajorTensor4<E> && std::is_convertible_v<decltype(std::declval<E&>().data()), T*> TensorView(
      E& tensor)
  noexcept  // NOLINT(google-explicit-constructor)
      : TensorView(
            tensor.data(),
            Shape{static_cast<std::size_t>(tensor.dimension(0)), static_cast<std::size_t>(tensor.dimension(1)),
                  static_cast<std::size_t>(tensor.dimension(2)), static_cast<std::size_t>(tensor.dimension(3))}) {}

  /// A view of one head held as a row-major Eigen matrix [tokens, head_dim]: shape [1, 1, T, D].
  /// A row's values must be contiguous: std::invalid_argument for an inner stride other than 1
  /// (a Map with Eigen::InnerStride or Eigen::Stride), which a view has no way to describe.
  template <class E>
  requires detail::RowMajorMatrix<E> && std::is_convertible_v<decltype(std::declval<E&>().data()), T*> TensorView(
      E& matrix)  // NOLINT(google-explicit-constructor)
      : TensorView(matrix.data(),
                   Shape{1, 1, static_cast<std::size_t>(matrix.rows()), static_cast<std::size_t>(matrix.cols())},
                   Strides{0, 0, static_cast<std::size_t>(matrix.outerStride())}) {
    if (matrix.cols() > 1 && matrix.innerStride() != 1) {
      throw std::invalid_argument("TensorView: Eigen matrix inner stride: expected 1 (head_dim contiguous), given " +
                                  std::to_string(matrix.innerStride()));
    }
  }

  [[nodiscard]] constexpr T* data() const noexcept { return data_; }
  [[nodiscard]] constexpr const Shape& shape() const noexcept { return shape_; }
  [[nodiscard]] constexpr const Strides& strides() const noexcept { return strides_; }
  [[nodiscard]] constexpr std::size_t batch() const noexcept { return shape_.batch; }
  [[nodiscard]] constexpr std::size_t heads() const noexcept { return shape_.heads; }
  [[nodiscard]] constexpr std::size_t tokens() const noexcept { return shape_.tokens; }
  [[nodiscard]] constexpr std::size_t head_dim() const noexcept { return shape_.head_dim; }

  /// Pointer to the head_dim contiguous values of (b, h, t).
  [[nodiscard]] constexpr T* row(std::size_t b, std::size_t h, std::size_t t) const noexcept {
    return data_ + b * strides_.batch + h * strides_.heads + t * strides_.tokens;
  }

  /// Element (b, h, t, d).
  [[nodiscard]] constexpr T& operator()(std::size_t b, std::size_t h, std::size_t t, std::size_t d) const noexcept {
    return row(b, h, t)[d];
  }

  /// The tokens [first, first + count) of every (batch, head) slice.
  [[nodiscard]] constexpr TensorView tokens(std::size_t first, std::size_t count) const noexcept {
    return {data_ + first * strides_.tokens, {shape_.batch, shape_.heads, count, shape_.head_dim}, strides_};
  }

 private:
  T* data_ = nullptr;
  Shape shape_{};
  Strides strides_{};
};

template <class E>
requires detail::RowMajorTensor4<E> || detail::RowMajorMatrix<E> TensorView(E&)
->TensorView<std::remove_pointer_t<decltype(std::declval<E&>().data())>>;

/// Absolute positions of `tokens` keys or queries for every batch row: one list shared by every
/// row (row_stride 0), or a list per row, row b's at data + b * row_stride. A view of
/// std::int64_t: converts from a std::span or any contiguous range of them (a shared list), and
/// from one std::int64_t variable. update() and causal_attention() take a PositionsArg, which
/// takes any integer type besides: `cache.update(layer, k, v, {pos})` with an int pos.
class Positions {
 public:
  constexpr Positions() noexcept = default;
  constexpr Positions(const std::int64_t* data, std::size_t tokens, std::size_t row_stride = 0) noexcept
      : data_(data), tokens_(tokens), row_stride_(row_stride) {}
  /// One token at `position`, viewed in place: the variable must outlive the Positions.
  constexpr Positions(const std::int64_t& position) noexcept  // NOLINT(google-explicit-constructor)
      : data_(&position), tokens_(1) {}
  // A view of a temporary (a literal, or an int converted on the way) would dangle once stored.
  Positions(const std::int64_t&& position) = delete;
  template <std::ranges::contiguous_range R>
  requires std::is_same_v<std::remove_cv_t<std::ranges::range_value_t<R>>, std::int64_t>
  constexpr Positions(const R& shared) noexcept  // NOLINT(google-explicit-constructor)
      : data_(std::ranges::data(shared)), tokens_(std::ranges::size(shared)) {}

  [[nodiscard]] constexpr const std::int64_t* data() const noexcept { return data_; }
  [[nodiscard]] constexpr std::size_t tokens() const noexcept { return tokens_; }
  [[nodiscard]] constexpr std::size_t row_stride() const noexcept { return row_stride_; }
  /// Whether rows have lists of their own.
  [[nodiscard]] constexpr bool per_row() const noexcept { return row_stride_ != 0; }
  /// Row b's positions.
  [[nodiscard]] constexpr std::span<const std::int64_t> row(std::size_t b) const noexcept {
    return {data_ + b * row_stride_, tokens_};
  }
  /// Position j of row 0 (of every row, for a shared list).
  [[nodiscard]] constexpr std::int64_t operator[](std::size_t j) const noexcept { return data_[j]; }
  [[nodiscard]] constexpr const std::int64_t* begin() const noexcept { return data_; }
  [[nodiscard]] constexpr const std::int64_t* end() const noexcept { return data_ + tokens_; }

 private:
  const std::int64_t* data_ = nullptr;
  std::size_t tokens_ = 0;
  std::size_t row_stride_ = 0;
};

/// The batch rows (slots) an update writes, in the order of k's batch rows: a non-owning list
/// from a std::span or any contiguous range of std::size_t, from one std::size_t variable, or
/// from a braced list, `cache.update(layer, k, v, positions, {0, 3})` (valid for that call).
class Rows {
 public:
  constexpr Rows() noexcept = default;
  constexpr Rows(const std::size_t* data, std::size_t size) noexcept : data_(data), size_(size) {}
  /// One row, viewed in place: the variable must outlive the Rows.
  constexpr Rows(const std::size_t& row) noexcept : data_(&row), size_(1) {}  // NOLINT(google-explicit-constructor)
  Rows(const std::size_t&& row) = delete;
// A braced list lives until the end of the call it is written in, which is all a Rows needs.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winit-list-lifetime"
#endif
  constexpr Rows(std::initializer_list<std::size_t> rows) noexcept  // NOLINT(google-explicit-constructor)
      : data_(rows.begin()), size_(rows.size()) {}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
  template <std::ranges::contiguous_range R>
  requires std::is_same_v<std::remove_cv_t<std::ranges::range_value_t<R>>, std::size_t>
  constexpr Rows(const R& rows) noexcept  // NOLINT(google-explicit-constructor)
      : data_(std::ranges::data(rows)), size_(std::ranges::size(rows)) {}

  [[nodiscard]] constexpr const std::size_t* data() const noexcept { return data_; }
  [[nodiscard]] constexpr std::size_t size() const noexcept { return size_; }
  [[nodiscard]] constexpr bool empty() const noexcept { return size_ == 0; }
  [[nodiscard]] constexpr std::size_t operator[](std::size_t i) const noexcept { return data_[i]; }
  [[nodiscard]] constexpr const std::size_t* begin() const noexcept { return data_; }
  [[nodiscard]] constexpr const std::size_t* end() const noexcept { return data_ + size_; }
  [[nodiscard]] constexpr std::span<const std::size_t> span() const noexcept { return {data_, size_}; }

 private:
  const std::size_t* data_ = nullptr;
  std::size_t size_ = 0;
};

namespace detail {

/// A call's list of integers as Value: viewed in place, or converted (inline up to 8, on the heap
/// beyond).
template <class Value>
class ConvertedList {
 public:
  ConvertedList() = default;
  ConvertedList(const ConvertedList&) = delete;
  ConvertedList& operator=(const ConvertedList&) = delete;

  /// The values of `list` as Value: in place if they are Value already, else converted, each of
  /// which must fit (std::invalid_argument naming `what`[i], `expected` and the value).
  template <std::ranges::contiguous_range R>
  const Value* values(const R& list, const char* what, const char* expected) {
    if constexpr (std::is_same_v<std::remove_cv_t<std::ranges::range_value_t<R>>, Value>) {
      return std::ranges::data(list);
    } else {
      const std::size_t n = std::ranges::size(list);
      if (n > inline_.size()) heap_.resize(n);
      Value* to = n > inline_.size() ? heap_.data() : inline_.data();
      std::size_t i = 0;
      for (const auto value : list) {
        if (!std::in_range<Value>(value)) {
          throw std::invalid_argument(std::string(what) + "[" + std::to_string(i) + "]: expected " + expected +
                                      ", given " + std::to_string(value));
        }
        to[i++] = static_cast<Value>(value);
      }
      return to;
    }
  }
  /// One value, held here (a call's argument outlives the list, not the variable it came from).
  template <class I>
  const Value* one(I value, const char* what, const char* expected) {
    inline_[0] = *values(std::span<const I>(&value, 1), what, expected);
    return inline_.data();
  }

 private:
  std::array<Value, 8> inline_{};
  std::vector<Value> heap_;
};

template <class R>
using range_integer = std::remove_cv_t<std::ranges::range_value_t<R>>;

}  // namespace detail

/// What update() and causal_attention() take as positions: a Positions view; one position of
/// any integer type, held for the call (`{pos}`, `{n + 1}`); or a contiguous range of integers of any
/// type (std::vector<int>, std::span<const std::int64_t>, ...), viewed in place if its values are
/// std::int64_t and converted for the call otherwise. std::invalid_argument for a value beyond
/// std::int64_t. Made for a call's argument: it may point into itself, so it is not copied.
class PositionsArg {
 public:
  /// No positions (an update of no tokens).
  PositionsArg() noexcept = default;
  PositionsArg(const Positions& positions) noexcept : view_(positions) {}  // NOLINT(google-explicit-constructor)
  template <detail::CountInteger I>
  PositionsArg(I position)  // NOLINT(google-explicit-constructor)
      : view_(converted_.one(position, "positions", "a std::int64_t"), 1) {}
  template <std::ranges::contiguous_range R>
  requires detail::CountInteger<detail::range_integer<R>> &&(!std::is_same_v<std::remove_cvref_t<R>, Positions>)
      PositionsArg(const R& positions)  // NOLINT(google-explicit-constructor)
      : view_(converted_.values(positions, "positions", "a std::int64_t"), std::ranges::size(positions)) {}
  PositionsArg(const PositionsArg&) = delete;
  PositionsArg& operator=(const PositionsArg&) = delete;
  ~PositionsArg() = default;

  /// The positions, valid while this argument lives (for the call).
  [[nodiscard]] const Positions& view() const noexcept { return view_; }

 private:
  detail::ConvertedList<std::int64_t> converted_;
  Positions view_;
};

/// What a slot cache's update() and history() take as rows: a Rows view; one row of any integer
/// type, held for the call; a braced list of integers (`{0, 3}`, `{slot_a, slot_b}`); or a
/// contiguous range of integers of any type, viewed in place if its values are std::size_t and
/// converted for the call otherwise. std::invalid_argument for a negative row. Made for a call's
/// argument: it may point into itself, so it is not copied.
class RowsArg {
 public:
  /// No rows.
  RowsArg() noexcept = default;
  RowsArg(Rows rows) noexcept : view_(rows) {}  // NOLINT(google-explicit-constructor)
// A braced list lives until the end of the call it is written in, which is all a RowsArg needs.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winit-list-lifetime"
#endif
  RowsArg(std::initializer_list<std::size_t> rows) noexcept  // NOLINT(google-explicit-constructor)
      : view_(rows.begin(), rows.size()) {}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
  template <detail::CountInteger I>
  RowsArg(std::initializer_list<I> rows)  // NOLINT(google-explicit-constructor)
      : view_(converted_.values(rows, "rows", "a slot >= 0"), rows.size()) {}
  template <detail::CountInteger I>
  RowsArg(I row)  // NOLINT(google-explicit-constructor)
      : view_(converted_.one(row, "rows", "a slot >= 0"), 1) {}
  template <std::ranges::contiguous_range R>
  requires detail::CountInteger<detail::range_integer<R>> &&
      (!std::is_same_v<std::remove_cvref_t<R>, Rows>)RowsArg(const R& rows)  // NOLINT(google-explicit-constructor)
      : view_(converted_.values(rows, "rows", "a slot >= 0"), std::ranges::size(rows)) {}
  RowsArg(const RowsArg&) = delete;
  RowsArg& operator=(const RowsArg&) = delete;
  ~RowsArg() = default;

  /// The rows, valid while this argument lives (for the call).
  [[nodiscard]] const Rows& view() const noexcept { return view_; }

 private:
  detail::ConvertedList<std::size_t> converted_;
  Rows view_;
};

/// The positions of `tokens` tokens that continue a layer holding `length`:
/// `auto positions = kvcache::next_positions(cache.length(layer), tokens);`
[[nodiscard]] inline std::vector<std::int64_t> next_positions(std::size_t length, std::size_t tokens) {
  std::vector<std::int64_t> positions(tokens);
  for (std::size_t i = 0; i < tokens; ++i) positions[i] = static_cast<std::int64_t>(length + i);
  return positions;
}

/// One float scale per stored row of a [B, H_kv, n] block, by element strides (a stride of 0
/// repeats a scale: 0 for tokens is one scale per head). Empty (null) for formats without.
struct RowScales {
  const float* data = nullptr;
  Strides strides{};

  [[nodiscard]] constexpr bool empty() const noexcept { return data == nullptr; }
  [[nodiscard]] constexpr const float* at(std::size_t b, std::size_t h, std::size_t t) const noexcept {
    return data + b * strides.batch + h * strides.heads + t * strides.tokens;
  }
};

/// One run of a layer's history: keys, values and the absolute position of each key.
/// keys/values are [B, H_kv, n, units] stored rows of format T (units = storage_codec<T>::units
/// of the head size: the head size itself for float, double, half and bfloat16); positions
/// has n entries, shared by every stored row or one list per row; scales, for formats whose
/// rows carry them.
///
/// Two optional spans let the batch rows of an attention call differ from the stored rows:
/// `rows`, the stored row each batch row reads (a slot cache's scattered slots; empty: batch row
/// b reads stored row b), and `row_tokens`, how many of its stored row's first keys each batch
/// row reads (rows of different lengths; empty: all n).
template <class T>
struct Segment {
  using unit = typename storage_codec<T>::unit;
  TensorView<const unit> keys;
  TensorView<const unit> values;
  Positions positions;
  RowScales key_scales{};
  RowScales value_scales{};
  std::span<const std::size_t> row_tokens{};
  std::span<const std::size_t> rows{};

  [[nodiscard]] constexpr std::size_t tokens() const noexcept { return positions.tokens(); }
  /// Batch rows an attention call over this segment has.
  [[nodiscard]] constexpr std::size_t batch() const noexcept { return rows.empty() ? keys.batch() : rows.size(); }
  /// The stored row batch row b reads.
  [[nodiscard]] constexpr std::size_t stored_row(std::size_t b) const noexcept { return rows.empty() ? b : rows[b]; }
  /// Keys batch row b reads.
  [[nodiscard]] constexpr std::size_t tokens(std::size_t b) const noexcept {
    return row_tokens.empty() ? tokens() : std::min(tokens(), row_tokens[b]);
  }
};

/// Everything attention may read for one layer, returned by a cache's update().
///
/// Valid until the next mutating call (update, truncate, reset) on that layer, like an
/// iterator. `window` and `sinks` carry the cache's own visibility rule (a ring returns the
/// window of a chunk's first query, older than its later queries may read): 0 means none.
template <class T>
struct History {
  std::span<const Segment<T>> segments;
  std::size_t window = 0;
  std::size_t sinks = 0;

  /// Total keys over all segments.
  [[nodiscard]] constexpr std::size_t tokens() const noexcept {
    std::size_t n = 0;
    for (const auto& s : segments) n += s.tokens();
    return n;
  }
};

}  // namespace KVCACHE_ABI
}  // namespace kvcache
