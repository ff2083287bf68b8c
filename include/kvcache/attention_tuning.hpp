// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>

#include "kvcache/version.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// What causal_attention leaves to the machine, with defaults that suit the processors it was
/// measured on (docs/attention.md says how). Results never depend on these; only speed does.
///
///   kvcache::causal_attention(q, positions, history, out, {.tuning = {.tile_bytes = 256 << 10}});
struct AttentionTuning {
  /// Stored K bytes a tile holds: its K and V stay in L2 for the passes that read them again.
  std::size_t tile_bytes = std::size_t{512} << 10;
  /// How far ahead (in bytes of K or V rows) the passes that read a tile from memory ask for
  /// rows; 0 leaves it to the hardware prefetcher.
  std::size_t prefetch_bytes = 0;
  /// K and V bytes a call reads per thread when the thread count is automatic.
  std::size_t bytes_per_thread = std::size_t{1} << 20;
};

}  // namespace KVCACHE_ABI
}  // namespace kvcache
