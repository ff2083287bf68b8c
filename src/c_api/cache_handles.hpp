// SPDX-License-Identifier: Apache-2.0
#pragma once

// The handles of one storage format T: each variant's C++ cache behind kvcache_cache, and the
// block pool behind kvcache_pool. Included by the translation unit of each format
// (format.cpp.in), which instantiates make_cache<T> and make_pool<T>.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "handles.hpp"
#include "kvcache/kvcache.hpp"

namespace kvcache::c_api {

template <class Cache>
inline constexpr kvcache_variant kVariantOf = KVCACHE_VARIANT_KV;
template <class T>
inline constexpr kvcache_variant kVariantOf<ConcatKvCache<T>> = KVCACHE_VARIANT_CONCAT;
template <class T>
inline constexpr kvcache_variant kVariantOf<RingKvCache<T>> = KVCACHE_VARIANT_RING;
template <class T>
inline constexpr kvcache_variant kVariantOf<SlotKvCache<T>> = KVCACHE_VARIANT_SLOT;
template <class T>
inline constexpr kvcache_variant kVariantOf<PagedKvCache<T>> = KVCACHE_VARIANT_PAGED;

/// Format T's place in kvcache::storage_formats, which is its kvcache_format.
template <class T>
constexpr kvcache_format format_of() noexcept {
  return [&]<class... Ts>(type_list<Ts...>) {
    int i = 0, found = 0;
    ((std::is_same_v<T, Ts> ? (found = i, ++i) : ++i), ...);
    return static_cast<kvcache_format>(found);
  }(storage_formats{});
}

/// An engine's buffer as the view of its dtype: f(TensorView<const In>) for In float, bfloat16 or half.
template <class F>
decltype(auto) with_view(const char* call, const char* name, const kvcache_tensor& t, const F& f) {
  const Shape shape{t.batch, t.heads, t.tokens, t.head_dim};
  const Strides strides{t.batch_stride, t.head_stride, t.token_stride};
  switch (as_int(t.dtype)) {
    case KVCACHE_DTYPE_F32:
      return f(TensorView<const float>(static_cast<const float*>(t.data), shape, strides));
    case KVCACHE_DTYPE_BF16:
      return f(TensorView<const bfloat16>(static_cast<const bfloat16*>(t.data), shape, strides));
    case KVCACHE_DTYPE_F16:
      return f(TensorView<const half>(static_cast<const half*>(t.data), shape, strides));
    default:
      break;
  }
  throw std::invalid_argument(std::string(call) + ": " + name +
                              " dtype: expected KVCACHE_DTYPE_F32, _BF16 or _F16, given " +
                              std::to_string(as_int(t.dtype)));
}

/// A dtype's name for messages.
inline std::string dtype_name(int dtype) {
  switch (dtype) {
    case KVCACHE_DTYPE_F32:
      return "F32";
    case KVCACHE_DTYPE_BF16:
      return "BF16";
    case KVCACHE_DTYPE_F16:
      return "F16";
    default:
      return std::to_string(dtype);
  }
}

/// Checks that v holds k's dtype (which with_view has checked is one).
inline void check_same_dtype(const char* call, const kvcache_tensor& k, const kvcache_tensor& v) {
  if (as_int(k.dtype) != as_int(v.dtype)) {
    throw std::invalid_argument(std::string(call) + ": v dtype: expected k's " + dtype_name(as_int(k.dtype)) +
                                ", given " + dtype_name(as_int(v.dtype)));
  }
}

/// One cache of any variant storing T, and what its layers' last updates returned (attention
/// reads them until a whole-cache call makes them stale).
template <class Cache>
class CacheHandle final : public kvcache_cache {
 public:
  using T = typename Cache::value_type;

  explicit CacheHandle(const KvCacheConfig& config) : cache_(config), last_(cache_.layers()) {}

  [[nodiscard]] kvcache_variant variant() const noexcept override { return kVariantOf<Cache>; }
  [[nodiscard]] kvcache_format format() const noexcept override { return format_of<T>(); }
  [[nodiscard]] std::size_t layers() const noexcept override { return cache_.layers(); }
  [[nodiscard]] std::size_t capacity() const noexcept override { return cache_.capacity(); }
  [[nodiscard]] std::size_t bytes() const noexcept override { return cache_.bytes(); }

