// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <list>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvcache/block_store.hpp"
#include "kvcache/codec.hpp"
#include "kvcache/concepts.hpp"
#include "kvcache/config.hpp"
#include "kvcache/detail/block_record.hpp"
#include "kvcache/detail/cache_base.hpp"
#include "kvcache/detail/checks.hpp"
#include "kvcache/detail/row_store.hpp"
#include "kvcache/version.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// How a BlockPool is sized, with designated initializers:
///
///   kvcache::BlockPool<kvcache::bfloat16> pool({.layers = 28, .kv_heads = 8, .head_dim = 128, .blocks = 4096});
///
/// `blocks` blocks of `block_tokens` tokens each, in every layer. `capacity` is the most tokens
/// one sequence may reach (0: every block's worth; without a bound for a pool with a window).
/// `window`, `sinks` and `slack` are RingKvCache's, for every sequence of the pool: attention
/// reads the last `window` positions and the first `sinks`, and a sequence gives back the blocks
/// wholly before its window (keeping `slack` positions more, so that truncate() can roll back
/// that far). Scales as KvCacheConfig's, shared by every sequence of the pool.
struct BlockPoolConfig {
  Count<"BlockPoolConfig.layers"> layers = 0;
  Count<"BlockPoolConfig.kv_heads"> kv_heads = 0;
  Count<"BlockPoolConfig.head_dim"> head_dim = 0;
  Count<"BlockPoolConfig.block_tokens"> block_tokens = 16;
  Count<"BlockPoolConfig.blocks"> blocks = 0;
  Count<"BlockPoolConfig.capacity"> capacity = 0;
  Count<"BlockPoolConfig.window"> window = 0;
  Count<"BlockPoolConfig.sinks"> sinks = 0;
  Count<"BlockPoolConfig.slack"> slack = 0;
  std::span<const float> key_scales{};
  std::span<const float> value_scales{};
};

/// A token id, for prefix reuse.
using TokenId = std::int32_t;

template <class T>
class PagedKvCache;
template <class T>
class PagedBatch;

/// A fixed pool of blocks of K and V shared by PagedKvCache sequences: a block holds
/// `block_tokens` consecutive tokens of one sequence in every layer, stored in format T.
/// Sequences take blocks as they grow and give them back when truncated, reset or destroyed;
/// `fork` shares them (reference counts) and copies a shared partial block before writing it.
/// Each block records the ids of the tokens whose rows it holds, as they were written; a full
/// block with all its ids is keyed by a hash chain of them, so a new sequence with the same
/// prompt prefix takes it instead of recomputing (`reuse_prefix`). Freed blocks keep their keys
/// and are reused in least-recently-freed order when the pool needs room (blocks never keyed
/// first); a sequence gives its blocks back last first, so a prefix loses its tail before its root.
///
/// A pool and its sequences are driven from one thread at a time (distinct layers of one
/// sequence may be updated concurrently only while no other sequence of the pool is written).
/// The pool must outlive its sequences.
template <class T>
class BlockPool : private detail::CacheGeometry, private detail::HeadScales {
  static_assert(detail::check_codec<T>(), "BlockPool<T>: T must be a storage format (a type with a storage_codec).");

 public:
  using value_type = T;

  /// Allocates every block; std::invalid_argument for a zero size, std::length_error for a size
  /// whose bytes overflow std::size_t.
  explicit BlockPool(const BlockPoolConfig& config)
      : CacheGeometry("BlockPool", geometry_of(config)),
        HeadScales(layers()),
        block_tokens_(config.block_tokens),
        blocks_(config.blocks),
        capacity_(config.capacity),
        window_(config.window),
        sinks_(config.sinks),
        slack_(config.slack),
        meta_(blocks_) {
    if (config.block_tokens > std::numeric_limits<std::size_t>::max() / blocks_) {
      throw std::length_error("BlockPool: config.blocks x block_tokens: expected to fit in std::size_t, given " +
                              std::to_string(blocks_) + " x " + std::to_string(block_tokens_));
    }
    (void)detail::check_footprint("BlockPool", geometry(), blocks_ * block_tokens_,
                                  sizeof(typename storage_codec<T>::unit));
    KvCacheConfig scales{.layers = config.layers, .kv_heads = config.kv_heads, .head_dim = config.head_dim};
    scales.key_scales = config.key_scales;
    scales.value_scales = config.value_scales;
    init_scales<T>(name(), geometry(), scales);
    if (capacity_ == 0) capacity_ = window_ != 0 ? std::numeric_limits<std::size_t>::max() : blocks_ * block_tokens_;
    positions_.resize(blocks_ * block_tokens_);
    rows_.reserve(layers());
    for (std::size_t l = 0; l < layers(); ++l) rows_.emplace_back(1, kv_heads(), head_dim(), blocks_ * block_tokens_);
    for (std::size_t b = 0; b < blocks_; ++b) {
      meta_[b].ids.reserve(block_tokens_);  // recording ids never allocates, so never throws mid-update
      meta_[b].free_at = free_.insert(free_.end(), b);
    }
  }
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  using CacheGeometry::head_dim;
  using CacheGeometry::kv_heads;
  using CacheGeometry::layers;
  using HeadScales::clipped;
  using HeadScales::key_head_scales;
  using HeadScales::value_head_scales;

