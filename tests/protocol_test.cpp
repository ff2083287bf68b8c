// SPDX-License-Identifier: Apache-2.0
// The update protocol, checked the same way on every cache variant and element type.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cache_test_support.hpp"
#include "kvcache/attention.hpp"
#include "kvcache/concepts.hpp"

namespace kvcache::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

static_assert(kv_cache_protocol<KvCache<Eigen::bfloat16>>);
static_assert(kv_cache_protocol<ConcatKvCache<Eigen::half>>);
static_assert(kv_cache_protocol<RingKvCache<double>>);
static_assert(row_cache_protocol<SlotKvCache<int8_rows>>);
static_assert(!row_cache_protocol<KvCache<float>>);
static_assert(kv_cache_protocol<PagedKvCache<int4_groups>>);
static_assert(kv_cache_protocol<KvCache<fp8_e4m3_heads>>);
static_assert(row_cache_protocol<SlotKvCache<int4_rotated>>);
static_assert(std::is_trivially_copyable_v<TensorView<const float>>);
static_assert(std::is_trivially_copyable_v<History<float>>);

template <class Cache>
class Protocol : public ::testing::Test {
 protected:
  using T = typename Cache::value_type;
  using In = input_t<T>;  // what the engine hands in
  static constexpr std::size_t layers = 3, batch = batch_of<Cache>, kv_heads = 2, head_dim = 4, capacity = 16;

  // A ring whose window covers the whole capacity behaves like the dense caches here; the
  // ring's own behaviour past its window is checked in ring_kv_cache_test and differential_test.
  static Cache make() {
    KvCacheConfig config{
        .layers = layers, .batch = batch, .kv_heads = kv_heads, .head_dim = head_dim, .capacity = capacity};
    if constexpr (is_ring<Cache>) {
      config.window = capacity;
      config.slack = 2;
    }
    return Cache(test_config<T>(config));
  }

  /// Feeds `tokens` new tokens to every layer; remembers what each layer should hold.
  void feed(Cache& cache, std::size_t tokens) {
    for (std::size_t layer = 0; layer < layers; ++layer) feed_layer(cache, layer, tokens);
  }

  History<T> feed_layer(Cache& cache, std::size_t layer, std::size_t tokens) {
    const std::size_t start = layer_length(cache, layer);
    Block<In> k({batch, kv_heads, tokens, head_dim}, seed_++);
    Block<In> v({batch, kv_heads, tokens, head_dim}, seed_++);
    const auto positions = arange(start, tokens);
    History<T> history = cache.update(layer, k.view(), v.view(), positions);
    auto& expected = expected_[layer];
    expected.erase(expected.lower_bound(static_cast<std::int64_t>(start)), expected.end());
    for (std::size_t t = 0; t < tokens; ++t) expected[positions[t]] = row_of<T>(k.view(), v.view(), t);
    return history;
  }

  std::map<std::int64_t, Row> expected_[layers];
  std::uint64_t seed_ = 1;
};

TYPED_TEST_SUITE(Protocol, AllCaches, CacheName);

TYPED_TEST(Protocol, UpdateReturnsEveryTokenWithItsPositionAfterPrefillChunkAndDecode) {
  auto cache = this->make();
  for (std::size_t tokens : {3U, 2U, 1U, 1U, 1U}) {
    for (std::size_t layer = 0; layer < this->layers; ++layer) {
      const auto history = this->feed_layer(cache, layer, tokens);
      EXPECT_EQ(flatten(history), this->expected_[layer]) << "layer " << layer;
    }
  }
  EXPECT_EQ(cache.length(), 8U);
  EXPECT_EQ(cache.layers(), this->layers);
  EXPECT_EQ(cache.capacity(), this->capacity);
}

