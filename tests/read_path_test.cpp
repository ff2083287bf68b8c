// SPDX-License-Identifier: Apache-2.0
// The read path's seams: a storage codec that only this test knows plugs into the caches and the
// kernel unchanged; a history of many short segments reads as one contiguous segment does; rows
// of a batch with positions and lengths of their own read as separate calls do.

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cache_test_support.hpp"
#include "kvcache/kvcache.hpp"

namespace kvcache_test {
/// Float rows stored divided by a power of two that brings their largest magnitude to at most
/// 1, the power kept as the row's scale: exact, so attention over it must equal attention over
/// plain float rows bit for bit, and only if the kernel applies each row's scale.
struct Pow2Rows {};
}  // namespace kvcache_test

template <>
struct kvcache::storage_codec<kvcache_test::Pow2Rows> {
  using unit = float;
  using acc = float;
  static constexpr scales_kept scales = scales_kept::per_row;
  static constexpr std::size_t units(std::size_t head_dim) noexcept { return head_dim; }
  template <class In>
  static EncodedRow encode(const In* in, unit* row, std::size_t head_dim, float /*head_scale*/) noexcept {
    float largest = 0.0F;
    for (std::size_t d = 0; d < head_dim; ++d) largest = std::max(largest, std::abs(widen(in[d])));
    const float scale = largest == 0.0F ? 1.0F : std::exp2(std::ceil(std::log2(largest)));
    for (std::size_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(widen(in[d])) / scale;
    return {.scale = scale, .clipped = 0};
  }
  template <std::size_t B>
  static Vec<float, B> load(const unit* row, std::size_t d) noexcept {
    return load_register<Vec<float, B>>(row + d);
  }
  static float value(const unit* row, std::size_t d) noexcept { return row[d]; }
};

namespace kvcache {
namespace {

using testing::arange;
using testing::Block;

template <class T>
std::vector<float> attend(const History<T>& history, const Block<float>& q, const Positions& positions,
                          const AttentionOptions& options = {}) {
  std::vector<float> out(q.data.size(), -7.0F);
  causal_attention(q.view(), positions, history, TensorView<float>(out.data(), q.shape), options);
  return out;
}

TEST(StorageCodec, ATestOnlyFormatWithRowScalesReadsAsPlainFloat) {
  const std::size_t dim = 64;
  const std::size_t keys = 900;
  Block<float> k({2, 2, keys, dim}, 1);
  Block<float> v({2, 2, keys, dim}, 2);
  for (std::size_t i = 0; i < k.data.size(); ++i) {  // magnitudes from 2^-9 to 2^8 across rows
    k.data[i] *= std::exp2(static_cast<float>(i / dim % 18) - 9.0F);
    v.data[i] *= std::exp2(static_cast<float>(i / dim % 13) - 6.0F);
  }
  const Block<float> q({2, 4, 5, dim}, 3);
  const std::vector<std::int64_t> positions = arange(keys - 5, 5);
  KvCache<float> plain({.layers = 1, .batch = 2, .kv_heads = 2, .head_dim = dim, .capacity = keys});
  KvCache<kvcache_test::Pow2Rows> scaled({.layers = 1, .batch = 2, .kv_heads = 2, .head_dim = dim, .capacity = keys});
  RingKvCache<kvcache_test::Pow2Rows> ring({.layers = 1, .batch = 2, .kv_heads = 2, .head_dim = dim, .window = 300});
  // Runs of 16 keys, which the ring's segments end on as the contiguous rows do: the same bits.
  const AttentionOptions options{.window = 300, .tuning = {.in_cache_bytes = 0, .cached_run_keys = 16}};
  const auto want = attend(plain.update(0, k.view(), v.view(), arange(0, keys)), q, positions, options);
  const auto got = attend(scaled.update(0, k.view(), v.view(), arange(0, keys)), q, positions, options);
  for (std::size_t done = 0; done < keys - 5; done += 100) {
    const std::size_t n = std::min<std::size_t>(100, keys - 5 - done);
    (void)ring.update(0, k.view().tokens(done, n), v.view().tokens(done, n), arange(done, n));
  }
  const auto ring_got = attend(ring.update(0, k.view().tokens(keys - 5, 5), v.view().tokens(keys - 5, 5), positions), q,
                               positions, {.tuning = options.tuning});
  EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(want.data(), ring_got.data(), want.size() * sizeof(float)));
  // The rows really are stored scaled: the first row's largest value is at most 1 and its scale
  // a power of two that gives it back.
  const Segment<kvcache_test::Pow2Rows>& s =
      scaled.update(0, k.view().tokens(0, 0), v.view().tokens(0, 0), {}).segments[0];
  EXPECT_LE(std::abs(s.keys(0, 0, 8, 0)), 1.0F);
  EXPECT_EQ(s.keys(0, 0, 8, 0) * *s.key_scales.at(0, 0, 8), k.data[8 * dim]);
  EXPECT_EQ(scaled.bytes(), plain.bytes() + 2 * 2 * 2 * keys * sizeof(float));  // the scales are counted
}

TEST(StorageCodec, AHistoryWithoutTheScalesItsFormatNeedsIsRefused) {
  Block<float> k({1, 1, 4, 8}, 1);
  const std::vector<std::int64_t> positions = arange(0, 4);
  const Segment<kvcache_test::Pow2Rows> bare{k.view(), k.view(), positions};
  const Block<float> q({1, 1, 1, 8}, 2);
  std::vector<float> out(8);
  EXPECT_THROW(causal_attention(q.view(), arange(3, 1), History<kvcache_test::Pow2Rows>{std::span(&bare, 1)},
                                TensorView<float>(out.data(), q.shape)),
               std::invalid_argument);
}

template <class T>
void expect_pages_read_as_one_segment(std::size_t dim, std::size_t keys, std::size_t page, std::size_t group,
                                      std::size_t window) {
  const Block<T> k({1, 2, keys, dim}, 11);
  const Block<T> v({1, 2, keys, dim}, 12);
  const Block<float> q({1, 2 * group, 1, dim}, 13);
  const std::vector<std::int64_t> positions = arange(0, keys);
  const Segment<T> whole{k.view(), v.view(), positions};
  std::vector<Segment<T>> pages;
  for (std::size_t first = 0; first < keys; first += page) {
    const std::size_t n = std::min(page, keys - first);
    pages.push_back({k.view().tokens(first, n), v.view().tokens(first, n), Positions(positions.data() + first, n)});
  }
  const std::vector<std::int64_t> query = arange(keys, 1);
  for (const std::size_t threads : {std::size_t{1}, std::size_t{2}}) {
    // As from memory: runs of run_keys, rows asked for ahead across pages.
    const AttentionOptions options{
        .window = window, .sinks = window != 0 ? 4U : 0U, .threads = threads, .tuning = {.in_cache_bytes = 0}};
    const auto want = attend(History<T>{std::span(&whole, 1)}, q, query, options);
    const auto got = attend(History<T>{pages}, q, query, options);
    // Pages that are whole runs fold the softmax where one segment does: the same bits. Other
    // pages cut runs elsewhere, which moves only the rounding.
    if (page % AttentionTuning{}.run_keys == 0) {
      EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)))
          << pages.size() << " pages of " << page << ", D " << dim << ", threads " << threads;
    } else {
      float worst = 0;
      for (std::size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::abs(want[i] - got[i]));
      EXPECT_LE(worst, 1e-6F) << pages.size() << " pages of " << page << ", D " << dim << ", threads " << threads;
    }
  }
}

