// SPDX-License-Identifier: Apache-2.0
// kvcache's own bfloat16 and half: the same values as Eigen's for every bit pattern and every
// rounding, an engine's 16-bit buffers read in place, and Eigen's types stored exactly as
// kvcache's (the same codec, the same bytes, state files that load into either).

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <type_traits>
#include <vector>

#include "cache_test_support.hpp"
#include "kvcache/kvcache.hpp"

namespace kvcache {
namespace {

using testing::arange;
using testing::Block;

static_assert(sizeof(bfloat16) == 2 && sizeof(half) == 2);
static_assert(std::is_trivially_copyable_v<bfloat16> && std::is_trivially_copyable_v<half>);
static_assert(std::is_convertible_v<bfloat16, float> && !std::is_convertible_v<float, bfloat16>);
static_assert(storage_format<bfloat16> && storage_format<half> && compute_type<bfloat16> && compute_type<half>);
static_assert(std::is_same_v<storage_codec<Eigen::bfloat16>::unit, bfloat16>);
static_assert(std::is_same_v<storage_codec<Eigen::half>::unit, half>);
static_assert(float(bfloat16(1.5F)) == 1.5F && half::from_bits(0x3C00).bits() == 0x3C00);  // constexpr

/// Eigen's 16-bit value of `bits`.
template <class Theirs>
Theirs eigen_of_bits(std::uint16_t bits) {
  Theirs x;
  std::memcpy(static_cast<void*>(&x), &bits, 2);
  return x;
}

template <class Ours, class Theirs>
void expect_every_bit_pattern_widens_as(const char* name) {
  for (std::uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const auto ours = static_cast<float>(Ours::from_bits(static_cast<std::uint16_t>(bits)));
    const auto theirs = static_cast<float>(eigen_of_bits<Theirs>(static_cast<std::uint16_t>(bits)));
    // A signaling NaN comes out quiet where Eigen widens by instruction (F16C) and as it was where
    // it widens in software: the sign and payload are the same either way.
    constexpr std::uint32_t kQuietBit = 0x00400000;
    const std::uint32_t ignored = std::isnan(theirs) ? kQuietBit : 0;
    ASSERT_EQ(std::isnan(ours), std::isnan(theirs)) << name << " bits 0x" << std::hex << bits;
    ASSERT_EQ(std::bit_cast<std::uint32_t>(ours) | ignored, std::bit_cast<std::uint32_t>(theirs) | ignored)
        << name << " bits 0x" << std::hex << bits;
  }
}

template <class Ours, class Theirs>
void expect_floats_round_as(const char* name) {
  std::vector<float> values = {0.0F,
                               -0.0F,
                               1.0F,
                               65504.0F,
                               65519.99F,
                               65520.0F,
                               1e-8F,
                               -5.96e-8F,
                               2.98e-8F,
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::denorm_min(),
                               std::numeric_limits<float>::max()};
  std::mt19937 rng(58);
  for (int i = 0; i < 200000; ++i) values.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
  for (const float x : values) {
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(static_cast<float>(Ours(x)))) << name;
      continue;
    }
    const std::uint16_t ours = Ours(x).bits();
    const std::uint16_t theirs = detail::bits_of(Theirs(x));
    ASSERT_EQ(ours, theirs) << name << " of " << x;
  }
}

TEST(Float16, WidensAndRoundsAsEigenDoes) {
  expect_every_bit_pattern_widens_as<bfloat16, Eigen::bfloat16>("bfloat16");
  expect_every_bit_pattern_widens_as<half, Eigen::half>("half");
  expect_floats_round_as<bfloat16, Eigen::bfloat16>("bfloat16");
  expect_floats_round_as<half, Eigen::half>("half");
}

TEST(Float16, AnEnginesBuffersAreReadInPlace) {
  std::vector<std::uint16_t> bits = {0x3F80, 0xC000, 0x7F80};  // bfloat16 1, -2, inf
  const bfloat16* view = as_bfloat16(bits.data());
  EXPECT_EQ(static_cast<const void*>(view), static_cast<const void*>(bits.data()));
  EXPECT_EQ(float(view[0]), 1.0F);
  EXPECT_EQ(float(view[1]), -2.0F);
  EXPECT_TRUE(std::isinf(float(view[2])));
  struct ggml_fp16_like {  // an engine's own 16-bit struct
    std::uint16_t bits;
  };
  const std::vector<ggml_fp16_like> halves = {{0x3C00}, {0x3800}};  // half 1, 0.5
  EXPECT_EQ(float(as_half(halves.data())[1]), 0.5F);
  // Written through the view, read back as the engine's bits.
  as_bfloat16(bits.data())[0] = bfloat16(3.0F);
  EXPECT_EQ(bits[0], 0x4040);
}

