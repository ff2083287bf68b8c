// SPDX-License-Identifier: Apache-2.0
#pragma once

// Every cache variant, listed once: the typed suites over variants (protocol, differential, the
// quantized formats' refusals, the reference model's equivalence) take them from here, so a new
// variant joins all of them with one entry.

#include "kvcache/concat_kv_cache.hpp"
#include "kvcache/kv_cache.hpp"
#include "kvcache/ring_kv_cache.hpp"
#include "kvcache/slot_kv_cache.hpp"
#include "pooled_sequence.hpp"
#include "support/format_matrix.hpp"

namespace kvcache::testing {

/// Cache variants, each a template over its storage format.
template <template <class> class... Variants>
struct variant_list {
  /// Each variant over each format of Formats, variant by variant.
  template <class Formats>
  using over = every<Formats, Variants...>;
};

/// The variants, each constructed from a KvCacheConfig (a paged sequence with a pool of its own).
using cache_variants = variant_list<KvCache, ConcatKvCache, RingKvCache, SlotKvCache, PooledSequence>;

}  // namespace kvcache::testing