  void update(std::size_t layer, const kvcache_tensor& k, const kvcache_tensor& v,
              const Positions& positions) override {
    with_view("kvcache_update", "k", k, [&](auto k_view) {
      check_same_dtype("kvcache_update", k, v);
      using View = decltype(k_view);
      const View v_view(static_cast<typename View::element_type*>(v.data), {v.batch, v.heads, v.tokens, v.head_dim},
                        {v.batch_stride, v.head_stride, v.token_stride});
      remember(layer, cache_.update(layer, k_view, v_view, positions));
    });
  }

  void update_rows(std::size_t layer, const kvcache_tensor& k, const kvcache_tensor& v, const Positions& positions,
                   Rows rows) override {
    if constexpr (kVariantOf<Cache> == KVCACHE_VARIANT_SLOT) {
      with_view("kvcache_update_rows", "k", k, [&](auto k_view) {
        check_same_dtype("kvcache_update_rows", k, v);
        using View = decltype(k_view);
        const View v_view(static_cast<typename View::element_type*>(v.data), {v.batch, v.heads, v.tokens, v.head_dim},
                          {v.batch_stride, v.head_stride, v.token_stride});
        remember(layer, cache_.update(layer, k_view, v_view, positions, rows));
      });
    } else {
      refuse("kvcache_update_rows", "a SlotKvCache (KVCACHE_VARIANT_SLOT)");
    }
  }

  void attention(std::size_t layer, const kvcache_tensor& q, const Positions& positions, void* out,
                 const AttentionOptions& options) override {
    if (layer >= cache_.layers()) detail::check_layer("kvcache_attention", layer, cache_.layers());
    const History<T> history = last_[layer] ? *last_[layer] : cache_.history(layer);
    with_view("kvcache_attention", "q", q, [&](auto q_view) {
      using Value = std::remove_const_t<typename decltype(q_view)::element_type>;
      causal_attention(q_view, positions, history,
                       TensorView<Value>(static_cast<Value*>(out), q_view.shape(), q_view.strides()), options);
    });
  }

  [[nodiscard]] std::size_t length() const override { return cache_.length(); }
  [[nodiscard]] std::size_t layer_length(std::size_t layer) const override {
    if constexpr (kVariantOf<Cache> == KVCACHE_VARIANT_SLOT) {
      if (layer >= cache_.layers()) detail::check_layer("kvcache_layer_length", layer, cache_.layers());
      std::size_t longest = 0;
      for (std::size_t row = 0; row < cache_.slots(); ++row) longest = std::max(longest, cache_.row_length(row, layer));
      return longest;
    } else {
      return cache_.length(layer);
    }
  }
  void truncate(std::size_t length) override {
    cache_.truncate(length);
    forget();
  }
  void reset() override {
    cache_.reset();
    forget();
  }
  void shrink_to_fit() override {
    cache_.shrink_to_fit();
    forget();
  }
  void save(const char* path, std::string_view metadata) const override {
    save_state(cache_, std::filesystem::path(path), metadata);
  }
  [[nodiscard]] std::string load(const char* path) override {
    std::string metadata = load_state(cache_, std::filesystem::path(path));
    forget();
    return metadata;
  }

  [[nodiscard]] std::size_t acquire() override {
    if constexpr (kVariantOf<Cache> == KVCACHE_VARIANT_SLOT) return cache_.acquire();
    refuse("kvcache_acquire", "a SlotKvCache (KVCACHE_VARIANT_SLOT)");
  }
  void release(std::size_t row) override {
    if constexpr (kVariantOf<Cache> == KVCACHE_VARIANT_SLOT) {
      cache_.release(row);
      forget();
    } else {
      refuse("kvcache_release", "a SlotKvCache (KVCACHE_VARIANT_SLOT)");
    }
  }
  [[nodiscard]] std::size_t row_length(std::size_t row) const override {
    if constexpr (kVariantOf<Cache> == KVCACHE_VARIANT_SLOT) return cache_.row_length(row);
    refuse("kvcache_row_length", "a SlotKvCache (KVCACHE_VARIANT_SLOT)");
  }
  void truncate_row(std::size_t row, std::size_t length) override {
    if constexpr (kVariantOf<Cache> == KVCACHE_VARIANT_SLOT) {
      cache_.truncate(row, length);
      forget();
    } else {
      refuse("kvcache_truncate_row", "a SlotKvCache (KVCACHE_VARIANT_SLOT)");
    }
  }

