/* SPDX-License-Identifier: Apache-2.0 */
/* A C engine's decode loop over kvcache's C API: a bfloat16 cache for a 2-layer model with
 * grouped-query heads, a 5-token prompt, then tokens one at a time, attention at every layer; the
 * state saved to a file and loaded into a second cache made from what the file says, which must
 * then give the very same output. Every value of kv head h is h + 1, so query head i, which reads
 * kv head i / (Q_HEADS / KV_HEADS), must output exactly that.
 *
 *   cc -std=c99 decode.c $(pkg-config --cflags --libs kvcache) -o decode && ./decode state.kvstate
 */
#include <kvcache.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { LAYERS = 2, Q_HEADS = 8, KV_HEADS = 2, HEAD_DIM = 64, PROMPT = 5, STEPS = 8, CAPACITY = 64 };

static void check(kvcache_status status, const char* call) {
  if (status != KVCACHE_OK) {
    fprintf(stderr, "%s failed (status %d): %s\n", call, (int)status, kvcache_last_error());
    exit(1);
  }
}

/* float to bfloat16 bits, rounded to nearest even: the engine's queries are bfloat16. */
static uint16_t bf16(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  return (uint16_t)((bits + 0x7FFFU + ((bits >> 16) & 1U)) >> 16);
}

static float from_bf16(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float x;
  memcpy(&x, &bits, sizeof x);
  return x;
}

/* Token-major [T, H, D] buffers of one layer's new keys, values and queries. */
static float k[PROMPT * KV_HEADS * HEAD_DIM], v[PROMPT * KV_HEADS * HEAD_DIM];
static uint16_t q[PROMPT * Q_HEADS * HEAD_DIM], out[PROMPT * Q_HEADS * HEAD_DIM];

static void make_tokens(int first, int tokens) {
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < KV_HEADS; ++h) {
      for (int d = 0; d < HEAD_DIM; ++d) {
        k[(t * KV_HEADS + h) * HEAD_DIM + d] = sinf((float)(first + t) * 0.1f + (float)d);
        v[(t * KV_HEADS + h) * HEAD_DIM + d] = (float)(h + 1);
      }
    }
    for (int i = 0; i < Q_HEADS * HEAD_DIM; ++i) q[t * Q_HEADS * HEAD_DIM + i] = bf16(cosf((float)i));
  }
}

/* One forward pass of `tokens` tokens at positions first...: every layer's update, then its
 * attention. Returns 0 if every output is its kv head's value. */
static int forward(kvcache_cache* cache, int first, int tokens) {
  int64_t positions[PROMPT];
  for (int t = 0; t < tokens; ++t) positions[t] = first + t;
  make_tokens(first, tokens);
  const kvcache_tensor k_new = kvcache_token_major(k, KVCACHE_DTYPE_F32, (size_t)tokens, KV_HEADS, HEAD_DIM);
  const kvcache_tensor v_new = kvcache_token_major(v, KVCACHE_DTYPE_F32, (size_t)tokens, KV_HEADS, HEAD_DIM);
  const kvcache_tensor q_new = kvcache_token_major(q, KVCACHE_DTYPE_BF16, (size_t)tokens, Q_HEADS, HEAD_DIM);
  for (size_t layer = 0; layer < LAYERS; ++layer) {
    check(kvcache_update(cache, layer, &k_new, &v_new, positions), "kvcache_update");
    check(kvcache_attention(cache, layer, &q_new, positions, 0, out, NULL), "kvcache_attention");
  }
  for (int i = 0; i < tokens * Q_HEADS * HEAD_DIM; ++i) {
    const int head = i / HEAD_DIM % Q_HEADS;
    if (from_bf16(out[i]) != (float)(head / (Q_HEADS / KV_HEADS) + 1)) return 1;
  }
  return 0;
}

int main(int argc, char** argv) {
  const char* path = argc > 1 ? argv[1] : "decode.kvstate";
  if (kvcache_version() != KVCACHE_VERSION) {
    fprintf(stderr, "kvcache.h is version %d, the library linked %d\n", KVCACHE_VERSION, kvcache_version());
    return 1;
  }
  kvcache_config config = {.layers = LAYERS, .kv_heads = KV_HEADS, .head_dim = HEAD_DIM, .capacity = CAPACITY};
  kvcache_cache* cache = NULL;
  check(kvcache_create(KVCACHE_VARIANT_KV, KVCACHE_FORMAT_BFLOAT16, &config, &cache), "kvcache_create");

  int wrong = forward(cache, 0, PROMPT);
  for (int step = 0; step < STEPS; ++step) wrong += forward(cache, PROMPT + step, 1);
  size_t length = 0;
  check(kvcache_length(cache, &length), "kvcache_length");

  /* A bad call changes nothing: a position that does not continue the layer's length. */
  const int64_t skipped = (int64_t)length + 1;
  const kvcache_tensor one = kvcache_token_major(k, KVCACHE_DTYPE_F32, 1, KV_HEADS, HEAD_DIM);
  if (kvcache_update(cache, 0, &one, &one, &skipped) != KVCACHE_ERROR_INVALID_ARGUMENT) wrong += 1;
  printf("a refused update: %s\n", kvcache_last_error());

  const char metadata[] = "kvcache C example";
  check(kvcache_save(cache, path, metadata, sizeof metadata - 1), "kvcache_save");
  kvcache_state_info info;
  check(kvcache_read_state_info(path, &info), "kvcache_read_state_info");
  kvcache_cache* restored = NULL;
  check(kvcache_create(info.variant, info.format, &info.config, &restored), "kvcache_create");
  char loaded[64];
  check(kvcache_load(restored, path, loaded, sizeof loaded, NULL), "kvcache_load");
  if (strcmp(loaded, metadata) != 0) wrong += 1;

  /* The next token through both caches: the same output, bit for bit. */
  wrong += forward(cache, (int)length, 1);
  uint16_t expected[Q_HEADS * HEAD_DIM];
  memcpy(expected, out, sizeof expected);
  wrong += forward(restored, (int)length, 1);
  if (memcmp(expected, out, sizeof expected) != 0) wrong += 1;

  printf("kvcache C example: %s cache of %zu tokens, %zu bytes, saved and loaded from %s: %s\n",
         kvcache_format_name(kvcache_format_of(cache)), length + 1, kvcache_bytes(cache), path,
         wrong == 0 ? "OK" : "WRONG");
  kvcache_destroy(restored);
  kvcache_destroy(cache);
  remove(path);
  return wrong == 0 ? 0 : 1;
}
