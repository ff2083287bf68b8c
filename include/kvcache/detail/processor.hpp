// SPDX-License-Identifier: Apache-2.0
#pragma once

// What the attention kernel asks of the processor it runs on, found once a process: the
// instruction set is the compiler's (-m flags); which of its paths are faster is not.

#include <cstddef>

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

/// Whether the passes that read 16-bit K or V rows from memory for one query row alone (one
/// query head per kv head, at decode) are kept plain streams: no row asked for ahead, the weights
/// made before the pass over V rather than in it, and each 64-byte line of bfloat16 loaded by
/// both operations that split it (RowReader::load_per_use) rather than once. On the Intel Xeon
/// of pair_products_pay, one core's read rate depends on the form of the loads as much as on the
/// bytes (bench/read_forms_bench: 0.81-0.84 of the plain read with 64-byte loads, or with the
/// address moved in a base register; 1.00 with 32-byte loads off an index register). A one-row
/// bf16 K pass, isolated over 64 MiB, read 0.90 of the fast read so, 0.77-0.85 as before. In the
/// kernel, all three together, one core, S = 32,768 (bench/ab, the history read from memory):
/// bf16 0.75 -> 0.82 of the plain read, half 0.72 -> 0.82; two cores 0.90-0.93 -> 0.95-1.00;
/// each alone moved it no more than 0.02, or lost. Float rows keep their passes: without their
/// V rows asked for, two cores went 0.90 -> 0.88. Where part of a history was still in the L3,
/// asking ahead paid (64 MiB of 16-bit history, two cores: 1.13-1.16 asking, 0.78-0.80 plain).
/// On the AMD EPYC the kernel was tuned on, one load a line read 5-10% faster, and weights made
/// in the pass 0.02-0.04 closer to the plain read.
[[nodiscard]] inline bool plain_one_row_passes() noexcept {
  static const bool plain = cpu_is_intel();
  return plain;
}

/// Whether four query rows over 16-bit K rows, at 64-byte vectors, score the K rows they read from
/// memory in order, one whole row after another (score_in_order, their queries read from L1 where
/// the registers do not hold them all), rather than kVector / 4 keys at a time (score_keys). On the
/// Intel Xeon of pair_products_pay, over 128 MiB of bf16 K rows, one core (two runs of
/// bench/read_forms_bench): 0.63-0.64 of the plain read four keys at a time, 0.81-0.82 in order,
/// 0.84-0.88 in order with the rows asked for as the V pass asks (FetchPolicy::rows, a line at a
/// time; the V pass itself read 1.02). In the kernel, bf16 and half at H_q = 32 (decode, four query
/// rows per kv head), S = 16,384 and 32,768: one core 0.75-0.77 -> 0.85-0.89 of the plain read, two
/// cores 0.82-0.86 -> 0.93-1.00; S = 512 and 4,096, one core 0.70-0.74 -> 0.75-0.87 (bench/ab, one
/// run each). With the tile in cache they took 2-6% longer a key, so only decode takes them (see
/// four_rows_in_order_). On the AVX-512 AMD EPYC the kernel was tuned on, four rows in order ran
/// slower (score_fixed).
[[nodiscard]] inline bool four_rows_in_order_pay() noexcept {
  static const bool pay = cpu_is_intel();
  return pay;
}

