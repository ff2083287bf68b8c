// SPDX-License-Identifier: Apache-2.0
#pragma once

// What the attention kernel asks of the processor it runs on, found once a process: the
// instruction set is the compiler's (-m flags); which of its paths are faster is not.

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#endif

namespace kvcache::detail {

/// Whether CPUID names the vendor GenuineIntel (false off x86 or without GCC/Clang).
[[nodiscard]] inline bool cpu_is_intel() noexcept {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  unsigned eax = 0;
  unsigned ebx = 0;
  unsigned ecx = 0;
  unsigned edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return false;
  return ebx == 0x756e6547 && edx == 0x49656e69 && ecx == 0x6c65746e;  // "GenuineIntel"
#else
  return false;
#endif
}

/// Whether four bfloat16 query rows over bfloat16 keys are better scored and weighed by bfloat16
/// pair products (vdpbf16ps, where the build has AVX-512 BF16) than by widening the keys to
/// float. On an AVX-512 AMD EPYC they were (see AttentionKernel::kScoresPairs). On an Intel Xeon
/// with AVX-512 BF16 (2 vCPUs, family 6 model 167 under KVM) they were not. Without them there,
/// four rows in cache took 21.7 ns a key instead of 29.7 and 8 kv heads of 512 keys 95 us a call
/// instead of 124; from memory at H_q = 32, S >= 16,384, one and two cores, 0.71-0.85 -> 0.74-0.90
/// of the plain read (bench/ab); causal prefill with 16 query heads 0.33-0.38 -> 0.47-0.57 of
/// the multiply-add peak, and 0.28 -> 0.37 under a window of 128 (two interleaved runs).
[[nodiscard]] inline bool pair_products_pay() noexcept {
  static const bool pay = !cpu_is_intel();
  return pay;
}

}  // namespace kvcache::detail
