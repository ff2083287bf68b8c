// SPDX-License-Identifier: Apache-2.0
// The C API (kvcache.h over kvcache_c): every variant and format gives what the C++ caches give,
// every failure is a status and a message with the cache unchanged, and the C enums follow the
// library's list of formats.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "cache_test_support.hpp"
#include "kvcache.h"
#include "kvcache/kvcache.hpp"

// c_api_test_callers.c: calls with enum values no enumerator has, made in C.
extern "C" kvcache_status kvcache_test_create_with_format(int format, const kvcache_config* config,
                                                          kvcache_cache** cache);
extern "C" kvcache_status kvcache_test_update_with_k_dtype(kvcache_cache* cache, const kvcache_tensor* k, int dtype,
                                                           const int64_t* position);

namespace kvcache {
namespace {

using testing::arange;
using testing::Block;
using ::testing::HasSubstr;

constexpr std::size_t kLayers = 2, kKvHeads = 2, kQHeads = 4, kDim = 64, kCapacity = 64;

/// Fails the test with the C API's message unless `status` is KVCACHE_OK.
#define EXPECT_C_OK(call) EXPECT_EQ((call), KVCACHE_OK) << kvcache_last_error()
#define ASSERT_C_OK(call) ASSERT_EQ((call), KVCACHE_OK) << kvcache_last_error()

kvcache_config c_config(std::size_t batch = 1) {
  kvcache_config c{};
  c.layers = kLayers;
  c.batch = batch;
  c.kv_heads = kKvHeads;
  c.head_dim = kDim;
  c.capacity = kCapacity;
  return c;
}

kvcache_tensor c_view(const Block<float>& b) {
  return kvcache_head_major(b.data.data(), KVCACHE_DTYPE_F32, b.shape.batch, b.shape.heads, b.shape.tokens,
                            b.shape.head_dim);
}

/// A cache handle freed at the end of the test (and its pool, for a paged sequence).
struct Handle {
  kvcache_cache* cache = nullptr;
  kvcache_pool* pool = nullptr;
  Handle() = default;
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() {
    kvcache_destroy(cache);
    EXPECT_EQ(kvcache_pool_destroy(pool), KVCACHE_OK) << kvcache_last_error();
  }
};

void make(Handle& h, kvcache_variant variant, kvcache_format format) {
  if (variant == KVCACHE_VARIANT_PAGED) {
    const kvcache_pool_config pool{kLayers, kKvHeads, kDim, 4, 64, 0, nullptr, nullptr};
    ASSERT_C_OK(kvcache_pool_create(format, &pool, &h.pool));
    ASSERT_C_OK(kvcache_pool_sequence(h.pool, &h.cache));
  } else {
    const kvcache_config config = c_config();
    ASSERT_C_OK(kvcache_create(variant, format, &config, &h.cache));
  }
}

/// A 7-token prompt and 3 decode steps through the C API into `h`, attention at every layer;
/// the last step's output.
std::vector<float> run_c(kvcache_cache* cache, std::size_t first = 0) {
  std::vector<float> out(kQHeads * kDim);
  for (const auto& [from, n] : {std::pair<std::size_t, std::size_t>{0, 7}, {7, 1}, {8, 1}, {9, 1}}) {
    const Block<float> kv({1, kKvHeads, n, kDim}, first + from), q({1, kQHeads, n, kDim}, 100 + from);
    const std::vector<std::int64_t> positions = arange(first + from, n);
    out.assign(q.data.size(), 0.0F);
    for (std::size_t layer = 0; layer < kLayers; ++layer) {
      const kvcache_tensor k = c_view(kv), qv = c_view(q);
      EXPECT_C_OK(kvcache_update(cache, layer, &k, &k, positions.data()));
      EXPECT_C_OK(kvcache_attention(cache, layer, &qv, positions.data(), 0, out.data(), nullptr));
    }
  }
  return out;
}

/// The same through the C++ KvCache<T>.
template <class T>
std::vector<float> run_cpp() {
  KvCache<T> cache(
      testing::test_config<T>({.layers = kLayers, .kv_heads = kKvHeads, .head_dim = kDim, .capacity = kCapacity}));
  std::vector<float> out;
  for (const auto& [from, n] : {std::pair<std::size_t, std::size_t>{0, 7}, {7, 1}, {8, 1}, {9, 1}}) {
    const Block<float> kv({1, kKvHeads, n, kDim}, from), q({1, kQHeads, n, kDim}, 100 + from);
    const std::vector<std::int64_t> positions = arange(from, n);
    out.assign(q.data.size(), 0.0F);
    for (std::size_t layer = 0; layer < kLayers; ++layer) {
      causal_attention(q.view(), positions, cache.update(layer, kv.view(), kv.view(), positions),
                       TensorView<float>(out.data(), q.shape));
    }
  }
  return out;
}

TEST(CApi, FormatsFollowTheLibrarysList) {
  EXPECT_EQ(KVCACHE_FORMAT_COUNT, static_cast<int>(storage_formats::size));
  int f = 0;
  for_each_format([&]<class T>() {
    const auto format = static_cast<kvcache_format>(f++);
    EXPECT_STREQ(kvcache_format_name(format), format_name<T>());
    kvcache_format back{};
    EXPECT_C_OK(kvcache_format_from_name(format_name<T>(), &back));
    EXPECT_EQ(back, format);
    EXPECT_EQ(kvcache_bytes_per_token(format, 28, 8, 128), (kv_bytes_per_token<T>(28, 8, 128)));
    if constexpr (detail::has_head_scales<T>) {
      // Stores values up to |largest| without clipping, as calibrate_head_scales' scales do.
      EXPECT_EQ(kvcache_head_scale(format, 3.5F), storage_codec<T>::scale_for(3.5F)) << format_name<T>();
      EXPECT_EQ(kvcache_head_scale(format, -3.5F), storage_codec<T>::scale_for(3.5F)) << format_name<T>();
      EXPECT_GT(kvcache_head_scale(format, 3.5F), 0.0F);
    } else {
      EXPECT_EQ(kvcache_head_scale(format, 3.5F), 0.0F) << format_name<T>();
    }
  });
  EXPECT_EQ(kvcache_head_scale(KVCACHE_FORMAT_COUNT, 3.5F), 0.0F);
  EXPECT_EQ(kvcache_format_name(KVCACHE_FORMAT_COUNT), nullptr);
  EXPECT_EQ(kvcache_bytes_per_token(KVCACHE_FORMAT_COUNT, 28, 8, 128), 0U);
  EXPECT_EQ(kvcache_layers(nullptr), 0U);
  EXPECT_EQ(kvcache_variant_of(nullptr), KVCACHE_VARIANT_COUNT);
  kvcache_format none{};
  EXPECT_EQ(kvcache_format_from_name("bf16", &none), KVCACHE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(kvcache_last_error(), HasSubstr("expected one of float, double, half, bfloat16"));
  EXPECT_EQ(kvcache_version(), KVCACHE_VERSION);
  EXPECT_STREQ(kvcache_variant_name(KVCACHE_VARIANT_RING), "RingKvCache");
}

// Every format as the C++ cache computes it (kvcache_c may be built for another vector width
// than the tests: the same results to rounding).
TEST(CApi, EveryFormatGivesWhatTheCppCacheGives) {
  int f = 0;
  for_each_format([&]<class T>() {
    const auto format = static_cast<kvcache_format>(f++);
    Handle h;
    if constexpr (detail::has_head_scales<T>) {
      // The C++ side's calibrated scales, given to the C side too.
      static const std::vector<float> scales(kLayers * kKvHeads, testing::kTestHeadScale);
      kvcache_config config = c_config();
      config.key_scales = config.value_scales = scales.data();
      ASSERT_C_OK(kvcache_create(KVCACHE_VARIANT_KV, format, &config, &h.cache));
    } else {
      make(h, KVCACHE_VARIANT_KV, format);
    }
    const std::vector<float> got = run_c(h.cache), want = run_cpp<T>();
    for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5) << format_name<T>();
    EXPECT_EQ(kvcache_format_of(h.cache), format);
  });
}

// Every variant of a format reads what KvCache reads (within the rounding of a different split
// of the keys), and says what it is.
TEST(CApi, EveryVariantGivesWhatKvCacheGives) {
  for (const kvcache_format format : {KVCACHE_FORMAT_FLOAT, KVCACHE_FORMAT_BFLOAT16, KVCACHE_FORMAT_INT8_ROWS}) {
    Handle dense;
    make(dense, KVCACHE_VARIANT_KV, format);
    const std::vector<float> want = run_c(dense.cache);
    for (const kvcache_variant variant :
         {KVCACHE_VARIANT_CONCAT, KVCACHE_VARIANT_RING, KVCACHE_VARIANT_SLOT, KVCACHE_VARIANT_PAGED}) {
      Handle h;
      if (variant == KVCACHE_VARIANT_RING) {
        kvcache_config config = c_config();
        config.window = kCapacity;
        ASSERT_C_OK(kvcache_create(variant, format, &config, &h.cache));
      } else {
        make(h, variant, format);
      }
      const std::vector<float> got = run_c(h.cache);
      for (std::size_t i = 0; i < got.size(); ++i)
        ASSERT_NEAR(got[i], want[i], 1e-5) << kvcache_variant_name(variant) << " " << kvcache_format_name(format);
      EXPECT_EQ(kvcache_variant_of(h.cache), variant);
      std::size_t length = 0;
      EXPECT_C_OK(kvcache_length(h.cache, &length));
      EXPECT_EQ(length, 10U);
      EXPECT_C_OK(kvcache_layer_length(h.cache, 1, &length));
      EXPECT_EQ(length, 10U);
    }
  }
}

// k and v in bfloat16 or half, read in place from the engine's 16-bit buffers.
TEST(CApi, SixteenBitInputsAreTheEnginesOwnBuffers) {
  for (const kvcache_dtype dtype : {KVCACHE_DTYPE_BF16, KVCACHE_DTYPE_F16}) {
    Handle c;
    make(c, KVCACHE_VARIANT_KV, KVCACHE_FORMAT_BFLOAT16);
    KvCache<bfloat16> cpp({.layers = 1, .kv_heads = kKvHeads, .head_dim = kDim, .capacity = kCapacity});
    const Block<float> kv({1, kKvHeads, 5, kDim}, 3), q({1, kQHeads, 5, kDim}, 4);
    std::vector<std::uint16_t> k16(kv.data.size()), q16(q.data.size()), out16(q.data.size());
    for (std::size_t i = 0; i < k16.size(); ++i)
      k16[i] = dtype == KVCACHE_DTYPE_BF16 ? bfloat16(kv.data[i]).bits() : half(kv.data[i]).bits();
    for (std::size_t i = 0; i < q16.size(); ++i)
      q16[i] = dtype == KVCACHE_DTYPE_BF16 ? bfloat16(q.data[i]).bits() : half(q.data[i]).bits();
    const std::vector<std::int64_t> positions = arange(0, 5);
    const kvcache_tensor k = kvcache_head_major(k16.data(), dtype, 1, kKvHeads, 5, kDim);
    const kvcache_tensor qt = kvcache_head_major(q16.data(), dtype, 1, kQHeads, 5, kDim);
    ASSERT_C_OK(kvcache_update(c.cache, 0, &k, &k, positions.data()));
    ASSERT_C_OK(kvcache_attention(c.cache, 0, &qt, positions.data(), 0, out16.data(), nullptr));

    std::vector<std::uint16_t> want(out16.size());
    const Shape kv_shape{1, kKvHeads, 5, kDim}, q_shape{1, kQHeads, 5, kDim};
    const auto attend = [&]<class In>() {
      const TensorView<const In> kin(reinterpret_cast<const In*>(k16.data()), kv_shape);
      causal_attention(TensorView<const In>(reinterpret_cast<const In*>(q16.data()), q_shape), positions,
                       cpp.update(0, kin, kin, positions), TensorView<In>(reinterpret_cast<In*>(want.data()), q_shape));
    };
    if (dtype == KVCACHE_DTYPE_BF16) {
      attend.operator()<bfloat16>();
    } else {
      attend.operator()<half>();
    }
    for (std::size_t i = 0; i < want.size(); ++i) {
      const auto value = [&](std::uint16_t bits) {
        return dtype == KVCACHE_DTYPE_BF16 ? float(bfloat16::from_bits(bits)) : float(half::from_bits(bits));
      };
      ASSERT_NEAR(value(out16[i]), value(want[i]), 1e-2F * std::abs(value(want[i])) + 1e-3F);
    }
  }
}

TEST(CApi, AFailedCallIsAStatusAndAMessageAndChangesNothing) {
  Handle h;
  make(h, KVCACHE_VARIANT_KV, KVCACHE_FORMAT_FLOAT);
  const std::vector<float> before = run_c(h.cache);
  const std::size_t bytes = kvcache_bytes(h.cache);
  const Block<float> kv({1, kKvHeads, 1, kDim}, 50), q({1, kQHeads, 1, kDim}, 109);
  const kvcache_tensor k = c_view(kv), qt = c_view(q);

  const std::int64_t skipped = 11;
  EXPECT_EQ(kvcache_update(h.cache, 0, &k, &k, &skipped), KVCACHE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(kvcache_last_error(), HasSubstr("positions[0]: expected 10 (layer 0 holds 10 tokens), given 11"));
  const std::int64_t next = 10;
  EXPECT_EQ(kvcache_update(h.cache, 2, &k, &k, &next), KVCACHE_ERROR_OUT_OF_RANGE);
  EXPECT_THAT(kvcache_last_error(), HasSubstr("layer: expected < 2, given 2"));
  EXPECT_EQ(kvcache_update(h.cache, 0, nullptr, &k, &next), KVCACHE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(kvcache_last_error(), HasSubstr("kvcache_update: k: expected a pointer, given NULL"));
  EXPECT_EQ(kvcache_test_update_with_k_dtype(h.cache, &k, 9, &next), KVCACHE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(kvcache_last_error(), HasSubstr("k dtype: expected KVCACHE_DTYPE_F32, _BF16 or _F16, given 9"));
  kvcache_tensor bf16 = k;
  bf16.dtype = KVCACHE_DTYPE_BF16;
  EXPECT_EQ(kvcache_update(h.cache, 0, &k, &bf16, &next), KVCACHE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(kvcache_last_error(), HasSubstr("v dtype: expected k's F32, given BF16"));
  EXPECT_EQ(kvcache_truncate(h.cache, 11), KVCACHE_ERROR_OUT_OF_RANGE);
  std::size_t row = 0;
  EXPECT_EQ(kvcache_acquire(h.cache, &row), KVCACHE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(kvcache_last_error(), HasSubstr("expected a SlotKvCache (KVCACHE_VARIANT_SLOT), given a KvCache"));
  kvcache_cache* fork = nullptr;
  EXPECT_EQ(kvcache_fork(h.cache, &fork), KVCACHE_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(fork, nullptr);
  EXPECT_EQ(kvcache_load(h.cache, "/nonexistent/kvcache.state", nullptr, 0, nullptr), KVCACHE_ERROR_RUNTIME);
  EXPECT_THAT(kvcache_last_error(), HasSubstr("cannot open /nonexistent/kvcache.state"));
  std::vector<float> out(q.data.size());
  EXPECT_EQ(kvcache_attention(h.cache, 0, &qt, nullptr, 0, out.data(), nullptr), KVCACHE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(kvcache_last_error(), HasSubstr("q_positions data: expected non-null pointers"));

  // Unchanged: the same length and bytes, and the next step reads what it would have.
  std::size_t length = 0;
  EXPECT_C_OK(kvcache_length(h.cache, &length));
  EXPECT_EQ(length, 10U);
  EXPECT_EQ(kvcache_bytes(h.cache), bytes);
  Handle fresh;
  make(fresh, KVCACHE_VARIANT_KV, KVCACHE_FORMAT_FLOAT);
  EXPECT_EQ(run_c(fresh.cache), before);
  std::vector<float> h_out(q.data.size()), fresh_out(q.data.size());
  for (std::size_t layer = 0; layer < kLayers; ++layer) {
    EXPECT_C_OK(kvcache_update(h.cache, layer, &k, &k, &next));
    EXPECT_C_OK(kvcache_attention(h.cache, layer, &qt, &next, 0, h_out.data(), nullptr));
    EXPECT_C_OK(kvcache_update(fresh.cache, layer, &k, &k, &next));
    EXPECT_C_OK(kvcache_attention(fresh.cache, layer, &qt, &next, 0, fresh_out.data(), nullptr));
  }
  EXPECT_EQ(h_out, fresh_out);

  // Creation failures leave no handle.
  kvcache_cache* none = nullptr;
  kvcache_config zero = c_config();
  zero.kv_heads = 0;
  EXPECT_EQ(kvcache_create(KVCACHE_VARIANT_KV, KVCACHE_FORMAT_FLOAT, &zero, &none), KVCACHE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(kvcache_last_error(), HasSubstr("config.kv_heads: expected > 0, given 0"));
  EXPECT_EQ(kvcache_create(KVCACHE_VARIANT_PAGED, KVCACHE_FORMAT_FLOAT, &zero, &none), KVCACHE_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(kvcache_test_create_with_format(99, &zero, &none), KVCACHE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(kvcache_last_error(), HasSubstr("format: expected a kvcache_format, given 99"));
  EXPECT_EQ(none, nullptr);
}

TEST(CApi, TheLastErrorIsEachThreadsOwn) {
  EXPECT_EQ(kvcache_truncate(nullptr, 0), KVCACHE_ERROR_INVALID_ARGUMENT);
  const std::string mine = kvcache_last_error();
  std::thread([] { EXPECT_EQ(kvcache_reset(nullptr), KVCACHE_ERROR_INVALID_ARGUMENT); }).join();
  EXPECT_EQ(kvcache_last_error(), mine);
  EXPECT_THAT(mine, HasSubstr("kvcache_truncate: cache"));
}

TEST(CApi, EveryVariantSavesAndLoads) {
  const std::filesystem::path path = std::filesystem::temp_directory_path() / "kvcache_c_api_test.kvstate";
  for (const kvcache_variant variant : {KVCACHE_VARIANT_KV, KVCACHE_VARIANT_CONCAT, KVCACHE_VARIANT_RING,
                                        KVCACHE_VARIANT_SLOT, KVCACHE_VARIANT_PAGED}) {
    Handle h;
    if (variant == KVCACHE_VARIANT_RING) {
      kvcache_config config = c_config();
      config.window = 8;  // it wraps
      ASSERT_C_OK(kvcache_create(variant, KVCACHE_FORMAT_BFLOAT16, &config, &h.cache));
    } else {
      make(h, variant, KVCACHE_FORMAT_BFLOAT16);
    }
    (void)run_c(h.cache);
    ASSERT_C_OK(kvcache_save(h.cache, path.c_str(), "meta", 4));
    kvcache_state_info info{};
    ASSERT_C_OK(kvcache_read_state_info(path.c_str(), &info));
    EXPECT_EQ(info.variant, variant);
    EXPECT_EQ(info.format, KVCACHE_FORMAT_BFLOAT16);
    EXPECT_EQ(info.metadata_bytes, 4U);
    Handle restored;
    if (variant == KVCACHE_VARIANT_PAGED) {
      make(restored, variant, KVCACHE_FORMAT_BFLOAT16);
    } else {
      ASSERT_C_OK(kvcache_create(info.variant, info.format, &info.config, &restored.cache));
    }
    char metadata[3];
    std::size_t metadata_bytes = 0;
    ASSERT_C_OK(kvcache_load(restored.cache, path.c_str(), metadata, sizeof metadata, &metadata_bytes));
    EXPECT_EQ(std::string(metadata, 3), "met");  // as much as there was room for
    EXPECT_EQ(metadata_bytes, 4U);
    // The next tokens through both: the same bits.
    const std::vector<float> a = run_c(h.cache, 10), b = run_c(restored.cache, 10);
    EXPECT_EQ(a, b) << kvcache_variant_name(variant);
  }
  std::filesystem::remove(path);
}

TEST(CApi, SlotRowsAdvanceOnTheirOwn) {
  Handle h;
  const kvcache_config config = c_config(3);
  ASSERT_C_OK(kvcache_create(KVCACHE_VARIANT_SLOT, KVCACHE_FORMAT_FLOAT, &config, &h.cache));
  std::size_t a = 0, b = 0;
  ASSERT_C_OK(kvcache_acquire(h.cache, &a));
  ASSERT_C_OK(kvcache_acquire(h.cache, &b));
  const Block<float> kv({2, kKvHeads, 3, kDim}, 1), q({2, kQHeads, 3, kDim}, 2);
  const kvcache_tensor k = c_view(kv), qt = c_view(q);
  // Row a starts a prompt at 0; row b continues from 0 as well, then only a advances.
  const std::int64_t positions[] = {0, 1, 2, 0, 1, 2};
  const std::size_t rows[] = {a, b};
  std::vector<float> out(q.data.size());
  for (std::size_t layer = 0; layer < kLayers; ++layer) {
    ASSERT_C_OK(kvcache_update_rows(h.cache, layer, &k, &k, positions, 3, rows, 2));
    ASSERT_C_OK(kvcache_attention(h.cache, layer, &qt, positions, 3, out.data(), nullptr));
  }
  const Block<float> one({1, kKvHeads, 1, kDim}, 5);
  const kvcache_tensor k1 = c_view(one);
  const std::int64_t next = 3;
  for (std::size_t layer = 0; layer < kLayers; ++layer)
    ASSERT_C_OK(kvcache_update_rows(h.cache, layer, &k1, &k1, &next, 0, &a, 1));
  std::size_t length = 0;
  EXPECT_C_OK(kvcache_row_length(h.cache, a, &length));
  EXPECT_EQ(length, 4U);
  EXPECT_C_OK(kvcache_row_length(h.cache, b, &length));
  EXPECT_EQ(length, 3U);
  EXPECT_C_OK(kvcache_truncate_row(h.cache, a, 2));
  EXPECT_C_OK(kvcache_row_length(h.cache, a, &length));
  EXPECT_EQ(length, 2U);
  EXPECT_C_OK(kvcache_release(h.cache, b));
  EXPECT_EQ(kvcache_release(h.cache, b), KVCACHE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(kvcache_last_error(), HasSubstr("which is free"));
  std::size_t again = 0;
  EXPECT_C_OK(kvcache_acquire(h.cache, &again));
  EXPECT_EQ(again, b);
  EXPECT_C_OK(kvcache_shrink_to_fit(h.cache));
  EXPECT_C_OK(kvcache_row_length(h.cache, a, &length));
  EXPECT_EQ(length, 2U);
}

TEST(CApi, PagedSequencesForkAndReusePrefixes) {
  Handle first;
  make(first, KVCACHE_VARIANT_PAGED, KVCACHE_FORMAT_FLOAT);
  std::vector<std::int32_t> prompt(10);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int32_t>(100 + i);
  std::size_t reused = 99;
  ASSERT_C_OK(kvcache_reuse_prefix(first.cache, prompt.data(), prompt.size(), &reused));
  EXPECT_EQ(reused, 0U);
  (void)run_c(first.cache);  // 10 tokens: two full blocks of 4, keyed by the prompt's ids
  const std::size_t free_before = kvcache_pool_free_blocks(first.pool);
  kvcache_cache* fork = nullptr;
  ASSERT_C_OK(kvcache_fork(first.cache, &fork));
  EXPECT_EQ(kvcache_pool_free_blocks(first.pool), free_before);  // it shares every block
  EXPECT_EQ(kvcache_pool_destroy(first.pool), KVCACHE_ERROR_LOGIC);
  EXPECT_THAT(kvcache_last_error(), HasSubstr("given one with 2"));
  EXPECT_C_OK(kvcache_pool_check(first.pool));
  std::size_t length = 0;
  EXPECT_C_OK(kvcache_length(fork, &length));
  EXPECT_EQ(length, 10U);
  kvcache_destroy(fork);

  kvcache_cache* second = nullptr;
  ASSERT_C_OK(kvcache_pool_sequence(first.pool, &second));
  ASSERT_C_OK(kvcache_reuse_prefix(second, prompt.data(), prompt.size(), &reused));
  EXPECT_EQ(reused, 8U);
  EXPECT_C_OK(kvcache_length(second, &length));
  EXPECT_EQ(length, 8U);
  EXPECT_EQ(kvcache_reuse_prefix(second, prompt.data(), prompt.size(), &reused), KVCACHE_ERROR_LOGIC);
  const std::int32_t more[] = {1, 2};
  EXPECT_C_OK(kvcache_add_token_ids(second, more, 2));
  EXPECT_C_OK(kvcache_pool_check(first.pool));
  kvcache_destroy(second);
  EXPECT_GT(kvcache_pool_bytes(first.pool), 0U);
  EXPECT_C_OK(kvcache_pool_shrink_to_fit(first.pool));
}

TEST(CApi, AResetRingGivesBackItsStagingArea) {
  Handle h;
  kvcache_config config = c_config();
  config.window = 4;
  config.capacity = 0;
  ASSERT_C_OK(kvcache_create(KVCACHE_VARIANT_RING, KVCACHE_FORMAT_FLOAT, &config, &h.cache));
  const std::size_t ring = kvcache_bytes(h.cache);
  (void)run_c(h.cache);  // a 7-token prompt: longer than the window, staged
  EXPECT_GT(kvcache_bytes(h.cache), ring);
  EXPECT_C_OK(kvcache_reset(h.cache));
  EXPECT_EQ(kvcache_bytes(h.cache), ring);
  EXPECT_EQ(kvcache_capacity(h.cache), SIZE_MAX);
  EXPECT_EQ(kvcache_layers(h.cache), kLayers);
}

}  // namespace
}  // namespace kvcache
