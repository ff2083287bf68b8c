/* SPDX-License-Identifier: Apache-2.0 */
/* kvcache's C API (C99): every cache variant and storage format of the C++ library behind
 * opaque handles, for engines written in C and for bindings (Python, Rust, Go, Zig). Link
 * kvcache_c: `cc -std=c99 engine.c $(pkg-config --cflags --libs kvcache)`, or CMake's
 * kvcache::kvcache_c (shared) and kvcache::kvcache_c_static.
 *
 *   kvcache_config config = {.layers = 2, .kv_heads = 4, .head_dim = 64, .capacity = 1024};
 *   kvcache_cache* cache;
 *   if (kvcache_create(KVCACHE_VARIANT_KV, KVCACHE_FORMAT_BFLOAT16, &config, &cache) != KVCACHE_OK)
 *     fprintf(stderr, "%s\n", kvcache_last_error());
 *   kvcache_tensor k = kvcache_token_major(k_data, KVCACHE_DTYPE_F32, tokens, 4, 64);  // [T, H, D]
 *   kvcache_update(cache, layer, &k, &v, positions);          // then, reading what it returned:
 *   kvcache_attention(cache, layer, &q, positions, out, NULL);  // out laid out as q
 *   kvcache_destroy(cache);
 *
 * Every call that can fail returns a kvcache_status; KVCACHE_OK is 0. A failed call changes
 * nothing (the C++ library's strong guarantee holds across the boundary, where no exception
 * ever passes), and kvcache_last_error() says what was expected and what was given. A handle
 * is used by one thread at a time, as its C++ cache is (docs/threads.md); attention on
 * different layers may run on different threads.
 */
#ifndef KVCACHE_H
#define KVCACHE_H

#include <stddef.h>
#include <stdint.h>

#include "kvcache/version.hpp"

#if defined(__GNUC__) || defined(__clang__)
#define KVCACHE_C_API __attribute__((visibility("default")))
#else
#define KVCACHE_C_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* What a call returns: KVCACHE_OK, or the kind of failure (the C++ exception it stands for). */
typedef enum kvcache_status {
  KVCACHE_OK = 0,
  KVCACHE_ERROR_INVALID_ARGUMENT = 1, /* a bad shape, position, config value, file of another cache */
  KVCACHE_ERROR_OUT_OF_RANGE = 2,     /* a layer, row or length beyond what the cache holds */
  KVCACHE_ERROR_LENGTH = 3,           /* no room: capacity, free slots, free blocks */
  KVCACHE_ERROR_LOGIC = 4,            /* a call the handle's state refuses (a pool with sequences left) */
  KVCACHE_ERROR_RUNTIME = 5,          /* a file that cannot be read or written, or is corrupt; layers that disagree */
  KVCACHE_ERROR_OUT_OF_MEMORY = 6,
  KVCACHE_ERROR_UNKNOWN = 7
} kvcache_status;

/* The storage formats, one X(NAME, name) a format (name as kvcache_format_name gives it):
 * KVCACHE_FORMAT_FLOAT, _DOUBLE, _HALF, _BFLOAT16, _FP8_E4M3, _INT8_ROWS, _INT4_GROUPS,
 * _FP8_E4M3_HEADS, _INT4_ROTATED, in the order of kvcache::storage_formats
 * (include/kvcache/formats.hpp), which the library checks. A new format is one line at the end. */
#define KVCACHE_FORMATS(X)          \
  X(FLOAT, float)                   \
  X(DOUBLE, double)                 \
  X(HALF, half)                     \
  X(BFLOAT16, bfloat16)             \
  X(FP8_E4M3, fp8_e4m3)             \
  X(INT8_ROWS, int8_rows)           \
  X(INT4_GROUPS, int4_groups)       \
  X(FP8_E4M3_HEADS, fp8_e4m3_heads) \
  X(INT4_ROTATED, int4_rotated)     \
  X(INT8_HEADS, int8_heads)

#define KVCACHE_DETAIL_FORMAT_ENUM(NAME, name) KVCACHE_FORMAT_##NAME,
typedef enum kvcache_format { KVCACHE_FORMATS(KVCACHE_DETAIL_FORMAT_ENUM) KVCACHE_FORMAT_COUNT } kvcache_format;
#undef KVCACHE_DETAIL_FORMAT_ENUM

/* The cache variants: KvCache, ConcatKvCache, RingKvCache, SlotKvCache, PagedKvCache (a
 * sequence in a pool: kvcache_pool_sequence makes one). */
