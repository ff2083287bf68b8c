// SPDX-License-Identifier: Apache-2.0
// kvcache.h's functions: each checks its pointers, calls the handle inside guarded(), which
// turns any exception into a status and this thread's last error, and never lets one through.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <new>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

#include "handles.hpp"
#include "kvcache.h"
#include "kvcache/size.hpp"
#include "kvcache/state_file.hpp"

namespace kvcache::c_api {
namespace {

thread_local std::string last_error;

kvcache_status fail(kvcache_status status, const char* message) noexcept {
  try {
    last_error = message;
  } catch (...) {  // no memory for the message: an empty one says less, but nothing is thrown
    last_error.clear();
  }
  return status;
}

/// Runs f(), returning KVCACHE_OK, or the status of the exception it threw.
template <class F>
kvcache_status guarded(const F& f) noexcept {
  try {
    f();
    return KVCACHE_OK;
  } catch (const std::invalid_argument& e) {
    return fail(KVCACHE_ERROR_INVALID_ARGUMENT, e.what());
  } catch (const std::out_of_range& e) {
    return fail(KVCACHE_ERROR_OUT_OF_RANGE, e.what());
  } catch (const std::length_error& e) {
    return fail(KVCACHE_ERROR_LENGTH, e.what());
  } catch (const std::logic_error& e) {
    return fail(KVCACHE_ERROR_LOGIC, e.what());
  } catch (const std::bad_alloc& e) {
    return fail(KVCACHE_ERROR_OUT_OF_MEMORY, e.what());
  } catch (const std::runtime_error& e) {  // files (std::filesystem::filesystem_error too)
    return fail(KVCACHE_ERROR_RUNTIME, e.what());
  } catch (const std::exception& e) {
    return fail(KVCACHE_ERROR_UNKNOWN, e.what());
  } catch (...) {
    return fail(KVCACHE_ERROR_UNKNOWN, "an exception that is no std::exception");
  }
}

/// std::invalid_argument unless `pointer` is given.
template <class P>
void require(const P* pointer, const char* call, const char* name) {
  if (pointer == nullptr)
    throw std::invalid_argument(std::string(call) + ": " + name + ": expected a pointer, given NULL");
}

/// Calls f.template operator()<T>() for the format T that `format` (a kvcache_format's value)
/// names.
template <class F>
decltype(auto) with_format(const char* call, int format, const F& f) {
  return [&]<std::size_t... I>(std::index_sequence<I...>)->decltype(auto) {
    using Result = decltype(f.template operator()<storage_formats::at<0>>());
    if constexpr (std::is_void_v<Result>) {
      bool done = false;
      ((format == static_cast<int>(I) ? (f.template operator()<storage_formats::at<I>>(), done = true) : false), ...);
      if (!done)
        throw std::invalid_argument(std::string(call) + ": format: expected a kvcache_format, given " +
                                    std::to_string(format));
    } else {
      Result result{};
      bool done = false;
      ((format == static_cast<int>(I) ? (result = f.template operator()<storage_formats::at<I>>(), done = true)
                                      : false),
       ...);
      if (!done)
        throw std::invalid_argument(std::string(call) + ": format: expected a kvcache_format, given " +
                                    std::to_string(format));
      return result;
    }
  }
  (std::make_index_sequence<storage_formats::size>{});
}

KvCacheConfig cache_config(const kvcache_config& c) {
  KvCacheConfig config{.layers = c.layers,
                       .batch = c.batch == 0 ? std::size_t{1} : c.batch,
                       .kv_heads = c.kv_heads,
                       .head_dim = c.head_dim,
                       .capacity = c.capacity,
                       .window = c.window,
                       .sinks = c.sinks,
                       .slack = c.slack};
  const std::size_t scales = c.layers * c.kv_heads;
  if (c.key_scales != nullptr) config.key_scales = std::span<const float>(c.key_scales, scales);
  if (c.value_scales != nullptr) config.value_scales = std::span<const float>(c.value_scales, scales);
  return config;
}

kvcache_tensor checked_tensor(const kvcache_tensor* t, const char* call, const char* name) {
  require(t, call, name);
  return *t;
}

}  // namespace
}  // namespace kvcache::c_api

using kvcache::c_api::guarded;
using kvcache::c_api::require;

