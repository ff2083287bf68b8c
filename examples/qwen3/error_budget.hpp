// SPDX-License-Identifier: Apache-2.0
#pragma once

// The error budget of a cache format (the chapter's experiment): fixed token ids fed
// teacher-forced, a prompt in one pass and then one token a step, through a cache of format T;
// each step's logits compared with another format's by the largest |dlogit|, the mean KL
// divergence of their softmax and how often their top-1 tokens agree.
//
//   const qwen3::Decode bf16 = qwen3::teacher_forced<Eigen::bfloat16>(model, tokens, 64);
//   const qwen3::Decode fp8 = qwen3::teacher_forced<kvcache::fp8_e4m3>(model, tokens, 64);
//   const qwen3::Drift drift = qwen3::drift(bf16.logits, fp8.logits);  // KL(bf16 || fp8)

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcache/kv_cache.hpp"
#include "kvcache/ring_kv_cache.hpp"
#include "qwen3/model.hpp"

namespace qwen3 {

/// The logits of a teacher-forced decode and what its cache held.
struct Decode {
  Matrix logits;            // [steps, vocab]: row i is the output of decode step i
  std::size_t bytes = 0;    // the cache's bytes() at the end
  std::size_t clipped = 0;  // values the cache saturated (fp8_e4m3 beyond its head scales)
};

/// Feeds tokens[0, prompt) in one forward pass, then every later token alone, through a cache of
/// format T: a KvCache, or a RingKvCache for a window. Returns each decode step's logits.
/// std::invalid_argument if there is no token after the prompt.
template <kvcache::storage_format T>
[[nodiscard]] Decode teacher_forced(Model& model, std::span<const TokenId> tokens, std::size_t prompt,
                                    Window window = {}) {
  if (prompt == 0 || tokens.size() <= prompt) {
    throw std::invalid_argument("qwen3::teacher_forced: expected a prompt of 1 to " +
                                std::to_string(tokens.size() == 0 ? 0 : tokens.size() - 1) + " tokens, given " +
                                std::to_string(prompt));
  }
  const Config& c = model.config();
  const auto decode = [&](auto& cache) {
    const std::size_t steps = tokens.size() - prompt;
    Decode d{Matrix(static_cast<Eigen::Index>(steps), static_cast<Eigen::Index>(c.vocab)), 0, 0};
    (void)model.forward(tokens.first(prompt), cache, Logits::last);
    for (std::size_t i = 0; i < steps; ++i)
      d.logits.row(static_cast<Eigen::Index>(i)) = model.forward(tokens.subspan(prompt + i, 1), cache, Logits::last);
    d.bytes = cache.bytes();
    d.clipped = cache.clipped();
    return d;
  };
  if (window.size == 0) {
    kvcache::KvCache<T> cache(
        {.layers = c.layers, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .capacity = tokens.size()});
    return decode(cache);
  }
  kvcache::RingKvCache<T> cache({.layers = c.layers,
                                 .kv_heads = c.kv_heads,
                                 .head_dim = c.head_dim,
                                 .window = window.size,
                                 .sinks = window.sinks});
  return decode(cache);
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
