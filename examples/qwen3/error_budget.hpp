// SPDX-License-Identifier: Apache-2.0
#pragma once

// The error budget of a cache format (the chapter's experiment): fixed token ids fed
// teacher-forced through a cache of format T, either a prompt in one update and then a token a
// step, or every token alone from the first (as token-by-token engines feed a prompt); each
// step's logits compared with another format's by the largest |dlogit|, the mean KL divergence
// of their softmax and how often their top-1 tokens agree. The same shapes, feeds and token ids
// serve the kvcache_error_budget tool and the budget test.
//
//   qwen3::Model model(qwen3::random_weights(qwen3::budget_shape("qwen3").config));
//   const auto tokens = qwen3::budget_tokens(model.config(), 1064);
//   const qwen3::Decode bf16 = qwen3::teacher_forced<Eigen::bfloat16>(model, tokens);
//   const qwen3::Decode fp8 = qwen3::teacher_forced<kvcache::fp8_e4m3>(model, tokens, {.feed =
//   qwen3::Feed::token_by_token}); const qwen3::Drift drift = qwen3::drift(bf16.logits, fp8.logits);  // KL(bf16 ||
//   fp8)

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kvcache/calibration.hpp"
#include "kvcache/kv_cache.hpp"
#include "kvcache/ring_kv_cache.hpp"
#include "qwen3/model.hpp"

