// SPDX-License-Identifier: Apache-2.0
#pragma once

// The inner loops of causal_attention, written so that a compiler vectorizes them at default
// flags (no -ffast-math): fixed-width lane accumulators instead of reductions it may not
// reorder, bit operations instead of library calls.

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

namespace kvcache::detail {

// The vector register width this translation unit is compiled for (the library is header-only,
// so this is the user's -m flags): accumulators span as many registers as keep the multiply-add
// units busy, without spilling, at every width.
#if defined(__AVX512F__)
inline constexpr std::size_t kVectorBytes = 64;
#elif defined(__AVX__)
inline constexpr std::size_t kVectorBytes = 32;
#else
inline constexpr std::size_t kVectorBytes = 16;
#endif

/// Acc values per vector register.
template <class Acc>
inline constexpr std::size_t kVector = kVectorBytes / sizeof(Acc);

/// Lanes per dot-product accumulator: two registers, so four keys at once make eight chains.
template <class Acc>
inline constexpr std::size_t kLanes = 2 * kVector<Acc>;

/// Hints that `bytes` from `p` will be read soon (a tile ahead of the one being computed).
inline void prefetch(const void* p, std::size_t bytes) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  const char* c = static_cast<const char*>(p);
  for (std::size_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(c + offset, 0, 3);
#else
  (void)p;
  (void)bytes;
#endif
}

/// Converts n stored values to the accumulation type.
template <class Acc, class T>
inline void convert_row(const T* __restrict src, Acc* __restrict dst, std::size_t n) noexcept {
  if constexpr (std::is_same_v<T, Eigen::bfloat16> && std::is_same_v<Acc, float>) {
    // bfloat16 is the top half of a float: a shift, which vectorizes, instead of a call per value.
    static_assert(sizeof(Eigen::bfloat16) == sizeof(std::uint16_t));
    for (std::size_t i = 0; i < n; ++i) {
      std::uint16_t bits;
      std::memcpy(&bits, src + i, sizeof bits);
      dst[i] = std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
    }
  } else if constexpr (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<Acc>(static_cast<float>(src[i]));
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<Acc>(src[i]);
  }
}

/// Whether rows of T can be converted to Acc in registers as they are read (a shift for
/// bfloat16), so a row read by one query row needs no converted copy.
template <class T, class Acc>
inline constexpr bool kConvertsInRegisters = std::is_same_v<T, Acc> ||
                                             (std::is_same_v<T, Eigen::bfloat16> && std::is_same_v<Acc, float>);

/// p[i] as Acc; for bfloat16 the same shift as convert_row.
template <class Acc, class T>
inline Acc load_as(const T* p, std::size_t i) noexcept {
  if constexpr (std::is_same_v<T, Eigen::bfloat16> && std::is_same_v<Acc, float>) {
    std::uint16_t bits;
    std::memcpy(&bits, p + i, sizeof bits);
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
  } else {
    return static_cast<Acc>(p[i]);
  }
}

/// Sums the lanes by halves (a fixed order, so results never depend on the thread count); each
/// step is a fixed-size loop a compiler turns into whole-register adds.
template <class Acc, std::size_t L>
inline Acc reduce_lanes(const Acc (&lanes)[L]) noexcept {
  if constexpr (L == 1) {
    return lanes[0];
  } else {
    static_assert(L % 2 == 0, "reduce_lanes halves its lanes: L must be a power of two.");
    Acc half[L / 2];
    for (std::size_t l = 0; l < L / 2; ++l) half[l] = lanes[l] + lanes[l + L / 2];
    return reduce_lanes(half);
  }
}

/// The largest of n values (-inf for none), over independent lanes so the compares pipeline.
template <class Acc>
inline Acc max_of(const Acc* x, std::size_t n) noexcept {
  constexpr std::size_t L = kVector<Acc>;
  Acc lanes[L];
  for (std::size_t l = 0; l < L; ++l) lanes[l] = -std::numeric_limits<Acc>::infinity();
  std::size_t i = 0;
  for (; i + L <= n; i += L) {
    for (std::size_t l = 0; l < L; ++l) lanes[l] = lanes[l] > x[i + l] ? lanes[l] : x[i + l];
  }
  for (std::size_t l = 0; i < n; ++i, ++l) lanes[l] = lanes[l] > x[i] ? lanes[l] : x[i];
  Acc m = lanes[0];
  for (std::size_t l = 1; l < L; ++l) m = m > lanes[l] ? m : lanes[l];
  return m;
}

/// The sum of n values, over independent lanes.
template <class Acc>
inline Acc sum_of(const Acc* x, std::size_t n) noexcept {
  constexpr std::size_t L = kVector<Acc>;
  Acc lanes[L] = {};
  std::size_t i = 0;
  for (; i + L <= n; i += L) {
    for (std::size_t l = 0; l < L; ++l) lanes[l] += x[i + l];
  }
  for (std::size_t l = 0; i < n; ++i, ++l) lanes[l] += x[i];
  return reduce_lanes(lanes);
}

/// out[i] = q . k_i for four key rows: q is loaded once for all four, and the four sets of lane
/// accumulators are independent, so the multiply-adds pipeline.
template <class Acc, class K>
inline void dot4(const Acc* __restrict q, const K* k0, const K* k1, const K* k2, const K* k3, std::size_t n,
                 Acc* __restrict out) noexcept {
  constexpr std::size_t L = kLanes<Acc>;
  Acc a0[L] = {};
  Acc a1[L] = {};
  Acc a2[L] = {};
  Acc a3[L] = {};
  std::size_t d = 0;
  for (; d + L <= n; d += L) {
    for (std::size_t l = 0; l < L; ++l) {
      const Acc x = q[d + l];
      a0[l] += x * load_as<Acc>(k0, d + l);
      a1[l] += x * load_as<Acc>(k1, d + l);
      a2[l] += x * load_as<Acc>(k2, d + l);
      a3[l] += x * load_as<Acc>(k3, d + l);
    }
  }
  // The tail goes to scalars: indexing the lane arrays by a variable would keep them in memory.
  Acc t0 = 0;
  Acc t1 = 0;
  Acc t2 = 0;
  Acc t3 = 0;
  for (; d < n; ++d) {
    t0 += q[d] * load_as<Acc>(k0, d);
    t1 += q[d] * load_as<Acc>(k1, d);
    t2 += q[d] * load_as<Acc>(k2, d);
    t3 += q[d] * load_as<Acc>(k3, d);
  }
  out[0] = reduce_lanes(a0) + t0;
  out[1] = reduce_lanes(a1) + t1;
  out[2] = reduce_lanes(a2) + t2;
  out[3] = reduce_lanes(a3) + t3;
}

/// q . k for one key row.
template <class Acc, class K>
inline Acc dot(const Acc* __restrict q, const K* __restrict k, std::size_t n) noexcept {
  constexpr std::size_t L = kLanes<Acc>;
  Acc a[L] = {};
  std::size_t d = 0;
  for (; d + L <= n; d += L) {
    for (std::size_t l = 0; l < L; ++l) a[l] += q[d + l] * load_as<Acc>(k, d + l);
  }
  Acc tail = 0;
  for (; d < n; ++d) tail += q[d] * load_as<Acc>(k, d);
  return reduce_lanes(a) + tail;
}

/// acc[d, d + L) += sum_j w[j] * rows[j][d, d + L): L lanes held in registers while every row
/// streams past, two rows at a time into separate lanes so that consecutive multiply-adds do
/// not wait on each other.
template <std::size_t L, class Acc, class V>
inline void accumulate_chunk(Acc* __restrict acc, const Acc* __restrict w, const V* rows, std::size_t stride,
                             std::size_t count) noexcept {
  Acc even[L];
  Acc odd[L] = {};
  for (std::size_t l = 0; l < L; ++l) even[l] = acc[l];
  std::size_t j = 0;
  for (; j + 2 <= count; j += 2) {
    const Acc w0 = w[j];
    const Acc w1 = w[j + 1];
    const V* v0 = rows + j * stride;
    const V* v1 = v0 + stride;
    for (std::size_t l = 0; l < L; ++l) {
      even[l] += w0 * load_as<Acc>(v0, l);
      odd[l] += w1 * load_as<Acc>(v1, l);
    }
  }
  if (j < count) {
    const Acc wj = w[j];
    const V* v = rows + j * stride;
    for (std::size_t l = 0; l < L; ++l) even[l] += wj * load_as<Acc>(v, l);
  }
  for (std::size_t l = 0; l < L; ++l) acc[l] = even[l] + odd[l];
}

/// acc[0, n) += sum_j w[j] * rows[j][0, n) over `count` rows `stride` apart, in the widest
/// chunks that fit: the accumulator stays in registers instead of being reloaded per row.
template <class Acc, class V>
inline void accumulate_rows(Acc* __restrict acc, const Acc* __restrict w, const V* rows, std::size_t stride,
                            std::size_t count, std::size_t n) noexcept {
  constexpr std::size_t W = kVector<Acc>;
  std::size_t d = 0;
  for (; d + 4 * W <= n; d += 4 * W) accumulate_chunk<4 * W>(acc + d, w, rows + d, stride, count);
  if (d + 2 * W <= n) {
    accumulate_chunk<2 * W>(acc + d, w, rows + d, stride, count);
    d += 2 * W;
  }
  if (d + W <= n) {
    accumulate_chunk<W>(acc + d, w, rows + d, stride, count);
    d += W;
  }
  for (; d < n; ++d) {
    Acc sum = acc[d];
    for (std::size_t j = 0; j < count; ++j) sum += w[j] * load_as<Acc>(rows, j * stride + d);
    acc[d] = sum;
  }
}

/// e^x for x <= 0, with e^x = 0 below -87 (and for -inf, a masked score). Within 1 ulp in
/// float; no branch, call or float-to-int conversion, so that a loop over a tile of scores
/// vectorizes.
inline float exp_nonpositive(float x) noexcept {
#if defined(__FAST_MATH__)
  // The rounding trick below is exactly what -ffast-math may rewrite away.
  return x < -87.0F ? 0.0F : std::exp(x);
#else
  const float xc = x < -87.0F ? -87.0F : x;
  // x = i ln2 + f with |f| <= ln2 / 2: adding 1.5 * 2^23 rounds x / ln2 to the integer i,
  // which lands in the low bits of the sum's mantissa.
  const float shifted = xc * 1.44269504088896341F + 12582912.0F;
  const float r = shifted - 12582912.0F;
  const float f = (xc - r * 0.693359375F) + r * 2.12194440e-4F;
  float p = 1.9875691500e-4F;
  p = p * f + 1.3981999507e-3F;
  p = p * f + 8.3334519073e-3F;
  p = p * f + 4.1665795894e-2F;
  p = p * f + 1.6666665459e-1F;
  p = p * f + 5.0000001201e-1F;
  const float e = p * f * f + f + 1.0F;
  // 2^i from the sum's bits: (i + 127) << 23, i in [-126, 0].
  const float two_i = std::bit_cast<float>((std::bit_cast<std::uint32_t>(shifted) + (127U - 0x400000U)) << 23);
  const float keep = x < -87.0F ? 0.0F : 1.0F;
  return e * two_i * keep;
#endif
}

inline double exp_nonpositive(double x) noexcept { return x == -HUGE_VAL ? 0.0 : std::exp(x); }

}  // namespace kvcache::detail
