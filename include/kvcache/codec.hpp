// SPDX-License-Identifier: Apache-2.0
#pragma once

// Storage codecs: how a format's stored rows are written from an engine's values and read back
// as floats. A format T (the cache's template parameter) names its codec as
// storage_codec<T>; the caches write through it and the attention kernel reads through it, and
// neither ever tests an element type. A new format is a new specialization:
//
//   template <> struct kvcache::storage_codec<MyFormat> {
//     using unit = std::uint8_t;                      // what a stored row is made of
//     using acc = float;                              // what rows are summed in
//     static constexpr scales_kept scales = scales_kept::per_row;  // a float scale per row
//     static constexpr std::size_t units(std::size_t head_dim) noexcept;
//     template <class In>
//     static EncodedRow encode(const In* in, unit* row, std::size_t head_dim, float head_scale) noexcept;
//     template <std::size_t B> static Vec<float, B> load(const unit* row, std::size_t d) noexcept;
//     static float value(const unit* row, std::size_t d) noexcept;
//   };
//
// encode stores a row and returns its scale (kept only with scales_kept::per_row) and the values
// that saturated (counted only with scales_kept::per_head); load gives the B / 4 values from d
// on, unscaled; the kernel multiplies a row's products by its scale once. A format with
// scales_kept::per_head (a static scale per (layer, kv head), given in the config) is given its
// head's scale as head_scale (others are given 1 and ignore it), and has
//
//     static float scale_for(float amax) noexcept;      // the head scale for a largest magnitude
//
// codec_vocabulary.hpp has the registers, loads and conversions a codec is written in.
//
// Optional members:
//
//     static constexpr const char* name = "my_format";   // for messages
//     static constexpr float max_magnitude = 65504.0F;  // update() refuses non-finite input and
//                                                       // input beyond this, cache unchanged
//     static constexpr int load_exponent = 120;          // load gives the values times 2^-120,
//                                                       // which the kernel folds into its scales
//     static void rotate(float* x, std::size_t head_dim) noexcept;    // an orthogonal transform R
//     static void unrotate(float* x, std::size_t head_dim) noexcept;  // of a head that encode
//                                                       // applies to every row, and R^T: attention
//                                                       // reads R q against the rows and writes
//                                                       // R^T of what it sums, once per call
//     static constexpr std::size_t split = 2;           // load_split gives 2 registers from the
//     template <std::size_t B>                          // 2 B / 4 values from d on, register s
//     static void load_split(const unit*, std::size_t d, Vec<float, B> (&)[2]) noexcept;  // lane l
//                                                       // holding value d + 2 l + s
//
// A format whose stored bits fall apart into registers that way at less cost than in order (two
// bfloat16 in a 32-bit word: a shift and a mask) names a split; the kernel then keeps queries and
// sums in that order and puts each output row back in order once.
//
// A format with head scales reads like one with row scales: its segments repeat the head's scale
// for every row (a token stride of 0), so the kernel reads both kinds the same way. Without rotate,
// the transform is the identity: the kernel never sees it either way.
//
// A codec that lacks a required member stops the build where a cache or causal_attention first
// uses the format, naming the member (detail::check_codec). docs/extending.md is the checklist.

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvcache/codec_vocabulary.hpp"
#include "kvcache/detail/simd.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// The codec of storage format T; specialize it to add a format.
template <class T>
struct storage_codec;

/// Where the scales a format's stored rows are multiplied by live: a codec's `scales`.
enum class scales_kept {
  none,      // rows are read as stored (or carry their scales inside them)
  per_row,   // encode returns a float scale for each row, kept beside it
  per_head,  // a static scale per (layer, kv head), given in the config and to encode
};

/// What a codec's encode reports of the row it stored: the row's scale (kept with
/// scales_kept::per_row) and the values that saturated (counted with scales_kept::per_head).
struct EncodedRow {
  float scale = 1.0F;
  std::size_t clipped = 0;
};

namespace detail {

/// Rows of 16-bit floats (kvcache::half or kvcache::bfloat16): no scales, widened to float in
/// registers.
template <class T>
struct SixteenBitCodec {
  using unit = T;
  using acc = float;
  static constexpr scales_kept scales = scales_kept::none;
  static constexpr std::size_t units(std::size_t head_dim) noexcept { return head_dim; }