  [[nodiscard]] std::size_t block_tokens() const noexcept { return block_tokens_; }
  [[nodiscard]] std::size_t blocks() const noexcept { return blocks_; }
  /// Blocks no sequence holds (some may still be keyed for reuse).
  [[nodiscard]] std::size_t free_blocks() const noexcept { return free_.size(); }
  /// Blocks keyed by their token ids, held or free.
  [[nodiscard]] std::size_t keyed_blocks() const noexcept { return keyed_.size(); }
  /// The most tokens one sequence may reach.
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  /// The window every sequence attends (0: none), the positions it keeps visible through it, and
  /// the positions older than it a sequence keeps for truncate().
  [[nodiscard]] std::size_t window() const noexcept { return window_; }
  [[nodiscard]] std::size_t sinks() const noexcept { return sinks_; }
  [[nodiscard]] std::size_t slack() const noexcept { return slack_; }
  /// Bytes of every block's K and V (and scales).
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t total = scale_bytes();
    for (const auto& r : rows_) total += r.bytes();
    return total;
  }
  /// Bytes of one block in every layer.
  [[nodiscard]] std::size_t block_bytes() const noexcept {
    return blocks_ == 0 ? 0 : (bytes() - scale_bytes()) / blocks_;
  }

  /// Gives the memory of the free blocks that hold no reusable prefix (never keyed, or rewritten)
  /// back to the system (whole pages; Linux): what finished sequences held stops being resident
  /// until a sequence takes those blocks again. Keyed free blocks keep their rows for
  /// reuse_prefix; addresses and bytes() stay the same.
  void shrink_to_fit() noexcept {
    const auto unkeyed_free = [&](std::size_t b) { return meta_[b].count == 0 && !meta_[b].keyed; };
    for (std::size_t first = 0; first < blocks_;) {  // runs of consecutive blocks, whose pages join
      if (!unkeyed_free(first)) {
        ++first;
        continue;
      }
      std::size_t end = first + 1;
      while (end < blocks_ && unkeyed_free(end)) ++end;
      for (auto& r : rows_) r.release(first * block_tokens_, (end - first) * block_tokens_);
      first = end;
    }
  }

  /// Checks the pool's bookkeeping against its sequences' block tables; std::logic_error
  /// naming the first inconsistency: free + held = total; each block's count equals the tables
  /// that hold it; no block twice in the free list, none there held; every key maps to a block
  /// keyed by it, full, whose ids hash to it from its parent's key; every sequence's known ids
  /// are the ids its blocks recorded for the rows it holds, and its chain keys are theirs.
  void check_invariants() const {
    const auto fail = [](const std::string& what) { throw std::logic_error("BlockPool::check_invariants: " + what); };
    std::vector<std::size_t> held(blocks_, 0);
    for (const PagedKvCache<T>* s : sequences_) {
      for (const std::size_t b : s->table_) {
        if (b == PagedKvCache<T>::kReleased) continue;
        if (b >= blocks_) fail("a table holds block " + std::to_string(b) + " of " + std::to_string(blocks_));
        ++held[b];
      }
      s->check_ids(fail);
    }
    std::vector<char> listed(blocks_, 0);
    for (const std::size_t b : free_) {
      if (listed[b] != 0) fail("block " + std::to_string(b) + " is twice in the free list");
      listed[b] = 1;
    }
    std::size_t used = 0;
    for (std::size_t b = 0; b < blocks_; ++b) {
      const Meta& m = meta_[b];
      if (m.count != held[b]) {
        fail("block " + std::to_string(b) + " counts " + std::to_string(m.count) + " holders, tables hold it " +
             std::to_string(held[b]) + " times");
      }
      if ((m.count == 0) != (listed[b] != 0)) {
        fail("block " + std::to_string(b) + " with " + std::to_string(m.count) + " holders is " +
             (listed[b] != 0 ? "" : "not ") + "in the free list");
      }
      if (m.count != 0) ++used;
      if (m.ids.size() > block_tokens_) fail("block " + std::to_string(b) + " records more ids than it has rows");
      if (m.keyed) {
        const auto it = keyed_.find(m.key);
        if (it == keyed_.end() || it->second != b)
          fail("block " + std::to_string(b) + " is keyed but not found by its key");
        if (m.ids.size() != block_tokens_)
          fail("block " + std::to_string(b) + " is keyed without the ids of every row");
        if (chain_key(m.parent, m.ids) != m.key) fail("block " + std::to_string(b) + "'s ids do not hash to its key");
      }
      for (std::size_t i = 1; i < block_tokens_ && m.count != 0; ++i) {
        if (positions_[b * block_tokens_ + i] != positions_[b * block_tokens_] + static_cast<std::int64_t>(i))
          fail("block " + std::to_string(b) + "'s positions do not follow one another");
      }
    }
    if (used + free_.size() != blocks_) {
      fail("held " + std::to_string(used) + " + free " + std::to_string(free_.size()) + " != total " +
           std::to_string(blocks_));
    }
    for (const auto& [key, b] : keyed_) {
      if (!meta_[b].keyed || meta_[b].key != key) fail("key of block " + std::to_string(b) + " is stale");
    }
  }

 private:
  friend class PagedKvCache<T>;
  friend class PagedBatch<T>;

  struct Meta {
    std::size_t count = 0;  // tables holding the block
    bool keyed = false;     // in keyed_ under `key`
    std::uint64_t key = 0;
    std::uint64_t parent = 0;
    // Ids of the tokens whose rows the block holds, from its first row, as they were written;
    // it stops at the first row written without a known id.
    std::vector<TokenId> ids;
    std::list<std::size_t>::iterator free_at;  // its place in free_, when count == 0
  };

  static detail::Geometry geometry_of(const BlockPoolConfig& c) {
    KvCacheConfig k{.layers = c.layers, .batch = 1, .kv_heads = c.kv_heads, .head_dim = c.head_dim};
    const detail::Geometry g = detail::check_config("BlockPool", k);
    if (c.block_tokens == 0) throw std::invalid_argument("BlockPool: config.block_tokens: expected > 0, given 0");
    if (c.blocks == 0) throw std::invalid_argument("BlockPool: config.blocks: expected > 0, given 0");
    if (c.window == 0 && (c.sinks != 0 || c.slack != 0)) {
      throw std::invalid_argument("BlockPool: config.sinks/slack: expected 0 without a window, given " +
                                  std::to_string(c.sinks) + "/" + std::to_string(c.slack));
    }
    return g;
  }

  /// The reference counts and free blocks that a batch of writes would leave, so that all of
  /// them are checked before any is made.
  class Counts {
   public:
    explicit Counts(const BlockPool& pool) : pool_(pool), free_(pool.free_blocks()) {}
    [[nodiscard]] std::size_t count(std::size_t b) const {
      const auto it = changed_.find(b);
      return it == changed_.end() ? pool_.meta_[b].count : it->second;
    }
    /// A table lets go of b (a block given back, or a shared one copied).
    void leave(std::size_t b) {
      const std::size_t n = count(b) - 1;
      changed_[b] = n;
      if (n == 0) ++free_;
    }
    [[nodiscard]] std::size_t free() const noexcept { return free_; }
    void take(std::size_t n) noexcept { free_ -= n; }

   private:
    const BlockPool& pool_;
    std::size_t free_;
    std::unordered_map<std::size_t, std::size_t> changed_;
  };

  /// Block b now holds positions [first, first + block_tokens) of the sequences that hold it.
  void place(std::size_t b, std::size_t first) noexcept {
    std::int64_t* p = positions_.data() + b * block_tokens_;
    for (std::size_t i = 0; i < block_tokens_; ++i) p[i] = static_cast<std::int64_t>(first + i);
  }

  /// The key of a full block of `ids` after the block keyed `parent` (0 for the first).
  static std::uint64_t chain_key(std::uint64_t parent, std::span<const TokenId> ids) noexcept {
    std::uint64_t h = parent ^ 0x9E3779B97F4A7C15ULL;
    const auto mix = [&](std::uint64_t x) {
      h ^= x + 0x9E3779B97F4A7C15ULL + (h << 6) + (h >> 2);
      h *= 0xBF58476D1CE4E5B9ULL;
      h ^= h >> 31;
    };
    for (const TokenId id : ids) mix(static_cast<std::uint32_t>(id));
    mix(ids.size());
    return h == 0 ? 1 : h;  // 0 is the empty chain's key
  }

  /// Takes a free block, forgetting its key and ids: never-keyed blocks first, then the least
  /// recently freed. The caller has checked that one is free.
  std::size_t take_free() {
    const std::size_t b = free_.front();
    free_.pop_front();
    Meta& m = meta_[b];
    if (m.keyed) forget_key(b);
    m.ids.clear();
    m.count = 1;
    return b;
  }
  void hold(std::size_t b) {
    Meta& m = meta_[b];
    if (m.count++ == 0) free_.erase(m.free_at);
  }
  void drop(std::size_t b) noexcept {
    Meta& m = meta_[b];
    if (--m.count != 0) return;
    // Keyed blocks wait at the back for reuse; the others go first.
    m.free_at = m.keyed ? free_.insert(free_.end(), b) : free_.insert(free_.begin(), b);
  }
  /// drop(b) for a block a window leaves behind after `parent`, given back before it: if the
  /// parent still waits keyed in the free list, b goes just ahead of it, so that eviction takes
  /// the chain's tail before its root as when a whole sequence goes.
  void drop_after(std::size_t b, std::size_t parent) noexcept {
    Meta& m = meta_[b];
    if (m.count == 1 && m.keyed && parent < blocks_ && meta_[parent].count == 0 && meta_[parent].keyed &&
        meta_[parent].key == m.parent) {
      m.count = 0;
      m.free_at = free_.insert(meta_[parent].free_at, b);
      return;
    }
    drop(b);
  }
  void forget_key(std::size_t b) noexcept {
    Meta& m = meta_[b];
    keyed_.erase(m.key);
    m.keyed = false;
  }
  /// Keys a full block by the ids it recorded, unless another block already holds that key.
  void key_block(std::size_t b, std::uint64_t parent, std::uint64_t key) {
    Meta& m = meta_[b];
    KVCACHE_ASSERT(m.ids.size() == block_tokens_ && chain_key(parent, m.ids) == key, "a block is keyed by its own ids");
    if (m.keyed || keyed_.count(key) != 0) return;
    keyed_.emplace(key, b);
    m.parent = parent;
    m.key = key;
    m.keyed = true;
  }
  /// Records that rows [first, first + rows) of block b were just written, the first
  /// known.size() of them with those ids and the rest with none the sequence knew.
  void record_ids(std::size_t b, std::size_t first, std::size_t rows, std::span<const TokenId> known) {
    std::vector<TokenId>& recorded = meta_[b].ids;
    for (std::size_t i = 0; i < rows; ++i) {
      const std::size_t at = first + i;
      if (at > recorded.size()) return;  // an earlier row has no id
      if (i >= known.size()) {
        recorded.resize(at);
        return;
      }
      if (at < recorded.size() && recorded[at] == known[i]) continue;  // another layer's write
      recorded.resize(at);  // rows past a rewritten one are stale until written again
      recorded.push_back(known[i]);
    }
  }
  /// The block keyed `key` whose ids are `ids`, or blocks_ if none.
  [[nodiscard]] std::size_t find(std::uint64_t key, std::span<const TokenId> ids) const {
    const auto it = keyed_.find(key);
    if (it == keyed_.end() ||
        !std::equal(ids.begin(), ids.end(), meta_[it->second].ids.begin(), meta_[it->second].ids.end()))
      return blocks_;
    return it->second;
  }
  /// Copies block `from`'s rows of every layer, and the ids and positions they were written
  /// with, into block `to`.
  void copy_block(std::size_t from, std::size_t to) {
    for (auto& r : rows_) r.copy(r, from * block_tokens_, block_tokens_, to * block_tokens_);
    meta_[to].ids = meta_[from].ids;
    std::copy_n(positions_.begin() + static_cast<std::ptrdiff_t>(from * block_tokens_), block_tokens_,
                positions_.begin() + static_cast<std::ptrdiff_t>(to * block_tokens_));
  }

  std::size_t block_tokens_;
  std::size_t blocks_;
  std::size_t capacity_;
  std::size_t window_, sinks_, slack_;
  // Per layer, [1, H_kv, blocks x block_tokens, D]: a head's blocks lie in block order, so a
  // table of consecutive blocks is read like a contiguous history.
  std::vector<detail::RowStore<T>> rows_;
  std::vector<Meta> meta_;
  std::list<std::size_t> free_;
  std::unordered_map<std::uint64_t, std::size_t> keyed_;
  std::vector<std::int64_t> positions_;            // [blocks, block_tokens]: the position each row holds
  std::vector<const PagedKvCache<T>*> sequences_;  // for check_invariants
  std::vector<std::string> fetched_;               // a store fetch's records, their memory kept for the next
};

