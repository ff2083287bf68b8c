// SPDX-License-Identifier: Apache-2.0
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <array>
#include <cstdint>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <unsupported/Eigen/CXX11/Tensor>
#include <vector>

#include "kvcache/attention.hpp"
#include "kvcache/kv_cache.hpp"
#include "kvcache/slot_kv_cache.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
namespace {

using ::testing::HasSubstr;
using ::testing::StrEq;
using ::testing::ThrowsMessage;

static_assert(std::is_trivially_copyable_v<TensorView<float>>);
static_assert(std::is_convertible_v<TensorView<float>, TensorView<const float>>);
static_assert(!std::is_convertible_v<TensorView<const float>, TensorView<float>>);

TEST(TensorView, RawPointerAndShapeAreRowMajor) {
  std::vector<float> data(2 * 3 * 4 * 5);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(i);
  const TensorView<const float> view(data.data(), {.batch = 2, .heads = 3, .tokens = 4, .head_dim = 5});
  EXPECT_EQ(view(1, 2, 3, 4), data.back());
  EXPECT_EQ(view(1, 0, 0, 0), 60.0F);
  EXPECT_EQ(view.row(0, 1, 2), data.data() + 1 * 20 + 2 * 5);
  const auto tail = view.tokens(2, 2);
  EXPECT_EQ(tail.tokens(), 2U);
  EXPECT_EQ(tail(0, 0, 0, 0), 10.0F);
}

TEST(TensorView, StridedViewReadsAnInterleavedLayout) {
  // [B=1, T=3, H=2, D=2] storage read as [B, H, T, D].
  std::vector<int> data = {0, 1, 10, 11, 2, 3, 12, 13, 4, 5, 14, 15};
  const TensorView<const int> view(data.data(), {1, 2, 3, 2}, {.batch = 12, .heads = 2, .tokens = 4});
  EXPECT_EQ(view(0, 0, 2, 1), 5);
  EXPECT_EQ(view(0, 1, 1, 0), 12);
}

TEST(TensorView, FromEigenTensorAndTensorMapWithoutCopying) {
  Eigen::Tensor<float, 4, Eigen::RowMajor> tensor(2, 3, 4, 5);
  tensor.setRandom();
  const TensorView<const float> view(tensor);
  EXPECT_EQ(view.data(), tensor.data());
  EXPECT_EQ(view.shape(), (Shape{2, 3, 4, 5}));
  EXPECT_EQ(view(1, 2, 3, 4), tensor(1, 2, 3, 4));
  EXPECT_EQ(view(0, 1, 2, 3), tensor(0, 1, 2, 3));

  Eigen::TensorMap<Eigen::Tensor<float, 4, Eigen::RowMajor>> map(tensor.data(), 2, 3, 4, 5);
  TensorView writable(map);
  static_assert(std::is_same_v<decltype(writable), TensorView<float>>);
  writable(1, 1, 1, 1) = 42.0F;
  EXPECT_EQ(tensor(1, 1, 1, 1), 42.0F);
}

TEST(TensorView, OneHeadFromARowMajorEigenMatrixOrMap) {
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  RowMajor matrix = RowMajor::Random(6, 8);
  const TensorView<const float> view(matrix);
  EXPECT_EQ(view.shape(), (Shape{1, 1, 6, 8}));
  EXPECT_EQ(view(0, 0, 5, 7), matrix(5, 7));

  // A block of columns: rows keep the parent's stride.
  Eigen::Map<const RowMajor, 0, Eigen::OuterStride<>> head(matrix.data() + 4, 6, 4, Eigen::OuterStride<>(8));
  const TensorView<const float> head_view(head);
  EXPECT_EQ(head_view.shape(), (Shape{1, 1, 6, 4}));
  EXPECT_EQ(head_view(0, 0, 3, 2), matrix(3, 6));
}

TEST(TensorView, AnEigenMapWhoseRowsAreNotContiguousIsRejected) {
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Strided = Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>;
  float data[8] = {0, -1, 1, -1, 2, -1, 3, -1};
  // Every other value: Eigen reads [0 1; 2 3], which a view (rows contiguous) cannot describe.
  const Eigen::Map<const RowMajor, 0, Strided> every_other(data, 2, 2, Strided(4, 2));
  try {
    const TensorView<const float> view(every_other);
    FAIL() << "accepted; reads " << view(0, 0, 0, 1) << " for Eigen's " << every_other(0, 1);
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "TensorView: Eigen matrix inner stride: expected 1 (head_dim contiguous), given 2");
  }

  // The same map type with contiguous rows is fine, and so is one value per row.
  const Eigen::Map<const RowMajor, 0, Strided> contiguous(data, 2, 3, Strided(4, 1));
  const TensorView<const float> view(contiguous);
  EXPECT_EQ(view(0, 0, 1, 2), contiguous(1, 2));
  const Eigen::Map<const RowMajor, 0, Strided> column(data, 4, 1, Strided(2, 3));
  EXPECT_EQ(TensorView<const float>(column)(0, 0, 3, 0), 3.0F);
}

