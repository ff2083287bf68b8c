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
#include <type_traits>

#include <Eigen/Core>

namespace kvcache::detail {

/// Lanes per accumulator: one cache line of Acc, so one or a few vector registers whatever the ISA.
template <class Acc>
inline constexpr std::size_t kLanes = 64 / sizeof(Acc);

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

/// Sums the lanes pairwise (a fixed order, so results never depend on the thread count).
template <class Acc, std::size_t L>
inline Acc reduce_lanes(Acc (&lanes)[L]) noexcept {
  for (std::size_t width = L / 2; width >= 1; width /= 2) {
    for (std::size_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

/// out[i] = q . k_i for four key rows: q is loaded once for all four, and the four sets of lane
/// accumulators are independent, so the multiply-adds pipeline.
template <class Acc>
inline void dot4(const Acc* __restrict q, const Acc* k0, const Acc* k1, const Acc* k2, const Acc* k3, std::size_t n,
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
      a0[l] += x * k0[d + l];
      a1[l] += x * k1[d + l];
      a2[l] += x * k2[d + l];
      a3[l] += x * k3[d + l];
    }
  }
  for (std::size_t l = 0; d < n; ++d, ++l) {
    a0[l] += q[d] * k0[d];
    a1[l] += q[d] * k1[d];
    a2[l] += q[d] * k2[d];
    a3[l] += q[d] * k3[d];
  }
  out[0] = reduce_lanes(a0);
  out[1] = reduce_lanes(a1);
  out[2] = reduce_lanes(a2);
  out[3] = reduce_lanes(a3);
}

/// q . k for one key row.
template <class Acc>
inline Acc dot(const Acc* __restrict q, const Acc* __restrict k, std::size_t n) noexcept {
  constexpr std::size_t L = kLanes<Acc>;
  Acc a[L] = {};
  std::size_t d = 0;
  for (; d + L <= n; d += L) {
    for (std::size_t l = 0; l < L; ++l) a[l] += q[d + l] * k[d + l];
  }
  for (std::size_t l = 0; d < n; ++d, ++l) a[l] += q[d] * k[d];
  return reduce_lanes(a);
}

/// acc[0, n) += sum_j w[j] * rows[j][0, n) over `count` rows `stride` apart. acc is held in
/// registers a chunk at a time while every row streams past, instead of being reloaded per row.
template <class Acc>
inline void accumulate_rows(Acc* __restrict acc, const Acc* __restrict w, const Acc* rows, std::size_t stride,
                            std::size_t count, std::size_t n) noexcept {
  constexpr std::size_t L = 2 * kLanes<Acc>;
  std::size_t d = 0;
  for (; d + L <= n; d += L) {
    Acc lanes[L];
    for (std::size_t l = 0; l < L; ++l) lanes[l] = acc[d + l];
    for (std::size_t j = 0; j < count; ++j) {
      const Acc wj = w[j];
      const Acc* v = rows + j * stride + d;
      for (std::size_t l = 0; l < L; ++l) lanes[l] += wj * v[l];
    }
    for (std::size_t l = 0; l < L; ++l) acc[d + l] = lanes[l];
  }
  for (; d < n; ++d) {
    Acc sum = acc[d];
    for (std::size_t j = 0; j < count; ++j) sum += w[j] * rows[j * stride + d];
    acc[d] = sum;
  }
}

/// e^x for x <= 0, with e^x = 0 below -87 (and for -inf, a masked score). Within 2 ulp in
/// float; branch-free so that a loop over a tile of scores vectorizes.
inline float exp_nonpositive(float x) noexcept {
  const float xc = x >= -87.0F ? x : -87.0F;  // also maps NaN and -inf to a safe argument
  // x = i ln2 + f with |f| <= ln2 / 2: round x / ln2 to the nearest integer (it is <= 0).
  const int i = static_cast<int>(xc * 1.44269504088896341F - 0.5F);
  const auto r = static_cast<float>(i);
  const float f = (xc - r * 0.693359375F) + r * 2.12194440e-4F;
  float p = 1.9875691500e-4F;
  p = p * f + 1.3981999507e-3F;
  p = p * f + 8.3334519073e-3F;
  p = p * f + 4.1665795894e-2F;
  p = p * f + 1.6666665459e-1F;
  p = p * f + 5.0000001201e-1F;
  const float e = p * f * f + f + 1.0F;
  const float two_i = std::bit_cast<float>(static_cast<std::uint32_t>(i + 127) << 23);  // i in [-126, 0]
  return x >= -87.0F ? e * two_i : 0.0F;
}

inline double exp_nonpositive(double x) noexcept { return x == -HUGE_VAL ? 0.0 : std::exp(x); }

}  // namespace kvcache::detail