/// One sequence in a BlockPool, following the protocol like KvCache: a model runs over it
/// unchanged. Its history is a segment per block, read in place. In a pool with a window, the
/// sequence gives back the blocks wholly before its window (its sinks' blocks stay), so what it
/// holds is bounded by the window however long it runs.
///
///   kvcache::BlockPool<float> pool({.layers = 28, .kv_heads = 8, .head_dim = 128, .blocks = 4096});
///   kvcache::PagedKvCache<float> seq(pool);
///   std::size_t skip = seq.reuse_prefix(prompt);            // tokens already in the pool
///   auto history = seq.update(layer, k, v, positions);      // feed prompt[skip..], from skip on
///   seq.add_token_ids({next});                              // a generated token's id, before feeding it
///   kvcache::PagedKvCache<float> sample = seq.fork();      // shares every block
template <class T>
class PagedKvCache : public detail::LayerLengths, public detail::ComputeTypeUpdates<PagedKvCache<T>, T> {
 public:
  using value_type = T;

  /// An empty sequence in `pool`, which must outlive it.
  explicit PagedKvCache(BlockPool<T>& pool)
      : LayerLengths("PagedKvCache", {pool.layers(), 1, pool.kv_heads(), pool.head_dim()}),
        pool_(&pool),
        needs_(pool.layers(), 0),
        segments_(pool.layers()) {
    pool_->sequences_.push_back(this);
  }
  PagedKvCache(const PagedKvCache&) = delete;
  PagedKvCache& operator=(const PagedKvCache&) = delete;
  PagedKvCache(PagedKvCache&& other) noexcept
      : LayerLengths(std::move(other)),
        pool_(std::exchange(other.pool_, nullptr)),
        table_(std::move(other.table_)),
        ids_(std::move(other.ids_)),
        keys_(std::move(other.keys_)),
        needs_(std::move(other.needs_)),
        given_back_(other.given_back_),
        last_given_back_(other.last_given_back_),
        segments_(std::move(other.segments_)),
        refetch_from_(other.refetch_from_) {
    other.table_.clear();
    if (pool_ != nullptr)
      std::replace(pool_->sequences_.begin(), pool_->sequences_.end(), &std::as_const(other), &std::as_const(*this));
  }
  PagedKvCache& operator=(PagedKvCache&& other) noexcept {
    if (this != &other) {
      leave();
      LayerLengths::operator=(std::move(other));
      pool_ = std::exchange(other.pool_, nullptr);
      table_ = std::move(other.table_);
      other.table_.clear();
      ids_ = std::move(other.ids_);
      keys_ = std::move(other.keys_);
      needs_ = std::move(other.needs_);
      given_back_ = other.given_back_;
      last_given_back_ = other.last_given_back_;
      segments_ = std::move(other.segments_);
      refetch_from_ = other.refetch_from_;
      if (pool_ != nullptr)
        std::replace(pool_->sequences_.begin(), pool_->sequences_.end(), &std::as_const(other), &std::as_const(*this));
    }
    return *this;
  }
  ~PagedKvCache() { leave(); }

  using detail::ComputeTypeUpdates<PagedKvCache<T>, T>::update;