  template <class In>
  static EncodedRow encode(const In* in, unit* row, std::size_t head_dim, float /*head_scale*/) noexcept {
    if constexpr (is_half<In> == is_half<T> && is_bfloat16<In> == is_bfloat16<T>) {
      std::memcpy(static_cast<void*>(row), in, head_dim * sizeof(T));  // the same bits, kvcache's or Eigen's
    } else {
      // Stored as bits: a loop of stores of the 16-bit type would vectorize less well.
      auto* bits = reinterpret_cast<std::uint16_t*>(row);
      for (std::size_t d = 0; d < head_dim; ++d) {
        const auto x = static_cast<float>(widen(in[d]));  // widening is exact: one rounding
        bits[d] = is_half<T> ? half_bits_of(x) : bfloat16_bits_of(x);
      }
    }
    return {};
  }
  template <std::size_t B>
  KVCACHE_ALWAYS_INLINE static Vec<float, B> load(const unit* row, std::size_t d) noexcept {
    const auto* bits = reinterpret_cast<const std::uint16_t*>(row) + d;
    if constexpr (is_half<T>) {
      return widen_half<B>(bits);
    } else {
      return widen_bfloat16<B>(bits);
    }
  }
  // bfloat16 is a float's top half: a word of two gives the even value by a shift and the odd
  // one by a mask, no widening load. Half widens by one instruction in order.
  static constexpr std::size_t split = is_bfloat16<T> ? 2 : 1;
  template <std::size_t B>
  KVCACHE_ALWAYS_INLINE static void load_split(const unit* row, std::size_t d, Vec<float, B> (&out)[split]) noexcept {
    if constexpr (split == 2) {
      const auto pairs =
          in_register(load_register<Vec<std::uint32_t, B>>(reinterpret_cast<const std::uint16_t*>(row) + d));
      out[0] = std::bit_cast<Vec<float, B>>(pairs << 16);
      out[1] = std::bit_cast<Vec<float, B>>(pairs & 0xFFFF0000U);
    } else {
      out[0] = load<B>(row, d);
    }
  }
  static float value(const unit* row, std::size_t d) noexcept { return widen(row[d]); }
};

/// Rows of float or double, read as they are.
template <class T>
struct PlainCodec {
  using unit = T;
  using acc = T;
  static constexpr scales_kept scales = scales_kept::none;
  static constexpr std::size_t units(std::size_t head_dim) noexcept { return head_dim; }

  template <class In>
  static EncodedRow encode(const In* in, unit* row, std::size_t head_dim, float /*head_scale*/) noexcept {
    if constexpr (std::is_same_v<In, T>) {
      std::memcpy(row, in, head_dim * sizeof(T));
    } else {
      for (std::size_t d = 0; d < head_dim; ++d) row[d] = narrow<T>(widen(in[d]));
    }
    return {};
  }
  template <std::size_t B>
  KVCACHE_ALWAYS_INLINE static Vec<T, B> load(const unit* row, std::size_t d) noexcept {
    return load_register<Vec<T, B>>(row + d);
  }
  static T value(const unit* row, std::size_t d) noexcept { return row[d]; }
};

}  // namespace detail

template <>
struct storage_codec<float> : detail::PlainCodec<float> {
  static constexpr const char* name = "float";
};
template <>
struct storage_codec<double> : detail::PlainCodec<double> {
  static constexpr const char* name = "double";
};
template <>
struct storage_codec<half> : detail::SixteenBitCodec<half> {
  static constexpr const char* name = "half";
};
template <>
struct storage_codec<bfloat16> : detail::SixteenBitCodec<bfloat16> {
  static constexpr const char* name = "bfloat16";
};
// Eigen's 16-bit types are stored as kvcache's (the same bits, the same codec and state files),
// so that a cache of them needs <Eigen/Core> only where values of them are handed in.
template <>
struct storage_codec<Eigen::half> : storage_codec<half> {};
template <>
struct storage_codec<Eigen::bfloat16> : storage_codec<bfloat16> {};

