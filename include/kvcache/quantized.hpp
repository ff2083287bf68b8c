// SPDX-License-Identifier: Apache-2.0
#pragma once

// Quantized storage formats: rows of 8 or 4 bits with their scales, read by attention through
// their codecs (dequantized in registers, never copied into a dense buffer).
//
//   kvcache::KvCache<kvcache::fp8_e4m3> cache({.layers = 28, .kv_heads = 8, .head_dim = 128, .capacity = 4096});
//
// fp8_e4m3       OCP e4m3fn bytes (largest finite 448, no infinities) with one float scale per
//                (token, kv head) row: amax / 448. Needs no calibration; nothing saturates.
// fp8_e4m3_heads the same bytes with one static float scale per (layer, kv head) for K and one
//                for V, given in KvCacheConfig::key_scales / value_scales (calibrate_head_scales
//                in calibration.hpp finds them from a float run). A value beyond 464 x its
//                head's scale (that would not round to 448) saturates at 448 and is counted by
//                the cache's clipped().
// int8_rows      symmetric int8 with one float scale per (token, kv head) row: amax / 127.
// int4_groups    groups of 32 values along the head, each with a half-precision scale and
//                minimum, two values a byte (20 bytes a group).
// int4_rotated   each head rotated on write by a fixed orthogonal transform (random signs, then
//                Walsh-Hadamard blocks: detail/hadamard.hpp), then groups of 16 values, each with
//                a half-precision scale and minimum (12 bytes a group). Attention rotates the
//                queries alike and rotates the output back, once per call.
//
// Each takes only finite input (int4_groups: of magnitude at most 65504, its scales' range;
// int4_rotated: at most 4000, so that a rotated value stays in that range); other input is
// refused by update() with the cache unchanged.

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvcache/codec.hpp"
#include "kvcache/detail/hadamard.hpp"
#include "kvcache/detail/simd.hpp"
#include "kvcache/version.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// FP8 E4M3 (OCP e4m3fn) with a scale per (token, kv head) row.
struct fp8_e4m3 {};
/// FP8 E4M3 (OCP e4m3fn) with a static scale per (layer, kv head), given in the config.
struct fp8_e4m3_heads {};
/// int8 with a scale per (token, kv head) row.
struct int8_rows {};
/// int4 in groups of 32 with a scale and a minimum per group.
struct int4_groups {};
/// int4 of each head rotated by a fixed orthogonal transform, in groups of 16 with a scale and a
/// minimum per group.
struct int4_rotated {};
/// int8 with one static scale per (layer, kv head), given in the config (calibrate_head_scales).
struct int8_heads {};

namespace detail {

/// E4M3's largest finite magnitude.
inline constexpr float kE4M3Max = 448.0F;

/// The e4m3fn code of x, rounded to nearest even, saturating at +-448 (NaN is the caller's to
/// refuse: it gives 0x7F). Without branches, so that a row's loop vectorizes.
inline std::uint8_t e4m3_of(float x) noexcept {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t sign = (bits >> 24) & 0x80U;
  const std::uint32_t m = bits & 0x7FFFFFFFU;
  const float magnitude = std::bit_cast<float>(m);
  // Normal: 3 mantissa bits rounded to nearest even, the exponent rebased from 127 to 7.
  const std::uint32_t normal = ((m + 0x7FFFFU + ((m >> 20) & 1U)) >> 20) - (120U << 3);
  // Subnormal: a multiple of 2^-9, which is float's step in [2^14, 2^15), so adding 2^14
  // rounds to one (to nearest even) and leaves it in the low mantissa bits.
  const std::uint32_t subnormal = std::bit_cast<std::uint32_t>(magnitude + 0x1p14F) - 0x46800000U;
  std::uint32_t code = magnitude < 0x1p-6F ? subnormal : normal;
  code = magnitude >= kE4M3Max ? 0x7EU : code;
  code = m > 0x7F800000U ? 0x7FU : code;
  return static_cast<std::uint8_t>(sign | code);
}

/// The value of an e4m3fn code (0x7F and 0xFF, its NaNs, give NaN).
inline float float_of_e4m3(std::uint8_t code) noexcept {
  if ((code & 0x7FU) == 0x7FU) return std::numeric_limits<float>::quiet_NaN();
  const auto magnitude = static_cast<std::uint32_t>(code & 0x7FU);
  // The code's exponent and mantissa moved into a float's place are the value times 2^-120.
  const float value = std::bit_cast<float>(magnitude << 20) * 0x1p120F;
  return (code & 0x80U) != 0 ? -value : value;
}

/// Half-precision bits of x rounded toward +inf (up) or -inf (down), for group scales and
/// minimums that must not shrink the range they cover.
inline std::uint16_t half_bits_toward(float x, bool up) noexcept {
  std::uint16_t h = half_bits_of(x);
  const float v = float_of_half_bits(h);
  const bool negative = (h & 0x8000U) != 0;
  if (up && v < x) {
    h = negative ? (h == 0x8000U ? std::uint16_t{1} : static_cast<std::uint16_t>(h - 1))
                 : static_cast<std::uint16_t>(h + 1);
  } else if (!up && v > x) {
    h = negative ? static_cast<std::uint16_t>(h + 1)
                 : (h == 0 ? std::uint16_t{0x8001} : static_cast<std::uint16_t>(h - 1));
  }
  return h;
}

/// Rows of E4M3 codes: how fp8_e4m3 and fp8_e4m3_heads read them.
struct E4M3Rows {
  using unit = std::uint8_t;
  using acc = float;
  static constexpr scales_kept scales = scales_kept::per_row;  // fp8_e4m3_heads' are per head
  static constexpr float max_magnitude = std::numeric_limits<float>::max();
  static constexpr std::size_t units(std::size_t head_dim) noexcept { return head_dim; }