TYPED_TEST(Protocol, WhatARowStoresAndAttendsDependsOnItsOwnValuesAlone) {
  // Nothing is shared between batch rows, nor between the sequences of a pool: row 0 stores and
  // attends the same whatever row 1 (a paged sequence's neighbour in its pool) holds, however
  // much larger (a scale per head shared by them would not).
  using Stored = typename TestFixture::T;
  using E = typename TestFixture::In;
  constexpr std::size_t B = 2, H = TestFixture::kv_heads, D = TestFixture::head_dim;
  constexpr bool paged = is_paged<TypeParam>;
  const auto row = [](const Block<E>& block, std::size_t b) {  // batch row b as a batch of one
    const Shape& s = block.shape;
    return TensorView<const E>(block.data.data() + b * (s.size() / s.batch), {1, s.heads, s.tokens, s.head_dim});
  };
  const KvCacheConfig config = test_config<Stored>(
      {.layers = TestFixture::layers, .kv_heads = H, .head_dim = D, .capacity = TestFixture::capacity});
  const BlockPoolConfig pool_config{.layers = config.layers,
                                    .kv_heads = config.kv_heads,
                                    .head_dim = config.head_dim,
                                    .block_tokens = kPooledBlockTokens,
                                    .blocks = 2 * (TestFixture::capacity / kPooledBlockTokens + 1),
                                    .capacity = config.capacity,
                                    .key_scales = config.key_scales,
                                    .value_scales = config.value_scales};
  // Paged: `alike` alone in its pool; `other` shares its pool with `neighbour`, which stores the
  // larger row 1 just before `other` stores row 0. Otherwise the rows of one batch.
  BlockPool<Stored> pool_alone(pool_config), pool_shared(pool_config);
  PagedKvCache<Stored> neighbour(pool_shared);
  auto alike = this->make();
  auto other = this->make();
  PagedKvCache<Stored> alike_seq(pool_alone), other_seq(pool_shared);
  std::uint64_t seed = 70;
  for (const std::size_t tokens : {4U, 1U, 3U, 1U}) {
    const Block<E> k({B, H, tokens, D}, seed++), v({B, H, tokens, D}, seed++), q({B, 2 * H, tokens, D}, seed++);
    Block<E> k_other = k, v_other = v;
    for (std::size_t h = 0; h < H; ++h)
      for (std::size_t t = 0; t < tokens; ++t)
        for (std::size_t d = 0; d < D; ++d) {
          k_other.mutable_view()(1, h, t, d) = static_cast<E>(1000.0F * static_cast<float>(v.view()(1, h, t, d)));
          v_other.mutable_view()(1, h, t, d) = static_cast<E>(-500.0F * static_cast<float>(k.view()(1, h, t, d)));
        }
    const auto positions = arange(paged ? alike_seq.length(0) : layer_length(alike, 0), tokens);
    for (std::size_t layer = 0; layer < TestFixture::layers; ++layer) {
      History<Stored> a, b;
      if constexpr (paged) {
        a = alike_seq.update(layer, row(k, 0), row(v, 0), positions);
        const auto beside = flatten_row(neighbour.update(layer, row(k_other, 1), row(v_other, 1), positions), 0);
        b = other_seq.update(layer, row(k, 0), row(v, 0), positions);
        EXPECT_NE(flatten_row(a, 0), beside) << "layer " << layer;  // the sequences do differ
      } else {
        a = alike.update(layer, k.view(), v.view(), positions);
        b = other.update(layer, k_other.view(), v_other.view(), positions);
        EXPECT_NE(flatten_row(a, 1), flatten_row(b, 1)) << "layer " << layer;  // the rows do differ
      }
      EXPECT_EQ(flatten_row(a, 0), flatten_row(b, 0)) << "layer " << layer;
      const TensorView<const E> queries = paged ? row(q, 0) : q.view();
      std::vector<E> out_a(queries.shape().size()), out_b(queries.shape().size());
      causal_attention(queries, positions, a, TensorView<E>(out_a.data(), queries.shape()), {.threads = 1});
      causal_attention(queries, positions, b, TensorView<E>(out_b.data(), queries.shape()), {.threads = 1});
      const std::size_t first_row = q.data.size() / B;  // batch row 0's outputs come first
      EXPECT_EQ(std::memcmp(out_a.data(), out_b.data(), first_row * sizeof(E)), 0) << "layer " << layer;
    }
  }
}