namespace detail {

/// Whether format T keeps one scale per (layer, kv head), given to its encode.
template <class T>
inline constexpr bool has_head_scales = requires {
  requires storage_codec<T>::scales == scales_kept::per_head;
};

/// Whether format T keeps a scale beside each stored row, returned by its encode.
template <class T>
inline constexpr bool has_row_scales = requires {
  requires storage_codec<T>::scales == scales_kept::per_row;
};

/// Whether codec C's rows are read with a scale each (a row's own, or its head's repeated).
template <class C>
inline constexpr bool reads_scales = C::scales != scales_kept::none;

/// Whether format T stores each head rotated (rotate and unrotate in its codec): attention then
/// rotates the queries alike and rotates its output back.
template <class T>
inline constexpr bool is_rotated = requires(float* x, std::size_t n) {
  storage_codec<T>::rotate(x, n);
  storage_codec<T>::unrotate(x, n);
};

/// The power of two format T's load leaves out of its values (0 unless the codec names one):
/// load gives value x 2^-load_exponent, and the kernel puts the power back in its scales.
template <class T>
constexpr int load_exponent() noexcept {
  if constexpr (requires { storage_codec<T>::load_exponent; }) {
    return storage_codec<T>::load_exponent;
  } else {
    return 0;
  }
}

/// The registers format T's load_split fills at once (1 without one: rows load in order).
template <class T>
constexpr std::size_t split_of() noexcept {
  if constexpr (requires { storage_codec<T>::split; }) {
    return storage_codec<T>::split;
  } else {
    return 1;
  }
}

/// Whether update() checks every input value of format T (finite, within max_magnitude).
template <class T>
inline constexpr bool checks_input = requires {
  storage_codec<T>::max_magnitude;
};

}  // namespace detail

/// Format T's name, for logs and messages: its codec's `name` ("bfloat16", "fp8_e4m3"; Eigen's
/// 16-bit types have kvcache's), or "this format" for a codec without one.
template <class T>
constexpr const char* format_name() noexcept {
  if constexpr (requires { storage_codec<T>::name; }) {
    return storage_codec<T>::name;
  } else {
    return "this format";
  }
}

