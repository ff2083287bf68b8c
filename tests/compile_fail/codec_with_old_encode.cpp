// SPDX-License-Identifier: Apache-2.0
// A codec whose encode returns a scale and takes no head scale (the signature before EncodedRow):
// the build stops at KvCache<MyFormat>, naming encode's signature.
#include <cstddef>
#include <cstdint>

#include "kvcache/kv_cache.hpp"

struct MyFormat {};

template <>
struct kvcache::storage_codec<MyFormat> {
  using unit = std::uint8_t;
  using acc = float;
  static constexpr kvcache::scales_kept scales = kvcache::scales_kept::per_row;
  static constexpr std::size_t units(std::size_t head_dim) noexcept { return head_dim; }
  template <class In>
  static float encode(const In*, unit*, std::size_t) noexcept {
    return 1.0F;
  }
  template <std::size_t B>
  static kvcache::Vec<float, B> load(const unit* row, std::size_t d) noexcept {
    return __builtin_convertvector(kvcache::widen_bytes<B, false>(row + d), kvcache::Vec<float, B>);
  }
  static float value(const unit* row, std::size_t d) noexcept { return row[d]; }
};

int main() {
  kvcache::KvCache<MyFormat> cache({.layers = 1, .kv_heads = 1, .head_dim = 8, .capacity = 4});
  return static_cast<int>(cache.capacity());
}