typedef enum kvcache_variant {
  KVCACHE_VARIANT_KV = 0,
  KVCACHE_VARIANT_CONCAT = 1,
  KVCACHE_VARIANT_RING = 2,
  KVCACHE_VARIANT_SLOT = 3,
  KVCACHE_VARIANT_PAGED = 4,
  KVCACHE_VARIANT_COUNT
} kvcache_variant;

/* What an engine's k, v, q and out buffers hold: float, bfloat16 or IEEE half (16-bit values
 * as uint16_t, read in place). A cache of format double takes F32 only. */
typedef enum kvcache_dtype { KVCACHE_DTYPE_F32 = 0, KVCACHE_DTYPE_BF16 = 1, KVCACHE_DTYPE_F16 = 2 } kvcache_dtype;

/* How a cache is sized (kvcache::KvCacheConfig). capacity: the most tokens a sequence (a slot)
 * may reach, required but for a ring (0: unbounded). window, sinks, slack: a ring's. batch: 0
 * is 1. key_scales, value_scales: for a format with static scales per (layer, kv head)
 * (fp8_e4m3_heads; kvcache_head_scale says which and gives them), layers x kv_heads each,
 * layer-major, copied; NULL for every other format (they scale each row or group themselves). */
typedef struct kvcache_config {
  size_t layers, batch, kv_heads, head_dim, capacity, window, sinks, slack;
  const float* key_scales;
  const float* value_scales;
} kvcache_config;

/* How a block pool is sized (kvcache::BlockPoolConfig): blocks of block_tokens tokens (0 is
 * 16), capacity the most tokens one sequence may reach (0: every block's worth). */
typedef struct kvcache_pool_config {
  size_t layers, kv_heads, head_dim, block_tokens, blocks, capacity;
  const float* key_scales;
  const float* value_scales;
} kvcache_pool_config;

/* A [batch, heads, tokens, head_dim] block of an engine's values, read in place: element
 * (b, h, t, d) is at data + b * batch_stride + h * head_stride + t * token_stride + d, in
 * elements of dtype. kvcache_head_major and kvcache_token_major fill one. */
typedef struct kvcache_tensor {
  const void* data;
  kvcache_dtype dtype;
  size_t batch, heads, tokens, head_dim;
  size_t batch_stride, head_stride, token_stride;
} kvcache_tensor;

/* A dense [batch, heads, tokens, head_dim] block. */
static inline kvcache_tensor kvcache_head_major(const void* data, kvcache_dtype dtype, size_t batch, size_t heads,
                                                size_t tokens, size_t head_dim) {
  kvcache_tensor t;
  t.data = data;
  t.dtype = dtype;
  t.batch = batch;
  t.heads = heads;
  t.tokens = tokens;
  t.head_dim = head_dim;
  t.batch_stride = heads * tokens * head_dim;
  t.head_stride = tokens * head_dim;
  t.token_stride = head_dim;
  return t;
}

/* A dense token-major [tokens, heads, head_dim] block of one sequence (batch 1), as most
 * engines hold a layer's new keys, values and queries. */
static inline kvcache_tensor kvcache_token_major(const void* data, kvcache_dtype dtype, size_t tokens, size_t heads,
                                                 size_t head_dim) {
  kvcache_tensor t;
  t.data = data;
  t.dtype = dtype;
  t.batch = 1;
  t.heads = heads;
  t.tokens = tokens;
  t.head_dim = head_dim;
  t.batch_stride = tokens * heads * head_dim;
  t.head_stride = head_dim;
  t.token_stride = heads * head_dim;
  return t;
}

/* kvcache::AttentionOptions: scale 0 is 1/sqrt(head_dim); window, sinks 0: none; threads 0:
 * automatic, 1: the caller's only. A NULL options pointer means all defaults. */
typedef struct kvcache_attention_options {
  float scale;
  size_t window, sinks, threads;
} kvcache_attention_options;

/* What a state file says of itself (kvcache_read_state_info): enough to create a cache that
 * loads it. */
typedef struct kvcache_state_info {
  kvcache_variant variant;
  kvcache_format format;
  kvcache_config config; /* no scales: the file brings them */
  size_t metadata_bytes;
} kvcache_state_info;

typedef struct kvcache_cache kvcache_cache;
typedef struct kvcache_pool kvcache_pool;

/* ---- the library */

