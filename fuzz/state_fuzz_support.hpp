// SPDX-License-Identifier: Apache-2.0
#pragma once

// What state_fuzz and the seed writer (fuzz/make_seeds.cpp) share: the small caches every
// variant x format is built as, how they are filled, and a comparable picture of what a cache
// shows (its histories by position, lengths and totals).

#include <Eigen/Core>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/formats.hpp"

namespace state_fuzz {

using namespace kvcache;

/// Stops the run: libFuzzer keeps the input that got here.
[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "state_fuzz: %s\n", what.c_str());
  std::abort();
}
inline void require(bool ok, const std::string& what) {
  if (!ok) fail(what);
}

// The shape every seed is saved from and every fixed target has: a few KB a file, a ring that
// wraps and stages, int4 rows shorter than a group.
inline constexpr std::size_t kLayers = 2, kBatch = 2, kSlots = 3, kHeads = 2, kDim = 8, kCapacity = 16;
inline constexpr std::size_t kWindow = 4, kSinks = 1, kSlack = 1, kBlockTokens = 4, kBlocks = 8;

enum class Variant { dense, concat, ring, slot, paged };
inline constexpr std::size_t kVariants = 5, kFormats = kvcache::testing::formats::size;
inline constexpr const char* kVariantNames[kVariants] = {"KvCache", "ConcatKvCache", "RingKvCache", "SlotKvCache",
                                                         "PagedKvCache"};

/// Calls f.template operator()<T>() for the storage format with this index (mod kFormats): the
/// index a corpus file's target byte holds, in the order of storage_formats.
template <class F>
decltype(auto) with_format_at(std::size_t index, F&& f) {
  return kvcache::testing::formats::visit(index % kFormats, std::forward<F>(f));
}

/// The index of the format named `name` (format_name<T>()), or kFormats.
inline std::size_t format_index(const std::string& name) {
  for (std::size_t i = 0; i < kFormats; ++i) {
    if (with_format_at(i, []<class T>() { return std::string(format_name<T>()); }) == name) return i;
  }
  return kFormats;
}

/// What a cache storing T is fed: T itself where it is a compute type, else float (or double).
template <class T>
using input_t = std::conditional_t<compute_type<T>, T, default_input<T>>;

/// [batch, kv_heads, tokens, head_dim] values from `seed`, in [-gain, gain].
template <class In>
struct Block {
  Shape shape;
  std::vector<In> data;
  Block(const Shape& s, std::uint64_t seed, float gain = 1.0F) : shape(s), data(s.size()) {
    std::uint64_t x = seed * 0x9E3779B97F4A7C15ULL + 1;
    for (In& v : data) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      const float unit = static_cast<float>(x >> 40) / static_cast<float>(1ULL << 24);  // [0, 1)
      v = static_cast<In>((2.0F * unit - 1.0F) * gain);
    }
  }
  [[nodiscard]] TensorView<const In> view() const { return {data.data(), shape}; }
};

inline std::vector<std::int64_t> arange(std::size_t first, std::size_t count) {
  std::vector<std::int64_t> p(count);
  std::iota(p.begin(), p.end(), static_cast<std::int64_t>(first));
  return p;
}

/// A cache of one variant and format with what it needs besides itself: a paged sequence's
/// pool, a sequence holding blocks of it, and a released prompt whose blocks stay keyed.
template <Variant V, class T>
struct Target;

/// `c` with the head scales a format that keeps them requires, where it gives none: every value
/// of the seeds lies within them but the later, larger ones, which saturate.
template <class T, class Config>
Config with_scales(Config c) {
  static const std::vector<float> scales(256, 1.0F / 448.0F);
  const std::size_t n = c.layers * c.kv_heads;
  if (detail::has_head_scales<T> && c.key_scales.empty() && n <= scales.size()) {
    c.key_scales = c.value_scales = std::span<const float>(scales).first(n);
  }
  return c;
}

template <class Cache>
struct Plain {
  explicit Plain(const KvCacheConfig& config) : cache(with_scales<typename Cache::value_type>(config)) {}
  Cache cache;
};
template <class T>
struct Target<Variant::dense, T> : Plain<KvCache<T>> {
  using Plain<KvCache<T>>::Plain;
};
template <class T>
struct Target<Variant::concat, T> : Plain<ConcatKvCache<T>> {
  using Plain<ConcatKvCache<T>>::Plain;
};
template <class T>
struct Target<Variant::ring, T> : Plain<RingKvCache<T>> {
  using Plain<RingKvCache<T>>::Plain;
};
template <class T>
struct Target<Variant::slot, T> : Plain<SlotKvCache<T>> {
  using Plain<SlotKvCache<T>>::Plain;
};
template <class T>
struct Target<Variant::paged, T> {
  explicit Target(const BlockPoolConfig& config)
      : pool(std::make_unique<BlockPool<T>>(with_scales<T>(config))),
        holder(std::make_unique<PagedKvCache<T>>(*pool)),
        cache(*pool) {}
  std::unique_ptr<BlockPool<T>> pool;
  std::unique_ptr<PagedKvCache<T>> holder;
  PagedKvCache<T> cache;
};