TYPED_TEST(Protocol, HistoryStaysValidWhileOtherLayersUpdate) {
  auto cache = this->make();
  const auto history = this->feed_layer(cache, 0, 4);
  this->feed_layer(cache, 1, 4);
  this->feed_layer(cache, 2, 4);
  EXPECT_EQ(flatten(history), this->expected_[0]);
}

TYPED_TEST(Protocol, StridedTokenMajorInputsAreStoredLikeDenseOnes) {
  using E = typename TestFixture::In;
  constexpr std::size_t B = TestFixture::batch, H = TestFixture::kv_heads, D = TestFixture::head_dim;
  auto strided = this->make();
  auto dense = this->make();
  for (std::size_t tokens : {5U, 1U, 3U}) {
    // The engine's own [B, T, H, D] buffers, read as [B, H, T, D] through strides.
    const Block<E> k({B, tokens, H, D}, 40 + tokens);
    const Block<E> v({B, tokens, H, D}, 50 + tokens);
    const Strides token_major{tokens * H * D, D, H * D};
    const TensorView<const E> k_view(k.data.data(), {B, H, tokens, D}, token_major);
    const TensorView<const E> v_view(v.data.data(), {B, H, tokens, D}, token_major);
    Block<E> k_dense({B, H, tokens, D}, 0);
    Block<E> v_dense({B, H, tokens, D}, 0);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < H; ++h)
        for (std::size_t t = 0; t < tokens; ++t)
          for (std::size_t d = 0; d < D; ++d) {
            k_dense.mutable_view()(b, h, t, d) = k_view(b, h, t, d);
            v_dense.mutable_view()(b, h, t, d) = v_view(b, h, t, d);
          }
    const auto positions = arange(strided.length(), tokens);
    for (std::size_t layer = 0; layer < TestFixture::layers; ++layer) {
      EXPECT_EQ(flatten(strided.update(layer, k_view, v_view, positions)),
                flatten(dense.update(layer, k_dense.view(), v_dense.view(), positions)))
          << "layer " << layer << " after " << tokens << " tokens";
    }
  }
}

TYPED_TEST(Protocol, ZeroTokenUpdateChangesNothing) {
  auto cache = this->make();
  this->feed(cache, 3);
  const auto history = this->feed_layer(cache, 0, 0);
  EXPECT_EQ(flatten(history), this->expected_[0]);
  EXPECT_EQ(cache.length(), 3U);
}

TYPED_TEST(Protocol, TruncateForgetsTheTailAndNewTokensReplaceIt) {
  auto cache = this->make();
  this->feed(cache, 6);
  cache.truncate(4);
  EXPECT_EQ(cache.length(), 4U);
  for (std::size_t layer = 0; layer < this->layers; ++layer) {
    const auto history = this->feed_layer(cache, layer, 2);
    EXPECT_EQ(flatten(history), this->expected_[layer]) << "layer " << layer;
  }
  EXPECT_EQ(cache.length(), 6U);
}

TYPED_TEST(Protocol, TruncateToTheLengthChangesNothingAndToZeroStartsOver) {
  auto cache = this->make();
  this->feed(cache, 6);
  cache.truncate(6);
  EXPECT_EQ(cache.length(), 6U);
  EXPECT_EQ(flatten(this->feed_layer(cache, 0, 1)), this->expected_[0]);
  cache.truncate(6);  // also repairs the pass stopped after layer 0
  EXPECT_EQ(cache.length(), 6U);
  cache.truncate(0);
  EXPECT_EQ(cache.length(), 0U);
  for (std::size_t layer = 0; layer < this->layers; ++layer) {
    const auto history = this->feed_layer(cache, layer, 2);
    EXPECT_EQ(flatten(history), this->expected_[layer]) << "layer " << layer;
    EXPECT_EQ(flatten(history).size(), 2U);
  }
}

