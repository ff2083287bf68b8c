// SPDX-License-Identifier: Apache-2.0
// The decode-step traffic report: KV bytes are the library's kv_cache_bytes, weight bytes are
// the model's parameter count, and the shares move from weights to cache as context grows.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/size.hpp"
#include "qwen3/config.hpp"
#include "qwen3/traffic.hpp"

namespace {

using ::testing::HasSubstr;

TEST(Traffic, KvBytesAreTheLibrarysKvCacheBytes) {
  const qwen3::Config c = qwen3::Config::qwen3_0_6b();
  for (const std::size_t context : {1U, 2048U, 8192U, 32768U}) {
    for (const std::size_t bytes : {1U, 2U, 4U}) {
      const qwen3::StepTraffic t = qwen3::decode_step_traffic(c, context, bytes);
      EXPECT_EQ(t.context, context);
      EXPECT_EQ(t.kv_bytes, kvcache::kv_cache_bytes(c.layers, 1, context, c.kv_heads, c.head_dim, bytes));
    }
  }
  // The sizes the design states for Qwen3-0.6B in BF16.
  EXPECT_EQ(qwen3::decode_step_traffic(c, 1, 2).kv_bytes, 112U * 1024U);
  EXPECT_EQ(qwen3::decode_step_traffic(c, 2048, 2).kv_bytes, 224ULL << 20);
  EXPECT_EQ(qwen3::decode_step_traffic(c, 32768, 2).kv_bytes, 7ULL << 29);  // 3.5 GiB
}

TEST(Traffic, WeightBytesAreEveryParameterPlusOneEmbeddingRow) {
  const qwen3::Config c = qwen3::Config::qwen3_0_6b();
  // Qwen3-0.6B's published size: 596,049,920 parameters (0.44 B outside the embedding).
  EXPECT_EQ(qwen3::parameters(c), 596049920U);
  EXPECT_EQ(qwen3::parameters(c) - c.vocab * c.hidden, 440467456U);
  // Tied: the logits read the whole table, the input one more row of it.
  EXPECT_EQ(qwen3::decode_step_traffic(c, 2048, 2).weight_bytes, 2 * (qwen3::parameters(c) + c.hidden));
  // Untied: lm_head is read whole, the embedding only for the one row.
  qwen3::Config untied = c;
  untied.tied = false;
  EXPECT_EQ(qwen3::parameters(untied), qwen3::parameters(c) + c.vocab * c.hidden);
  EXPECT_EQ(qwen3::decode_step_traffic(untied, 2048, 2).weight_bytes,
            qwen3::decode_step_traffic(c, 2048, 2).weight_bytes);
  // Weights do not depend on the context.
  EXPECT_EQ(qwen3::decode_step_traffic(c, 1, 2).weight_bytes, qwen3::decode_step_traffic(c, 32768, 2).weight_bytes);
}

TEST(Traffic, CacheOvertakesWeightsAsContextGrows) {
  const qwen3::Config c = qwen3::Config::qwen3_0_6b();
  double previous = 0.0;
  for (const std::size_t context : {2048U, 8192U, 32768U}) {
    const qwen3::StepTraffic t = qwen3::decode_step_traffic(c, context, 2);
    EXPECT_DOUBLE_EQ(t.kv_share() + t.weight_share(), 1.0);
    EXPECT_GT(t.kv_share(), previous);
    previous = t.kv_share();
  }
  EXPECT_LT(qwen3::decode_step_traffic(c, 2048, 2).kv_share(), 0.5);
  EXPECT_GT(qwen3::decode_step_traffic(c, 32768, 2).kv_share(), 0.5);
  // Where they cross: the context whose cache is as large as the weights.
  const std::uint64_t per_token = kvcache::kv_cache_bytes(c.layers, 1, 1, c.kv_heads, c.head_dim, 2);
  const std::uint64_t crossover = qwen3::decode_step_traffic(c, 0, 2).weight_bytes / per_token;
  EXPECT_LE(qwen3::decode_step_traffic(c, crossover, 2).kv_share(), 0.5);
  EXPECT_GT(qwen3::decode_step_traffic(c, crossover + 1, 2).kv_share(), 0.5);
}

TEST(Traffic, ReportHasOneLinePerContext) {
  const std::vector<std::size_t> contexts = {2048, 8192, 32768};
  const std::string report = qwen3::traffic_report(qwen3::Config::qwen3_0_6b(), contexts, 2);
  EXPECT_THAT(report, HasSubstr("28 layers, 16 q heads, 8 kv heads x 128"));
  EXPECT_THAT(report, HasSubstr("224.0 MiB"));
  EXPECT_THAT(report, HasSubstr("3.5 GiB"));
  EXPECT_THAT(report, HasSubstr("596.0 M parameters"));
  std::size_t lines = 0;
  for (const char ch : report) lines += ch == '\n' ? 1U : 0U;
  EXPECT_EQ(lines, 2 + contexts.size());
  EXPECT_EQ(qwen3::format_bytes(1023), "1023 B");
  EXPECT_EQ(qwen3::format_bytes(1536), "1.5 KiB");
}

}  // namespace
