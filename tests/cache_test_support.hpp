// SPDX-License-Identifier: Apache-2.0
#pragma once

// Shared by the cache tests: the variant × element-type list, seeded data, a flattened,
// comparable picture of what a History holds, and the reference model's (support/
// reference_model.hpp) rows and attention in that picture.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvcache/attention.hpp"
#include "kvcache/concat_kv_cache.hpp"
#include "kvcache/kv_cache.hpp"
#include "kvcache/quantized.hpp"
#include "kvcache/ring_kv_cache.hpp"
#include "kvcache/slot_kv_cache.hpp"
#include "pooled_sequence.hpp"
#include "support/format_matrix.hpp"
#include "support/formats.hpp"
#include "support/reference_model.hpp"
#include "support/variants.hpp"

namespace kvcache::testing {

template <class Cache>
inline constexpr bool is_ring = false;
template <class T>
inline constexpr bool is_ring<RingKvCache<T>> = true;
template <class Cache>
inline constexpr bool is_slot = false;
template <class T>
inline constexpr bool is_slot<SlotKvCache<T>> = true;
template <class Cache>
inline constexpr bool is_paged = false;
template <class T>
inline constexpr bool is_paged<PooledSequence<T>> = true;

/// The batch rows the suites give a variant: a paged sequence is one row.
template <class Cache>
inline constexpr std::size_t batch_of = is_paged<Cache> ? 1 : 2;

/// Tokens `layer` holds: every row's, for the caches whose rows advance together; the longest
/// row's, for a slot cache (whose rows each have their own: row_length(row, layer)).
template <class Cache>
std::size_t layer_length(const Cache& cache, std::size_t layer) {
  if constexpr (is_slot<Cache>) {
    std::size_t longest = 0;
    for (std::size_t row = 0; row < std::max<std::size_t>(cache.slots(), 1); ++row)
      longest = std::max(longest, cache.row_length(row, layer));
    return longest;
  } else {
    return cache.length(layer);
  }
}

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVCACHE_TESTS_SANITIZED 1
#endif
#endif

/// Whether format T has code paths of its own: all but double and half, which share float's and
/// bfloat16's.
template <class T>
struct own_code_path : std::bool_constant<!(std::is_same_v<T, double> || std::is_same_v<T, Eigen::half>)> {};

/// Whether the variants besides KvCache run format T under AddressSanitizer (CI's sanitized
/// build, whose length bounds CI): the formats with code paths of their own, but fp8_e4m3,
/// int4_rotated and int8_heads, which share int8_rows', int4_groups' and fp8_e4m3_heads' (a scale
/// per row, groups in the row, a scale per head). Every format still runs there through KvCache,
/// and the release build runs every pair.
template <class T>
struct runs_sanitized : std::bool_constant<own_code_path<T>::value && !std::is_same_v<T, fp8_e4m3> &&
                                           !std::is_same_v<T, int4_rotated> && !std::is_same_v<T, int8_heads>> {};
template <class T>
struct runs_unsanitized_only : std::bool_constant<!runs_sanitized<T>::value> {};
#if defined(KVCACHE_TESTS_SANITIZED)
using variant_formats = filter<runs_sanitized, formats>;
using kv_cache_only_formats = filter<runs_unsanitized_only, formats>;
#else
using variant_formats = formats;
using kv_cache_only_formats = type_list<>;
#endif

/// Every variant over every storage format: the protocol's typed suites run over all of them.
using AllCaches = gtest_types<concat<cache_variants::over<variant_formats>, kv_cache_only_formats::transform<KvCache>>>;

/// What the suites feed a cache storing T: T itself where it is a compute type, else float.
template <class T>
using input_t = std::conditional_t<compute_type<T>, T, default_input<T>>;

/// The head scale the suites give formats that keep one: inputs in [-1, 1] fill E4M3's range.
inline constexpr float kTestHeadScale = 1.0F / 448.0F;

/// `config` with calibrated head scales for formats that keep them, so that what a cache
/// stores for an input does not depend on its first update.
template <class T>
KvCacheConfig test_config(KvCacheConfig config) {
  if constexpr (detail::has_head_scales<T>) {
    static const std::vector<float> scales(4096, kTestHeadScale);
    const std::size_t n = config.layers * config.kv_heads;
    config.key_scales = std::span<const float>(scales.data(), n);
    config.value_scales = std::span<const float>(scales.data(), n);
  }
  return config;
}

/// A cache type's name for typed-test output: its variant's, from the list, and its format's
/// ("RingKvCache_int8_rows").
struct CacheName {
  template <class Cache>
  static std::string GetName(int /*index*/) {
    return std::string(variant_name<Cache>) + "_" + format_name<typename Cache::value_type>();
  }
};

/// The standard exceptions a bad call may throw.
enum class Throws { out_of_range, invalid_argument, length_error };

/// Runs `call` and expects it to throw `type` with a message holding every one of `parts`.
inline void expect_throw_naming(const std::function<void()>& call, Throws type, const std::vector<std::string>& parts) {
  std::string message;
  try {
    call();
    ADD_FAILURE() << "no exception";
  } catch (const std::out_of_range& e) {
    EXPECT_EQ(type, Throws::out_of_range) << e.what();
    message = e.what();
  } catch (const std::length_error& e) {
    EXPECT_EQ(type, Throws::length_error) << e.what();
    message = e.what();
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(type, Throws::invalid_argument) << e.what();
    message = e.what();
  }
  for (const std::string& part : parts) EXPECT_THAT(message, ::testing::HasSubstr(part));
}

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

/// The stored bytes of one (position) across every (b, h), with their scales where the format
/// has them: keys then values.
using Row = std::vector<unsigned char>;

inline void append_bytes(Row& row, const void* p, std::size_t n) {
  const auto* bytes = static_cast<const unsigned char*>(p);
  row.insert(row.end(), bytes, bytes + n);
}

/// What a history holds, by position; fails the test on a duplicate position.
template <class T>
std::map<std::int64_t, Row> flatten(const History<T>& history) {
  using Unit = typename storage_codec<T>::unit;
  std::map<std::int64_t, Row> rows;
  for (const Segment<T>& s : history.segments) {
    EXPECT_EQ(s.keys.shape(), s.values.shape());
    EXPECT_EQ(s.keys.tokens(), s.positions.tokens());
    for (std::size_t j = 0; j < s.tokens(); ++j) {
      Row row;
      for (const auto& [view, scales] : {std::pair{&s.keys, &s.key_scales}, std::pair{&s.values, &s.value_scales}}) {
        for (std::size_t b = 0; b < s.batch(); ++b) {
          if (j >= s.tokens(b)) continue;  // a row that holds fewer keys
          const std::size_t stored = s.stored_row(b);
          for (std::size_t h = 0; h < view->heads(); ++h) {
            append_bytes(row, view->row(stored, h, j), view->head_dim() * sizeof(Unit));
            if constexpr (detail::reads_scales<storage_codec<T>>)
              append_bytes(row, scales->at(stored, h, j), sizeof(float));
          }
        }
      }
      const std::int64_t position = s.positions.row(s.stored_row(0))[j];
      if (position < 0) continue;  // a slot no token has filled since a truncate: no query reads it
      EXPECT_TRUE(rows.emplace(position, std::move(row)).second) << "position " << position << " twice";
    }
  }
  return rows;
}

/// What batch row b of a history reads, by position: its stored bytes (and scales) in every
/// head, keys then values (flatten's picture of one row); fails the test on a duplicate position.
template <class T>
std::map<std::int64_t, Row> flatten_row(const History<T>& history, std::size_t b) {
  using Unit = typename storage_codec<T>::unit;
  std::map<std::int64_t, Row> rows;
  for (const Segment<T>& s : history.segments) {
    const std::size_t stored = s.stored_row(b);
    for (std::size_t j = 0; j < s.tokens(b); ++j) {
      Row row;
      for (const auto& [view, scales] : {std::pair{&s.keys, &s.key_scales}, std::pair{&s.values, &s.value_scales}}) {
        for (std::size_t h = 0; h < view->heads(); ++h) {
          append_bytes(row, view->row(stored, h, j), view->head_dim() * sizeof(Unit));
          if constexpr (detail::reads_scales<storage_codec<T>>)
            append_bytes(row, scales->at(stored, h, j), sizeof(float));
        }
      }
      const std::int64_t position = s.positions.row(stored)[j];
      if (position < 0) continue;
      EXPECT_TRUE(rows.emplace(position, std::move(row)).second) << "position " << position << " twice";
    }
  }
  return rows;
}

/// The row `flatten` gives for one position whose batch rows the reference model stored as
/// `tokens`, one a batch row.
template <class T>
Row row_of(const std::vector<const StoredToken<T>*>& tokens) {
  using Unit = typename storage_codec<T>::unit;
  Row row;
  for (const bool value : {false, true}) {
    for (const StoredToken<T>* token : tokens) {
      const std::size_t heads = token->scales(value).size();
      const std::size_t units = heads == 0 ? 0 : token->units(value).size() / heads;
      for (std::size_t h = 0; h < heads; ++h) {
        append_bytes(row, token->units(value).data() + h * units, units * sizeof(Unit));
        if constexpr (detail::reads_scales<storage_codec<T>>)
          append_bytes(row, &token->scales(value)[h], sizeof(float));
      }
    }
  }
  return row;
}

/// Token t of every batch row of (k, v) as the reference model stores it in format T, with the
/// suites' head scales (test_config).
template <class T, class In>
std::vector<StoredToken<T>> store_tokens(const TensorView<const In>& k, const TensorView<const In>& v, std::size_t t) {
  const std::vector<float> scales(k.heads(), kTestHeadScale);
  std::vector<StoredToken<T>> tokens;
  for (std::size_t b = 0; b < k.batch(); ++b) tokens.push_back(store_token<T>(k, v, b, t, scales, scales));
  return tokens;
}

/// flatten's picture of a history of one batch row that holds every position of `stream`.
template <class T>
std::map<std::int64_t, Row> flatten(const Stream<T>& stream) {
  std::map<std::int64_t, Row> rows;
  for (std::size_t p = 0; p < stream.size(); ++p) rows[static_cast<std::int64_t>(p)] = row_of<T>({&stream[p]});
  return rows;
}

/// The row `flatten` would give for token t of (k, v) stored in format T: each row encoded once.
template <class T, class In>
Row row_of(const TensorView<const In>& k, const TensorView<const In>& v, std::size_t t) {
  const std::vector<StoredToken<T>> tokens = store_tokens<T>(k, v, t);
  std::vector<const StoredToken<T>*> each;
  for (const StoredToken<T>& token : tokens) each.push_back(&token);
  return row_of(each);
}

/// causal_attention over `history` for one seeded query per batch row b, at queries[b] (or at
/// queries[0] for every row), every KV head's `group` query heads, against the reference model's
/// uncached attention over streams[b] by `rule`.
template <class T>
void expect_reference_attention(const History<T>& history, const std::vector<const Stream<T>*>& streams,
                                const std::vector<std::int64_t>& queries, const WindowRule& rule, std::size_t kv_heads,
                                std::size_t group, std::size_t head_dim, std::uint64_t seed) {
  using In = input_t<T>;
  const Shape shape{streams.size(), kv_heads * group, 1, head_dim};
  const Block<In> q(shape, seed);
  std::vector<In> out(shape.size());
  const bool shared = queries.size() == 1;
  const Positions positions = shared ? Positions(queries[0]) : Positions(queries.data(), 1, 1);
  causal_attention(q.view(), positions, history, TensorView<In>(out.data(), shape));
  const double base = sizeof(In) == 2 ? 1e-2 : 1e-4;  // In's rounding of the output
  std::vector<double> q_row(head_dim);
  for (std::size_t b = 0; b < shape.batch; ++b) {
    for (std::size_t hq = 0; hq < shape.heads; ++hq) {
      const std::size_t row = (b * shape.heads + hq) * head_dim;
      for (std::size_t d = 0; d < head_dim; ++d) q_row[d] = static_cast<double>(static_cast<float>(q.data[row + d]));
      const auto query = static_cast<std::size_t>(queries[shared ? 0 : b]);
      const ReferenceAttention expected = reference_attention(q_row, *streams[b], hq / group, query, rule);
      for (std::size_t d = 0; d < head_dim; ++d) {
        ASSERT_NEAR(static_cast<double>(static_cast<float>(out[row + d])), expected.out[d],
                    base * (1.0 + expected.value_max))
            << "batch row " << b << " q head " << hq << " query at " << query << " over " << expected.keys << " keys";
      }
    }
  }
}

}  // namespace kvcache::testing
