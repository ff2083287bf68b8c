/* SPDX-License-Identifier: Apache-2.0 */
/* For c_api_test: calls of the C API with enum values no enumerator has, as a C caller may pass
 * them (C may hold any int in an enum; C++ may not form such a value). */
#include <kvcache.h>

kvcache_status kvcache_test_create_with_format(int format, const kvcache_config* config, kvcache_cache** cache) {
  return kvcache_create(KVCACHE_VARIANT_KV, (kvcache_format)format, config, cache);
}

kvcache_status kvcache_test_update_with_k_dtype(kvcache_cache* cache, const kvcache_tensor* k, int dtype,
                                                const int64_t* position) {
  kvcache_tensor bad = *k;
  bad.dtype = (kvcache_dtype)dtype;
  return kvcache_update(cache, 0, &bad, k, position);
}