/// The fixed config of a variant: the seeds' shape.
inline KvCacheConfig fixed_config(Variant v) {
  KvCacheConfig c{.layers = kLayers, .batch = kBatch, .kv_heads = kHeads, .head_dim = kDim, .capacity = kCapacity};
  if (v == Variant::ring) {
    c.window = kWindow;
    c.sinks = kSinks;
    c.slack = kSlack;
  }
  if (v == Variant::slot) c.batch = kSlots;
  if (v == Variant::paged) c.batch = 1;
  return c;
}
inline BlockPoolConfig pool_config(const KvCacheConfig& c, std::size_t blocks = kBlocks) {
  return {.layers = c.layers,
          .kv_heads = c.kv_heads,
          .head_dim = c.head_dim,
          .block_tokens = kBlockTokens,
          .blocks = blocks,
          .capacity = c.capacity,
          .key_scales = c.key_scales,
          .value_scales = c.value_scales};
}

/// Feeds `tokens` tokens to layers [0, until) of every row (a slot cache: of `row`), each layer
/// continuing its own length.
template <class Cache>
void feed(Cache& cache, std::size_t tokens, std::uint64_t seed, float gain = 1.0F, std::size_t until = SIZE_MAX,
          std::size_t row = 0) {
  using In = input_t<typename Cache::value_type>;
  constexpr bool slot = requires { cache.acquire(); };
  const std::size_t rows = slot ? 1 : cache.batch();
  for (std::size_t l = 0; l < std::min(until, cache.layers()); ++l) {
    Block<In> k({rows, cache.kv_heads(), tokens, cache.head_dim()}, seed + 2 * l, gain);
    Block<In> v({rows, cache.kv_heads(), tokens, cache.head_dim()}, seed + 2 * l + 1, gain);
    if constexpr (slot) {
      cache.update(l, k.view(), v.view(), arange(cache.row_length(row, l), tokens), Rows(row));
    } else {
      cache.update(l, k.view(), v.view(), arange(cache.length(l), tokens));
    }
  }
}

/// The state a seed is saved from: a prompt, decoded tokens, a chunk a ring stages, a pass
/// stopped part-way; a slot released; fp8_e4m3_heads' later, larger values clipped; a paged
/// prompt's ids.
template <Variant V, class T>
void fill(Target<V, T>& t) {
  auto& cache = t.cache;
  if constexpr (V == Variant::slot) {
    for (std::size_t row = 0; row < kSlots; ++row) (void)cache.acquire();
    feed(cache, 5, 1, 1.0F, SIZE_MAX, 0);
    feed(cache, 2, 20, 1.0F, SIZE_MAX, 1);
    feed(cache, 3, 40, 1.0F, SIZE_MAX, 2);
    cache.release(1);
    feed(cache, 1, 60, 2.0F, SIZE_MAX, 0);
    feed(cache, 1, 80, 1.5F, 1, 2);
  } else {
    if constexpr (V == Variant::paged) {
      const std::vector<TokenId> ids = {101, 102, 103, 104, 105, 106};
      (void)cache.reuse_prefix(ids);
    }
    feed(cache, 3, 1);
    feed(cache, 1, 10, 2.0F);
    feed(cache, 1, 20);
    feed(cache, 4, 30, 1.5F);  // more than a ring's slack + 1: staged
    feed(cache, 1, 40, 1.0F, 1);
  }
}

/// The file a seed holds: the fixed target of variant V filled as above, saved.
template <Variant V, class T>
std::string saved_state() {
  const KvCacheConfig config = fixed_config(V);
  std::ostringstream out;
  if constexpr (V == Variant::paged) {
    Target<V, T> t(pool_config(config));
    fill(t);
    save_state(t.cache, out, "paged seed");
  } else {
    Target<V, T> t(config);
    fill(t);
    save_state(t.cache, out, "seed");
  }
  return std::move(out).str();
}