/// Whether a tile of keys is longer than usual (AttentionKernel::kTileBytes) for a block of up to
/// four query rows that one pass over K and one over V serve whole, so that no row is read again
/// from cache: four times for one query row, twice for two to four (AttentionKernel::tile_keys).
/// The passes then switch between the K and the V stream less often. On the Intel Xeon of
/// pair_products_pay, one core switching between plain reads of K and V read 0.94-0.95 of the plain
/// read in 512 KiB runs, 0.97-0.99 in 1 MiB and 1.00-1.01 in 2 MiB (bench/read_forms_bench, two
/// runs). In the kernel, S = 16,384 and 32,768 (bench/ab, one run): 16-bit rows, one query row per
/// kv head, one core 0.82-0.84 of the plain read, 0.85-0.87 at twice the length, 0.87-0.89 at four
/// times; two query rows 0.92-0.93 -> 0.95-0.97 at twice (four times no better); four 0.84-0.87 ->
/// 0.85-0.88 at twice, 0.82-0.83 at four times; float two and four rows +0.00 to +0.03 at twice,
/// one row level. So one row four times, two to four rows twice: against the usual length, 16-bit
/// one row per kv head, one core 0.82-0.84 -> 0.87-0.90, two cores 0.90-0.95 -> 0.95-1.01; every
/// cell at S = 16,384 and 32,768 within 0.01 or closer to the plain read (a second run). The
/// AVX-512 AMD EPYC keeps the usual length: there four query rows gained nothing from 1 MiB tiles
/// and lost from longer ones (kTileBytes).
[[nodiscard]] inline bool long_tiles_pay() noexcept {
  static const bool pay = cpu_is_intel();
  return pay;
}

/// Whether a kernel built for AVX-512 reads its K and V rows from memory faster in 32-byte vectors
/// (all 32 registers of them) than in 64-byte ones, for blocks of `rows` query rows a kv head
/// over `sixteen_bit` or float rows. On the Intel Xeon of pair_products_pay, one core, S = 16,384
/// and 32,768 (bench/ab, the two widths timed in turn): two query rows a kv head, every type,
/// 0.71-0.81 -> 0.84-0.90 of the plain read, two cores 0.85-0.91 -> 0.97-1.02; float at one and
/// four rows 0.75-0.79 -> 0.79-0.90; but 16-bit rows at four rows 0.74-0.82 -> 0.69-0.74, and at
/// one row (plain_one_row_passes) within 0.03. One core there reads faster with 32-byte loads
/// than with 64-byte ones (bench/read_forms_bench). The AVX-512 AMD EPYC keeps 64 bytes.
[[nodiscard]] inline bool narrow_vectors_pay(std::size_t rows, bool sixteen_bit) noexcept {
  static const bool intel = cpu_is_intel();
  return intel && (sixteen_bit ? rows == 2 : rows <= 4);
}

/// K and V bytes a call reads per thread it runs on when its thread count is automatic: waking a
/// kept thread (WorkerPool) and waiting for it costs about what one core takes to read this
/// much. Decoding layer after layer from memory (bench/threads_bench), two threads took, against
/// one: on a 2-vCPU AMD EPYC (seven runs) 1.09-1.54 times as long at 0.5 MiB per call, 0.96-1.24
/// at 1 MiB, 0.79-1.11 at 2 MiB (five runs under 0.91), 0.60-0.95 at 4 MiB and 0.43-0.82 at 8-32
/// MiB (threads started for each call had cost a few MiB: 2.1-3.0 times as long at 0.5-1 MiB);
/// on the Intel Xeon above (six runs) 1.09-1.21 at 0.5 MiB and 0.55-0.94 at 1 MiB. So two
/// threads from 2 MiB on the EPYC (a thread per MiB) and from 1 MiB on Intel, where the automatic
/// count then ran at 0.99-1.04 of the faster of one and two threads at 0.5 and 1 MiB (three runs).
[[nodiscard]] inline std::size_t bytes_per_thread() noexcept {
  static const std::size_t bytes = cpu_is_intel() ? std::size_t{1} << 19 : std::size_t{1} << 20;
  return bytes;
}

/// The forms of the attention kernel that a processor chooses between at run time, each measured
/// above: AttentionKernel runs this processor's unless given others (the tests run every form on
/// any processor).
struct AttentionForms {
  bool pair_products = false;       // pair_products_pay
  bool plain_one_row = false;       // plain_one_row_passes
  bool four_rows_in_order = false;  // four_rows_in_order_pay
  bool long_tiles = false;          // long_tiles_pay

  /// The forms this processor reads fastest with.
  [[nodiscard]] static AttentionForms of_this_processor() noexcept {
    return {pair_products_pay(), plain_one_row_passes(), four_rows_in_order_pay(), long_tiles_pay()};
  }
};

}  // namespace kvcache::detail
