// SPDX-License-Identifier: Apache-2.0
#pragma once

// Block stores: where a paged cache's full blocks outlive the process that computed them, so
// that other processes, on this machine or others, reuse a prompt's prefix instead of
// recomputing it. A store maps content keys to immutable, checksummed block records:
//
//   kvcache::FileBlockStore store({.directory = "/var/cache/kvcache", .model = "Qwen3-0.6B@c1899de"});
//   kvcache::PagedKvCache<kvcache::bfloat16> seq(pool);
//   const kvcache::PrefixReuse hit = seq.reuse_prefix(prompt, store);  // pool first, then the store
//   model.forward(std::span(prompt).subspan(hit.tokens), seq);           // the rest of the prompt
//   seq.save_prefix(store);                                              // its full blocks, for others
//
// A key names a block's whole prefix in a namespace: SHA-256 of the namespace (the model id the
// store was given, the storage format and its row layout, block_tokens, layers, kv_heads,
// head_dim, the record version, and head scales for formats that keep them), the previous
// block's key and the block's token ids, cut to 128 bits (block_key below, docs/store.md). Keys
// are the same on every build and machine, and a record carries its namespace and token ids,
// which a fetch verifies, so a collision or a stray record is a miss, never another prompt's rows.
// FileBlockStore (file_block_store.hpp) is the embedded default; RedisBlockStore
// (redis_block_store.hpp, target kvcache::redis) serves several machines.

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "kvcache/detail/sha256.hpp"
#include "kvcache/version.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// A block's key in a store: 128 bits (block_key), written as 32 lowercase hex digits.
struct BlockKey {
  std::array<std::uint8_t, 16> bytes{};

  /// The key as 32 lowercase hex digits, as stores name their records.
  [[nodiscard]] std::string hex() const {
    static constexpr char kDigits[] = "0123456789abcdef";
    std::string s;
    s.reserve(2 * bytes.size());
    for (const std::uint8_t b : bytes) {
      s += kDigits[b >> 4];
      s += kDigits[b & 0xFU];
    }
    return s;
  }
  friend bool operator==(const BlockKey&, const BlockKey&) = default;
};

/// SHA-256 of a namespace's canonical bytes: the root every key of that namespace hashes from.
using NamespaceDigest = detail::Sha256::Digest;

/// The key of a block of `ids` after the block keyed `parent` (all zero bytes for a prompt's
/// first block), in the namespace `space`: the first 16 bytes of
/// SHA-256(space || parent || each id as 4 little-endian bytes).
[[nodiscard]] inline BlockKey block_key(const NamespaceDigest& space, const BlockKey& parent,
                                        std::span<const std::int32_t> ids) noexcept {
  detail::Sha256 hash;
  hash.update(space.data(), space.size());
  hash.update(parent.bytes.data(), parent.bytes.size());
  for (const std::int32_t id : ids) {
    const auto u = static_cast<std::uint32_t>(id);
    const std::array<std::uint8_t, 4> le = {static_cast<std::uint8_t>(u), static_cast<std::uint8_t>(u >> 8),
                                            static_cast<std::uint8_t>(u >> 16), static_cast<std::uint8_t>(u >> 24)};
    hash.update(le.data(), le.size());
  }
  const NamespaceDigest digest = hash.digest();
  BlockKey key;
  std::copy_n(digest.begin(), key.bytes.size(), key.bytes.begin());
  return key;
}

/// What a store's backend throws when it cannot do what was asked (a file it cannot read or
/// write, a connection lost, a server refusing a write): the store, the key or step, and the
/// reason. The paged cache catches it and reports it as a miss with that message.
class BlockStoreError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// What a block store provides. Keys are the paged cache's store keys (block_key); records are
/// opaque bytes the cache writes and verifies. Every member is safe to call from several threads.
///
/// - model(): the model id the engine gave the store, the part of the namespace only it knows;
/// - contains(keys): how many leading keys the store holds (it stops at the first it lacks);
/// - get(keys, records): records.size() == keys.size(); fills records[i] for the leading keys
///   held and returns how many (it stops at the first it lacks);
/// - put(keys, records): stores each record under its key, each whole or not at all (a reader
///   never sees part of one), replacing any record the key held.
///
/// A backend throws BlockStoreError when it fails (never for a key it lacks: that is a miss).
template <class S>
concept BlockStore = requires(S& store, const S& view, std::span<const BlockKey> keys, std::span<std::string> out,
                              std::span<const std::string> records) {
  { view.model() } -> std::convertible_to<std::string_view>;
  { store.contains(keys) } -> std::same_as<std::size_t>;
  { store.get(keys, out) } -> std::same_as<std::size_t>;
  store.put(keys, records);
};

/// What PagedKvCache::reuse_prefix(prompt, store) did.
struct PrefixReuse {
  std::size_t tokens = 0;        // tokens the engine may skip: it feeds the prompt from here
  std::size_t pool_blocks = 0;   // blocks found in the pool
  std::size_t store_blocks = 0;  // blocks fetched from the store and verified
  std::string error;             // why fetching stopped short of a plain miss; empty for none
};

/// What PagedKvCache::save_prefix(store) did.
struct PrefixSave {
  std::size_t held = 0;     // leading full blocks the store already held
  std::size_t written = 0;  // blocks written after them
  std::string error;        // why writing stopped before the sequence's last full block; empty for none
};

}  // namespace KVCACHE_ABI
}  // namespace kvcache
