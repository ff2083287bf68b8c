// SPDX-License-Identifier: Apache-2.0
#pragma once

// The vocabulary a storage codec is written in (codec.hpp's contract): registers of B bytes,
// loads that widen stored bytes, halves or bfloat16 into them, and the engine's values as floats.
// kvcache's own codecs use these names alone, so that a new format reads like them:
//
//   template <std::size_t B>
//   static kvcache::Vec<float, B> load(const unit* row, std::size_t d) noexcept {
//     return __builtin_convertvector(kvcache::widen_bytes<B, true>(row + d), kvcache::Vec<float, B>);
//   }
//
// B is at most the widest register the including translation unit is compiled for; every load
// here compiles to one instruction or a few where the build has them (SSE4.1, AVX2, F16C,
// AVX-512), and to portable vector code elsewhere.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvcache/detail/simd.hpp"
#include "kvcache/float16.hpp"

namespace Eigen {
struct half;
struct bfloat16;
}  // namespace Eigen

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

/// Whether T is a half type (kvcache's or Eigen's), or a bfloat16 type.
template <class T>
inline constexpr bool is_half =
    std::is_same_v<std::remove_cv_t<T>, half> || std::is_same_v<std::remove_cv_t<T>, Eigen::half>;
template <class T>
inline constexpr bool is_bfloat16 =
    std::is_same_v<std::remove_cv_t<T>, bfloat16> || std::is_same_v<std::remove_cv_t<T>, Eigen::bfloat16>;

/// Whether T is a complete type where this is first asked (Eigen's 16-bit types are declared
/// here, and defined only where the engine includes <Eigen/Core>).
template <class T>
inline constexpr bool is_complete = requires {
  sizeof(T);
};

/// Stops the build, naming the header to include, where Eigen's 16-bit types are used without
/// <Eigen/Core>.
template <class T>
constexpr void require_complete() noexcept {
  static_assert(!is_half<T> || is_complete<T>,
                "kvcache: Eigen::half is an incomplete type here: #include <Eigen/Core> before using it "
                "(kvcache::half needs no other header).");
  static_assert(!is_bfloat16<T> || is_complete<T>,
                "kvcache: Eigen::bfloat16 is an incomplete type here: #include <Eigen/Core> before using it "
                "(kvcache::bfloat16 needs no other header).");
}

template <class T>
inline std::uint16_t bits_of(const T& x) noexcept {
  require_complete<T>();
  static_assert(sizeof(T) == 2, "a 16-bit value");
  std::uint16_t bits;
  std::memcpy(&bits, &x, 2);
  return bits;
}

/// An engine's value (float, double, half or bfloat16, kvcache's or Eigen's) as float (double as
/// double).
template <class In>
inline auto widen(const In& x) noexcept {
  if constexpr (is_half<In>) {
    return float_of_half_bits(bits_of(x));
  } else if constexpr (is_bfloat16<In>) {
    return float_of_bfloat16_bits(bits_of(x));
  } else {
    return x;
  }
}

/// A float (or double) as T, rounded to nearest even once.
template <class T, class F>
inline T narrow(F x) noexcept {
  if constexpr (is_half<T> || is_bfloat16<T>) {
    const float f = static_cast<float>(x);
    const std::uint16_t bits = is_half<T> ? half_bits_of(f) : bfloat16_bits_of(f);
    require_complete<T>();
    T out;
    std::memcpy(static_cast<void*>(&out), &bits, 2);
    return out;
  } else {
    return static_cast<T>(x);
  }
}

/// The largest |in[d]| of n values as float bits: an integer maximum, which vectorizes where a
/// float one may not, and orders every non-negative float (NaN's bits above infinity's).
template <class In>
inline std::uint32_t max_magnitude_bits(const In* in, std::size_t n) noexcept {
  std::uint32_t top = 0;
  for (std::size_t d = 0; d < n; ++d) {
    top = std::max(top, std::bit_cast<std::uint32_t>(static_cast<float>(widen(in[d]))) & 0x7FFFFFFFU);
  }
  return top;
}

/// Rounds to the nearest integer, ties to even (the default rounding mode's rint; a single
/// instruction on SSE4.1 and later, which lets a row's loop vectorize).
inline float round_even(float x) noexcept { return std::nearbyint(x); }

}  // namespace detail

/// A register of B bytes of E (E: float, double, 32-bit or 16-bit integers, bytes).
template <class E, std::size_t B>
using Vec = detail::Vec<E, B>;

/// The register of type V (a Vec) at p, any alignment.
template <class V>
KVCACHE_ALWAYS_INLINE inline V load_register(const void* p) noexcept {
  return detail::load<V>(p);
}

/// v, kept in a register: compilers otherwise fold a row loaded once into each use of it.
using detail::in_register;
/// Vec<std::int32_t, B> from the B / 4 bytes at p, sign-extended (Signed) or zero-extended.
using detail::widen_bytes;
/// Vec<std::int32_t, B> from the B / 8 bytes at p: the low nibbles, then the high ones (B >= 32).
using detail::widen_nibbles;
/// Vec<float, B> from the B / 4 half-precision bit patterns at p, exactly.
using detail::widen_half;
/// Vec<float, B> from the B / 4 bfloat16 bit patterns at p, exactly.
using detail::widen_bfloat16;

/// Whether T is a half type (kvcache's or Eigen's).
using detail::is_half;
/// Whether T is a bfloat16 type (kvcache's or Eigen's).
using detail::is_bfloat16;
/// An engine's value (float, double, half or bfloat16, kvcache's or Eigen's) as float (double as
/// double).
using detail::widen;
/// A float (or double) as T (float, double, half or bfloat16), rounded to nearest even once.
using detail::narrow;
/// The largest |in[d]| of n engine values, as the bits of a float (a NaN's above infinity's).
using detail::max_magnitude_bits;
/// x rounded to the nearest integer, ties to even.
using detail::round_even;
/// The half-precision bits of x, rounded to nearest even, and the float of half bits h.
using detail::float_of_half_bits;
using detail::half_bits_of;
/// The bfloat16 bits of x, rounded to nearest even, and the float of bfloat16 bits h.
using detail::bfloat16_bits_of;
using detail::float_of_bfloat16_bits;

}  // namespace KVCACHE_ABI
}  // namespace kvcache
