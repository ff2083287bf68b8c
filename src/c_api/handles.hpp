// SPDX-License-Identifier: Apache-2.0
#pragma once

// What kvcache.h's opaque handles are: a cache or a pool of any variant and format behind one
// interface of virtual calls, which the C functions (kvcache_c.cpp) call inside a guard that
// turns exceptions into statuses. The handles of each format are made in a translation unit of
// their own (format.cpp.in), so that the attention kernel of each is compiled once, and in
// parallel.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "kvcache.h"
#include "kvcache/attention.hpp"
#include "kvcache/config.hpp"
#include "kvcache/formats.hpp"
#include "kvcache/paged_kv_cache.hpp"

/// A cache of any variant and format.
struct kvcache_cache {
  kvcache_cache() = default;
  kvcache_cache(const kvcache_cache&) = delete;
  kvcache_cache& operator=(const kvcache_cache&) = delete;
  virtual ~kvcache_cache() = default;

  [[nodiscard]] virtual kvcache_variant variant() const noexcept = 0;
  [[nodiscard]] virtual kvcache_format format() const noexcept = 0;
  [[nodiscard]] virtual std::size_t layers() const noexcept = 0;
  [[nodiscard]] virtual std::size_t capacity() const noexcept = 0;
  [[nodiscard]] virtual std::size_t bytes() const noexcept = 0;

  virtual void update(std::size_t layer, const kvcache_tensor& k, const kvcache_tensor& v,
                      const kvcache::Positions& positions) = 0;
  virtual void update_rows(std::size_t layer, const kvcache_tensor& k, const kvcache_tensor& v,
                           const kvcache::Positions& positions, kvcache::Rows rows) = 0;
  virtual void attention(std::size_t layer, const kvcache_tensor& q, const kvcache::Positions& positions, void* out,
                         const kvcache::AttentionOptions& options) = 0;

  [[nodiscard]] virtual std::size_t length() const = 0;
  [[nodiscard]] virtual std::size_t layer_length(std::size_t layer) const = 0;
  virtual void truncate(std::size_t length) = 0;
  virtual void reset() = 0;
  virtual void shrink_to_fit() = 0;
  virtual void save(const char* path, std::string_view metadata) const = 0;
  [[nodiscard]] virtual std::string load(const char* path) = 0;

  // Slot caches'.
  [[nodiscard]] virtual std::size_t acquire() = 0;
  virtual void release(std::size_t row) = 0;
  [[nodiscard]] virtual std::size_t row_length(std::size_t row) const = 0;
  virtual void truncate_row(std::size_t row, std::size_t length) = 0;

  // Paged sequences'.
  [[nodiscard]] virtual std::unique_ptr<kvcache_cache> fork() const = 0;
  [[nodiscard]] virtual std::size_t reuse_prefix(std::span<const kvcache::TokenId> prompt) = 0;
  virtual void add_token_ids(std::span<const kvcache::TokenId> ids) = 0;
};

/// A block pool of any format, and the count of its sequences (a pool outlives them).
struct kvcache_pool {
  kvcache_pool() = default;
  kvcache_pool(const kvcache_pool&) = delete;
  kvcache_pool& operator=(const kvcache_pool&) = delete;
  virtual ~kvcache_pool() = default;

  [[nodiscard]] virtual std::unique_ptr<kvcache_cache> sequence() = 0;
  [[nodiscard]] virtual std::size_t free_blocks() const noexcept = 0;
  [[nodiscard]] virtual std::size_t bytes() const noexcept = 0;
  virtual void shrink_to_fit() noexcept = 0;
  virtual void check() const = 0;

  std::size_t sequences = 0;
};

namespace kvcache::c_api {

/// A C enum's value as the int the caller passed, read without forming a C++ enum value: C
/// callers may pass values no enumerator has, which C++ may not hold in the enum's type.
template <class Enum>
int as_int(const Enum& e) noexcept {
  static_assert(sizeof(Enum) == sizeof(int), "kvcache.h's enums are ints");
  return std::bit_cast<int>(e);
}

/// A cache of `variant` (a kvcache_variant's value; not paged) storing T.
template <class T>
std::unique_ptr<kvcache_cache> make_cache(int variant, const KvCacheConfig& config);
/// A block pool storing T.
template <class T>
std::unique_ptr<kvcache_pool> make_pool(const BlockPoolConfig& config);

/// The C API's name of every variant, in kvcache_variant's order.
inline constexpr const char* kVariantNames[] = {"KvCache", "ConcatKvCache", "RingKvCache", "SlotKvCache",
                                                "PagedKvCache"};
static_assert(std::size(kVariantNames) == KVCACHE_VARIANT_COUNT, "a name for every kvcache_variant");

/// kvcache.h's formats are kvcache::storage_formats, in order and by name.
consteval bool same_name(const char* a, const char* b) {
  for (; *a != '\0' && *a == *b; ++a, ++b) {
  }
  return *a == *b;
}
#define KVCACHE_C_API_CHECK_FORMAT(NAME, name)                                                   \
  static_assert(KVCACHE_FORMAT_##NAME < storage_formats::size &&                                 \
                    same_name(format_name<storage_formats::at<KVCACHE_FORMAT_##NAME>>(), #name), \
                "kvcache.h: KVCACHE_FORMAT_" #NAME                                               \
                " must name kvcache::storage_formats' format at its place, "                     \
                "called " #name);
KVCACHE_FORMATS(KVCACHE_C_API_CHECK_FORMAT)
#undef KVCACHE_C_API_CHECK_FORMAT
static_assert(KVCACHE_FORMAT_COUNT == storage_formats::size,
              "kvcache.h: KVCACHE_FORMATS must list every format of kvcache::storage_formats (formats.hpp), in order");

}  // namespace kvcache::c_api
