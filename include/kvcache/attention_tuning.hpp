// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>

#include "kvcache/version.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// What causal_attention leaves to the machine, with defaults that suit the processors it was
/// measured on (docs/attention.md says how). Results depend on these only by rounding (run_keys
/// sets where the online softmax folds); speed depends on them.
///
///   kvcache::causal_attention(q, positions, history, out, {.tuning = {.prefetch_bytes = 0}});
struct AttentionTuning {
  /// Keys a run takes (at most 256) when the call reads from memory: each run is scored and
  /// summed before the next, so K and V are read as two streams that advance together. Formats
  /// under 16 bits a value, which arithmetic rather than the read limits, take 2 to 8 times as
  /// many as their items have query rows.
  std::size_t run_keys = 16;
  /// How far ahead (in bytes of K or V rows) the rows after a run's are asked for while it is
  /// scored, when the call reads from memory; 0 leaves it to the hardware prefetcher.
  std::size_t prefetch_bytes = 1024;
  /// A batch row whose stored K and V (every kv head) are fewer bytes than this is taken to be
  /// read from cache: cached_run_keys at a time (a run's fixed costs spread wider), nothing
  /// asked for ahead. Blocks of several queries (prefill) always read so.
  std::size_t in_cache_bytes = std::size_t{8} << 20;
  /// Keys a run takes (at most 256) when the call reads from cache.
  std::size_t cached_run_keys = 256;
  /// K and V bytes a call reads per thread when the thread count is automatic.
  std::size_t bytes_per_thread = std::size_t{1} << 20;
};

}  // namespace KVCACHE_ABI
}  // namespace kvcache
