// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>

namespace kvcache {

/// How a cache is sized, with designated initializers:
///
///   kvcache::KvCache<float> cache({.layers = 28, .kv_heads = 8, .head_dim = 128, .capacity = 4096});
///   kvcache::RingKvCache<float> ring({.layers = 28, .kv_heads = 8, .head_dim = 128, .window = 4096, .sinks = 4});
///
/// `capacity` is the most tokens a sequence may reach (required for KvCache and ConcatKvCache;
/// for RingKvCache 0 means unbounded). `window`, `sinks` and `slack` are the ring's: it keeps
/// the last `window` positions, the first `sinks` positions forever, and `slack` older
/// positions so that truncate() can roll back that far after the ring has wrapped.
struct KvCacheConfig {
  std::size_t layers = 0;
  std::size_t batch = 1;
  std::size_t kv_heads = 0;
  std::size_t head_dim = 0;
  std::size_t capacity = 0;
  std::size_t window = 0;
  std::size_t sinks = 0;
  std::size_t slack = 0;
};

}  // namespace kvcache