  /// The most tokens the sequence may reach (the pool's capacity; blocks permitting).
  [[nodiscard]] std::size_t capacity() const noexcept { return pool_ == nullptr ? 0 : pool_->capacity(); }
  /// Bytes of the blocks this sequence holds (shared ones too).
  [[nodiscard]] std::size_t bytes() const noexcept {
    return pool_ == nullptr ? 0 : (table_.size() - given_back_) * pool_->block_bytes();
  }
  /// The pool's saturated values and head scales: the pool's blocks share the static scale per
  /// (layer, kv head) its config gave, for formats that keep one.
  [[nodiscard]] std::size_t clipped() const noexcept { return pool_ == nullptr ? 0 : pool_->clipped(); }
  [[nodiscard]] std::vector<float> key_head_scales() const {
    return pool_ == nullptr ? std::vector<float>{} : pool_->key_head_scales();
  }
  [[nodiscard]] std::vector<float> value_head_scales() const {
    return pool_ == nullptr ? std::vector<float>{} : pool_->value_head_scales();
  }
  /// What block_table() shows for a block a windowed sequence gave back.
  static constexpr std::size_t kReleased = ~std::size_t{0};
  /// The blocks of the sequence's tokens, in order: entry j holds positions [j x block_tokens,
  /// (j + 1) x block_tokens). A windowed sequence's blocks given back show kReleased.
  [[nodiscard]] std::span<const std::size_t> block_table() const noexcept { return table_; }

  /// Forgets everything after `length` tokens in every layer, and the ids of the tokens past
  /// it, giving back the blocks past it. std::out_of_range if a layer holds fewer, or if a
  /// windowed sequence gave back blocks of positions a query at `length` reads (`slack` in the
  /// pool's config keeps them for rollbacks that short); nothing changes then.
  void truncate(std::size_t length) {
    check_truncate(length);
    if (pool_ == nullptr) return set_all_lengths(length);  // moved from
    check_window_truncate("PagedKvCache::truncate", length);
    set_all_lengths(length);
    ids_.resize(std::min(ids_.size(), length));
    keys_.resize(std::min(keys_.size(), length / block()));
    std::fill(needs_.begin(), needs_.end(), window_start(length));
    shrink_table();
  }
  /// The pool's shrink_to_fit(): gives back the memory of its free blocks that hold no reusable
  /// prefix (a sequence's own blocks go back to the pool as it truncates, resets or ends).
  void shrink_to_fit() noexcept {
    if (pool_ != nullptr) pool_->shrink_to_fit();
  }

  /// Empties the sequence, giving back every block.
  void reset() noexcept {
    set_all_lengths(0);
    ids_.clear();
    keys_.clear();
    std::fill(needs_.begin(), needs_.end(), 0);
    refetch_from_ = kNone;
    shrink_table();
  }

  /// A second sequence holding the same tokens: it shares every block, and either copies a
  /// shared partial block before writing it. The fork knows the ids of the tokens it holds, not
  /// of those this sequence was given beyond them (add_token_ids gives it its own).
  [[nodiscard]] PagedKvCache fork() const {
    PagedKvCache copy(*pool_);
    for (const std::size_t b : table_)
      if (b != kReleased) pool_->hold(b);
    copy.table_ = table_;
    copy.needs_ = needs_;
    copy.given_back_ = given_back_;
    // Ids of tokens not yet held stay with this sequence: a fork may continue differently.
    const std::size_t held = held_tokens();
    copy.ids_.assign(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(std::min(held, ids_.size())));
    copy.keys_ = keys_;
    for (std::size_t l = 0; l < layers(); ++l) copy.set_length(l, length(l));
    return copy;
  }

  /// Starts the sequence with a prompt: takes the pool's blocks that hold its longest keyed
  /// prefix of full blocks, and keeps the prompt's ids so that the blocks it fills are keyed
  /// in turn. Returns the tokens the engine may skip, from which it feeds the rest of the
  /// prompt: a whole number of blocks, but never the whole prompt (its last token is fed for
  /// its logits). std::logic_error unless the sequence is empty.
  std::size_t reuse_prefix(std::span<const TokenId> prompt) {
    check_empty("PagedKvCache::reuse_prefix");
    reserve_for(prompt);
    return finish_reuse(prompt, take_pool_prefix(prompt));
  }

  /// reuse_prefix(prompt), then the prompt's following full blocks from `store` (a BlockStore,
  /// block_store.hpp) into free blocks of the pool, up to the first the store lacks. Each fetched
  /// record is verified whole (checksums; namespace: the store's model, this pool's format and
  /// shape; key; the token ids, which must be the prompt's) before it reaches a block, then its
  /// block records those ids and is keyed as a computed one. A fault (a corrupt or foreign record,
  /// the store failing, no free block) stops the fetch: the sequence holds the blocks found
  /// before it and the result's `error` names what failed. Batches of up to kStoreBatch blocks
  /// (kStoreBatchBytes) are fetched at once, into memory the pool keeps for its next fetch; a batch
  /// the store fails part-way gives none of its blocks. Never throws for a fault of the store;
  /// std::logic_error unless the sequence is empty.
  template <BlockStore Store>
  PrefixReuse reuse_prefix(std::span<const TokenId> prompt, Store& store) {
    check_empty("PagedKvCache::reuse_prefix");
    reserve_for(prompt);
    PrefixReuse result;
    std::size_t matched = take_pool_prefix(prompt);
    result.pool_blocks = matched;
    const std::size_t b = block(), full = prompt.size() / b;
    refetch_from_ = kNone;
    std::size_t bad = kNone;  // a block whose record failed verification
    try {
      if (matched < full) {
        const detail::BlockSpace space = store_space(store.model());
        const std::vector<BlockKey> keys = detail::prompt_keys(space, prompt, b, full);
        std::vector<std::string>& records = pool_->fetched_;  // its memory kept for the next fetch
        while (matched < full) {
          const std::size_t batch = std::min({store_batch(), full - matched, pool_->free_blocks()});
          if (batch == 0) throw BlockStoreError("no free block in the pool for the store's blocks");
          records.resize(batch);
          const std::size_t got = store.get(std::span(keys).subspan(matched, batch), records);
          for (std::size_t i = 0; i < got; ++i, ++matched) {
            const std::size_t j = matched;
            const BlockKey parent = j == 0 ? BlockKey{} : keys[j - 1];
            const auto ids = prompt.subspan(j * b, b);
            const std::size_t first = pool_->free_.front() * b;  // the block take_free() takes below
            std::vector<std::string_view> layers;
            try {
              layers = detail::verify_block<T>(records[i], space, keys[j], parent, ids, pool_->rows_, first, b);
            } catch (const std::runtime_error& e) {
              bad = j;
              throw BlockStoreError("block " + std::to_string(j) + " of the prompt (key " + keys[j].hex() +
                                    "): " + e.what());
            }
            place_fetched(layers, ids);
            ++result.store_blocks;
          }
          if (got < batch) break;  // the store lacks the next block: a plain miss
        }
      }
    } catch (const std::exception& e) {
      result.error = e.what();
      refetch_from_ = bad;
    }
    result.tokens = finish_reuse(prompt, matched);
    return result;
  }