namespace detail {

// The members of a codec the caches and the kernel use, each on its own so that a codec missing
// one is told which (check_codec).
template <class C>
concept codec_has_unit = requires {
  typename C::unit;
};
template <class C>
concept codec_has_acc = requires {
  typename C::acc;
}
&&(std::same_as<typename C::acc, float> || std::same_as<typename C::acc, double>);
template <class C>
concept codec_has_units = requires(std::size_t n) {
  { C::units(n) } -> std::same_as<std::size_t>;
};
template <class C>
concept codec_has_scales = requires {
  { C::scales } -> std::convertible_to<scales_kept>;
};
template <class C>
concept codec_has_load = requires(const typename C::unit* row, std::size_t d) {
  { C::template load<kNativeBytes>(row, d) } -> std::same_as<Vec<typename C::acc, kNativeBytes>>;
};
template <class C>
concept codec_has_value = requires(const typename C::unit* row, std::size_t d) {
  { C::value(row, d) } -> std::convertible_to<typename C::acc>;
};
template <class C>
concept codec_has_head_scales = requires {
  requires C::scales == scales_kept::per_head;
};
template <class C>
concept codec_has_encode = requires(const float* in, typename C::unit* row, std::size_t n, float head_scale) {
  { C::encode(in, row, n, head_scale) } -> std::same_as<EncodedRow>;
};
template <class C>
concept codec_has_scale_for = !codec_has_head_scales<C> || requires(float amax) {
  { C::scale_for(amax) } -> std::convertible_to<float>;
};

/// Stops the build at a format whose codec lacks a member the caches or the kernel need, naming
/// the member (codec.hpp's contract says what each is); true otherwise.
template <class T>
constexpr bool check_codec() noexcept {
  using C = storage_codec<T>;
  if constexpr (!is_complete<C>) {
    static_assert(is_complete<C>,
                  "kvcache: no storage_codec<T> for this T: a storage format is a type with a specialization of "
                  "kvcache::storage_codec (codec.hpp), or one of kvcache's (formats.hpp lists them).");
  } else if constexpr (!codec_has_unit<C>) {
    static_assert(codec_has_unit<C>, "kvcache: storage_codec<T>::unit is missing: the type a stored row is made of.");
  } else if constexpr (!codec_has_acc<C>) {
    static_assert(codec_has_acc<C>,
                  "kvcache: storage_codec<T>::acc is missing or not float or double: the type "
                  "rows are summed in.");
  } else if constexpr (!codec_has_units<C>) {
    static_assert(codec_has_units<C>,
                  "kvcache: storage_codec<T>::units(head_dim) is missing: a static function "
                  "giving the units a stored row of head_dim values takes.");
  } else if constexpr (!codec_has_scales<C>) {
    static_assert(codec_has_scales<C>,
                  "kvcache: storage_codec<T>::scales is missing: a static constexpr kvcache::scales_kept saying "
                  "where the scales rows are multiplied by live (none, per_row, per_head).");
  } else if constexpr (!codec_has_encode<C>) {
    static_assert(codec_has_encode<C>,
                  "kvcache: storage_codec<T>::encode is missing or of another signature: template <class In> static "
                  "kvcache::EncodedRow encode(const In* in, unit* row, std::size_t head_dim, float head_scale) "
                  "(returns the row's scale and the values that saturated).");
  } else if constexpr (!codec_has_scale_for<C>) {
    static_assert(codec_has_scale_for<C>,
                  "kvcache: storage_codec<T>::scale_for(amax) is missing: with scales_kept::per_head, a static "
                  "function giving the head scale for a largest magnitude.");
  } else if constexpr (!codec_has_load<C>) {
    static_assert(codec_has_load<C>,
                  "kvcache: storage_codec<T>::load is missing or of another signature: "
                  "template <std::size_t B> static Vec<acc, B> load(const unit* row, "
                  "std::size_t d), the B bytes of values from d on.");
  } else if constexpr (!codec_has_value<C>) {
    static_assert(codec_has_value<C>,
                  "kvcache: storage_codec<T>::value(row, d) is missing: a static function "
                  "giving one stored value as acc.");
  }
  return is_complete<C> && codec_has_unit<C> && codec_has_acc<C> && codec_has_units<C> && codec_has_scales<C> &&
         codec_has_encode<C> && codec_has_scale_for<C> && codec_has_load<C> && codec_has_value<C>;
}

}  // namespace detail

/// A storage format: a type with a complete storage_codec (detail::check_codec names what a
/// codec lacks).
template <class T>
concept storage_format = detail::is_complete<storage_codec<T>> && detail::codec_has_unit<storage_codec<T>> &&
    detail::codec_has_acc<storage_codec<T>> && detail::codec_has_units<storage_codec<T>> &&
    detail::codec_has_scales<storage_codec<T>> && detail::codec_has_encode<storage_codec<T>> &&
    detail::codec_has_scale_for<storage_codec<T>> && detail::codec_has_load<storage_codec<T>> &&
    detail::codec_has_value<storage_codec<T>>;

/// A value type an engine computes in: float, double, kvcache::half, kvcache::bfloat16, or
/// Eigen's half and bfloat16 (with <Eigen/Core> included).
template <class In>
concept compute_type =
    std::is_same_v<In, float> || std::is_same_v<In, double> || detail::is_half<In> || detail::is_bfloat16<In>;

/// Whether a cache storing T takes k and v of type In: any compute type, but double only where
/// T is summed in double (a double would otherwise be rounded twice on its way in).
template <class T, class In>
inline constexpr bool accepts_input = compute_type<In> && (!std::is_same_v<In, double> ||
                                                           std::is_same_v<typename storage_codec<T>::acc, double>);

/// The type a format is summed in (float, or double for double storage).
template <class T>
using acc_type = typename storage_codec<T>::acc;

/// The compute type a cache storing T takes by default: float, or double for double storage.
template <class T>
using default_input = std::conditional_t<std::is_same_v<acc_type<T>, double>, double, float>;

}  // namespace KVCACHE_ABI
}  // namespace kvcache
