// SPDX-License-Identifier: Apache-2.0
#pragma once

// Every cache variant, listed once with its name: the typed suites over variants (protocol,
// differential, the quantized formats' refusals, the reference model's equivalence) and their
// test names take them from here, so a new variant joins all of them with one entry.

#include <algorithm>
#include <cstddef>
#include <string_view>
#include <type_traits>

#include "kvcache/concat_kv_cache.hpp"
#include "kvcache/kv_cache.hpp"
#include "kvcache/ring_kv_cache.hpp"
#include "kvcache/slot_kv_cache.hpp"
#include "pooled_sequence.hpp"
#include "support/format_matrix.hpp"

namespace kvcache::testing {

/// A string literal as a template argument: a variant's name in its entry.
template <std::size_t N>
struct fixed_name {
  // Implicit, so that an entry reads variant<KvCache, "KvCache">.
  constexpr fixed_name(const char (&text)[N]) noexcept { std::copy_n(text, N, chars); }  // NOLINT
  char chars[N];
};

/// One entry of the list: a cache template over its storage format, and the class's name.
template <template <class> class Variant, fixed_name Name>
struct variant {
  template <class T>
  using over = Variant<T>;
  static constexpr std::string_view name{Name.chars};
};

/// Cache variants, each an entry variant<Template, "Name">.
template <class... Entries>
struct variant_list {
  /// Each variant over each format of Formats, variant by variant.
  template <class Formats>
  using over = every<Formats, Entries::template over...>;

  /// Whether Cache is one of the variants over some format.
  template <class Cache>
  static constexpr bool lists = (std::is_same_v<Cache, typename Entries::template over<typename Cache::value_type>> ||
                                 ...);

  /// The name of the variant Cache is, as its entry gives it.
  template <class Cache>
  static constexpr std::string_view name_of() {
    static_assert(lists<Cache>, "name_of<Cache>: Cache is none of the list's variants; add its entry to the list");
    std::string_view name;
    ((std::is_same_v<Cache, typename Entries::template over<typename Cache::value_type>> ? (void)(name = Entries::name)
                                                                                         : (void)0),
     ...);
    return name;
  }
};

/// The variants, each constructed from a KvCacheConfig (a paged sequence with a pool of its own),
/// named as the state files name them.
using cache_variants = variant_list<variant<KvCache, "KvCache">, variant<ConcatKvCache, "ConcatKvCache">,
                                    variant<RingKvCache, "RingKvCache">, variant<SlotKvCache, "SlotKvCache">,
                                    variant<PooledSequence, "PagedKvCache">>;

/// The name of cache type Cache's variant ("RingKvCache" for RingKvCache<float>), for test names.
template <class Cache>
inline constexpr std::string_view variant_name = cache_variants::name_of<Cache>();

}  // namespace kvcache::testing