extern "C" {

int kvcache_version(void) { return KVCACHE_VERSION; }

const char* kvcache_last_error(void) { return kvcache::c_api::last_error.c_str(); }

const char* kvcache_format_name(kvcache_format format) {
  const char* name = nullptr;
  kvcache::for_each_format([&, i = 0]<class T>() mutable {
    if (kvcache::c_api::as_int(format) == i++) name = kvcache::format_name<T>();
  });
  return name;
}

const char* kvcache_variant_name(kvcache_variant variant) {
  const int i = kvcache::c_api::as_int(variant);
  return i >= 0 && i < KVCACHE_VARIANT_COUNT ? kvcache::c_api::kVariantNames[i] : nullptr;
}

kvcache_status kvcache_format_from_name(const char* name, kvcache_format* format) {
  return guarded([&] {
    require(name, "kvcache_format_from_name", "name");
    require(format, "kvcache_format_from_name", "format");
    for (int f = 0; f < KVCACHE_FORMAT_COUNT; ++f) {
      if (std::strcmp(kvcache_format_name(static_cast<kvcache_format>(f)), name) == 0) {
        *format = static_cast<kvcache_format>(f);
        return;
      }
    }
    std::string known;
    for (int f = 0; f < KVCACHE_FORMAT_COUNT; ++f) {
      known += std::string(known.empty() ? "" : ", ") + kvcache_format_name(static_cast<kvcache_format>(f));
    }
    throw std::invalid_argument(std::string("kvcache_format_from_name: name: expected one of ") + known + ", given \"" +
                                name + "\"");
  });
}

size_t kvcache_bytes_per_token(kvcache_format format, size_t layers, size_t kv_heads, size_t head_dim) {
  std::size_t bytes = 0;
  (void)guarded([&] {
    bytes = kvcache::c_api::with_format("kvcache_bytes_per_token", kvcache::c_api::as_int(format), [&]<class T>() {
      return kvcache::kv_bytes_per_token<T>(layers, kv_heads, head_dim);
    });
  });
  return bytes;
}

float kvcache_head_scale(kvcache_format format, float largest) {
  float scale = 0.0F;
  (void)guarded([&] {
    scale = kvcache::c_api::with_format("kvcache_head_scale", kvcache::c_api::as_int(format), [&]<class T>() {
      if constexpr (kvcache::detail::has_head_scales<T>) {
        return kvcache::storage_codec<T>::scale_for(std::fabs(largest));
      } else {
        return 0.0F;
      }
    });
  });
  return scale;
}

kvcache_status kvcache_create(kvcache_variant variant, kvcache_format format, const kvcache_config* config,
                              kvcache_cache** cache) {
  return guarded([&] {
    require(config, "kvcache_create", "config");
    require(cache, "kvcache_create", "cache");
    const kvcache::KvCacheConfig c = kvcache::c_api::cache_config(*config);
    *cache = kvcache::c_api::with_format("kvcache_create", kvcache::c_api::as_int(format), [&]<class T>() {
               return kvcache::c_api::make_cache<T>(kvcache::c_api::as_int(variant), c);
             }).release();
  });
}

void kvcache_destroy(kvcache_cache* cache) { delete cache; }

kvcache_variant kvcache_variant_of(const kvcache_cache* cache) {
  return cache == nullptr ? KVCACHE_VARIANT_COUNT : cache->variant();
}
kvcache_format kvcache_format_of(const kvcache_cache* cache) {
  return cache == nullptr ? KVCACHE_FORMAT_COUNT : cache->format();
}
size_t kvcache_layers(const kvcache_cache* cache) { return cache == nullptr ? 0 : cache->layers(); }
size_t kvcache_capacity(const kvcache_cache* cache) { return cache == nullptr ? 0 : cache->capacity(); }
size_t kvcache_bytes(const kvcache_cache* cache) { return cache == nullptr ? 0 : cache->bytes(); }

kvcache_status kvcache_update(kvcache_cache* cache, size_t layer, const kvcache_tensor* k, const kvcache_tensor* v,
                              const int64_t* positions) {
  return guarded([&] {
    require(cache, "kvcache_update", "cache");
    const kvcache_tensor key = kvcache::c_api::checked_tensor(k, "kvcache_update", "k");
    const kvcache_tensor value = kvcache::c_api::checked_tensor(v, "kvcache_update", "v");
    cache->update(layer, key, value, kvcache::Positions(positions, key.tokens));
  });
}

kvcache_status kvcache_update_rows(kvcache_cache* cache, size_t layer, const kvcache_tensor* k, const kvcache_tensor* v,
                                   const int64_t* positions, size_t positions_row_stride, const size_t* rows,
                                   size_t row_count) {
  return guarded([&] {
    require(cache, "kvcache_update_rows", "cache");
    const kvcache_tensor key = kvcache::c_api::checked_tensor(k, "kvcache_update_rows", "k");
    const kvcache_tensor value = kvcache::c_api::checked_tensor(v, "kvcache_update_rows", "v");
    if (row_count != 0) require(rows, "kvcache_update_rows", "rows");
    cache->update_rows(layer, key, value, kvcache::Positions(positions, key.tokens, positions_row_stride),
                       kvcache::Rows(rows, row_count));
  });
}

kvcache_status kvcache_attention(kvcache_cache* cache, size_t layer, const kvcache_tensor* q,
                                 const int64_t* q_positions, size_t q_positions_row_stride, void* out,
                                 const kvcache_attention_options* options) {
  return guarded([&] {
    require(cache, "kvcache_attention", "cache");
    const kvcache_tensor query = kvcache::c_api::checked_tensor(q, "kvcache_attention", "q");
    kvcache::AttentionOptions o;
    if (options != nullptr) {
      o.scale = options->scale;
      o.window = options->window;
      o.sinks = options->sinks;
      o.threads = options->threads;
    }
    cache->attention(layer, query, kvcache::Positions(q_positions, query.tokens, q_positions_row_stride), out, o);
  });
}

kvcache_status kvcache_length(const kvcache_cache* cache, size_t* length) {
  return guarded([&] {
    require(cache, "kvcache_length", "cache");
    require(length, "kvcache_length", "length");
    *length = cache->length();
  });
}

kvcache_status kvcache_layer_length(const kvcache_cache* cache, size_t layer, size_t* length) {
  return guarded([&] {
    require(cache, "kvcache_layer_length", "cache");
    require(length, "kvcache_layer_length", "length");
    *length = cache->layer_length(layer);
  });
}

kvcache_status kvcache_truncate(kvcache_cache* cache, size_t length) {
  return guarded([&] {
    require(cache, "kvcache_truncate", "cache");
    cache->truncate(length);
  });
}

kvcache_status kvcache_reset(kvcache_cache* cache) {
  return guarded([&] {
    require(cache, "kvcache_reset", "cache");
    cache->reset();
  });
}

kvcache_status kvcache_shrink_to_fit(kvcache_cache* cache) {
  return guarded([&] {
    require(cache, "kvcache_shrink_to_fit", "cache");
    cache->shrink_to_fit();
  });
}

kvcache_status kvcache_save(const kvcache_cache* cache, const char* path, const char* metadata, size_t metadata_bytes) {
  return guarded([&] {
    require(cache, "kvcache_save", "cache");
    require(path, "kvcache_save", "path");
    if (metadata_bytes != 0) require(metadata, "kvcache_save", "metadata");
    cache->save(path, std::string_view(metadata == nullptr ? "" : metadata, metadata_bytes));
  });
}

kvcache_status kvcache_load(kvcache_cache* cache, const char* path, char* metadata, size_t metadata_capacity,
                            size_t* metadata_bytes) {
  return guarded([&] {
    require(cache, "kvcache_load", "cache");
    require(path, "kvcache_load", "path");
    if (metadata_capacity != 0) require(metadata, "kvcache_load", "metadata");
    const std::string loaded = cache->load(path);
    // The state is loaded: what follows cannot fail.
    if (metadata != nullptr && metadata_capacity != 0) {
      const std::size_t n = std::min(loaded.size(), metadata_capacity);
      std::memcpy(metadata, loaded.data(), n);
      if (n < metadata_capacity) metadata[n] = '\0';
    }
    if (metadata_bytes != nullptr) *metadata_bytes = loaded.size();
  });
}

kvcache_status kvcache_read_state_info(const char* path, kvcache_state_info* info) {
  return guarded([&] {
    require(path, "kvcache_read_state_info", "path");
    require(info, "kvcache_read_state_info", "info");
    const kvcache::StateInfo read = kvcache::read_state_info(std::filesystem::path(path));
    kvcache_state_info out{};
    int variant = 0;
    while (variant < KVCACHE_VARIANT_COUNT && read.variant != kvcache::c_api::kVariantNames[variant]) ++variant;
    if (variant == KVCACHE_VARIANT_COUNT) {
      throw std::invalid_argument("kvcache_read_state_info: the file's variant: expected one of the C API's, found " +
                                  read.variant);
    }
    out.variant = static_cast<kvcache_variant>(variant);
    kvcache_format format{};
    if (kvcache_format_from_name(read.format.c_str(), &format) != KVCACHE_OK) {
      throw std::invalid_argument("kvcache_read_state_info: the file's format: expected one of the C API's, found " +
                                  read.format);
    }
    out.format = format;
    const kvcache::KvCacheConfig& c = read.config;
    out.config = kvcache_config{c.layers, c.batch, c.kv_heads, c.head_dim, c.capacity,
                                c.window, c.sinks, c.slack,    nullptr,    nullptr};
    out.metadata_bytes = read.metadata.size();
    *info = out;
  });
}

kvcache_status kvcache_acquire(kvcache_cache* cache, size_t* row) {
  return guarded([&] {
    require(cache, "kvcache_acquire", "cache");
    require(row, "kvcache_acquire", "row");
    *row = cache->acquire();
  });
}

kvcache_status kvcache_release(kvcache_cache* cache, size_t row) {
  return guarded([&] {
    require(cache, "kvcache_release", "cache");
    cache->release(row);
  });
}

kvcache_status kvcache_row_length(const kvcache_cache* cache, size_t row, size_t* length) {
  return guarded([&] {
    require(cache, "kvcache_row_length", "cache");
    require(length, "kvcache_row_length", "length");
    *length = cache->row_length(row);
  });
}

kvcache_status kvcache_truncate_row(kvcache_cache* cache, size_t row, size_t length) {
  return guarded([&] {
    require(cache, "kvcache_truncate_row", "cache");
    cache->truncate_row(row, length);
  });
}

kvcache_status kvcache_pool_create(kvcache_format format, const kvcache_pool_config* config, kvcache_pool** pool) {
  return guarded([&] {
    require(config, "kvcache_pool_create", "config");
    require(pool, "kvcache_pool_create", "pool");
    kvcache::BlockPoolConfig c{.layers = config->layers,
                               .kv_heads = config->kv_heads,
                               .head_dim = config->head_dim,
                               .block_tokens = config->block_tokens == 0 ? std::size_t{16} : config->block_tokens,
                               .blocks = config->blocks,
                               .capacity = config->capacity};
    const std::size_t scales = config->layers * config->kv_heads;
    if (config->key_scales != nullptr) c.key_scales = std::span<const float>(config->key_scales, scales);
    if (config->value_scales != nullptr) c.value_scales = std::span<const float>(config->value_scales, scales);
    *pool = kvcache::c_api::with_format("kvcache_pool_create", kvcache::c_api::as_int(format), [&]<class T>() {
              return kvcache::c_api::make_pool<T>(c);
            }).release();
  });
}

kvcache_status kvcache_pool_destroy(kvcache_pool* pool) {
  return guarded([&] {
    if (pool == nullptr) return;
    if (pool->sequences != 0) {
      throw std::logic_error(
          "kvcache_pool_destroy: expected a pool without sequences (kvcache_destroy each first), "
          "given one with " +
          std::to_string(pool->sequences));
    }
    delete pool;
  });
}

kvcache_status kvcache_pool_sequence(kvcache_pool* pool, kvcache_cache** sequence) {
  return guarded([&] {
    require(pool, "kvcache_pool_sequence", "pool");
    require(sequence, "kvcache_pool_sequence", "sequence");
    *sequence = pool->sequence().release();
  });
}

size_t kvcache_pool_free_blocks(const kvcache_pool* pool) { return pool == nullptr ? 0 : pool->free_blocks(); }
size_t kvcache_pool_bytes(const kvcache_pool* pool) { return pool == nullptr ? 0 : pool->bytes(); }

kvcache_status kvcache_pool_shrink_to_fit(kvcache_pool* pool) {
  return guarded([&] {
    require(pool, "kvcache_pool_shrink_to_fit", "pool");
    pool->shrink_to_fit();
  });
}

kvcache_status kvcache_pool_check(const kvcache_pool* pool) {
  return guarded([&] {
    require(pool, "kvcache_pool_check", "pool");
    pool->check();
  });
}

kvcache_status kvcache_fork(const kvcache_cache* sequence, kvcache_cache** fork) {
  return guarded([&] {
    require(sequence, "kvcache_fork", "sequence");
    require(fork, "kvcache_fork", "fork");
    *fork = sequence->fork().release();
  });
}

kvcache_status kvcache_reuse_prefix(kvcache_cache* sequence, const int32_t* prompt, size_t count, size_t* reused) {
  return guarded([&] {
    require(sequence, "kvcache_reuse_prefix", "sequence");
    if (count != 0) require(prompt, "kvcache_reuse_prefix", "prompt");
    const std::size_t n = sequence->reuse_prefix(std::span<const kvcache::TokenId>(prompt, count));
    if (reused != nullptr) *reused = n;
  });
}

kvcache_status kvcache_add_token_ids(kvcache_cache* sequence, const int32_t* ids, size_t count) {
  return guarded([&] {
    require(sequence, "kvcache_add_token_ids", "sequence");
    if (count != 0) require(ids, "kvcache_add_token_ids", "ids");
    sequence->add_token_ids(std::span<const kvcache::TokenId>(ids, count));
  });
}

}  // extern "C"