  /// Writes this sequence's full keyed blocks (those whose every token id it knows) to `store`,
  /// past the leading ones the store already holds, so that other processes find them; a block
  /// the last reuse_prefix(prompt, store) found corrupt there is written again. Call it once a
  /// prompt's prefill is done: a write never happens inside update(), and a windowed sequence
  /// writes none past the first block it gave back. Never throws for a fault of the store: the
  /// result's `error` names it, and the records written before it stay (each whole). The
  /// sequence and the pool are unchanged either way.
  template <BlockStore Store>
  PrefixSave save_prefix(Store& store) const {
    PrefixSave result;
    const std::size_t b = block();
    const std::size_t full = std::min({keys_.size(), ids_.size() / b, given_back_ != 0 ? sink_blocks() : kNone});
    std::vector<BlockKey> keys;
    std::size_t done = 0, attempted = 0;
    try {
      const detail::BlockSpace space = store_space(store.model());
      keys = detail::prompt_keys(space, ids_, b, full);
      result.held = std::min(store.contains(keys), refetch_from_);
      std::vector<std::string> records;
      for (done = result.held; done < full;) {
        const std::size_t batch = std::min(store_batch(), full - done);
        attempted = done + batch;
        records.clear();
        for (std::size_t j = done; j < done + batch; ++j) {
          records.push_back(detail::encode_block<T>(space, keys[j], j == 0 ? BlockKey{} : keys[j - 1],
                                                    std::span<const TokenId>(ids_).subspan(j * b, b), pool_->rows_,
                                                    table_[j] * b, b));
        }
        store.put(std::span(keys).subspan(done, batch), records);
        done += batch;
        result.written = done - result.held;
      }
    } catch (const std::exception& e) {
      result.error = e.what();
      try {  // how many the failing batch wrote before it failed
        if (attempted > done) result.written = std::max(done, std::min(attempted, store.contains(keys))) - result.held;
      } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): the first error is the one to report
      }
    }
    return result;
  }

  /// Blocks a store call moves at most at once, and bytes of them: a batch is fetched (or
  /// written) together, and a fetch holds its records in memory until they are verified.
  static constexpr std::size_t kStoreBatch = 16;
  static constexpr std::size_t kStoreBatchBytes = std::size_t{64} << 20;

  /// Gives the ids of the next tokens, those to be fed after the ones whose ids are known
  /// (a generated token's, before feeding it), so that the blocks they fill are keyed for reuse.
  /// std::logic_error once the sequence holds tokens whose ids it was not given: ids given
  /// then could name other tokens than those the rows hold (after truncate(n), the ids past n
  /// are forgotten and must be given again before their tokens).
  void add_token_ids(std::span<const TokenId> ids) {
    const std::size_t held = held_tokens();
    if (ids_.size() < held && !ids.empty()) {
      throw std::logic_error(
          detail::expected_given("PagedKvCache::add_token_ids", "ids given before the tokens they name",
                                 std::to_string(ids.size()) + " ids after " + std::to_string(held) +
                                     " tokens were fed with only " + std::to_string(ids_.size()) + " ids known"));
    }
    ids_.insert(ids_.end(), ids.begin(), ids.end());
  }
  /// The ids known of the sequence's tokens, from position 0: those it holds and those given
  /// ahead of them.
  [[nodiscard]] std::span<const TokenId> token_ids() const noexcept { return ids_; }

  /// The layer's history as update() returns it, without writing: a segment per block, those
  /// of the sinks and those from the window of the layer's last update on.
  [[nodiscard]] History<T> history(std::size_t layer) {
    const std::size_t end = length(layer);
    const std::size_t b = block();
    auto& segments = segments_[layer];
    segments.clear();
    for (std::size_t j = 0; j * b < end; ++j) {
      if (!reads(layer, j)) continue;
      const std::size_t n = std::min(b, end - j * b);
      const std::size_t at = table_[j] * b;
      segments.push_back(pool_->rows_[layer].segment(at, n, Positions(pool_->positions_.data() + at, n),
                                                     pool_->head_scale_view(layer)));
    }
    return {std::span<const Segment<T>>(segments), pool_->window(), pool_->sinks()};
  }

 private:
  friend class detail::ComputeTypeUpdates<PagedKvCache<T>, T>;
  friend class BlockPool<T>;
  friend class PagedBatch<T>;

  [[nodiscard]] std::size_t block() const noexcept { return pool_->block_tokens(); }

  /// The first position other than a sink that a query at `position` reads.
  [[nodiscard]] std::size_t window_start(std::size_t position) const noexcept {
    const std::size_t w = pool_->window();
    return w != 0 && position + 1 > w ? position + 1 - w : 0;
  }
  /// Blocks holding sinks: kept whatever the window.
  [[nodiscard]] std::size_t sink_blocks() const noexcept {
    return pool_->window() == 0 ? 0 : (pool_->sinks() + block() - 1) / block();
  }
  /// Whether the layer's history reads block j (held): a sink's, or one that reaches the window
  /// of its last update.
  [[nodiscard]] bool reads(std::size_t layer, std::size_t j) const noexcept {
    return table_[j] != kReleased && (j < sink_blocks() || (j + 1) * block() > needs_[layer]);
  }
  /// The blocks [first, end) an update of `layer` from position `start` gives back: those wholly
  /// before every layer's window (less the slack), past the sinks' and those given back already.
  [[nodiscard]] std::pair<std::size_t, std::size_t> releases(std::size_t layer, std::size_t start) const noexcept {
    const std::size_t first = sink_blocks() + given_back_;
    if (pool_->window() == 0) return {first, first};
    std::size_t bound = std::max(needs_[layer], window_start(start));
    for (std::size_t l = 0; l < layers(); ++l)
      if (l != layer) bound = std::min(bound, needs_[l]);
    bound = bound > pool_->slack() ? bound - pool_->slack() : 0;
    return {first, std::max(first, std::min(bound / block(), table_.size()))};
  }

  /// std::out_of_range unless a windowed sequence still holds what a query at `length` reads:
  /// the blocks it gave back hold positions before that query's window.
  void check_window_truncate(const char* call, std::size_t length) const {
    if (given_back_ == 0) return;
    const std::size_t b = block(), gap_begin = sink_blocks() * b, gap_end = (sink_blocks() + given_back_) * b;
    if (length <= gap_begin || std::max(pool_->sinks(), window_start(length)) >= gap_end) return;
    throw std::out_of_range(detail::expected_given(
        std::string(call) + ": length",
        ">= " + std::to_string(gap_end + pool_->window() - 1) + " or <= " + std::to_string(gap_begin) +
            " (the blocks of positions [" + std::to_string(gap_begin) + ", " + std::to_string(gap_end) +
            ") were given back; a query reads the " + std::to_string(pool_->window()) + " positions up to itself)",
        std::to_string(length)));
  }

  /// Checks that an update of `layer` writing `tokens` from `start` finds its blocks in `counts`
  /// (free ones, and those it gives back), and takes them there; std::length_error naming the
  /// blocks needed and free otherwise. `what()` names the call for the message.
  template <class What>
  void check_blocks(std::size_t layer, std::size_t start, std::size_t tokens, typename BlockPool<T>::Counts& counts,
                    const What& what) const {
    const auto [first_release, end_release] = releases(layer, start);
    for (std::size_t j = first_release; j < end_release; ++j) counts.leave(table_[j]);
    std::size_t needed = 0;
    const std::size_t b = block();
    for (std::size_t j = start / b; tokens != 0 && j <= (start + tokens - 1) / b; ++j) {
      if (j >= table_.size()) {
        ++needed;
      } else if (counts.count(table_[j]) > 1) {
        ++needed;
        counts.leave(table_[j]);
      }
    }
    if (needed > counts.free()) {
      throw std::length_error(
          detail::expected_given(what(), "at most the " + std::to_string(counts.free()) + " free",
                                 std::to_string(needed) + " needed for " + std::to_string(tokens) + " tokens"));
    }
    counts.take(needed);
  }

  /// Gives back the blocks an update of `layer` from `start` leaves behind (releases()).
  void release(std::size_t layer, std::size_t start) noexcept {
    const auto [first, end] = releases(layer, start);
    needs_[layer] = std::max(needs_[layer], window_start(start));
    for (std::size_t j = first; j < end; ++j) {
      pool_->drop_after(table_[j], last_given_back_);
      last_given_back_ = table_[j];
      table_[j] = kReleased;
    }
    given_back_ += end - first;
  }

  /// Writes batch row `row` of k and v at `start` of `layer` (checked, and its blocks counted),
  /// with the pool's head scales; returns the values that saturated.
  template <class In>
  std::size_t write(std::size_t layer, const TensorView<const In>& k, const TensorView<const In>& v, std::size_t row,
                    std::size_t start) {
    const detail::HeadScaleView scales = pool_->head_scale_view(layer);
    const std::size_t tokens = k.tokens();
    const std::size_t b = block();
    release(layer, start);
    const std::size_t first = start / b, last = tokens == 0 ? first : (start + tokens - 1) / b;
    for (std::size_t j = first; tokens != 0 && j <= last; ++j) {
      if (j >= table_.size()) {
        table_.push_back(pool_->take_free());
        pool_->place(table_.back(), j * b);
      } else if (pool_->meta_[table_[j]].count > 1) {
        const std::size_t copy = pool_->take_free();
        pool_->copy_block(table_[j], copy);
        pool_->drop(table_[j]);
        table_[j] = copy;
      } else if (pool_->meta_[table_[j]].keyed) {
        pool_->forget_key(table_[j]);  // a keyed block's rows never change while it is keyed
      }
    }
    const TensorView<const In> k_row(k.row(row, 0, 0), {1, k.heads(), tokens, k.head_dim()}, k.strides());
    const TensorView<const In> v_row(v.row(row, 0, 0), {1, v.heads(), tokens, v.head_dim()}, v.strides());
    std::size_t clipped = 0;
    for (std::size_t done = 0; done < tokens;) {
      const std::size_t at = start + done;
      const std::size_t n = std::min(tokens - done, b - at % b);
      clipped += pool_->rows_[layer].encode(k_row, v_row, done, n, table_[at / b] * b + at % b, scales);
      const std::size_t known = std::min(n, ids_.size() - std::min(ids_.size(), at));
      pool_->record_ids(table_[at / b], at % b, n,
                        std::span<const TokenId>(ids_).subspan(std::min(at, ids_.size()), known));
      done += n;
    }
    set_length(layer, start + tokens);
    key_full_blocks();
    return clipped;
  }

  friend struct detail::StateAccess;

  // State files (state_file.hpp): one sequence, not its pool. PAGE holds the block size and
  // the token ids known; ROWS[l] the layer's tokens block after block. A load takes fresh
  // blocks of the pool into an empty sequence; BASE's head scales must agree with the pool's,
  // and the pool's clipped count stays its own. A windowed sequence also writes PWIN: the blocks
  // it gave back and each layer's first needed position; ROWS then holds the blocks it keeps.
  template <class Settings>
  void state_settings(Settings& settings) const {
    settings.may_differ("capacity", capacity() == std::numeric_limits<std::size_t>::max() ? 0 : capacity());
    settings.must_match("window", pool_->window());
    settings.must_match("sinks", pool_->sinks());
    settings.must_match("slack", pool_->slack());
  }
  /// The blocks the sequence holds, in order (its table without those given back).
  [[nodiscard]] std::vector<std::size_t> held_blocks() const {
    std::vector<std::size_t> held;
    held.reserve(table_.size() - given_back_);
    for (const std::size_t b : table_)
      if (b != kReleased) held.push_back(b);
    return held;
  }
  [[nodiscard]] const detail::HeadScales& state_scale_owner() const noexcept { return *pool_; }
  template <class Out>
  void save_sections(Out& out) const {
    out.section("PAGE", [&](auto& fields) {
      fields.u64(block());
      fields.u64(ids_.size());
      fields.i64s(std::vector<std::int64_t>(ids_.begin(), ids_.end()));
    });
    if (pool_->window() != 0) {
      out.section("PWIN", [&](auto& fields) {
        fields.u64(given_back_);
        for (const std::size_t n : needs_) fields.u64(n);
      });
    }
    const std::vector<std::size_t> held = held_blocks();
    const std::size_t gap = given_back_ * block();
    for (std::size_t l = 0; l < layers(); ++l) out.blocks("ROWS", l, pool_->rows_[l], held, block(), length(l) - gap);
  }
  template <class In>
  auto load_sections(In& in) {
    const std::size_t held = held_tokens();
    if (held != 0 || !table_.empty() || !ids_.empty()) {
      throw std::logic_error(
          "kvcache::load_state: PagedKvCache: expected an empty sequence (reset() empties it), found " +
          std::to_string(held) + " tokens and " + std::to_string(ids_.size()) + " token ids held");
    }
    auto fields = in.section("PAGE", kMaxPageBytes);
    const std::size_t block_tokens = fields.u64("block_tokens");
    if (block_tokens != block()) {
      throw std::invalid_argument("kvcache::load_state: the file's block_tokens: expected " + std::to_string(block()) +
                                  " (the pool loaded into), found " + std::to_string(block_tokens));
    }
    const std::size_t count = fields.u64("token ids");
    const std::vector<std::int64_t> wide = fields.i64s("token ids", count);
    fields.finish();
    std::vector<TokenId> ids(count);
    for (std::size_t i = 0; i < count; ++i) {
      fields.require(std::in_range<TokenId>(wide[i]), "token id", "a 32-bit id", std::to_string(wide[i]));
      ids[i] = static_cast<TokenId>(wide[i]);
    }

    // The rows were encoded with the file's head scales: they must be the pool's, which its
    // blocks share (0, a head no update had set in a file of an earlier version, agrees).
    for (std::size_t l = 0; l < layers() && !in.key_head_scales().empty(); ++l) {
      const detail::HeadScaleView own = pool_->head_scale_view(l);
      for (const bool values : {false, true}) {
        for (std::size_t h = 0; h < kv_heads(); ++h) {
          const float pool = (values ? own.values : own.keys)[h];
          const float file = (values ? in.value_head_scales() : in.key_head_scales())[l * kv_heads() + h];
          if (file != 0.0F && pool != file) {
            throw std::invalid_argument("kvcache::load_state: the file's " + std::string(values ? "V" : "K") +
                                        " scale of layer " + std::to_string(l) + " kv head " + std::to_string(h) +
                                        ": expected " + std::to_string(pool) +
                                        " (the pool's, which its blocks share), found " + std::to_string(file));
          }
        }
      }
    }

    // A windowed sequence's blocks given back, and what each layer still reads.
    std::size_t longest = 0;
    for (const std::size_t n : in.lengths()) longest = std::max(longest, n);
    std::size_t given_back = 0;
    std::vector<std::size_t> needs(layers(), 0);
    if (pool_->window() != 0) {
      auto window = in.section("PWIN", 8 * (1 + layers()));
      given_back = window.u64("blocks given back");
      for (std::size_t l = 0; l < layers(); ++l) {
        needs[l] = window.u64("needed position");
        window.require(needs[l] <= in.lengths()[l], "needed position",
                       "<= the layer's tokens " + std::to_string(in.lengths()[l]), std::to_string(needs[l]));
      }
      window.finish();
      const std::size_t gap_end = (sink_blocks() + given_back) * block();
      const std::size_t needed_from = *std::min_element(needs.begin(), needs.end());
      window.require(given_back == 0 || gap_end <= needed_from, "blocks given back",
                     "blocks before every layer's needed position " + std::to_string(needed_from),
                     std::to_string(given_back) + " after the sinks' " + std::to_string(sink_blocks()));
    }

    // Fresh blocks: the first the pool would take (never-keyed ones first). Those free but
    // keyed hold a prefix others may reuse: the data reaches them only once verified.
    const std::size_t needed = (longest + block() - 1) / block() - given_back;
    if (needed > pool_->free_blocks()) {
      throw std::length_error("kvcache::load_state: PagedKvCache: blocks: expected at most the " +
                              std::to_string(pool_->free_blocks()) + " free, found " + std::to_string(needed) +
                              " needed for " + std::to_string(longest) + " tokens");
    }
    std::vector<std::size_t> table(pool_->free_.begin(),
                                   std::next(pool_->free_.begin(), static_cast<std::ptrdiff_t>(needed)));
    if (std::any_of(table.begin(), table.end(), [&](std::size_t b) { return pool_->meta_[b].keyed; })) {
      in.set_data(In::Data::hold);
    }
    const std::size_t gap = given_back * block();
    for (std::size_t l = 0; l < layers(); ++l)
      in.blocks("ROWS", l, pool_->rows_[l], table, block(), in.lengths()[l] - gap);
    // The table: the sinks' blocks, those given back, the rest.
    const auto at = static_cast<std::ptrdiff_t>(std::min(sink_blocks(), table.size()));
    table.insert(table.begin() + at, given_back, kReleased);
    keys_.reserve(table.size());

    return [this, table = std::move(table), ids = std::move(ids), needs = std::move(needs), given_back,
            lengths = std::vector<std::size_t>(in.lengths().begin(), in.lengths().end())]() mutable noexcept {
      for (std::size_t j = 0; j < table.size(); ++j) {
        if (table[j] == kReleased) continue;
        [[maybe_unused]] const std::size_t taken = pool_->take_free();
        KVCACHE_ASSERT(taken == table[j], "a load takes the free blocks it read into");
        pool_->place(table[j], j * block());
      }
      table_ = std::move(table);
      given_back_ = given_back;
      needs_ = std::move(needs);
      ids_ = std::move(ids);
      const std::size_t longest_held = *std::max_element(lengths.begin(), lengths.end());
      for (std::size_t j = 0; j < table_.size(); ++j) {
        if (table_[j] == kReleased) continue;
        const std::size_t from = std::min(j * block(), ids_.size());
        const std::size_t to = std::min({(j + 1) * block(), longest_held, ids_.size()});
        pool_->meta_[table_[j]].ids.assign(ids_.begin() + static_cast<std::ptrdiff_t>(from),
                                           ids_.begin() + static_cast<std::ptrdiff_t>(std::max(from, to)));
      }
      for (std::size_t l = 0; l < layers(); ++l) set_length(l, lengths[l]);
      try {
        key_full_blocks();  // as an update would: a later sequence may reuse them
      } catch (...) {       // std::bad_alloc: the blocks are only not offered for reuse
      }
    };
  }
  /// A PAGE section's bound: its ids, of a sequence the pool holds (any count the caller gave).
  static constexpr std::size_t kMaxPageBytes = std::size_t{1} << 30;

  template <class In>
  History<T> store(std::size_t layer, const TensorView<const In>& k, const TensorView<const In>& v,
                   const Positions& positions) {
    const std::size_t start = check_update(layer, k, v, positions, capacity());
    typename BlockPool<T>::Counts counts(*pool_);
    check_blocks(layer, start, k.tokens(), counts,
                 [&] { return "PagedKvCache::update: layer " + std::to_string(layer) + ": blocks"; });
    pool_->template check_values<T>(pool_->name(), layer, k, v);
    pool_->count_clipped(layer, write(layer, k, v, std::size_t{0}, start));
    return history(layer);
  }

  /// Keys every block that is full in every layer and recorded the id of every row, in chain
  /// order, by those ids.
  void key_full_blocks() {
    const std::size_t b = block();
    std::size_t full = ~std::size_t{0};
    for (std::size_t l = 0; l < layers(); ++l) full = std::min(full, length(l) / b);
    full = std::min(full, table_.size());
    while (keys_.size() < full) {
      const std::size_t j = keys_.size();
      const std::uint64_t parent = j == 0 ? 0 : keys_.back();
      if (table_[j] == kReleased) {  // its chain key alone, from the ids the sequence knows (a load)
        if (ids_.size() < (j + 1) * b) return;
        keys_.push_back(BlockPool<T>::chain_key(parent, std::span<const TokenId>(ids_).subspan(j * b, b)));
        continue;
      }
      const std::vector<TokenId>& ids = pool_->meta_[table_[j]].ids;
      if (ids.size() != b) return;
      const std::uint64_t key = BlockPool<T>::chain_key(parent, ids);
      pool_->key_block(table_[j], parent, key);
      keys_.push_back(key);
    }
  }

  /// For check_invariants: the ids this sequence knows are those its blocks recorded for the
  /// rows it holds, and its chain keys hash from them.
  template <class Fail>
  void check_ids(const Fail& fail) const {
    const std::size_t b = block();
    const std::size_t held = held_tokens();
    const std::string name = "a sequence's ";
    if (table_.size() != (held + b - 1) / b) {
      fail(name + "table holds " + std::to_string(table_.size()) + " blocks for " + std::to_string(held) + " tokens");
    }
    for (std::size_t j = 0; j < table_.size(); ++j) {
      const bool gap = j >= sink_blocks() && j < sink_blocks() + given_back_;
      if ((table_[j] == kReleased) != gap) {
        fail(name + "block " + std::to_string(j) + (gap ? " was given back but is held" : " is missing"));
      }
      if (!gap && pool_->positions_[table_[j] * b] != static_cast<std::int64_t>(j * b)) {
        fail(name + "block " + std::to_string(j) + " holds positions from " +
             std::to_string(pool_->positions_[table_[j] * b]));
      }
    }
    for (std::size_t l = 0; l < layers(); ++l) {
      if (needs_[l] > length(l)) fail(name + "layer " + std::to_string(l) + " needs positions past its tokens");
      if (given_back_ != 0 && needs_[l] < (sink_blocks() + given_back_) * b)
        fail(name + "layer " + std::to_string(l) + " needs positions of blocks given back");
    }
    for (std::size_t p = 0; p < std::min(held, ids_.size()); ++p) {
      if (table_[p / b] == kReleased) continue;
      const std::vector<TokenId>& recorded = pool_->meta_[table_[p / b]].ids;
      if (p % b >= recorded.size() || recorded[p % b] != ids_[p]) {
        fail(name + "token " + std::to_string(p) + " has id " + std::to_string(ids_[p]) + ", its block " +
             std::to_string(table_[p / b]) + " recorded " +
             (p % b < recorded.size() ? std::to_string(recorded[p % b]) : std::string("none")));
      }
    }
    if (keys_.size() * b > held) fail(name + "chain keys cover more blocks than it holds");
    for (std::size_t j = 0; j < keys_.size(); ++j) {
      const std::size_t from = std::min(ids_.size(), j * b);
      const std::span<const TokenId> recorded =
          table_[j] != kReleased ? std::span<const TokenId>(pool_->meta_[table_[j]].ids)
                                 : std::span<const TokenId>(ids_).subspan(from, std::min(b, ids_.size() - from));
      if (recorded.size() != b || BlockPool<T>::chain_key(j == 0 ? 0 : keys_[j - 1], recorded) != keys_[j])
        fail(name + "chain key of block " + std::to_string(j) + " is not its recorded ids'");
    }
  }

  static constexpr std::size_t kNone = ~std::size_t{0};

  /// Blocks of this pool a store call moves at once: kStoreBatch, fewer for blocks so large
  /// that their records would pass kStoreBatchBytes, at least one.
  [[nodiscard]] std::size_t store_batch() const noexcept {
    return std::clamp<std::size_t>(kStoreBatchBytes / std::max<std::size_t>(pool_->block_bytes(), 1), 1, kStoreBatch);
  }

  /// std::logic_error unless the sequence holds no token and no id.
  void check_empty(const char* call) const {
    const std::size_t held = held_tokens();  // not length(): that throws when a pass stopped part-way
    if (held != 0 || !ids_.empty()) {
      throw std::logic_error(detail::expected_given(
          call, "an empty sequence",
          std::to_string(held) + " tokens and " + std::to_string(ids_.size()) + " token ids held"));
    }
  }
  /// Room for a prompt's blocks and ids, so that taking them allocates nothing.
  void reserve_for(std::span<const TokenId> prompt) {
    table_.reserve(prompt.size() / block());
    keys_.reserve(prompt.size() / block());
    ids_.reserve(prompt.size());
  }
  /// Takes the pool's blocks holding the prompt's longest keyed prefix of full blocks; returns
  /// how many.
  std::size_t take_pool_prefix(std::span<const TokenId> prompt) noexcept {
    const std::size_t b = block();
    std::uint64_t parent = 0;
    std::size_t matched = 0;
    while ((matched + 1) * b <= prompt.size()) {
      const auto ids = prompt.subspan(matched * b, b);
      const std::uint64_t key = BlockPool<T>::chain_key(parent, ids);
      const std::size_t found = pool_->find(key, ids);
      if (found == pool_->blocks()) break;
      pool_->hold(found);
      table_.push_back(found);
      keys_.push_back(key);
      parent = key;
      ++matched;
    }
    return matched;
  }
  /// The prompt's `matched` leading blocks taken: keeps its ids and returns the tokens to skip.
  /// The whole prompt found: its last token is left to be fed, into the last block (copied
  /// first if shared), which keeps that token's id.
  std::size_t finish_reuse(std::span<const TokenId> prompt, std::size_t matched) noexcept {
    const std::size_t b = block();
    ids_.assign(prompt.begin(), prompt.end());
    const std::size_t skip = matched * b == prompt.size() && matched != 0 ? prompt.size() - 1 : matched * b;
    keys_.resize(skip / b);
    set_all_lengths(skip);
    shrink_table();  // blocks of one token: the last one is not held
    for (std::size_t l = 0; l < layers(); ++l) release(l, skip);
    return skip;
  }
  /// This pool's namespace in a store of `model`'s blocks.
  [[nodiscard]] detail::BlockSpace store_space(std::string_view model) const {
    return detail::block_space<T>(model, block(), layers(), kv_heads(), head_dim(), pool_->key_head_scales(),
                                  pool_->value_head_scales());
  }
  /// Puts a verified record's rows (verify_block's payloads) for the prompt's next block, of
  /// `ids`, into a free block, which records the ids, is keyed, and joins the table.
  void place_fetched(std::span<const std::string_view> layers, std::span<const TokenId> ids) noexcept {
    const std::size_t b = block();
    const std::size_t taken = pool_->take_free();
    pool_->place(taken, table_.size() * b);
    detail::copy_block_rows<T>(layers, pool_->rows_, taken * b, b);
    pool_->meta_[taken].ids.assign(ids.begin(), ids.end());  // within the capacity reserved for it
    const std::uint64_t parent = keys_.empty() ? 0 : keys_.back();
    const std::uint64_t key = BlockPool<T>::chain_key(parent, ids);
    try {
      pool_->key_block(taken, parent, key);
    } catch (...) {  // NOLINT(bugprone-empty-catch): std::bad_alloc: the block is only not offered to others
    }
    table_.push_back(taken);  // within reserve_for's room
    keys_.push_back(key);
  }

  /// The most tokens any layer holds (the layers differ while a pass is part-way).
  [[nodiscard]] std::size_t held_tokens() const noexcept {
    std::size_t held = 0;
    for (std::size_t l = 0; l < layers(); ++l) held = std::max(held, length(l));
    return held;
  }

  /// Gives back the blocks no layer's tokens reach any more.
  void shrink_table() noexcept {
    if (pool_ == nullptr) return;
    const std::size_t keep = (held_tokens() + block() - 1) / block();
    while (table_.size() > keep) {
      if (table_.back() != kReleased) pool_->drop(table_.back());
      table_.pop_back();
    }
    given_back_ = std::min(given_back_, table_.size() - std::min(table_.size(), sink_blocks()));
    if (given_back_ == 0) last_given_back_ = kNone;
  }

  void leave() noexcept {
    if (pool_ == nullptr) return;
    // Last block first: the free list then evicts a prefix's tail before its root.
    for (auto b = table_.rbegin(); b != table_.rend(); ++b)
      if (*b != kReleased) pool_->drop(*b);
    table_.clear();
    given_back_ = 0;
    auto& all = pool_->sequences_;
    all.erase(std::remove(all.begin(), all.end(), this), all.end());
    pool_ = nullptr;
  }

  BlockPool<T>* pool_;
  std::vector<std::size_t> table_;                 // block of each block_tokens tokens, in order
  std::vector<TokenId> ids_;                       // token ids known, from position 0
  std::vector<std::uint64_t> keys_;                // chain key of each leading full block keyed
  std::vector<std::size_t> needs_;                 // per layer, the first position (sinks aside) it reads
  std::size_t given_back_ = 0;                     // blocks given back, from sink_blocks() on
  std::size_t last_given_back_ = kNone;            // the last of them
  std::vector<std::vector<Segment<T>>> segments_;  // per layer, what the last update returned
  std::size_t refetch_from_ = kNone;               // the first block the last store fetch found corrupt
};

static_assert(kv_cache_protocol<PagedKvCache<float>>);

}  // namespace KVCACHE_ABI
}  // namespace kvcache