  [[nodiscard]] std::unique_ptr<kvcache_cache> fork() const override {
    if constexpr (kVariantOf<Cache> == KVCACHE_VARIANT_PAGED) {
      return std::make_unique<CacheHandle>(cache_.fork(), pool_);
    } else {
      refuse("kvcache_fork", "a PagedKvCache (KVCACHE_VARIANT_PAGED)");
    }
  }
  [[nodiscard]] std::size_t reuse_prefix(std::span<const TokenId> prompt) override {
    if constexpr (kVariantOf<Cache> == KVCACHE_VARIANT_PAGED) {
      const std::size_t reused = cache_.reuse_prefix(prompt);
      forget();
      return reused;
    } else {
      refuse("kvcache_reuse_prefix", "a PagedKvCache (KVCACHE_VARIANT_PAGED)");
    }
  }
  void add_token_ids(std::span<const TokenId> ids) override {
    if constexpr (kVariantOf<Cache> == KVCACHE_VARIANT_PAGED) {
      cache_.add_token_ids(ids);
    } else {
      refuse("kvcache_add_token_ids", "a PagedKvCache (KVCACHE_VARIANT_PAGED)");
    }
  }

  /// A paged sequence's pool, whose count of sequences this handle is one of.
  CacheHandle(Cache&& cache, kvcache_pool* pool) : cache_(std::move(cache)), last_(cache_.layers()), pool_(pool) {
    ++pool_->sequences;
  }
  ~CacheHandle() override {
    if (pool_ != nullptr) --pool_->sequences;
  }

 private:
  [[noreturn]] void refuse(const char* call, const char* expected) const {
    throw std::invalid_argument(std::string(call) + ": cache: expected " + expected + ", given a " +
                                kVariantNames[kVariantOf<Cache>]);
  }
  void remember(std::size_t layer, const History<T>& history) { last_[layer] = history; }
  void forget() noexcept {
    for (auto& h : last_) h.reset();
  }

  Cache cache_;
  std::vector<std::optional<History<T>>> last_;  // per layer
  kvcache_pool* pool_ = nullptr;
};

template <class T>
class PoolHandle final : public kvcache_pool {
 public:
  explicit PoolHandle(const BlockPoolConfig& config) : pool_(config) {}

  [[nodiscard]] std::unique_ptr<kvcache_cache> sequence() override {
    return std::make_unique<CacheHandle<PagedKvCache<T>>>(PagedKvCache<T>(pool_), this);
  }
  [[nodiscard]] std::size_t free_blocks() const noexcept override { return pool_.free_blocks(); }
  [[nodiscard]] std::size_t bytes() const noexcept override { return pool_.bytes(); }
  void shrink_to_fit() noexcept override { pool_.shrink_to_fit(); }
  void check() const override { pool_.check_invariants(); }

 private:
  BlockPool<T> pool_;
};

template <class T>
std::unique_ptr<kvcache_cache> make_cache(int variant, const KvCacheConfig& config) {
  switch (variant) {
    case KVCACHE_VARIANT_KV:
      return std::make_unique<CacheHandle<KvCache<T>>>(config);
    case KVCACHE_VARIANT_CONCAT:
      return std::make_unique<CacheHandle<ConcatKvCache<T>>>(config);
    case KVCACHE_VARIANT_RING:
      return std::make_unique<CacheHandle<RingKvCache<T>>>(config);
    case KVCACHE_VARIANT_SLOT:
      return std::make_unique<CacheHandle<SlotKvCache<T>>>(config);
    default:
      break;
  }
  throw std::invalid_argument(
      "kvcache_create: variant: expected KVCACHE_VARIANT_KV, _CONCAT, _RING or _SLOT (a paged "
      "sequence comes from kvcache_pool_sequence), given " +
      std::to_string(static_cast<int>(variant)));
}

template <class T>
std::unique_ptr<kvcache_pool> make_pool(const BlockPoolConfig& config) {
  return std::make_unique<PoolHandle<T>>(config);
}

}  // namespace kvcache::c_api