// One token's position from a variable, never from a temporary the view would outlive.
static_assert(std::is_convertible_v<std::int64_t&, Positions>);
static_assert(std::is_convertible_v<const std::int64_t&, Positions>);
static_assert(!std::is_constructible_v<Positions, std::int64_t>);
static_assert(!std::is_constructible_v<Positions, int>);

TEST(Positions, FromContiguousRangesAndOneVariable) {
  const std::vector<std::int64_t> list = {4, 5, 6};
  const Positions from_vector = list;
  EXPECT_EQ(from_vector.data(), list.data());
  EXPECT_EQ(from_vector.tokens(), 3U);
  const std::array<std::int64_t, 2> pair = {7, 8};
  EXPECT_EQ(Positions(pair)[1], 8);

  const std::int64_t pos = 9;
  const Positions one = pos;
  EXPECT_EQ(one.data(), &pos);
  EXPECT_EQ(one.tokens(), 1U);
  EXPECT_FALSE(one.per_row());
}

TEST(Positions, NextPositionsContinueALayer) {
  EXPECT_EQ(next_positions(5, 3), (std::vector<std::int64_t>{5, 6, 7}));
  EXPECT_TRUE(next_positions(5, 0).empty());

  // A prompt, then one token at a time, with positions no caller counts itself.
  KvCache<float> cache({.layers = 2, .kv_heads = 1, .head_dim = 4, .capacity = 8});
  const std::vector<float> prompt(1 * 3 * 4, 0.5F);
  const std::vector<float> token(4, 1.0F);
  const TensorView<const float> k_prompt(prompt.data(), {1, 1, 3, 4});
  const TensorView<const float> k_token(token.data(), {1, 1, 1, 4});
  for (std::size_t layer = 0; layer < 2; ++layer) {
    const auto positions = next_positions(cache.length(layer), 3);
    EXPECT_EQ(cache.update(layer, k_prompt, k_prompt, positions).tokens(), 3U);
  }
  for (std::size_t layer = 0; layer < 2; ++layer) {
    const auto pos = static_cast<std::int64_t>(cache.length(layer));
    const auto history = cache.update(layer, k_token, k_token, {pos});
    ASSERT_EQ(history.segments.size(), 1U);
    EXPECT_EQ(std::vector<std::int64_t>(history.segments[0].positions.begin(), history.segments[0].positions.end()),
              (std::vector<std::int64_t>{0, 1, 2, 3}));
    EXPECT_EQ(history.segments[0].keys(0, 0, 3, 0), 1.0F);
  }
  EXPECT_EQ(cache.length(), 4U);
  // A position that does not continue the layer is still refused.
  const std::int64_t stale = 2;
  EXPECT_THROW((void)cache.update(0, k_token, k_token, {stale}), std::invalid_argument);
}

// An engine's own ints, in braces and as variables: shapes, strides, positions and rows take
// them without narrowing (GCC warns and Clang refuses a narrowing conversion in braces: this
// file is compiled by both, with warnings as errors), and a negative one is refused by name.
TEST(EngineInts, ShapesAndStridesTakeInts) {
  const int batch = 1, heads = 8, tokens = 5, dim = 64;
  const Shape positional{batch, heads, tokens, dim};
  const Shape designated{.batch = batch, .heads = heads, .tokens = tokens, .head_dim = dim};
  EXPECT_EQ(positional, designated);
  EXPECT_EQ(positional.size(), 8U * 5U * 64U);
  const Strides token_major{.batch = tokens * heads * dim, .heads = dim, .tokens = heads * dim};
  EXPECT_EQ(token_major.tokens, 512U);
  // One field's count as another's: a shape's head size as a stride.
  const Strides from_shape{0, 0, positional.head_dim};
  EXPECT_EQ(from_shape.tokens, 64U);
  std::vector<float> data(8 * 5 * 64);
  const TensorView<const float> view(data.data(), {batch, heads, tokens, dim}, {0, dim, heads * dim});
  EXPECT_EQ(view.row(0, 1, 2), data.data() + 64 + 2 * 512);
  const int negative = -3;
  EXPECT_THAT(
      [&] {
        (void)(Shape{batch, negative, tokens, dim});
      },
      ThrowsMessage<std::invalid_argument>(StrEq("Shape.heads: expected a count >= 0, given -3")));
  EXPECT_THAT(
      [&] {
        (void)(Strides{0, negative, 0});
      },
      ThrowsMessage<std::invalid_argument>(StrEq("Strides.heads: expected a count >= 0, given -3")));
}

