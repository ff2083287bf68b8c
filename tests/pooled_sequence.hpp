// SPDX-License-Identifier: Apache-2.0
#pragma once

// A PagedKvCache with a pool of its own, so that the typed suites and the equivalence cases
// construct it from a KvCacheConfig like every other variant.

#include <cstddef>
#include <memory>
#include <utility>

#include "kvcache/config.hpp"
#include "kvcache/paged_kv_cache.hpp"

namespace kvcache::testing {

template <class T>
struct PoolHolder {
  std::unique_ptr<BlockPool<T>> pool;
};

/// One sequence in a pool of blocks of `kPooledBlockTokens` tokens, enough of them for the
/// config's capacity (batch 1: a paged sequence is one row), with the config's window.
inline constexpr std::size_t kPooledBlockTokens = 4;

template <class T>
class PooledSequence : private PoolHolder<T>, public PagedKvCache<T> {
 public:
  explicit PooledSequence(const KvCacheConfig& c)
      : PoolHolder<T>{std::make_unique<BlockPool<T>>(
            BlockPoolConfig{.layers = c.layers,
                            .kv_heads = c.kv_heads,
                            .head_dim = c.head_dim,
                            .block_tokens = kPooledBlockTokens,
                            .blocks = (c.capacity + kPooledBlockTokens - 1) / kPooledBlockTokens + 1,
                            .capacity = c.capacity,
                            .window = c.window,
                            .sinks = c.sinks,
                            .slack = c.slack,
                            .key_scales = c.key_scales,
                            .value_scales = c.value_scales})},
        PagedKvCache<T>(*this->pool) {}
  PooledSequence(PooledSequence&&) noexcept = default;
  PooledSequence& operator=(PooledSequence&& other) noexcept {
    PagedKvCache<T>::operator=(std::move(other));  // leaves the old pool before it goes
    this->pool = std::move(other.pool);
    return *this;
  }

  [[nodiscard]] const BlockPool<T>& block_pool() const { return *this->pool; }
};

}  // namespace kvcache::testing