  /// load gives the value times 2^-120: integer operations alone, which leave the vector
  /// unit's multipliers to the dot products; the kernel puts 2^120 back in its scales.
  static constexpr int load_exponent = 120;
  template <std::size_t B>
  KVCACHE_ALWAYS_INLINE static Vec<float, B> load(const unit* row, std::size_t d) noexcept {
    // Sign-extended, shifted so the exponent and mantissa sit in a float's place, the sign's
    // copies masked off.
    const auto wide = widen_bytes<B, true>(row + d) << 20;
    const auto bits = wide & static_cast<std::int32_t>(0x87F00000U);
    return std::bit_cast<Vec<float, B>>(bits);
  }
  static float value(const unit* row, std::size_t d) noexcept { return float_of_e4m3(row[d]); }
};

/// Rows of int8 codes: how int8_rows and int8_heads read them.
struct Int8Rows {
  using unit = std::int8_t;
  using acc = float;
  static constexpr scales_kept scales = scales_kept::per_row;  // int8_heads' are per head
  static constexpr float max_magnitude = std::numeric_limits<float>::max();
  static constexpr std::size_t units(std::size_t head_dim) noexcept { return head_dim; }

  template <std::size_t B>
  KVCACHE_ALWAYS_INLINE static Vec<float, B> load(const unit* row, std::size_t d) noexcept {
    return __builtin_convertvector(widen_bytes<B, true>(row + d), Vec<float, B>);
  }
  static float value(const unit* row, std::size_t d) noexcept { return static_cast<float>(row[d]); }
};

/// int4 rows in groups of G values along the head. A group: a half step and a half minimum,
/// then G / 2 bytes whose low nibbles hold values [0, G / 2) and high nibbles [G / 2, G), so
/// that a register's values come from one nibble of adjacent bytes (or, a register as wide as
/// the group, from the low nibbles and then the high ones).
template <std::size_t G>
struct Int4Groups {
  using unit = std::uint8_t;
  using acc = float;
  static constexpr scales_kept scales = scales_kept::none;  // inside the row, a pair a group
  static constexpr std::size_t kGroup = G;
  static constexpr std::size_t kGroupBytes = 4 + G / 2;
  static constexpr std::size_t units(std::size_t head_dim) noexcept { return (head_dim + G - 1) / G * kGroupBytes; }

  /// Stores n <= G values as one group; a short group is padded with its first value (which
  /// moves neither end of its range).
  static void encode_group(const float* in, std::size_t n, unit* group) noexcept {
    float x[G];
    std::copy_n(in, n, x);
    std::fill(x + n, x + G, in[0]);
    // Min and max through order-keeping integers, which vectorize.
    std::int32_t lo_key = std::numeric_limits<std::int32_t>::max();
    std::int32_t hi_key = std::numeric_limits<std::int32_t>::min();
    for (std::size_t i = 0; i < G; ++i) {
      const std::int32_t key = ordered(x[i]);
      lo_key = std::min(lo_key, key);
      hi_key = std::max(hi_key, key);
    }
    const float lo = unordered(lo_key), hi = unordered(hi_key);
    // The minimum rounded down and the step up, so that 0..15 still cover [lo, hi].
    const std::uint16_t min_bits = half_bits_toward(lo, false);
    const float min = float_of_half_bits(min_bits);
    const std::uint16_t step_bits = half_bits_toward((hi - min) / 15.0F, true);
    const float step = float_of_half_bits(step_bits);
    const float divisor = step > 0.0F ? step : 1.0F;  // a step of 0: every value is min
    std::uint8_t q[G];
    for (std::size_t i = 0; i < G; ++i) {
      q[i] = static_cast<std::uint8_t>(std::clamp(round_even((x[i] - min) / divisor), 0.0F, 15.0F));
    }
    std::fill(q + n, q + G, std::uint8_t{0});
    std::memcpy(group, &step_bits, 2);
    std::memcpy(group + 2, &min_bits, 2);
    for (std::size_t i = 0; i < G / 2; ++i) group[4 + i] = static_cast<unit>(q[i] | (q[i + G / 2] << 4));
  }