/* The version of the library linked, as KVCACHE_VERSION gives the header's. */
KVCACHE_C_API int kvcache_version(void);
/* The message of this thread's last failed call ("" before any): valid until its next one. */
KVCACHE_C_API const char* kvcache_last_error(void);
/* "bfloat16", "fp8_e4m3", ...; NULL for a value that is no format. */
KVCACHE_C_API const char* kvcache_format_name(kvcache_format format);
/* "KvCache", "RingKvCache", ...; NULL for a value that is no variant. */
KVCACHE_C_API const char* kvcache_variant_name(kvcache_variant variant);
/* The format named `name` (as kvcache_format_name gives it). */
KVCACHE_C_API kvcache_status kvcache_format_from_name(const char* name, kvcache_format* format);
/* Bytes one token takes in `format`, K and V over every layer and kv head (row scales included);
 * 0 for a value that is no format. */
KVCACHE_C_API size_t kvcache_bytes_per_token(kvcache_format format, size_t layers, size_t kv_heads, size_t head_dim);
/* The head scale that stores values up to |largest| in `format` without clipping, for a format
 * whose config takes key_scales and value_scales (calibrate: each (layer, kv head)'s largest |K|
 * or |V| over a run, times a margin such as 1.25); 0 for every other format and for a value that
 * is no format. */
KVCACHE_C_API float kvcache_head_scale(kvcache_format format, float largest);

/* ---- caches */

/* A cache of `variant` (not PAGED: kvcache_pool_sequence) storing `format`, into *cache. */
KVCACHE_C_API kvcache_status kvcache_create(kvcache_variant variant, kvcache_format format,
                                            const kvcache_config* config, kvcache_cache** cache);
/* Frees a cache (a paged sequence gives its blocks back to its pool); NULL does nothing. */
KVCACHE_C_API void kvcache_destroy(kvcache_cache* cache);

/* What a cache is (KVCACHE_VARIANT_COUNT, KVCACHE_FORMAT_COUNT and 0 for NULL). */
KVCACHE_C_API kvcache_variant kvcache_variant_of(const kvcache_cache* cache);
KVCACHE_C_API kvcache_format kvcache_format_of(const kvcache_cache* cache);
KVCACHE_C_API size_t kvcache_layers(const kvcache_cache* cache);
/* The most tokens a sequence (a slot) may reach. */
KVCACHE_C_API size_t kvcache_capacity(const kvcache_cache* cache);
/* Bytes allocated for K and V (a paged sequence: of the blocks it holds). */
KVCACHE_C_API size_t kvcache_bytes(const kvcache_cache* cache);

/* Writes k and v [batch, kv_heads, T, head_dim] of layer `layer` at `positions` (T of them,
 * shared by every batch row; NULL if T is 0), which continue the layer's length. A slot
 * cache's every slot, admitting free ones (kvcache_update_rows writes chosen rows). */
KVCACHE_C_API kvcache_status kvcache_update(kvcache_cache* cache, size_t layer, const kvcache_tensor* k,
                                            const kvcache_tensor* v, const int64_t* positions);
/* A slot cache's update of `row_count` rows (acquired, distinct): k and v [row_count, kv_heads,
 * T, head_dim], batch row i into slot rows[i] at positions + i * positions_row_stride (a
 * stride of 0: one list for every row), each continuing its row's length. */
KVCACHE_C_API kvcache_status kvcache_update_rows(kvcache_cache* cache, size_t layer, const kvcache_tensor* k,
                                                 const kvcache_tensor* v, const int64_t* positions,
                                                 size_t positions_row_stride, const size_t* rows, size_t row_count);
/* Causal attention of q [batch, q_heads, T, head_dim] at q_positions (T a batch row, row i's at
 * q_positions + i * q_positions_row_stride; a stride of 0: one list) over what the layer's last
 * update returned (kvcache_update_rows: the rows it wrote), or over the layer's whole history
 * if a truncate, reset, release or load came after it. Writes out, laid out as q (its dtype,
 * shape and strides); out may be q's own buffer. */
KVCACHE_C_API kvcache_status kvcache_attention(kvcache_cache* cache, size_t layer, const kvcache_tensor* q,
                                               const int64_t* q_positions, size_t q_positions_row_stride, void* out,
                                               const kvcache_attention_options* options);

/* Tokens every layer holds (a slot cache: its longest row); KVCACHE_ERROR_RUNTIME if the
 * layers disagree (a forward pass stopped part-way: truncate repairs it). */
