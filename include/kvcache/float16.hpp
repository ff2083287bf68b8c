// SPDX-License-Identifier: Apache-2.0
#pragma once

// kvcache's own 16-bit floating-point types, so that 16-bit storage and 16-bit compute need
// nothing but the standard library: bfloat16 (8 exponent bits, float's range) and half (IEEE
// binary16). Each is its 16 bits; it widens to float exactly, implicitly, and is made from a
// float rounded to nearest even, explicitly. Either is a storage format and a compute type:
//
//   kvcache::KvCache<kvcache::bfloat16> cache({.layers = 28, .kv_heads = 8, .head_dim = 128, .capacity = 4096});
//   std::vector<std::uint16_t> k = ...;  // an engine's own bf16 keys, [1, 8, T, 128]
//   kvcache::TensorView<const kvcache::bfloat16> k_view(kvcache::as_bfloat16(k.data()), {1, 8, T, 128});
//
// as_bfloat16 and as_half read an engine's buffer of 16-bit values (std::uint16_t, or a struct
// of one such as ggml_bf16_t) in place, without a copy. Eigen::bfloat16 and Eigen::half are
// accepted too where an engine includes <Eigen/Core>: the same bits, stored the same way.

#include <bit>
#include <cstdint>
#include <type_traits>

#include "kvcache/version.hpp"

// The 16-bit types may view an engine's buffers of other 16-bit types (as_bfloat16, as_half).
#if defined(__GNUC__) || defined(__clang__)
#define KVCACHE_MAY_ALIAS __attribute__((__may_alias__))
#else
#define KVCACHE_MAY_ALIAS
#endif

namespace kvcache {
inline namespace KVCACHE_ABI {

namespace detail {

/// bfloat16 bits as float (exact).
constexpr float float_of_bfloat16_bits(std::uint16_t bits) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

/// half bits as float (exact, subnormals included).
constexpr float float_of_half_bits(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000U) << 16;
  const std::uint32_t magnitude = h & 0x7FFFU;
  // As in widen_half: the magnitude's bits moved into a float's place are the value times 2^-112.
  float value = std::bit_cast<float>(magnitude << 13) * 0x1p112F;
  if (magnitude > 0x7BFFU) value = std::bit_cast<float>((magnitude << 13) | 0x7F800000U);  // inf, NaN
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(value) | sign);
}

/// float to bfloat16 bits, rounded to nearest even; NaN stays NaN.
constexpr std::uint16_t bfloat16_bits_of(float x) noexcept {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  if ((bits & 0x7FFFFFFFU) > 0x7F800000U) return static_cast<std::uint16_t>((bits >> 16) | 0x40U);
  return static_cast<std::uint16_t>((bits + 0x7FFFU + ((bits >> 16) & 1U)) >> 16);
}

/// float to half bits, rounded to nearest even, overflowing to infinity; NaN stays NaN.
constexpr std::uint16_t half_bits_of(float x) noexcept {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000U);
  const std::uint32_t magnitude = bits & 0x7FFFFFFFU;
  if (magnitude > 0x7F800000U) return static_cast<std::uint16_t>(sign | 0x7E00U);
  if (magnitude >= 0x477FF000U) return static_cast<std::uint16_t>(sign | 0x7C00U);  // rounds past 65504
  if (magnitude < 0x38800000U) {
    // Subnormal half: adding 0.5 makes the float's mantissa hold the half's bits, rounded to
    // nearest even by the float addition itself.
    const float shifted = std::bit_cast<float>(magnitude) + 0.5F;
    return static_cast<std::uint16_t>(sign | (std::bit_cast<std::uint32_t>(shifted) - 0x3F000000U));
  }
  const std::uint32_t odd = (magnitude >> 13) & 1U;
  const std::uint32_t rebased = magnitude - 0x38000000U + 0xFFFU + odd;  // exponent bias 127 -> 15
  return static_cast<std::uint16_t>(sign | (rebased >> 13));
}

/// What bfloat16 and half share: 16 bits that widen to float exactly and are made from a float
/// rounded to nearest even (Self: the type itself).
template <class Self, float (*Widen)(std::uint16_t) noexcept, std::uint16_t (*Narrow)(float) noexcept>
class KVCACHE_MAY_ALIAS Float16 {
 public:
  /// Uninitialized, as a float is (zero when value-initialized: `T{}`, std::vector<T>(n)).
  Float16() = default;
  /// x rounded to nearest even.
  constexpr explicit Float16(float x) noexcept : bits_(Narrow(x)) {}
  /// The value, exactly.
  constexpr operator float() const noexcept { return Widen(bits_); }  // NOLINT(google-explicit-constructor)

  /// The value whose bits are `bits`.
  [[nodiscard]] static constexpr Self from_bits(std::uint16_t bits) noexcept {
    Self x;
    x.bits_ = bits;
    return x;
  }
  [[nodiscard]] constexpr std::uint16_t bits() const noexcept { return bits_; }

 private:
  std::uint16_t bits_;
};

}  // namespace detail

/// bfloat16: float's sign and 8 exponent bits with 7 mantissa bits.
class KVCACHE_MAY_ALIAS bfloat16
    : public detail::Float16<bfloat16, detail::float_of_bfloat16_bits, detail::bfloat16_bits_of> {
 public:
  using Float16::Float16;
};

/// half: IEEE binary16 (5 exponent bits, 10 mantissa bits; largest finite 65504, beyond which a
/// float rounds to infinity).
class KVCACHE_MAY_ALIAS half : public detail::Float16<half, detail::float_of_half_bits, detail::half_bits_of> {
 public:
  using Float16::Float16;
};

static_assert(sizeof(bfloat16) == 2 && sizeof(half) == 2, "kvcache's 16-bit types are their 16 bits");
static_assert(std::is_trivial_v<bfloat16> && std::is_standard_layout_v<bfloat16> && std::is_trivial_v<half> &&
                  std::is_standard_layout_v<half>,
              "kvcache's 16-bit types are copied with memcpy and viewed over an engine's buffers");

/// Whether U's values are 16 bits an engine may hand in as bfloat16 or half: std::uint16_t,
/// std::int16_t, or a trivially copyable type of 2 bytes (a struct of one std::uint16_t).
template <class U>
concept sixteen_bits = sizeof(U) == 2 && std::is_trivially_copyable_v<U>;

/// An engine's buffer of 16-bit bfloat16 values, read in place as kvcache::bfloat16.
template <sixteen_bits U>
[[nodiscard]] const bfloat16* as_bfloat16(const U* data) noexcept {
  return reinterpret_cast<const bfloat16*>(data);
}
template <sixteen_bits U>
[[nodiscard]] bfloat16* as_bfloat16(U* data) noexcept {
  return reinterpret_cast<bfloat16*>(data);
}
/// An engine's buffer of 16-bit IEEE half values, read in place as kvcache::half.
template <sixteen_bits U>
[[nodiscard]] const half* as_half(const U* data) noexcept {
  return reinterpret_cast<const half*>(data);
}
template <sixteen_bits U>
[[nodiscard]] half* as_half(U* data) noexcept {
  return reinterpret_cast<half*>(data);
}

}  // namespace KVCACHE_ABI
}  // namespace kvcache
