// SPDX-License-Identifier: Apache-2.0
#pragma once

// What one decode step reads from memory: every weight once, and every cached key and value
// once. Weights are fixed; the cache grows with the context, so past some length it is the
// larger of the two and decode speed is set by the cache's size.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <span>
#include <string>

#include "kvcache/size.hpp"
#include "qwen3/config.hpp"

namespace qwen3 {

/// Parameters of one decoder layer: projections, MLP and the four norm weight vectors.
[[nodiscard]] constexpr std::uint64_t layer_parameters(const Config& c) noexcept {
  const std::uint64_t attention = c.hidden * c.q_width() * 2 + c.hidden * c.kv_width() * 2;  // q, o; k, v
  const std::uint64_t mlp = 3 * c.hidden * c.mlp;                                            // gate, up, down
  const std::uint64_t norms = 2 * c.hidden + 2 * c.head_dim;  // input, post-attention; q, k
  return attention + mlp + norms;
}

/// Every parameter of the model (the embedding counted once when tied).
[[nodiscard]] constexpr std::uint64_t parameters(const Config& c) noexcept {
  const std::uint64_t table = c.vocab * c.hidden;
  return table + c.layers * layer_parameters(c) + c.hidden + (c.tied ? 0 : table);
}

/// One decode step's memory reads at a given context.
struct StepTraffic {
  std::size_t context = 0;         // tokens already in the cache
  std::uint64_t kv_bytes = 0;      // every cached key and value, every layer
  std::uint64_t weight_bytes = 0;  // every layer's weights, the final norm, the output table, one embedding row

  [[nodiscard]] std::uint64_t total() const noexcept { return kv_bytes + weight_bytes; }
  [[nodiscard]] double kv_share() const noexcept {
    return total() == 0 ? 0.0 : static_cast<double>(kv_bytes) / static_cast<double>(total());
  }
  [[nodiscard]] double weight_share() const noexcept { return total() == 0 ? 0.0 : 1.0 - kv_share(); }
};

/// Bytes one decode step (batch 1) reads with `context` tokens cached, every value stored in
/// `bytes_per_value` bytes (2 for BF16).
[[nodiscard]] constexpr StepTraffic decode_step_traffic(const Config& c, std::size_t context,
                                                        std::size_t bytes_per_value) noexcept {
  // Tied or not, the logits read a whole vocab x hidden table and the input one embedding row.
  const std::uint64_t weights = c.layers * layer_parameters(c) + c.hidden /* final norm */ +
                                c.vocab * c.hidden /* output table */ + c.hidden /* embedding row */;
  return {context, kvcache::kv_cache_bytes(c.layers, 1, context, c.kv_heads, c.head_dim, bytes_per_value),
          weights * bytes_per_value};
}

/// "224.0 MiB" for a byte count.
[[nodiscard]] inline std::string format_bytes(std::uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  auto v = static_cast<double>(bytes);
  std::size_t u = 0;
  while (v >= 1024.0 && u + 1 < std::size(units)) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

/// A table of decode_step_traffic at each context, one line per context.
[[nodiscard]] inline std::string traffic_report(const Config& c, std::span<const std::size_t> contexts,
                                                std::size_t bytes_per_value) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line,
                "decode-step memory reads: %zu layers, %zu q heads, %zu kv heads x %zu, hidden %zu, MLP %zu, "
                "vocab %zu, %zu bytes per value (%.1f M parameters)\n",
                c.layers, c.q_heads, c.kv_heads, c.head_dim, c.hidden, c.mlp, c.vocab, bytes_per_value,
                static_cast<double>(parameters(c)) / 1e6);
  out += line;
  std::snprintf(line, sizeof line, "%10s  %14s  %14s  %14s  %9s  %9s\n", "context", "KV cache", "weights", "total",
                "KV share", "wt share");
  out += line;
  for (const std::size_t context : contexts) {
    const StepTraffic t = decode_step_traffic(c, context, bytes_per_value);
    std::snprintf(line, sizeof line, "%10zu  %14s  %14s  %14s  %8.1f%%  %8.1f%%\n", context,
                  format_bytes(t.kv_bytes).c_str(), format_bytes(t.weight_bytes).c_str(),
                  format_bytes(t.total()).c_str(), 100.0 * t.kv_share(), 100.0 * t.weight_share());
    out += line;
  }
  return out;
}

}  // namespace qwen3
