// SPDX-License-Identifier: Apache-2.0
#pragma once

// CRC-32C (Castagnoli, the checksum of iSCSI, ext4 and SSE4.2's crc32 instruction): what a state
// file keeps per section. One portable form (tables, eight bytes a step) and the instruction
// where the processor has it, chosen at run time on x86-64 so that a build without -msse4.2
// still checksums at memory speed; both give the same values.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvcache/version.hpp"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define KVCACHE_CRC32C_X86 1
#elif defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#define KVCACHE_CRC32C_ARM 1
#endif

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

/// The reflected Castagnoli polynomial.
inline constexpr std::uint32_t kCrc32cPolynomial = 0x82F63B78U;

/// Tables for eight bytes a step: entry [k][b] is the CRC of byte b followed by k zero bytes.
inline constexpr std::array<std::array<std::uint32_t, 256>, 8> kCrc32cTables = [] {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c >> 1) ^ ((c & 1U) != 0 ? kCrc32cPolynomial : 0U);
    t[0][b] = c;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::size_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFU];
  }
  return t;
}();

/// CRC-32C of n bytes continuing `crc` (0 to start; crc32c(crc32c(0, a), b) is the CRC of a then
/// b), from tables.
inline std::uint32_t crc32c_portable(std::uint32_t crc, const void* data, std::size_t n) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  const auto& t = kCrc32cTables;
  std::uint32_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    std::uint32_t lo;
    std::uint32_t hi;
    std::memcpy(&lo, p, 4);  // the format is little-endian, and so is every host that loads it
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xFFU] ^ t[6][(lo >> 8) & 0xFFU] ^ t[5][(lo >> 16) & 0xFFU] ^ t[4][lo >> 24] ^ t[3][hi & 0xFFU] ^
        t[2][(hi >> 8) & 0xFFU] ^ t[1][(hi >> 16) & 0xFFU] ^ t[0][hi >> 24];
  }
  for (; n != 0; --n, ++p) c = (c >> 8) ^ t[0][(c ^ *p) & 0xFFU];
  return ~c;
}

/// a * b modulo the polynomial, both in the reflected form CRCs are kept in (bit 31 is x^0).
constexpr std::uint32_t crc32c_multiply(std::uint32_t a, std::uint32_t b) noexcept {
  std::uint32_t product = 0;
  for (std::uint32_t m = 1U << 31; m != 0; m >>= 1) {
    if ((a & m) != 0) product ^= b;
    b = (b & 1U) != 0 ? (b >> 1) ^ kCrc32cPolynomial : b >> 1;
  }
  return product;
}

/// x^(8n) modulo the polynomial: what appending n bytes multiplies a CRC by.
constexpr std::uint32_t crc32c_shift(std::size_t n) noexcept {
  std::uint32_t result = 1U << 31;  // x^0
  std::uint32_t power = 1U << 23;   // x^8: one byte
  for (; n != 0; n >>= 1, power = crc32c_multiply(power, power)) {
    if ((n & 1U) != 0) result = crc32c_multiply(power, result);
  }
  return result;
}

/// The CRC of a then b from crc(a), crc(b) and b's length in bytes.
constexpr std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::size_t b_bytes) noexcept {
  return crc32c_multiply(crc32c_shift(b_bytes), crc_a) ^ crc_b;
}

#if defined(KVCACHE_CRC32C_X86)
/// crc32c_portable's result through SSE4.2's crc32 instruction; only where the processor has it.
/// Three lanes run at once: one instruction's latency is three times its throughput.
__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_sse42(std::uint32_t crc, const void* data,
                                                                    std::size_t n) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  const auto word = [](const unsigned char* at) {
    std::uint64_t w;
    std::memcpy(&w, at, 8);
    return w;
  };
#if defined(__x86_64__)
  constexpr std::size_t kLane = 8192;
  constexpr std::uint32_t kOneLane = crc32c_shift(kLane), kTwoLanes = crc32c_shift(2 * kLane);
  for (; n >= 3 * kLane; n -= 3 * kLane, p += 3 * kLane) {
    std::uint64_t a = ~crc, b = 0xFFFFFFFFU, c = 0xFFFFFFFFU;
    for (std::size_t i = 0; i < kLane; i += 8) {
      a = _mm_crc32_u64(a, word(p + i));
      b = _mm_crc32_u64(b, word(p + kLane + i));
      c = _mm_crc32_u64(c, word(p + 2 * kLane + i));
    }
    const auto done = [](std::uint64_t lane) { return ~static_cast<std::uint32_t>(lane); };
    crc = crc32c_multiply(kTwoLanes, done(a)) ^ crc32c_multiply(kOneLane, done(b)) ^ done(c);
  }
  std::uint64_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) c = _mm_crc32_u64(c, word(p));
  auto c32 = static_cast<std::uint32_t>(c);
#else
  std::uint32_t c32 = ~crc;
  for (; n >= 4; n -= 4, p += 4) c32 = _mm_crc32_u32(c32, static_cast<std::uint32_t>(word(p)));
#endif
  for (; n != 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return ~c32;
}

/// Whether this processor has SSE4.2's crc32 instruction: a bit of the processor model the
/// runtime reads once at start-up, so no cache (and no guard a fork could leave held) is needed.
inline bool has_sse42() noexcept { return __builtin_cpu_supports("sse4.2") != 0; }
#endif

#if defined(KVCACHE_CRC32C_ARM)
/// crc32c_portable's result through ARMv8's crc32c instructions.
inline std::uint32_t crc32c_arm(std::uint32_t crc, const void* data, std::size_t n) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);
    c = __crc32cd(c, word);
  }
  for (; n != 0; --n, ++p) c = __crc32cb(c, *p);
  return ~c;
}
#endif

/// CRC-32C of n bytes continuing `crc` (0 to start), by the fastest form this processor has.
inline std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t n) noexcept {
#if defined(KVCACHE_CRC32C_X86)
  if (has_sse42()) return crc32c_sse42(crc, data, n);
#elif defined(KVCACHE_CRC32C_ARM)
  return crc32c_arm(crc, data, n);
#endif
  return crc32c_portable(crc, data, n);
}

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