/// The stored bytes of layer 0 of `cache` after the same updates, for a cache of Eigen's type
/// and one of kvcache's.
template <class Cache>
std::vector<unsigned char> stored_bytes(Cache& cache) {
  const auto history = cache.history(0);
  const auto& keys = history.segments[0].keys;
  std::vector<unsigned char> bytes(keys.tokens() * keys.head_dim() * 2);
  for (std::size_t t = 0; t < keys.tokens(); ++t)
    std::memcpy(&bytes[t * keys.head_dim() * 2], keys.row(0, 1, t), keys.head_dim() * 2);
  return bytes;
}

template <class Ours, class Theirs>
void expect_eigens_format_is_kvcaches() {
  const KvCacheConfig config{.layers = 1, .kv_heads = 2, .head_dim = 64, .capacity = 32};
  KvCache<Ours> ours(config);
  KvCache<Theirs> theirs(config);
  const Block<float> kv({1, 2, 9, 64}, 7), q({1, 4, 9, 64}, 8);
  // Eigen's values handed in, for both caches; then kvcache's values.
  std::vector<Theirs> kv_eigen(kv.data.size());
  for (std::size_t i = 0; i < kv.data.size(); ++i) kv_eigen[i] = Theirs(kv.data[i]);
  const TensorView<const Theirs> in(kv_eigen.data(), kv.shape);
  const std::vector<std::int64_t> positions = arange(0, 9);
  std::vector<float> out_ours(q.data.size()), out_theirs(q.data.size());
  (void)ours.update(0, in.tokens(0, 5), in.tokens(0, 5), arange(0, 5));
  (void)theirs.update(0, in.tokens(0, 5), in.tokens(0, 5), arange(0, 5));
  std::vector<Ours> kv_ours(kv.data.size());
  for (std::size_t i = 0; i < kv.data.size(); ++i) kv_ours[i] = Ours(kv.data[i]);
  const TensorView<const Ours> in_ours(kv_ours.data(), kv.shape);
  causal_attention(q.view(), positions, ours.update(0, in_ours.tokens(5, 4), in_ours.tokens(5, 4), arange(5, 4)),
                   TensorView<float>(out_ours.data(), q.shape));
  causal_attention(q.view(), positions, theirs.update(0, in_ours.tokens(5, 4), in_ours.tokens(5, 4), arange(5, 4)),
                   TensorView<float>(out_theirs.data(), q.shape));
  EXPECT_EQ(stored_bytes(ours), stored_bytes(theirs));
  EXPECT_EQ(out_ours, out_theirs);

  // A state file of one loads into the other: the same format.
  std::stringstream file;
  save_state(theirs, file);
  KvCache<Ours> loaded(config);
  (void)load_state(loaded, file);
  EXPECT_EQ(stored_bytes(loaded), stored_bytes(theirs));
}

TEST(Float16, EigensTypesAreStoredAsKvcaches) {
  expect_eigens_format_is_kvcaches<bfloat16, Eigen::bfloat16>();
  expect_eigens_format_is_kvcaches<half, Eigen::half>();
}

TEST(Float16, QueriesAndOutputsInKvcachesTypes) {
  KvCache<float> cache({.layers = 1, .kv_heads = 1, .head_dim = 8, .capacity = 4});
  const Block<float> kv({1, 1, 2, 8}, 1);
  const std::vector<std::int64_t> positions = {0, 1};
  const auto history = cache.update(0, kv.view(), kv.view(), positions);
  std::vector<bfloat16> q(16, bfloat16(0.25F)), out(16);
  std::vector<Eigen::bfloat16> q_eigen(16, Eigen::bfloat16(0.25F)), out_eigen(16);
  causal_attention(TensorView<const bfloat16>(q.data(), {1, 1, 2, 8}), positions, history,
                   TensorView<bfloat16>(out.data(), {1, 1, 2, 8}));
  causal_attention(TensorView<const Eigen::bfloat16>(q_eigen.data(), {1, 1, 2, 8}), positions, history,
                   TensorView<Eigen::bfloat16>(out_eigen.data(), {1, 1, 2, 8}));
  for (std::size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i].bits(), detail::bits_of(out_eigen[i]));
  EXPECT_EQ(float(out[0]), float(bfloat16(kv.data[0])));  // the first query sees only the first key
}

}  // namespace
}  // namespace kvcache
