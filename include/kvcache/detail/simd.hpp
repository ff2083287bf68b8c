// SPDX-License-Identifier: Apache-2.0
#pragma once

// Vector registers for the attention kernel and the storage codecs: GCC/Clang vector
// extensions of B bytes, where B is at most the width the including translation unit is
// compiled for (the library is header-only, so that is the user's -m flags). One source serves
// SSE2, AVX2 and AVX-512; only conversions ask for instructions (F16C, extending loads).

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "kvcache/version.hpp"

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__) || defined(__SSE4_1__)
#include <immintrin.h>
#endif

#if !defined(__GNUC__) && !defined(__clang__)
#error "kvcache's attention needs GCC or Clang vector extensions"
#endif

#define KVCACHE_ALWAYS_INLINE __attribute__((always_inline))

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

#if defined(__AVX512F__)
inline constexpr std::size_t kNativeBytes = 64;
#elif defined(__AVX__)
inline constexpr std::size_t kNativeBytes = 32;
#else
inline constexpr std::size_t kNativeBytes = 16;
#endif

/// Vector registers the instruction set has (AVX-512: 32; SSE2 and AVX2: 16).
inline constexpr std::size_t kRegisters = kNativeBytes == 64 ? 32 : 16;

template <class E, std::size_t B>
struct VectorOf;
#define KVCACHE_VECTOR_OF(E, B)                     \
  template <>                                       \
  struct VectorOf<E, B> {                           \
    typedef E type __attribute__((vector_size(B))); \
  };
#define KVCACHE_VECTORS_OF(E) KVCACHE_VECTOR_OF(E, 16) KVCACHE_VECTOR_OF(E, 32) KVCACHE_VECTOR_OF(E, 64)
KVCACHE_VECTORS_OF(float)
KVCACHE_VECTORS_OF(double)
KVCACHE_VECTORS_OF(std::int32_t)
KVCACHE_VECTORS_OF(std::uint32_t)
KVCACHE_VECTORS_OF(std::uint16_t)
KVCACHE_VECTOR_OF(std::uint16_t, 8)
KVCACHE_VECTOR_OF(std::int8_t, 4)
KVCACHE_VECTOR_OF(std::int8_t, 8)
KVCACHE_VECTOR_OF(std::int8_t, 16)
KVCACHE_VECTOR_OF(std::uint8_t, 4)
KVCACHE_VECTOR_OF(std::uint8_t, 8)
KVCACHE_VECTOR_OF(std::uint8_t, 16)
#undef KVCACHE_VECTORS_OF
#undef KVCACHE_VECTOR_OF

/// A register of B bytes of E.
template <class E, std::size_t B>
using Vec = typename VectorOf<E, B>::type;

/// Lanes of a register type.
template <class V>
inline constexpr std::size_t kLanes = sizeof(V) / sizeof(V{}[0]);

/// Calls f(integral_constant<i>) for i in [0, N), unrolled, so arrays of registers stay in
/// registers.
template <std::size_t N, class F>
KVCACHE_ALWAYS_INLINE inline void unroll(const F& f) noexcept {
  [&]<std::size_t... I>(std::index_sequence<I...>) KVCACHE_ALWAYS_INLINE {
    (f(std::integral_constant<std::size_t, I>{}), ...);
  }
  (std::make_index_sequence<N>{});
}

