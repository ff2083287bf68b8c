// SPDX-License-Identifier: Apache-2.0
#pragma once

// Shared by the cache tests: the variant × element-type list, seeded data, and a flattened,
// comparable picture of what a History holds.

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "kvcache/concat_kv_cache.hpp"
#include "kvcache/kv_cache.hpp"
#include "kvcache/ring_kv_cache.hpp"

namespace kvcache::testing {

template <class Cache>
inline constexpr bool is_ring = false;
template <class T>
inline constexpr bool is_ring<RingKvCache<T>> = true;

/// Every variant over every element type: the protocol's typed suites run over all of them.
using AllCaches = ::testing::Types<KvCache<float>, KvCache<double>, KvCache<Eigen::half>, KvCache<Eigen::bfloat16>,
                                   ConcatKvCache<float>, ConcatKvCache<double>, ConcatKvCache<Eigen::half>,
                                   ConcatKvCache<Eigen::bfloat16>, RingKvCache<float>, RingKvCache<double>,
                                   RingKvCache<Eigen::half>, RingKvCache<Eigen::bfloat16>>;

/// A readable name per cache type for typed-test output.
struct CacheName {
  template <class Cache>
  static std::string GetName(int) {
    using T = typename Cache::value_type;
    std::string variant = is_ring<Cache> ? "Ring" : std::is_same_v<Cache, ConcatKvCache<T>> ? "Concat" : "Dense";
    std::string type = std::is_same_v<T, float>         ? "float"
                       : std::is_same_v<T, double>      ? "double"
                       : std::is_same_v<T, Eigen::half> ? "half"
                                                        : "bfloat16";
    return variant + "_" + type;
  }
};

/// Owned [B, H, T, D] data of seeded random values, viewable as TensorView<const T>.
template <class T>
struct Block {
  Shape shape;
  std::vector<T> data;

  Block(const Shape& s, std::uint64_t seed) : shape(s), data(s.size()) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> dist(-1.0F, 1.0F);
    for (T& x : data) x = static_cast<T>(dist(rng));
  }
  [[nodiscard]] TensorView<const T> view() const { return {data.data(), shape}; }
  [[nodiscard]] TensorView<T> mutable_view() { return {data.data(), shape}; }
};

/// Positions first, first + 1, ..., first + count - 1.
inline std::vector<std::int64_t> arange(std::size_t first, std::size_t count) {
  std::vector<std::int64_t> p(count);
  std::iota(p.begin(), p.end(), static_cast<std::int64_t>(first));
  return p;
}

/// The bytes of one (position) across every (b, h): keys then values.
using Row = std::vector<unsigned char>;

/// What a history holds, by position; fails the test on a duplicate position.
template <class T>
std::map<std::int64_t, Row> flatten(const History<T>& history) {
  std::map<std::int64_t, Row> rows;
  for (const Segment<T>& s : history.segments) {
    EXPECT_EQ(s.keys.shape(), s.values.shape());
    EXPECT_EQ(s.keys.tokens(), s.positions.size());
    for (std::size_t j = 0; j < s.tokens(); ++j) {
      Row row;
      for (const auto* view : {&s.keys, &s.values}) {
        for (std::size_t b = 0; b < view->batch(); ++b) {
          for (std::size_t h = 0; h < view->heads(); ++h) {
            const auto* bytes = reinterpret_cast<const unsigned char*>(view->row(b, h, j));
            row.insert(row.end(), bytes, bytes + view->head_dim() * sizeof(T));
          }
        }
      }
      EXPECT_TRUE(rows.emplace(s.positions[j], std::move(row)).second) << "position " << s.positions[j] << " twice";
    }
  }
  return rows;
}

/// The row `flatten` would give for token t of (k, v).
template <class T>
Row row_of(const TensorView<const T>& k, const TensorView<const T>& v, std::size_t t) {
  Row row;
  for (const auto* view : {&k, &v}) {
    for (std::size_t b = 0; b < view->batch(); ++b) {
      for (std::size_t h = 0; h < view->heads(); ++h) {
        const auto* bytes = reinterpret_cast<const unsigned char*>(view->row(b, h, t));
        row.insert(row.end(), bytes, bytes + view->head_dim() * sizeof(T));
      }
    }
  }
  return row;
}

}  // namespace kvcache::testing
