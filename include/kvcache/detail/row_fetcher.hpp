// SPDX-License-Identifier: Apache-2.0
#pragma once

// Software prefetch for the attention passes that read a tile of K or V rows from memory: how
// far ahead and into which cache to ask, which the two processors measured want differently.

#include <algorithm>
#include <cstddef>

#include "kvcache/detail/attention_math.hpp"  // KVCACHE_ALWAYS_INLINE
#include "kvcache/detail/processor.hpp"

namespace kvcache::detail {

/// How far ahead of the row being read a pass asks for rows, and into which cache.
struct FetchDistance {
  std::size_t ahead_bytes = 8192;
  bool into_l2 = false;  // prefetcht2 (Intel: into L2 only) instead of prefetcht0
};

/// How the passes that read from memory ask for rows ahead.
struct FetchPolicy {
  FetchDistance rows;         // every pass that asks, but the one below
  bool float_values = false;  // ask for float V rows too, not only 16-bit ones
  bool one_row = false;       // ask for 16-bit rows that only one query row reads too
  // (Where plain_one_row_passes, 16-bit rows that one query row reads alone are never asked for.)
  FetchDistance keys_by_groups{};  // the pass over K rows that reads them W / R keys at a time (score_keys)
};

/// The policy for this processor, found once. Default (tuned on an AVX-512 AMD EPYC): 8 KiB
/// ahead into L1 (6-8 KiB did best, 1-2 KiB too little; into L2 or twice as far 0.01-0.09
/// worse), 16-bit V rows only (asking for float V rows lost 5-10%), and only rows that two or
/// more query rows read (see AttentionKernel::run_tile). On an Intel Xeon with
/// AVX-512 (2 vCPUs, about 16 GB/s from memory for one core), prefetcht0 holds one of L1's few
/// fill buffers for the whole trip to memory: 16 KiB ahead into L2, float V rows included (and
/// 16-bit rows that one query row reads, as when it was measured), read
/// 0.04-0.13 closer to the plain read of the same bytes at every H_q, S >= 16,384, one and two
/// cores (float H_q = 32, one core: 0.78-0.81 -> 0.84-0.90); 32 or 64 KiB, or L2 far and L1
/// 2 KiB ahead, no better. There the pass over K rows that reads W / R keys at a time, in turn
/// (keys_by_groups), took longer with them asked for 16 KiB ahead than with none (bf16 at H_q =
/// 32, one core: 27 -> 20 ns a key from memory), though from the L3 asking paid; asked for 1 KiB
/// ahead into L1, the hardware prefetcher brings them from memory and the request only from L2:
/// 0.63-0.89 -> 0.72-0.98 of the plain read at H_q = 16 and 32, S >= 16,384, one and two cores
/// (median +0.09, 29 of 32 cells higher; against 1 KiB, 2 KiB into L2 -0.01, 2 KiB into L1
/// -0.02, 4 KiB into L1 -0.05; none at all as good from memory, but 0.1-0.2 lower at two cores,
/// S = 16,384, 16-bit, where part of the history was in the L3). A pass over K that reads whole
/// rows in order asks as `rows` says, as the V pass does: two query rows (32-byte vectors, see
/// narrow_vectors_pay) and four float rows, S = 16,384 and 32,768, one core 0.83-0.92 ->
/// 0.91-0.95 of the plain read (16-bit at H_q = 16 +0.08 to +0.10), two cores 0.93-1.03 ->
/// 0.96-1.07, against 1 KiB into L1 (one run of bench/ab).
[[nodiscard]] inline const FetchPolicy& fetch_policy() noexcept {
  static const FetchPolicy policy =
      cpu_is_intel() ? FetchPolicy{{16384, true}, true, true, {1024, false}} : FetchPolicy{};
  return policy;
}

/// Asks memory for the row a fixed distance ahead of the one a pass reads, in the same stream,
/// so that requests leave the core while it computes: a loop shaped like a tile's passes
/// (512-byte rows, four multiply-adds per cache line) read at 0.65 of the plain read's rate on
/// its own, 0.85 asking 8 KiB ahead (AMD EPYC). A default one asks for nothing: the passes that
/// read a tile again from cache.
class RowFetcher {
 public:
  RowFetcher() noexcept = default;
  /// Rows of `row_bytes` from `rows`, `stride` bytes apart, of which the first `end` exist.
  /// Asks `distance` ahead.
  RowFetcher(const void* rows, std::size_t stride, std::size_t row_bytes, std::size_t end,
             const FetchDistance& distance = fetch_policy().rows) noexcept
      : rows_(static_cast<const char*>(rows)),
        stride_(stride),
        row_bytes_(row_bytes),
        ahead_(std::max<std::size_t>(distance.ahead_bytes / std::max<std::size_t>(row_bytes, 1), 1)),
        end_(end),
        into_l2_(distance.into_l2) {}

  /// Row j is being read.
  KVCACHE_ALWAYS_INLINE void operator()(std::size_t j) const noexcept {
    if (j + ahead_ >= end_) return;
    const char* row = rows_ + (j + ahead_) * stride_;
    if (into_l2_) {
      prefetch<1>(row, row_bytes_);
    } else {
      prefetch<3>(row, row_bytes_);
    }
  }

  /// operator() for rows of Bytes bytes known at compile time: the lines asked for one by one,
  /// without a loop's bookkeeping.
  template <std::size_t Bytes>
  KVCACHE_ALWAYS_INLINE void row(std::size_t j) const noexcept {
    if (j + ahead_ >= end_) return;
    const char* row = rows_ + (j + ahead_) * stride_;
    if (into_l2_) {
      prefetch_lines<1, Bytes>(row);
    } else {
      prefetch_lines<3, Bytes>(row);
    }
  }

  /// Row j's 64-byte line at byte `offset` is being read: asks for the same line of the row
  /// ahead, for passes that ask a line at a time.
  KVCACHE_ALWAYS_INLINE void line(std::size_t j, std::size_t offset) const noexcept {
    if (j + ahead_ >= end_) return;
    const char* line = rows_ + (j + ahead_) * stride_ + offset;
    if (into_l2_) {
      prefetch<1>(line, 1);
    } else {
      prefetch<3>(line, 1);
    }
  }

 private:
  /// Hints that `bytes` from `p` will be read soon; Locality as __builtin_prefetch's.
  template <int Locality>
  KVCACHE_ALWAYS_INLINE static void prefetch(const char* p, std::size_t bytes) noexcept {
#if defined(__GNUC__) || defined(__clang__)
    for (std::size_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, Locality);
#else
    (void)p;
    (void)bytes;
#endif
  }

  template <int Locality, std::size_t Bytes>
  KVCACHE_ALWAYS_INLINE static void prefetch_lines(const char* p) noexcept {
#if defined(__GNUC__) || defined(__clang__)
    unroll<(Bytes + 63) / 64>([&](auto line) KVCACHE_ALWAYS_INLINE { __builtin_prefetch(p + line * 64, 0, Locality); });
#else
    (void)p;
#endif
  }

  const char* rows_ = nullptr;
  std::size_t stride_ = 0;
  std::size_t row_bytes_ = 0;
  std::size_t ahead_ = 1;
  std::size_t end_ = 0;
  bool into_l2_ = false;
};

}  // namespace kvcache::detail