TEST(EngineInts, PositionsTakeAnyIntegerTypeForUpdateAndAttention) {
  KvCache<float> cache({.layers = 1, .kv_heads = 1, .head_dim = 4, .capacity = 16});
  std::vector<float> kv(3 * 4, 0.5F), q(3 * 4, 1.0F), out(q.size());
  const auto k3 = TensorView<const float>(kv.data(), {1, 1, 3, 4});
  const auto k1 = TensorView<const float>(kv.data(), {1, 1, 1, 4});
  const auto q1 = TensorView<const float>(q.data(), {1, 1, 1, 4});
  const auto out1 = TensorView<float>(out.data(), {1, 1, 1, 4});
  const std::vector<int> prompt = {0, 1, 2};  // a C engine's int positions, converted for the call
  causal_attention(TensorView<const float>(q.data(), {1, 1, 3, 4}), prompt, cache.update(0, k3, k3, prompt),
                   TensorView<float>(out.data(), {1, 1, 3, 4}));
  const int pos = 3;  // a single int variable,
  causal_attention(q1, {pos}, cache.update(0, k1, k1, {pos}), out1);
  causal_attention(q1, {pos + 1}, cache.update(0, k1, k1, {pos + 1}), out1);  // an expression,
  causal_attention(q1, {5}, cache.update(0, k1, k1, {5}), out1);              // a literal,
  const std::size_t unsigned_pos = 6;                                         // std::size_t,
  causal_attention(q1, {unsigned_pos}, cache.update(0, k1, k1, {unsigned_pos}), out1);
  const std::array<std::int32_t, 1> span_pos = {7};  // a span of int32,
  (void)cache.update(0, k1, k1, std::span<const std::int32_t>(span_pos));
  const std::vector<std::int64_t> wide = {8};  // and int64 lists still viewed in place.
  const PositionsArg viewed = wide;
  EXPECT_EQ(viewed.view().data(), wide.data());
  (void)cache.update(0, k1, k1, wide);
  EXPECT_EQ(cache.length(), 9U);
  EXPECT_EQ(out[0], 0.5F);
  // Converted positions are checked as given: a stale int is refused naming it, cache unchanged.
  EXPECT_THAT(
      [&] { (void)cache.update(0, k1, k1, {pos}); },
      ThrowsMessage<std::invalid_argument>(HasSubstr("positions[0]: expected 9 (layer 0 holds 9 tokens), given 3")));
  EXPECT_EQ(cache.length(), 9U);
  // An unsigned position beyond std::int64_t is refused before anything is read.
  const std::uint64_t huge = ~std::uint64_t{0};
  EXPECT_THAT(
      [&] { (void)cache.update(0, k1, k1, {huge}); },
      ThrowsMessage<std::invalid_argument>(StrEq("positions[0]: expected a std::int64_t, given 18446744073709551615")));
  const std::vector<std::uint64_t> huge_list = {9, huge};
  EXPECT_THROW((void)PositionsArg(huge_list), std::invalid_argument);
  EXPECT_EQ(cache.length(), 9U);
  // More positions than fit inline are converted on the heap, as they are.
  std::vector<int> many(40);
  std::iota(many.begin(), many.end(), 100);
  const PositionsArg converted = many;
  EXPECT_EQ(std::vector<std::int64_t>(converted.view().begin(), converted.view().end()),
            std::vector<std::int64_t>(many.begin(), many.end()));
}

TEST(EngineInts, RowsTakeAnyIntegerType) {
  SlotKvCache<float> cache({.layers = 1, .batch = 4, .kv_heads = 1, .head_dim = 4, .capacity = 8});
  const int a = static_cast<int>(cache.acquire()), b = static_cast<int>(cache.acquire());
  std::vector<float> kv(2 * 4, 1.0F);
  const auto two = TensorView<const float>(kv.data(), {2, 1, 1, 4});
  const auto one = TensorView<const float>(kv.data(), {1, 1, 1, 4});
  EXPECT_EQ(cache.update(0, two, two, {0}, {a, b}).segments[0].rows.size(), 2U);  // a braced list of ints
  const std::vector<int> rows = {b, a};
  (void)cache.update(0, two, two, {1}, rows);  // a vector of ints
  (void)cache.update(0, one, one, {2}, a);     // one int
  EXPECT_EQ(cache.row_length(static_cast<std::size_t>(a)), 3U);
  EXPECT_EQ(cache.row_length(static_cast<std::size_t>(b)), 2U);
  EXPECT_EQ(cache.history(0, {b}).segments[0].row_tokens[0], 2U);
  EXPECT_THAT(
      [&] {
        (void)cache.update(0, two, two, {3}, {a, -1});
      },
      ThrowsMessage<std::invalid_argument>(StrEq("rows[1]: expected a slot >= 0, given -1")));
  EXPECT_EQ(cache.row_length(static_cast<std::size_t>(a)), 3U);
}

}  // namespace
}  // namespace kvcache
