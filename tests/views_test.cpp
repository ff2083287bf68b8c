// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <array>
#include <cstdint>
#include <stdexcept>
#include <unsupported/Eigen/CXX11/Tensor>
#include <vector>

#include "kvcache/kv_cache.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
namespace {

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

}  // namespace
}  // namespace kvcache