TEST(KeyCursor, ThousandsOfPagesReadAsOneSegment) {
  expect_pages_read_as_one_segment<float>(128, 32768, 16, 4, 0);
  expect_pages_read_as_one_segment<bfloat16>(128, 32768, 16, 1, 0);
  expect_pages_read_as_one_segment<half>(64, 5000, 7, 2, 1000);
  expect_pages_read_as_one_segment<double>(32, 3000, 1, 2, 0);
}

// Two batch rows with positions and lengths of their own in one call: row 0 holds 300 keys at
// 0..299, row 1 holds 120 keys at 50..169 (its later slots are never read), and each row's
// queries continue its own positions. Each row must get what a call over that row alone gives.
TEST(KeyCursor, RowsWithTheirOwnPositionsAndLengths) {
  const std::size_t dim = 48;
  const std::size_t slots = 300;
  const Block<float> k({2, 2, slots, dim}, 21);
  const Block<float> v({2, 2, slots, dim}, 22);
  const Block<float> q({2, 4, 3, dim}, 23);
  std::vector<std::int64_t> key_positions = arange(0, slots);
  const std::vector<std::int64_t> row1 = arange(50, slots);
  key_positions.insert(key_positions.end(), row1.begin(), row1.end());
  const std::vector<std::size_t> row_tokens{300, 120};
  const std::vector<std::int64_t> query_positions{297, 298, 299, 167, 168, 169};
  const Segment<float> both{k.view(), v.view(), Positions(key_positions.data(), slots, slots), {}, {}, row_tokens};
  const auto got = attend(History<float>{std::span(&both, 1)}, q, Positions(query_positions.data(), 3, 3));
  for (std::size_t b = 0; b < 2; ++b) {
    const auto one_row = [&](const TensorView<const float>& view) {
      return TensorView<const float>(view.row(b, 0, 0), {1, view.heads(), view.tokens(), dim}, view.strides());
    };
    const Segment<float> alone{one_row(k.view()).tokens(0, row_tokens[b]), one_row(v.view()).tokens(0, row_tokens[b]),
                               Positions(key_positions.data() + b * slots, row_tokens[b])};
    std::vector<float> want(4 * 3 * dim);
    causal_attention(one_row(q.view()), Positions(query_positions.data() + 3 * b, 3),
                     History<float>{std::span(&alone, 1)}, TensorView<float>(want.data(), {1, 4, 3, dim}));
    EXPECT_EQ(0, std::memcmp(want.data(), got.data() + b * want.size(), want.size() * sizeof(float))) << "row " << b;
  }
}

}  // namespace
}  // namespace kvcache