TYPED_TEST(Protocol, ResetStartsOverAtPositionZero) {
  auto cache = this->make();
  this->feed(cache, 5);
  cache.reset();
  EXPECT_EQ(cache.length(), 0U);
  const auto history = this->feed_layer(cache, 0, 2);
  EXPECT_EQ(flatten(history).size(), 2U);
  EXPECT_EQ(flatten(history).begin()->first, 0);
}

TYPED_TEST(Protocol, PartWayPassMakesLengthThrowNamingTheLayersUntilRepaired) {
  auto cache = this->make();
  this->feed(cache, 5);
  this->feed_layer(cache, 0, 1);  // the pass stops after layer 0
  EXPECT_EQ(layer_length(cache, 0), 6U);
  EXPECT_EQ(layer_length(cache, 1), 5U);
  try {
    (void)cache.length();
    FAIL() << "length() must throw while layers disagree";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("layer 0 holds 6"), HasSubstr("layers 1-2 hold 5")));
  }
  EXPECT_THROW(cache.truncate(6), std::out_of_range);  // layers 1-2 never held token 5
  cache.truncate(5);
  EXPECT_EQ(cache.length(), 5U);

  this->feed_layer(cache, 0, 1);
  cache.reset();
  EXPECT_EQ(cache.length(), 0U);
}

TYPED_TEST(Protocol, CapacityIsEnforced) {
  auto cache = this->make();
  this->feed(cache, this->capacity);
  EXPECT_EQ(cache.length(), this->capacity);
  Block<typename TestFixture::In> k({this->batch, this->kv_heads, 1, this->head_dim}, 99);
  EXPECT_THROW(cache.update(0, k.view(), k.view(), arange(this->capacity, 1)), std::length_error);
}

TYPED_TEST(Protocol, LengthOfABadLayerThrows) {
  auto cache = this->make();
  EXPECT_THROW((void)layer_length(cache, this->layers), std::out_of_range);
}