template <class T>
std::string saved_state(Variant v) {
  switch (v) {
    case Variant::dense:
      return saved_state<Variant::dense, T>();
    case Variant::concat:
      return saved_state<Variant::concat, T>();
    case Variant::ring:
      return saved_state<Variant::ring, T>();
    case Variant::slot:
      return saved_state<Variant::slot, T>();
    default:
      return saved_state<Variant::paged, T>();
  }
}

/// Other tokens in a target before a load: the load must verify before it overwrites them. A
/// paged sequence loads into an empty sequence only: its pool's other blocks hold them.
template <Variant V, class T>
void hold_others(Target<V, T>& t) {
  if constexpr (V == Variant::slot) {
    (void)t.cache.acquire();
    (void)t.cache.acquire();
    feed(t.cache, 4, 1000, 1.0F, SIZE_MAX, 1);
  } else if constexpr (V == Variant::paged) {
    feed(*t.holder, 5, 1000);
    PagedKvCache<T> keeper(*t.pool);  // a prompt released whose blocks stay keyed
    const std::vector<TokenId> ids = {7, 8, 9, 10};
    (void)keeper.reuse_prefix(ids);
    feed(keeper, 4, 2000);
  } else {
    feed(t.cache, 3, 1000);
    feed(t.cache, 1, 1100);
  }
}

/// The stored bytes of every position a history holds: keys then values, every row and head,
/// with their row scales. Fails on a position returned twice.
using Row = std::vector<unsigned char>;
template <class T>
std::map<std::int64_t, Row> flatten(const History<T>& history) {
  using Unit = typename storage_codec<T>::unit;
  std::map<std::int64_t, Row> rows;
  const auto append = [](Row& row, const void* p, std::size_t n) {
    const auto* bytes = static_cast<const unsigned char*>(p);
    row.insert(row.end(), bytes, bytes + n);
  };
  std::set<std::pair<std::size_t, std::int64_t>> seen;  // (batch row, position)
  for (const Segment<T>& s : history.segments) {
    require(s.keys.shape() == s.values.shape() && s.keys.tokens() == s.positions.tokens(), "a segment's shapes");
    for (std::size_t b = 0; b < s.batch(); ++b) {
      const std::size_t stored = s.stored_row(b);
      const std::span<const std::int64_t> positions = s.positions.row(stored);  // a slot's own, with a window
      for (std::size_t j = 0; j < s.tokens(b); ++j) {
        if (positions[j] == -1) continue;  // a windowed slot's row that holds no position
        require(seen.emplace(b, positions[j]).second, "a history returns a position twice");
        Row& row = rows[positions[j]];
        for (const auto& [view, scales] : {std::pair{&s.keys, &s.key_scales}, std::pair{&s.values, &s.value_scales}}) {
          for (std::size_t h = 0; h < view->heads(); ++h) {
            append(row, view->row(stored, h, j), view->head_dim() * sizeof(Unit));
            if constexpr (detail::reads_scales<storage_codec<T>>) append(row, scales->at(stored, h, j), sizeof(float));
          }
        }
      }
    }
  }
  return rows;
}

/// Everything a cache shows: per layer (a slot cache: per layer and slot) its history by
/// position and its tokens; which slots are acquired, the block table's size; its totals.
struct Snapshot {
  std::vector<std::map<std::int64_t, Row>> histories;
  std::vector<std::size_t> lengths;
  std::vector<bool> acquired;
  std::size_t blocks = 0;
  std::size_t bytes = 0, clipped = 0;
  std::vector<float> key_scales, value_scales;
  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};

template <class Cache>
Snapshot snapshot(Cache& cache) {
  Snapshot s;
  if constexpr (requires { cache.acquire(); }) {
    for (std::size_t row = 0; row < cache.slots(); ++row) s.acquired.push_back(cache.acquired(row));
    for (std::size_t l = 0; l < cache.layers(); ++l) {
      for (std::size_t row = 0; row < cache.slots(); ++row) {
        s.lengths.push_back(cache.row_length(row, l));
        s.histories.push_back(flatten(cache.history(l, Rows(row))));
      }
    }
  } else {
    for (std::size_t l = 0; l < cache.layers(); ++l) {
      s.lengths.push_back(cache.length(l));
      s.histories.push_back(flatten(cache.history(l)));
    }
  }
  if constexpr (requires { cache.block_table(); }) s.blocks = cache.block_table().size();
  s.bytes = cache.bytes();
  s.clipped = cache.clipped();
  s.key_scales = cache.key_head_scales();
  s.value_scales = cache.value_head_scales();
  return s;
}

}  // namespace state_fuzz
