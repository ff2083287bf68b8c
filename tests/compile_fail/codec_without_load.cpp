// SPDX-License-Identifier: Apache-2.0
// A format whose codec lacks load: the build stops at KvCache<MyFormat>, naming the member.
#include <cstddef>
#include <cstdint>

#include "kvcache/kv_cache.hpp"

struct MyFormat {};

template <>
struct kvcache::storage_codec<MyFormat> {
  using unit = std::uint8_t;
  using acc = float;
  static constexpr kvcache::scales_kept scales = kvcache::scales_kept::none;
  static constexpr std::size_t units(std::size_t head_dim) noexcept { return head_dim; }
  template <class In>
  static kvcache::EncodedRow encode(const In*, unit*, std::size_t, float) noexcept {
    return {};
  }
  static float value(const unit* row, std::size_t d) noexcept { return row[d]; }
};

int main() {
  kvcache::KvCache<MyFormat> cache({.layers = 1, .kv_heads = 1, .head_dim = 8, .capacity = 4});
  return static_cast<int>(cache.capacity());
}
