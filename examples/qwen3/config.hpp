// SPDX-License-Identifier: Apache-2.0
#pragma once

// The shape of a Qwen3-style decoder: what config.json describes. No Eigen here, so the
// traffic report and its test stay light.

#include <cstddef>
#include <stdexcept>
#include <string>

namespace qwen3 {

/// Sizes and constants of the decoder. The defaults are the tiny model the demo and the tests
/// run with no files: byte-level tokens (vocab 256), so a text prompt is its own token ids.
///
///   qwen3::Config tiny;                                  // 4 layers, hidden 128
///   qwen3::Config big = qwen3::Config::qwen3_0_6b();     // the real checkpoint's shape
struct Config {
  std::size_t vocab = 256;
  std::size_t hidden = 128;
  std::size_t layers = 4;
  std::size_t q_heads = 8;
  std::size_t kv_heads = 2;
  std::size_t head_dim = 32;
  std::size_t mlp = 384;  // intermediate size of the SwiGLU MLP
  float rms_eps = 1e-6F;
  double rope_theta = 1e6;
  bool tied = true;  // logits through the embedding matrix (no separate lm_head)

  /// The shape of Qwen3-0.6B (BF16 on disk): 28 layers, 16 query heads, 8 kv heads x 128.
  [[nodiscard]] static Config qwen3_0_6b() {
    return {.vocab = 151936, .hidden = 1024, .layers = 28, .q_heads = 16, .kv_heads = 8, .head_dim = 128, .mlp = 3072};
  }

  /// Width of all query heads together (q_heads x head_dim).
  [[nodiscard]] constexpr std::size_t q_width() const noexcept { return q_heads * head_dim; }
  /// Width of all kv heads together (kv_heads x head_dim).
  [[nodiscard]] constexpr std::size_t kv_width() const noexcept { return kv_heads * head_dim; }

  /// Throws std::invalid_argument naming the first field that cannot describe a decoder.
  void validate() const {
    const auto positive = [](const char* field, std::size_t value) {
      if (value == 0) throw std::invalid_argument(std::string("qwen3::Config.") + field + ": expected > 0, given 0");
    };
    positive("vocab", vocab);
    positive("hidden", hidden);
    positive("layers", layers);
    positive("q_heads", q_heads);
    positive("kv_heads", kv_heads);
    positive("head_dim", head_dim);
    positive("mlp", mlp);
    if (q_heads % kv_heads != 0) {
      throw std::invalid_argument("qwen3::Config.q_heads: expected a multiple of kv_heads " + std::to_string(kv_heads) +
                                  ", given " + std::to_string(q_heads));
    }
    if (head_dim % 2 != 0) {
      throw std::invalid_argument("qwen3::Config.head_dim: expected even (rotary halves), given " +
                                  std::to_string(head_dim));
    }
    if (!(rms_eps > 0.0F)) throw std::invalid_argument("qwen3::Config.rms_eps: expected > 0");
    if (!(rope_theta > 1.0)) throw std::invalid_argument("qwen3::Config.rope_theta: expected > 1");
  }
};

}  // namespace qwen3
