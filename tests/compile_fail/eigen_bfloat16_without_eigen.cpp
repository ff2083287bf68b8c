// SPDX-License-Identifier: Apache-2.0
// Must not compile (tests/CMakeLists.txt checks the message): Eigen::bfloat16 values handed in
// where <Eigen/Core> is not included. A cache of Eigen's type needs no Eigen to be stored; the
// values do, and the build says which header.
#include <kvcache/kvcache.hpp>

int main() {
  kvcache::KvCache<Eigen::bfloat16> cache({.layers = 1, .kv_heads = 1, .head_dim = 8, .capacity = 4});
  unsigned short bits[8] = {};
  const kvcache::TensorView<const Eigen::bfloat16> k(reinterpret_cast<const Eigen::bfloat16*>(bits), {1, 1, 1, 8});
  const int position = 0;
  return static_cast<int>(cache.update(0, k, k, {position}).tokens());
}