  template <std::size_t B>
  KVCACHE_ALWAYS_INLINE static Vec<float, B> load(const unit* row, std::size_t d) noexcept {
    constexpr std::size_t W = B / 4;
    static_assert(G % W == 0, "a register's values lie in one group");
    const unit* group = row + d / G * kGroupBytes;
    const std::size_t at = d % G;
    Vec<std::int32_t, B> q;
    if constexpr (W == G) {
      q = widen_nibbles<B>(group + 4);
    } else {
      q = (widen_bytes<B, false>(group + 4 + at % (G / 2)) >> static_cast<int>(at / (G / 2) * 4)) & 15;
    }
    const auto [scale, min] = scale_and_min(group);
    return __builtin_convertvector(q, Vec<float, B>) * scale + min;
  }
  static float value(const unit* row, std::size_t d) noexcept {
    const unit* group = row + d / G * kGroupBytes;
    const std::size_t at = d % G;
    const auto [scale, min] = scale_and_min(group);
    return static_cast<float>((group[4 + at % (G / 2)] >> (at / (G / 2) * 4)) & 15U) * scale + min;
  }

 private:
  /// A float as an integer that orders as the float does (negative ones bit-flipped), and back.
  static std::int32_t ordered(float x) noexcept {
    const auto bits = std::bit_cast<std::int32_t>(x);
    return bits ^ ((bits >> 31) & 0x7FFFFFFF);
  }
  static float unordered(std::int32_t key) noexcept { return std::bit_cast<float>(key ^ ((key >> 31) & 0x7FFFFFFF)); }

  struct ScaleAndMin {
    float scale, min;
  };
  KVCACHE_ALWAYS_INLINE static ScaleAndMin scale_and_min(const unit* group) noexcept {
#if defined(__F16C__)
    std::int32_t both;
    std::memcpy(&both, group, 4);
    const __m128 wide = _mm_cvtph_ps(_mm_cvtsi32_si128(both));  // both halves in one instruction
    return {_mm_cvtss_f32(wide), _mm_cvtss_f32(_mm_movehdup_ps(wide))};
#else
    std::uint16_t bits[2];
    std::memcpy(bits, group, 4);
    return {float_of_half_bits(bits[0]), float_of_half_bits(bits[1])};
#endif
  }
};

}  // namespace detail

template <>
struct storage_codec<fp8_e4m3> : detail::E4M3Rows {
  static constexpr const char* name = "fp8_e4m3";

  /// Stores in / scale with scale = amax / 448 (1 for a row of zeros, or of values so small that
  /// amax / 448 is 0 in float: they store as zeros); returns scale. The largest value maps to
  /// 448 itself, so nothing saturates.
  template <class In>
  static EncodedRow encode(const In* in, unit* row, std::size_t head_dim, float /*head_scale*/) noexcept {
    const float amax = std::bit_cast<float>(max_magnitude_bits(in, head_dim));
    const float scale = amax / detail::kE4M3Max > 0.0F ? amax / detail::kE4M3Max : 1.0F;
    for (std::size_t d = 0; d < head_dim; ++d) {
      // Divided, not multiplied by an inverse, which overflows for the smallest rows.
      row[d] = detail::e4m3_of(static_cast<float>(widen(in[d])) / scale);
    }
    return {.scale = scale, .clipped = 0};
  }
};

template <>
struct storage_codec<fp8_e4m3_heads> : detail::E4M3Rows {
  static constexpr const char* name = "fp8_e4m3_heads";
  // One scale per (layer, kv head), given to encode; segments repeat it for every row.
  static constexpr scales_kept scales = scales_kept::per_head;

  /// The scale that maps a largest magnitude to E4M3's largest.
  static float scale_for(float amax) noexcept { return amax / detail::kE4M3Max; }

  /// Beyond this, rounding to nearest even would give more than 448 (up to it, 448 is nearest).
  static constexpr float kSaturatesAbove = 464.0F;

