// SPDX-License-Identifier: Apache-2.0
// A type that is no storage format: the build stops at KvCache<int>, saying what a format is.
#include "kvcache/kv_cache.hpp"

int main() {
  kvcache::KvCache<int> cache({.layers = 1, .kv_heads = 1, .head_dim = 8, .capacity = 4});
  return static_cast<int>(cache.capacity());
}