TYPED_TEST(Protocol, BadCallsThrowNamingBothValuesAndLeaveTheCacheUnchanged) {
  using E = typename TestFixture::In;
  using Cache = TypeParam;
  constexpr std::size_t B = TestFixture::batch, H = TestFixture::kv_heads, D = TestFixture::head_dim;
  const Block<E> good({B, H, 1, D}, 7);
  const auto at5 = arange(5, 1);
  const auto update_with = [&](std::size_t layer, Shape k_shape, Shape v_shape, std::vector<std::int64_t> positions) {
    return [=](Cache& cache) {
      const Block<E> k(k_shape, 11);
      const Block<E> v(v_shape, 12);
      cache.update(layer, k.view(), v.view(), positions);
    };
  };
  struct Case {
    std::string name;
    std::function<void(Cache&)> call;
    Throws type;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {"layer",
       update_with(3, {B, H, 1, D}, {B, H, 1, D}, at5),
       Throws::out_of_range,
       {"layer", "expected < 3", "given 3"}},
      {"batch",
       update_with(0, {B + 1, H, 1, D}, {B + 1, H, 1, D}, at5),
       Throws::invalid_argument,
       {"batch", "expected " + std::to_string(B), "given " + std::to_string(B + 1)}},
      {"kv_heads",
       update_with(0, {B, 3, 1, D}, {B, 3, 1, D}, at5),
       Throws::invalid_argument,
       {"kv_heads", "expected 2", "given 3"}},
      {"head_dim",
       update_with(0, {B, H, 1, 5}, {B, H, 1, 5}, at5),
       Throws::invalid_argument,
       {"head_dim", "expected 4", "given 5"}},
      {"v tokens",
       update_with(0, {B, H, 1, D}, {B, H, 2, D}, at5),
       Throws::invalid_argument,
       {"v shape", "[" + std::to_string(B) + ", 2, 1, 4]", "given [" + std::to_string(B) + ", 2, 2, 4]"}},
      {"v head_dim",
       update_with(0, {B, H, 1, D}, {B, H, 1, 3}, at5),
       Throws::invalid_argument,
       {"v shape", "[" + std::to_string(B) + ", 2, 1, 4]", "given [" + std::to_string(B) + ", 2, 1, 3]"}},
      {"positions count",
       update_with(0, {B, H, 1, D}, {B, H, 1, D}, arange(5, 2)),
       Throws::invalid_argument,
       {"positions count", "expected k's tokens 1", "given 2"}},
      {"position gap",
       update_with(0, {B, H, 1, D}, {B, H, 1, D}, arange(6, 1)),
       Throws::invalid_argument,
       {"positions[0]", "expected 5", "given 6"}},
      {"position repeated",
       update_with(0, {B, H, 1, D}, {B, H, 1, D}, arange(4, 1)),
       Throws::invalid_argument,
       {"positions[0]", "expected 5", "given 4"}},
      {"positions restart",
       update_with(0, {B, H, 2, D}, {B, H, 2, D}, arange(0, 2)),
       Throws::invalid_argument,
       {"positions[0]", "expected 5", "given 0"}},
      {"positions out of order",
       update_with(1, {B, H, 2, D}, {B, H, 2, D}, {5, 7}),
       Throws::invalid_argument,
       {"positions[1]", "expected 6", "given 7"}},
      {"negative position",
       update_with(0, {B, H, 1, D}, {B, H, 1, D}, {-1}),
       Throws::invalid_argument,
       {"positions[0]", "expected 5", "given -1"}},
      {"null data",
       [=](Cache& cache) {
         const Block<E> v({B, H, 1, D}, 12);
         cache.update(0, TensorView<const E>(nullptr, {B, H, 1, D}), v.view(), at5);
       },
       Throws::invalid_argument,
       {"non-null", "given null"}},
      {"zero tokens, wrong kv_heads",
       update_with(0, {B, 3, 0, D}, {B, 3, 0, D}, {}),
       Throws::invalid_argument,
       {"kv_heads", "expected 2", "given 3"}},
      {"zero tokens, bad layer",
       update_with(3, {B, H, 0, D}, {B, H, 0, D}, {}),
       Throws::out_of_range,
       {"layer", "expected < 3", "given 3"}},
      {"capacity",
       update_with(2, {B, H, 12, D}, {B, H, 12, D}, arange(5, 12)),
       Throws::length_error,
       {"capacity 16", "5 + 12"}},
      {"truncate beyond length",
       [](Cache& cache) { cache.truncate(6); },
       Throws::out_of_range,
       {"truncate", "<= 5", "given 6"}},
  };

  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto cache = this->make();
    auto twin = this->make();
    for (std::size_t step : {3U, 2U}) {
      for (std::size_t layer = 0; layer < TestFixture::layers; ++layer) {
        const Block<E> k({B, H, step, D}, 100 + layer + step);
        const auto positions = arange(layer_length(cache, layer), step);
        cache.update(layer, k.view(), k.view(), positions);
        twin.update(layer, k.view(), k.view(), positions);
      }
    }
    const std::size_t bytes_before = cache.bytes();
    expect_throw_naming([&] { c.call(cache); }, c.type, c.parts);

    // Unchanged: same lengths and bytes, and the next good update returns exactly what the
    // twin that never saw the bad call returns.
    EXPECT_EQ(cache.length(), 5U);
    EXPECT_EQ(cache.bytes(), bytes_before);
    for (std::size_t layer = 0; layer < TestFixture::layers; ++layer) {
      EXPECT_EQ(flatten(cache.update(layer, good.view(), good.view(), at5)),
                flatten(twin.update(layer, good.view(), good.view(), at5)))
          << "layer " << layer;
    }
  }
}