namespace qwen3 {

/// A model shape the error budget runs (random weights).
struct BudgetShape {
  const char* name;
  const char* description;
  Config config;
};

/// The shapes: the tests' tiny model (head size 32), multi-head ones of head size 48 and 64 (as
/// small llama2.c checkpoints are), and a Qwen3-like one (head size 128, 8 query heads per 2 kv
/// heads); the last three two layers deep, so that the budget test over 1,000 steps stays short
/// (it runs tiny, d48 and qwen3).
inline const std::vector<BudgetShape>& budget_shapes() {
  static const std::vector<BudgetShape> shapes = {
      {"tiny", "4 layers, hidden 128, 8 q / 2 kv heads x 32, MLP 384", Config{}},
      {"d48",
       "2 layers, hidden 192, 6 q / 6 kv heads x 48, MLP 512",
       {.vocab = 256, .hidden = 192, .layers = 2, .q_heads = 6, .kv_heads = 6, .head_dim = 48, .mlp = 512}},
      {"d64",
       "2 layers, hidden 256, 4 q / 4 kv heads x 64, MLP 512",
       {.vocab = 256, .hidden = 256, .layers = 2, .q_heads = 4, .kv_heads = 4, .head_dim = 64, .mlp = 512}},
      {"qwen3",
       "2 layers, hidden 256, 8 q / 2 kv heads x 128, MLP 512",
       {.vocab = 256, .hidden = 256, .layers = 2, .q_heads = 8, .kv_heads = 2, .head_dim = 128, .mlp = 512}},
  };
  return shapes;
}

/// The shape named `name`; std::invalid_argument naming the shapes otherwise.
inline const BudgetShape& budget_shape(std::string_view name) {
  for (const BudgetShape& s : budget_shapes()) {
    if (name == s.name) return s;
  }
  throw std::invalid_argument("qwen3::budget_shape: expected tiny, d48, d64 or qwen3, given " + std::string(name));
}

/// Weights of `config` (seed 2024) with `outliers` > 0 scaling a few channels of K and V by that
/// factor in every layer (two rotary pairs of k_norm, one v_proj output channel of each kv head):
/// the outsized channels trained models have and random weights lack.
inline Weights budget_weights(const Config& config, float outliers = 0.0F) {
  Weights w = random_weights(config, 2024);
  if (outliers > 0.0F) {
    const auto d = static_cast<Eigen::Index>(config.head_dim);
    for (LayerWeights& l : w.layers) {
      for (const Eigen::Index c : {Eigen::Index{3}, Eigen::Index{3} + d / 2, Eigen::Index{1}, Eigen::Index{1} + d / 2})
        l.k_norm[c] *= outliers;
      for (Eigen::Index h = 0; h < static_cast<Eigen::Index>(config.kv_heads); ++h) l.v_proj.row(h * d + 5) *= outliers;
    }
  }
  return w;
}

/// `count` fixed token ids of the vocabulary of `config`, from a SplitMix64 of `seed`.
inline std::vector<TokenId> budget_tokens(const Config& config, std::size_t count, std::uint64_t seed = 7) {
  SplitMix64 rng(seed);
  std::vector<TokenId> tokens(count);
  for (TokenId& t : tokens) t = static_cast<TokenId>(rng.next() % config.vocab);
  return tokens;
}

/// How a teacher-forced run feeds its tokens before the steps compared.
enum class Feed {
  prompt_then_decode,  // the prompt in one update, then a token each (a server's prefill)
  token_by_token,      // every token alone from the first (as llama2.c's run.c feeds a prompt)
};

inline const char* feed_name(Feed feed) noexcept {
  return feed == Feed::prompt_then_decode ? "prompt then decode" : "token by token";
}

/// What a teacher-forced run does besides its tokens.
struct Forcing {
  std::size_t prompt = 64;  // tokens before the first step compared
  Feed feed = Feed::prompt_then_decode;
  Window window{};  // a RingKvCache of this window, or (0) a KvCache
  /// K and V scales per (layer, kv head) for a format with head scales (fp8_e4m3_heads):
  /// required there, as kvcache::calibrate_head_scales gives them; empty for other formats.
  kvcache::CalibratedScales scales{};
};

/// The logits of a teacher-forced decode and what its cache held.
struct Decode {
  Matrix logits;            // [steps, vocab]: row i is the output at position prompt + i
  std::size_t bytes = 0;    // the cache's bytes() at the end
  std::size_t clipped = 0;  // values the cache saturated (fp8_e4m3_heads beyond its head scales)
  std::size_t values = 0;   // values the cache stored (K and V), for the share clipped
};

/// Feeds `tokens` through a cache of format T as `how` says; returns the logits of every token
/// after the prompt. std::invalid_argument if there is no token after the prompt.
template <kvcache::storage_format T>
[[nodiscard]] Decode teacher_forced(Model& model, std::span<const TokenId> tokens, const Forcing& how = {}) {
  if (how.prompt == 0 || tokens.size() <= how.prompt) {
    throw std::invalid_argument("qwen3::teacher_forced: expected a prompt of 1 to " +
                                std::to_string(tokens.size() == 0 ? 0 : tokens.size() - 1) + " tokens, given " +
                                std::to_string(how.prompt));
  }
  const Config& c = model.config();
  const auto decode = [&](auto& cache) {
    const std::size_t steps = tokens.size() - how.prompt;
    Decode d{Matrix(static_cast<Eigen::Index>(steps), static_cast<Eigen::Index>(c.vocab)), 0, 0, 0};
    if (how.feed == Feed::prompt_then_decode) {
      (void)model.forward(tokens.first(how.prompt), cache, Logits::last);
    } else {
      for (std::size_t i = 0; i < how.prompt; ++i) (void)model.forward(tokens.subspan(i, 1), cache, Logits::last);
    }
    for (std::size_t i = 0; i < steps; ++i) {
      d.logits.row(static_cast<Eigen::Index>(i)) =
          model.forward(tokens.subspan(how.prompt + i, 1), cache, Logits::last);
    }
    d.bytes = cache.bytes();
    d.clipped = cache.clipped();
    d.values = 2 * c.layers * c.kv_heads * c.head_dim * tokens.size();
    return d;
  };
  if (how.window.size == 0) {
    kvcache::KvCache<T> cache({.layers = c.layers,
                               .kv_heads = c.kv_heads,
                               .head_dim = c.head_dim,
                               .capacity = tokens.size(),
                               .key_scales = how.scales.keys,
                               .value_scales = how.scales.values});
    return decode(cache);
  }
  kvcache::RingKvCache<T> cache({.layers = c.layers,
                                 .kv_heads = c.kv_heads,
                                 .head_dim = c.head_dim,
                                 .window = how.window.size,
                                 .sinks = how.window.sinks,
                                 .key_scales = how.scales.keys,
                                 .value_scales = how.scales.values});
  return decode(cache);
}

/// Head scales of format T (fp8_e4m3_heads) from a float run of `tokens`, a calibration text: each
/// (layer, kv head)'s largest |K| and |V| times `margin`.
template <class T>
[[nodiscard]] kvcache::CalibratedScales calibrated_scales(Model& model, std::span<const TokenId> tokens,
                                                          float margin = kvcache::kDefaultCalibrationMargin) {
  const Config& c = model.config();
  kvcache::KvCache<float> cache(
      {.layers = c.layers, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .capacity = tokens.size()});
  (void)model.forward(tokens, cache, Logits::last);
  return kvcache::calibrate_head_scales<T>(cache, margin);
}

/// How far one run's logits are from a reference's, over every step.
struct Drift {
  double max_abs = 0.0;  // largest |dlogit| over every step and token
  double mean_kl = 0.0;  // mean over steps of KL(softmax(reference) || softmax(logits)), in nats
  double top1 = 1.0;     // fraction of steps whose largest logit is the same token
};

/// Compares logits [steps, vocab] with the reference's, row by row. std::invalid_argument if
/// the shapes differ.
[[nodiscard]] inline Drift drift(const Matrix& reference, const Matrix& logits) {
  if (reference.rows() != logits.rows() || reference.cols() != logits.cols() || reference.rows() == 0) {
    throw std::invalid_argument("qwen3::drift: expected two non-empty logit matrices of one shape, given [" +
                                std::to_string(reference.rows()) + ", " + std::to_string(reference.cols()) + "] and [" +
                                std::to_string(logits.rows()) + ", " + std::to_string(logits.cols()) + "]");
  }
  // log softmax in double, max-subtracted: the KL of two close distributions is a small
  // difference of large sums, which float would swamp. Plain loops: GCC 12 reports its own
  // AVX-512 intrinsics as uninitialized inside Eigen's vectorized double exp.
  const auto log_softmax = [](const auto& x, std::vector<double>& out) {
    out.resize(static_cast<std::size_t>(x.size()));
    const auto top = static_cast<double>(x.maxCoeff());
    double sum = 0.0;
    for (Eigen::Index j = 0; j < x.size(); ++j) sum += std::exp(static_cast<double>(x(j)) - top);
    const double log_sum = std::log(sum);
    for (Eigen::Index j = 0; j < x.size(); ++j)
      out[static_cast<std::size_t>(j)] = static_cast<double>(x(j)) - top - log_sum;
  };
  Drift d;
  double kl = 0.0;
  std::size_t same = 0;
  std::vector<double> p;
  std::vector<double> q;
  for (Eigen::Index i = 0; i < reference.rows(); ++i) {
    log_softmax(reference.row(i), p);
    log_softmax(logits.row(i), q);
    for (std::size_t j = 0; j < p.size(); ++j) kl += std::exp(p[j]) * (p[j] - q[j]);
    d.max_abs = std::max(d.max_abs, static_cast<double>((reference.row(i) - logits.row(i)).cwiseAbs().maxCoeff()));
    Eigen::Index a = 0;
    Eigen::Index b = 0;
    reference.row(i).maxCoeff(&a);
    logits.row(i).maxCoeff(&b);
    if (a == b) ++same;
  }
  d.mean_kl = kl / static_cast<double>(reference.rows());
  d.top1 = static_cast<double>(same) / static_cast<double>(reference.rows());
  return d;
}

}  // namespace qwen3