  /// Stores in / head_scale; returns how many values saturated at +-448.
  template <class In>
  static EncodedRow encode(const In* in, unit* row, std::size_t head_dim, float head_scale) noexcept {
    std::size_t clipped = 0;
    for (std::size_t d = 0; d < head_dim; ++d) {
      const float x = static_cast<float>(widen(in[d])) / head_scale;  // an inverse overflows for tiny scales
      if (std::fabs(x) > kSaturatesAbove) ++clipped;
      row[d] = detail::e4m3_of(x);
    }
    return {.scale = 1.0F, .clipped = clipped};
  }
};

template <>
struct storage_codec<int8_rows> : detail::Int8Rows {
  static constexpr const char* name = "int8_rows";

  /// Stores round(in / scale) with scale = amax / 127 (1 for a row of zeros, or of values so
  /// small that amax / 127 is 0 in float: they store as zeros); returns scale.
  template <class In>
  static EncodedRow encode(const In* in, unit* row, std::size_t head_dim, float /*head_scale*/) noexcept {
    const float amax = std::bit_cast<float>(max_magnitude_bits(in, head_dim));
    const float scale = amax / 127.0F > 0.0F ? amax / 127.0F : 1.0F;
    for (std::size_t d = 0; d < head_dim; ++d) {
      // Divided, not multiplied by an inverse, which overflows for the smallest rows.
      const float q = std::clamp(round_even(static_cast<float>(widen(in[d])) / scale), -127.0F, 127.0F);
      row[d] = static_cast<std::int8_t>(static_cast<int>(q));
    }
    return {.scale = scale, .clipped = 0};
  }
};

template <>
struct storage_codec<int8_heads> : detail::Int8Rows {
  static constexpr const char* name = "int8_heads";
  // One scale per (layer, kv head), given to encode; segments repeat it for every row.
  static constexpr scales_kept scales = scales_kept::per_head;

  /// The scale that maps a largest magnitude to 127.
  static float scale_for(float amax) noexcept { return amax / 127.0F; }

  /// Stores round(in / head_scale), saturated at +-127; returns how many values saturated.
  template <class In>
  static EncodedRow encode(const In* in, unit* row, std::size_t head_dim, float head_scale) noexcept {
    std::size_t clipped = 0;
    for (std::size_t d = 0; d < head_dim; ++d) {
      const float q = round_even(static_cast<float>(widen(in[d])) / head_scale);
      if (std::fabs(q) > 127.0F) ++clipped;
      row[d] = static_cast<std::int8_t>(static_cast<int>(std::clamp(q, -127.0F, 127.0F)));
    }
    return {.scale = 1.0F, .clipped = clipped};
  }
};

template <>
struct storage_codec<int4_groups> : detail::Int4Groups<32> {
  static constexpr const char* name = "int4_groups";
  static constexpr float max_magnitude = 65504.0F;

  template <class In>
  static EncodedRow encode(const In* in, unit* row, std::size_t head_dim, float /*head_scale*/) noexcept {
    for (std::size_t g0 = 0; g0 < head_dim; g0 += kGroup) {
      const std::size_t n = std::min(kGroup, head_dim - g0);
      float x[kGroup];
      for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<float>(widen(in[g0 + i]));
      encode_group(x, n, row + g0 / kGroup * kGroupBytes);
    }
    return {};
  }
};

template <>
struct storage_codec<int4_rotated> : detail::Int4Groups<16> {
  static constexpr const char* name = "int4_rotated";
  /// A rotated value is at most sqrt(256) = 16 times the input's largest: this keeps it, and its
  /// group's range, within half precision's.
  static constexpr float max_magnitude = 4000.0F;

  /// x := R x and its inverse: what attention applies to the queries and the output.
  static void rotate(float* x, std::size_t head_dim) noexcept { detail::rotate_head(x, 0, head_dim, head_dim); }
  static void unrotate(float* x, std::size_t head_dim) noexcept { detail::unrotate_head(x, 0, head_dim, head_dim); }

  template <class In>
  static EncodedRow encode(const In* in, unit* row, std::size_t head_dim, float /*head_scale*/) noexcept {
    // A chunk holds whole rotation blocks and whole groups (the block divides 16 or 16 divides it).
    const std::size_t chunk = std::max(detail::rotation_block(head_dim), kGroup);
    std::array<float, std::max(detail::kMaxRotationBlock, kGroup)> x;
    for (std::size_t c0 = 0; c0 < head_dim; c0 += chunk) {
      const std::size_t n = std::min(chunk, head_dim - c0);
      for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<float>(widen(in[c0 + i]));
      detail::rotate_head(x.data(), c0, n, head_dim);
      for (std::size_t g = 0; g < n; g += kGroup) {
        encode_group(x.data() + g, std::min(kGroup, n - g), row + (c0 + g) / kGroup * kGroupBytes);
      }
    }
    return {};
  }
};

}  // namespace KVCACHE_ABI
}  // namespace kvcache