TYPED_TEST(Protocol, AMovedFromCacheHoldsNoLayersAndCanBeAssignedAgain) {
  using Cache = TypeParam;
  auto cache = this->make();
  this->feed(cache, 5);
  const std::size_t bytes = cache.bytes();

  Cache moved(std::move(cache));
  EXPECT_EQ(moved.length(), 5U);
  EXPECT_EQ(moved.bytes(), bytes);
  EXPECT_EQ(flatten(this->feed_layer(moved, 0, 1)), this->expected_[0]);

  // NOLINTBEGIN(bugprone-use-after-move, clang-analyzer-cplusplus.Move): what this test checks
  EXPECT_EQ(cache.layers(), 0U);
  EXPECT_EQ(cache.length(), 0U);
  EXPECT_EQ(cache.bytes(), 0U);
  EXPECT_THROW((void)layer_length(cache, 0), std::out_of_range);
  Block<typename TestFixture::In> k({this->batch, this->kv_heads, 1, this->head_dim}, 99);
  EXPECT_THROW(cache.update(0, k.view(), k.view(), arange(0, 1)), std::out_of_range);
  EXPECT_THROW(cache.truncate(1), std::out_of_range);
  cache.truncate(0);
  cache.reset();

  cache = std::move(moved);
  EXPECT_EQ(cache.layers(), this->layers);
  EXPECT_EQ(layer_length(cache, 0), 6U);
  EXPECT_EQ(moved.layers(), 0U);
  // NOLINTEND(bugprone-use-after-move, clang-analyzer-cplusplus.Move)
  this->feed_layer(cache, 1, 1);
  EXPECT_EQ(flatten(this->feed_layer(cache, 2, 1)), this->expected_[2]);
}

// Every compute type the cache's format takes: what is stored is the input encoded once into
// the format (each value widened exactly, then rounded or quantized once), and a bad call in
// that type throws and leaves the cache unchanged.
template <class Cache, class In>
void expect_input_type_rounded_once_and_checked() {
  using T = typename Cache::value_type;
  constexpr std::size_t B = batch_of<Cache>, H = 2, D = 4, N = 5;
  const Block<In> k({B, H, N, D}, 31);
  const Block<In> v({B, H, N, D}, 32);
  std::map<std::int64_t, Row> expected;
  for (std::size_t t = 0; t < N; ++t) expected[static_cast<std::int64_t>(t)] = row_of<T>(k.view(), v.view(), t);
  KvCacheConfig config{.layers = 2, .batch = B, .kv_heads = H, .head_dim = D, .capacity = 16};
  if constexpr (is_ring<Cache>) config.window = 16;
  Cache given(test_config<T>(config));
  const auto got = flatten(given.update(0, k.view(), v.view(), arange(0, N)));
  EXPECT_EQ(got, expected);
  const std::size_t bytes = given.bytes();
  EXPECT_THROW(given.update(0, k.view(), v.view(), arange(4, N)), std::invalid_argument);  // positions
  EXPECT_THROW(given.update(2, k.view(), v.view(), arange(N, N)), std::out_of_range);      // layer
  EXPECT_THROW(given.update(0, k.view(), v.view().tokens(0, 4), arange(N, N)), std::invalid_argument);
  EXPECT_EQ(layer_length(given, 0), N);
  EXPECT_EQ(given.bytes(), bytes);
  EXPECT_EQ(flatten(given.update(0, k.view().tokens(0, 0), v.view().tokens(0, 0), arange(N, 0))), got);
}

TYPED_TEST(Protocol, EveryComputeTypeIsRoundedOnceAndChecked) {
  using Cache = TypeParam;
  using Stored = typename Cache::value_type;
  static_assert(kv_cache_protocol<Cache, float> && kv_cache_protocol<Cache, Eigen::half> &&
                kv_cache_protocol<Cache, Eigen::bfloat16>);
  static_assert(kv_cache_protocol<Cache, double> == std::is_same_v<Stored, double>);
  expect_input_type_rounded_once_and_checked<Cache, float>();
  expect_input_type_rounded_once_and_checked<Cache, Eigen::half>();
  expect_input_type_rounded_once_and_checked<Cache, Eigen::bfloat16>();
  if constexpr (std::is_same_v<Stored, double>) expect_input_type_rounded_once_and_checked<Cache, double>();
}

}  // namespace
}  // namespace kvcache::testing