template <class V>
KVCACHE_ALWAYS_INLINE inline V load(const void* p) noexcept {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class V>
KVCACHE_ALWAYS_INLINE inline void store(void* p, const V& v) noexcept {
  std::memcpy(p, &v, sizeof v);
}

template <class V, class E>
KVCACHE_ALWAYS_INLINE inline V splat(E x) noexcept {
  return static_cast<std::remove_cvref_t<decltype(V{}[0])>>(x) - V{};
}

/// v, kept in a register: compilers otherwise fold a row loaded once for R query rows into each
/// of R multiply-adds, so that loads, not multiply-adds, set the pace.
template <class V>
KVCACHE_ALWAYS_INLINE inline V in_register(V v) noexcept {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+v"(v));
#endif
  return v;
}

/// A register of floats from one of bfloat16 bit patterns: each is a float's top half.
template <std::size_t B>
KVCACHE_ALWAYS_INLINE inline Vec<float, B> widen_bfloat16(const std::uint16_t* p) noexcept {
  // One zero-extending load where the build has it: GCC 12 splits the generic conversion of a
  // whole register into halves and an insert.
#if defined(__AVX512F__)
  if constexpr (B == 64) {
    const __m512i wide = _mm512_maskz_cvtepu16_epi32(static_cast<__mmask16>(0xFFFF),
                                                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return std::bit_cast<Vec<float, B>>(std::bit_cast<Vec<std::uint32_t, B>>(wide) << 16);
  }
#endif
#if defined(__AVX2__)
  if constexpr (B == 32) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return std::bit_cast<Vec<float, B>>(std::bit_cast<Vec<std::uint32_t, B>>(wide) << 16);
  }
#endif
  const auto bits = __builtin_convertvector(load<Vec<std::uint16_t, B / 2>>(p), Vec<std::uint32_t, B>);
  return std::bit_cast<Vec<float, B>>(bits << 16);
}

/// A register of 32-bit integers from B / 4 bytes, sign- or zero-extended: one extending load
/// where the build has it (GCC 12 assembles the generic conversion lane by lane).
template <std::size_t B, bool Signed>
KVCACHE_ALWAYS_INLINE inline Vec<std::int32_t, B> widen_bytes(const void* p) noexcept {
#if defined(__AVX512F__)
  if constexpr (B == 64) {
    const __m128i bytes = _mm_loadu_si128(static_cast<const __m128i*>(p));
    const auto all = static_cast<__mmask16>(0xFFFF);
    return std::bit_cast<Vec<std::int32_t, B>>(Signed ? _mm512_maskz_cvtepi8_epi32(all, bytes)
                                                      : _mm512_maskz_cvtepu8_epi32(all, bytes));
  }
#endif
#if defined(__AVX2__)
  if constexpr (B == 32) {
    const __m128i bytes = _mm_loadl_epi64(static_cast<const __m128i*>(p));
    return std::bit_cast<Vec<std::int32_t, B>>(Signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
  }
#endif
#if defined(__SSE4_1__)
  if constexpr (B == 16) {
    std::int32_t word;
    std::memcpy(&word, p, 4);
    const __m128i bytes = _mm_cvtsi32_si128(word);
    return std::bit_cast<Vec<std::int32_t, B>>(Signed ? _mm_cvtepi8_epi32(bytes) : _mm_cvtepu8_epi32(bytes));
  }
#endif
  using Bytes = Vec<std::conditional_t<Signed, std::int8_t, std::uint8_t>, B / 4>;
  return __builtin_convertvector(load<Bytes>(p), Vec<std::int32_t, B>);
}

/// A register of 32-bit integers from the B / 8 bytes at p, each holding two 4-bit values:
/// lanes [0, B / 8) are the bytes' low nibbles, lanes [B / 8, B / 4) their high nibbles.
template <std::size_t B>
KVCACHE_ALWAYS_INLINE inline Vec<std::int32_t, B> widen_nibbles(const void* p) noexcept {
  static_assert(B >= 32, "widen_nibbles: registers of at least 8 lanes (4 bytes in)");
  constexpr std::size_t W = B / 4;
  using Ints = Vec<std::int32_t, B>;
  Ints shift;
  for (std::size_t i = 0; i < W; ++i) shift[i] = i < W / 2 ? 0 : 4;
#if defined(__AVX512F__)
  if constexpr (B == 64) {
    // The 8 bytes twice in one register, widened by one extending load.
    const __m128i half = _mm_loadl_epi64(static_cast<const __m128i*>(p));
    const __m512i wide = _mm512_maskz_cvtepu8_epi32(static_cast<__mmask16>(0xFFFF), _mm_unpacklo_epi64(half, half));
    return (std::bit_cast<Ints>(wide) >> shift) & 15;
  }
#endif
  using Half = Vec<std::uint8_t, W / 2>;
  const Half half = load<Half>(p);
  Vec<std::uint8_t, W> both;
  for (std::size_t i = 0; i < W; ++i) both[i] = half[i % (W / 2)];
  return (__builtin_convertvector(both, Ints) >> shift) & 15;
}

/// A register of floats from one of half-precision bit patterns, exactly: F16C where the
/// build has it, else integer operations and one multiply.
template <std::size_t B>
KVCACHE_ALWAYS_INLINE inline Vec<float, B> widen_half(const std::uint16_t* p) noexcept {
#if defined(__AVX512F__)
  if constexpr (B == 64) {
    return std::bit_cast<Vec<float, B>>(
        _mm512_maskz_cvtph_ps(static_cast<__mmask16>(0xFFFF), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
#endif
#if defined(__F16C__)
  if constexpr (B == 32)
    return std::bit_cast<Vec<float, B>>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  if constexpr (B == 16)
    return std::bit_cast<Vec<float, B>>(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
  using Bits = Vec<std::uint32_t, B>;
  const Bits bits = __builtin_convertvector(load<Vec<std::uint16_t, B / 2>>(p), Bits);
  const Bits magnitude = bits & 0x7FFFU;
  // Exponent and mantissa where a float keeps them read as the half's value times 2^-112
  // (subnormals included); one exact multiply rebases the exponent. Inf and NaN get a float's
  // all-ones exponent.
  const Bits scaled = std::bit_cast<Bits>(std::bit_cast<Vec<float, B>>(magnitude << 13) * 0x1p112F);
  const Bits special = std::bit_cast<Bits>(std::bit_cast<Vec<std::int32_t, B>>(magnitude) > 0x7BFF);
  return std::bit_cast<Vec<float, B>>(scaled | (special & 0x7F800000U) | ((bits & 0x8000U) << 16));
}

/// Lane l of one half of a pair sum over blocks of 2h lanes: the low (or high) h lanes of each
/// block of x, then those of the same block of y (lane w + i is y[i]).
constexpr int pair_lane(std::size_t w, std::size_t h, bool high, std::size_t l) noexcept {
  const std::size_t block = l / (2 * h) * (2 * h);
  const std::size_t i = l % (2 * h);
  const std::size_t offset = high ? h : 0;
  return static_cast<int>(i < h ? block + offset + i : w + block + offset + i - h);
}

template <std::size_t H, bool High, class V, std::size_t... L>
KVCACHE_ALWAYS_INLINE inline V pick_halves(const V& x, const V& y, std::index_sequence<L...>) noexcept {
  return __builtin_shufflevector(x, y, pair_lane(sizeof...(L), H, High, L)...);
}

/// The index whose log2(w) low bits are those of i reversed.
constexpr std::size_t reverse_bits(std::size_t i, std::size_t w) noexcept {
  std::size_t r = 0;
  for (std::size_t bit = 1; bit < w; bit <<= 1, i >>= 1) r = (r << 1) | (i & 1);
  return r;
}

/// Sums N = W registers into one whose lane l is the sum of a[l]'s lanes: each level adds the
/// low and high halves of every block of a pair, W - 1 pair sums in all instead of W horizontal
/// reductions.
template <class V, std::size_t N, std::size_t H = kLanes<V> / 2>
KVCACHE_ALWAYS_INLINE inline V transpose_sum(const V (&a)[N]) noexcept {
  constexpr std::size_t W = kLanes<V>;
  if constexpr (N == 1) {
    return a[0];
  } else {
    static_assert(N % 2 == 0 && H >= 1, "transpose_sum: N must be a power of two no larger than the lanes.");
    V b[N / 2];
    unroll<N / 2>([&](auto i) KVCACHE_ALWAYS_INLINE {
      // The top level pairs registers in bit-reversed order, so lane l ends up with a[l].
      constexpr std::size_t x = N == W ? reverse_bits(2 * i, W) : 2 * i;
      constexpr std::size_t y = N == W ? reverse_bits(2 * i + 1, W) : 2 * i + 1;
      b[i] = pick_halves<H, false>(a[x], a[y], std::make_index_sequence<W>{}) +
             pick_halves<H, true>(a[x], a[y], std::make_index_sequence<W>{});
    });
    return transpose_sum<V, N / 2, H / 2>(b);
  }
}

/// Lane i of v moved to lane i - H (lanes past the top come from the bottom): a halving step.
template <std::size_t H, class V, std::size_t... L>
KVCACHE_ALWAYS_INLINE inline V rotate_lanes(const V& v, std::index_sequence<L...>) noexcept {
  return __builtin_shufflevector(v, v, static_cast<int>((L + H) % sizeof...(L))...);
}

/// Folds every lane of v into lane 0 by op, halving the lanes at each step (log2 W shuffles),
/// so that the result does not wait on a chain of W scalar operations.
template <class V, class Op>
KVCACHE_ALWAYS_INLINE inline auto reduce(V v, const Op& op) noexcept {
  constexpr std::size_t W = kLanes<V>;
  if constexpr (W >= 16) v = op(v, rotate_lanes<8>(v, std::make_index_sequence<W>{}));
  if constexpr (W >= 8) v = op(v, rotate_lanes<4>(v, std::make_index_sequence<W>{}));
  if constexpr (W >= 4) v = op(v, rotate_lanes<2>(v, std::make_index_sequence<W>{}));
  if constexpr (W >= 2) v = op(v, rotate_lanes<1>(v, std::make_index_sequence<W>{}));
  static_assert(W <= 16, "reduce: at most 16 lanes");
  return v[0];
}

template <class V>
KVCACHE_ALWAYS_INLINE inline auto reduce_add(const V& v) noexcept {
  return reduce(v, [](const V& a, const V& b) KVCACHE_ALWAYS_INLINE { return a + b; });
}

template <class V>
KVCACHE_ALWAYS_INLINE inline auto reduce_max(const V& v) noexcept {
  return reduce(v, [](const V& a, const V& b) KVCACHE_ALWAYS_INLINE { return a > b ? a : b; });
}

/// Unsigned integers of the size of F (a float, or a register of floats).
template <class F>
struct BitsOf {
  using type = Vec<std::uint32_t, sizeof(F)>;
};
template <>
struct BitsOf<float> {
  using type = std::uint32_t;
};

/// e^x for x <= 0 on a float or lane by lane: 0 below -87 (and for -inf, a masked score),
/// within 1 ulp elsewhere, with no call and no float-to-int conversion, so loops vectorize.
template <class F>
KVCACHE_ALWAYS_INLINE inline F exp_nonpositive(const F& x) noexcept {
  using Bits = typename BitsOf<F>::type;
  const F floor = F{} - 87.0F;
  const F xc = x < floor ? floor : x;
  // x = i ln2 + f, |f| <= ln2 / 2: adding 1.5 * 2^23 rounds x / ln2 to i in the low mantissa bits.
  const F shifted = xc * 1.44269504088896341F + 12582912.0F;
  const F r = shifted - 12582912.0F;
  const F f = (xc - r * 0.693359375F) + r * 2.12194440e-4F;
  F p = F{} + 1.9875691500e-4F;
  p = p * f + 1.3981999507e-3F;
  p = p * f + 8.3334519073e-3F;
  p = p * f + 4.1665795894e-2F;
  p = p * f + 1.6666665459e-1F;
  p = p * f + 5.0000001201e-1F;
  const F e = p * f * f + f + 1.0F;
  const F two_i = std::bit_cast<F>((std::bit_cast<Bits>(shifted) + (127U - 0x400000U)) << 23);
  const F keep = x < floor ? F{} : F{} + 1.0F;
  return e * two_i * keep;
}

inline double exp_nonpositive(double x) noexcept { return x == -HUGE_VAL ? 0.0 : std::exp(x); }

template <class V>
requires std::is_same_v<V, Vec<double, sizeof(V)>>
inline V exp_nonpositive(const V& x) noexcept {
  V out;
  for (std::size_t i = 0; i < kLanes<V>; ++i) out[i] = exp_nonpositive(x[i]);
  return out;
}

/// Asks for the cache line at p to be brought towards L1 ahead of its use.
KVCACHE_ALWAYS_INLINE inline void prefetch(const void* p) noexcept { __builtin_prefetch(p, 0, 3); }

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