KVCACHE_C_API kvcache_status kvcache_length(const kvcache_cache* cache, size_t* length);
/* Tokens layer `layer` holds (a slot cache: its longest row there). */
KVCACHE_C_API kvcache_status kvcache_layer_length(const kvcache_cache* cache, size_t layer, size_t* length);
/* Forgets everything after `length` tokens (speculative decoding's rollback). */
KVCACHE_C_API kvcache_status kvcache_truncate(kvcache_cache* cache, size_t length);
/* Empties the cache (a slot cache frees every slot; a ring gives back its staging area). */
KVCACHE_C_API kvcache_status kvcache_reset(kvcache_cache* cache);
/* Gives back memory no token needs (docs/memory.md says what, for each variant). */
KVCACHE_C_API kvcache_status kvcache_shrink_to_fit(kvcache_cache* cache);

/* Writes the cache's state to `path` (atomically: through path + ".partial") with
 * `metadata_bytes` bytes of the caller's metadata. */
KVCACHE_C_API kvcache_status kvcache_save(const kvcache_cache* cache, const char* path, const char* metadata,
                                          size_t metadata_bytes);
/* Replaces the cache's state with the one saved at `path` (same variant, format and shape; a
 * paged sequence must be empty). Copies up to metadata_capacity bytes of the file's metadata
 * into `metadata` (NUL-terminated if there is room; NULL: none) and its length into
 * *metadata_bytes (NULL: not asked). */
KVCACHE_C_API kvcache_status kvcache_load(kvcache_cache* cache, const char* path, char* metadata,
                                          size_t metadata_capacity, size_t* metadata_bytes);
/* What the state file at `path` holds, without its data. */
KVCACHE_C_API kvcache_status kvcache_read_state_info(const char* path, kvcache_state_info* info);

/* ---- slot caches (KVCACHE_VARIANT_SLOT): rows with lengths of their own */

/* Admits a sequence: the lowest free slot into *row. KVCACHE_ERROR_LENGTH if none is free. */
KVCACHE_C_API kvcache_status kvcache_acquire(kvcache_cache* cache, size_t* row);
/* Finishes the sequence in `row`: forgets its tokens and frees the slot. */
KVCACHE_C_API kvcache_status kvcache_release(kvcache_cache* cache, size_t row);
KVCACHE_C_API kvcache_status kvcache_row_length(const kvcache_cache* cache, size_t row, size_t* length);
KVCACHE_C_API kvcache_status kvcache_truncate_row(kvcache_cache* cache, size_t row, size_t length);

/* ---- block pools and paged sequences (KVCACHE_VARIANT_PAGED) */

KVCACHE_C_API kvcache_status kvcache_pool_create(kvcache_format format, const kvcache_pool_config* config,
                                                 kvcache_pool** pool);
/* Frees a pool; KVCACHE_ERROR_LOGIC (and nothing freed) while a sequence of it remains. */
KVCACHE_C_API kvcache_status kvcache_pool_destroy(kvcache_pool* pool);
/* An empty sequence in `pool` into *sequence. */
KVCACHE_C_API kvcache_status kvcache_pool_sequence(kvcache_pool* pool, kvcache_cache** sequence);
KVCACHE_C_API size_t kvcache_pool_free_blocks(const kvcache_pool* pool);
KVCACHE_C_API size_t kvcache_pool_bytes(const kvcache_pool* pool);
/* Gives back the memory of free blocks that hold no reusable prefix. */
KVCACHE_C_API kvcache_status kvcache_pool_shrink_to_fit(kvcache_pool* pool);
/* Checks the pool's bookkeeping against its sequences (KVCACHE_ERROR_LOGIC naming what differs). */
KVCACHE_C_API kvcache_status kvcache_pool_check(const kvcache_pool* pool);

/* A second sequence holding the same tokens, sharing every block, into *fork. */
KVCACHE_C_API kvcache_status kvcache_fork(const kvcache_cache* sequence, kvcache_cache** fork);
/* Starts an empty sequence with a prompt of `count` token ids: takes the pool's blocks of its
 * longest prefix already computed; *reused (NULL: not asked) is how many tokens to skip. */
KVCACHE_C_API kvcache_status kvcache_reuse_prefix(kvcache_cache* sequence, const int32_t* prompt, size_t count,
                                                  size_t* reused);
/* Adds the ids of tokens after those given so far, so that the blocks they fill are keyed. */
KVCACHE_C_API kvcache_status kvcache_add_token_ids(kvcache_cache* sequence, const int32_t* ids, size_t count);

#ifdef __cplusplus
}
#endif

#endif /* KVCACHE_H */
