// SPDX-License-Identifier: Apache-2.0
// A consumer of the packaged library: every variant through the protocol, then attention; a
// bfloat16 cache with no Eigen anywhere (the library needs only the standard library); and the
// package's version, which must be the header's.
#include <cmath>
#include <cstdio>
#include <kvcache/kvcache.hpp>
#include <string>
#include <utility>
#include <vector>

template <kvcache::kv_cache_protocol Cache>
std::vector<float> attend(Cache& cache) {
  const std::size_t tokens = 5, kv_heads = 2, q_heads = 4, dim = 8;
  std::vector<float> q(q_heads * tokens * dim), k(kv_heads * tokens * dim), v(k.size()), out(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(static_cast<float>(i));
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = std::cos(static_cast<float>(i)), v[i] = static_cast<float>(i % 7);
  const std::vector<std::int64_t> positions = {0, 1, 2, 3, 4};
  const auto history = cache.update(0, kvcache::TensorView<const float>(k.data(), {1, kv_heads, tokens, dim}),
                                    kvcache::TensorView<const float>(v.data(), {1, kv_heads, tokens, dim}), positions);
  kvcache::causal_attention(kvcache::TensorView<const float>(q.data(), {1, q_heads, tokens, dim}), positions, history,
                            kvcache::TensorView<float>(out.data(), {1, q_heads, tokens, dim}));
  return out;
}

// Eigen is not on this program's include path (Debian keeps it under /usr/include/eigen3, which
// nothing here adds): the bfloat16 cache below needs none.
#if defined(__has_include)
#if __has_include(<Eigen/Core>)
#error "the consumer must build with no Eigen on its include path"
#endif
#endif

int main() {
#if defined(KVCACHE_PACKAGE_VERSION)
  const std::string header = std::to_string(KVCACHE_VERSION_MAJOR) + "." + std::to_string(KVCACHE_VERSION_MINOR) + "." +
                             std::to_string(KVCACHE_VERSION_PATCH);
  if (header != KVCACHE_PACKAGE_VERSION) {
    std::printf("kvcache consumer: the package is version %s, its header %s\n", KVCACHE_PACKAGE_VERSION,
                header.c_str());
    return 1;
  }
#endif
  const kvcache::KvCacheConfig config{.layers = 1, .kv_heads = 2, .head_dim = 8, .capacity = 16};
  kvcache::KvCache<float> dense(config);
  kvcache::ConcatKvCache<float> concat(config);
  kvcache::RingKvCache<float> ring({.layers = 1, .kv_heads = 2, .head_dim = 8, .window = 16});
  kvcache::KvCache<kvcache::bfloat16> bf16(config);
  const auto expected = attend(dense);
  for (const auto& [got, tolerance] :
       {std::pair{attend(concat), 1e-6F}, {attend(ring), 1e-6F}, {attend(bf16), 5e-2F}}) {
    for (std::size_t i = 0; i < expected.size(); ++i) {
      if (std::abs(got[i] - expected[i]) > tolerance) {
        std::printf("kvcache consumer: outputs differ at %zu\n", i);
        return 1;
      }
    }
  }
  std::printf("kvcache consumer OK: %zu cached bytes\n", dense.bytes());
  return 0;
}
