// SPDX-License-Identifier: Apache-2.0
#pragma once

// A tiny Qwen3-style decoder that runs over any kvcache cache, and without one.
//
// Per layer: RMSNorm -> q/k/v projections -> per-head RMSNorm on q and k -> rotary embedding
// (rotate-half) -> grouped-query causal attention -> o projection -> residual -> RMSNorm ->
// SwiGLU MLP down(silu(gate(x)) * up(x)) -> residual. Then a final RMSNorm and logits through
// the embedding matrix (or lm_head). Everything computes in float; the cache stores K and V in
// its own format (float, double, Eigen::half, Eigen::bfloat16, or a quantized one).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "kvcache/attention.hpp"
#include "kvcache/concepts.hpp"
#include "kvcache/kv_cache.hpp"
#include "kvcache/views.hpp"
#include "qwen3/config.hpp"

namespace qwen3 {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Vector = Eigen::Matrix<float, 1, Eigen::Dynamic>;  // norm weights, applied to rows
using TokenId = std::int32_t;

/// One decoder layer's parameters; matrices are [out, in] like a checkpoint's linear weights.
struct LayerWeights {
  Vector input_norm;  // [hidden]
  Matrix q_proj;      // [q_heads * head_dim, hidden]
  Matrix k_proj;      // [kv_heads * head_dim, hidden]
  Matrix v_proj;      // [kv_heads * head_dim, hidden]
  Matrix o_proj;      // [hidden, q_heads * head_dim]
  Vector q_norm;      // [head_dim]
  Vector k_norm;      // [head_dim]
  Vector post_norm;   // [hidden]
  Matrix gate_proj;   // [mlp, hidden]
  Matrix up_proj;     // [mlp, hidden]
  Matrix down_proj;   // [hidden, mlp]
};

/// Every parameter of the model, with the config that sizes them.
struct Weights {
  Config config;
  Matrix embed;  // [vocab, hidden]
  std::vector<LayerWeights> layers;
  Vector final_norm;  // [hidden]
  Matrix lm_head;     // [vocab, hidden]; empty when config.tied

  /// Weights of the config's shapes, all zero; throws std::invalid_argument for a bad config.
  [[nodiscard]] static Weights zeros(const Config& config) {
    config.validate();
    const auto matrix = [](std::size_t rows, std::size_t cols) {
      return Matrix::Zero(static_cast<Eigen::Index>(rows), static_cast<Eigen::Index>(cols)).eval();
    };
    const auto vector = [](std::size_t n) { return Vector::Zero(static_cast<Eigen::Index>(n)).eval(); };
    Weights w{config, matrix(config.vocab, config.hidden), {}, vector(config.hidden), {}};
    if (!config.tied) w.lm_head = matrix(config.vocab, config.hidden);
    w.layers.reserve(config.layers);
    for (std::size_t l = 0; l < config.layers; ++l) {
      w.layers.push_back({vector(config.hidden), matrix(config.q_width(), config.hidden),
                          matrix(config.kv_width(), config.hidden), matrix(config.kv_width(), config.hidden),
                          matrix(config.hidden, config.q_width()), vector(config.head_dim), vector(config.head_dim),
                          vector(config.hidden), matrix(config.mlp, config.hidden), matrix(config.mlp, config.hidden),
                          matrix(config.hidden, config.mlp)});
    }
    return w;
  }
};

/// Calls f(name, tensor, shape) for every parameter in checkpoint order, with its Hugging Face
/// name, the Matrix or Vector that holds it, and the shape the config expects ({n} or {rows, cols}).
/// The one list of names that loading, saving, validating and the traffic report share.
template <class W, class F>
requires std::is_same_v<std::remove_const_t<W>, Weights>
void for_each_tensor(W& w, F&& f) {
  const Config& c = w.config;
  f(std::string("model.embed_tokens.weight"), w.embed, std::vector<std::size_t>{c.vocab, c.hidden});
  for (std::size_t l = 0; l < w.layers.size(); ++l) {
    auto& layer = w.layers[l];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    f(p + "input_layernorm.weight", layer.input_norm, std::vector<std::size_t>{c.hidden});
    f(p + "self_attn.q_proj.weight", layer.q_proj, std::vector<std::size_t>{c.q_width(), c.hidden});
    f(p + "self_attn.k_proj.weight", layer.k_proj, std::vector<std::size_t>{c.kv_width(), c.hidden});
    f(p + "self_attn.v_proj.weight", layer.v_proj, std::vector<std::size_t>{c.kv_width(), c.hidden});
    f(p + "self_attn.o_proj.weight", layer.o_proj, std::vector<std::size_t>{c.hidden, c.q_width()});
    f(p + "self_attn.q_norm.weight", layer.q_norm, std::vector<std::size_t>{c.head_dim});
    f(p + "self_attn.k_norm.weight", layer.k_norm, std::vector<std::size_t>{c.head_dim});
    f(p + "post_attention_layernorm.weight", layer.post_norm, std::vector<std::size_t>{c.hidden});
    f(p + "mlp.gate_proj.weight", layer.gate_proj, std::vector<std::size_t>{c.mlp, c.hidden});
    f(p + "mlp.up_proj.weight", layer.up_proj, std::vector<std::size_t>{c.mlp, c.hidden});
    f(p + "mlp.down_proj.weight", layer.down_proj, std::vector<std::size_t>{c.hidden, c.mlp});
  }
  f(std::string("model.norm.weight"), w.final_norm, std::vector<std::size_t>{c.hidden});
  if (!c.tied) f(std::string("lm_head.weight"), w.lm_head, std::vector<std::size_t>{c.vocab, c.hidden});
}

/// The shape a tensor has, as the same kind of list for_each_tensor gives ({n} for a Vector).
template <class Tensor>
[[nodiscard]] std::vector<std::size_t> shape_of(const Tensor& t) {
  if constexpr (Tensor::RowsAtCompileTime == 1) {
    return {static_cast<std::size_t>(t.cols())};
  } else {
    return {static_cast<std::size_t>(t.rows()), static_cast<std::size_t>(t.cols())};
  }
}

/// A fixed pseudo-random generator (splitmix64): the same numbers on every platform and
/// standard library, which std's distributions do not promise.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) noexcept : state_(seed) {}

  std::uint64_t next() noexcept {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  /// Uniform in [-1, 1) with 24 random bits, so every value is exact in float.
  float uniform() noexcept {
    const auto bits = static_cast<std::int32_t>(next() >> 40);  // [0, 2^24)
    return static_cast<float>(bits - (1 << 23)) * 0x1p-23F;
  }

 private:
  std::uint64_t state_;
};

/// FNV-1a of a tensor name: each tensor gets its own stream, so adding one moves no other.
[[nodiscard]] inline std::uint64_t name_hash(const std::string& name) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (const char ch : name) h = (h ^ static_cast<unsigned char>(ch)) * 0x100000001b3ULL;
  return h;
}

/// Weights drawn from `seed`: matrices uniform with variance 1/fan_in (so activations keep
/// their scale and logits stay within a few units), norm weights uniform in [0.8, 1.2].
[[nodiscard]] inline Weights random_weights(const Config& config, std::uint64_t seed = 2024) {
  Weights w = Weights::zeros(config);
  const float sqrt3 = std::sqrt(3.0F);
  for_each_tensor(w, [&](const std::string& name, auto& tensor, const std::vector<std::size_t>& shape) {
    SplitMix64 rng(seed ^ name_hash(name));
    float* data = tensor.data();
    const auto size = static_cast<std::size_t>(tensor.size());
    if (shape.size() == 1) {
      // Near 1 but not 1, so a norm weight applied to the wrong axis changes the logits.
      for (std::size_t i = 0; i < size; ++i) data[i] = 1.0F + 0.2F * rng.uniform();
      return;
    }
    // Variance 1 / fan_in everywhere. For the output table that makes logits (a normalized
    // row times the table) spread over about one unit and peak at a few: peaked enough for
    // greedy decoding to mean something, small enough that float rounding, a few ulps of the
    // largest logit, stays well under the 1e-5 the equivalence tests demand.
    const float stddev = 1.0F / std::sqrt(static_cast<float>(shape[1]));
    for (std::size_t i = 0; i < size; ++i) data[i] = sqrt3 * stddev * rng.uniform();
  });
  return w;
}

/// Which positions forward() returns logits for.
enum class Logits { all, last };

/// A sliding window for the uncached pass, as RingKvCache applies it: query p sees key k iff
/// p - size < k <= p, or k < sinks. size 0 means full causal attention.
struct Window {
  std::size_t size = 0;
  std::size_t sinks = 0;
};

/// K and V scales per (layer, kv head), layer-major, for formats that keep one
/// (kvcache::fp8_e4m3_heads, which requires them); empty for the others. As
/// KvCacheConfig::key_scales / value_scales.
struct HeadScales {
  std::span<const float> keys{};
  std::span<const float> values{};
};

/// How a Model computes, besides its weights.
struct ModelOptions {
  /// What every attention call of forward() takes (forward_uncached() adds its window):
  /// `.threads = 1`, say, so that no call's rounding depends on how threads split it.
  kvcache::AttentionOptions attention{};
  /// Every token's projections computed on their own, a matrix-vector product each, instead of
  /// one matrix product over the batch's tokens, which may round a token's row differently with
  /// other rows beside it. A sequence's logits then do not depend, to the bit, on what else the
  /// batch held; slower, for tests that compare requests served together and alone.
  bool batch_invariant = false;
};

/// The decoder. forward() reads and extends any cache that follows kvcache's protocol;
/// forward_uncached() recomputes the whole sequence with none.
///
///   qwen3::Model model(qwen3::random_weights(qwen3::Config{}));
///   kvcache::KvCache<float> cache({.layers = 4, .kv_heads = 2, .head_dim = 32, .capacity = 512});
///   qwen3::Matrix prefill = model.forward(prompt, cache);                 // [P, vocab]
///   qwen3::Matrix next = model.forward(one_token, cache, qwen3::Logits::last);  // [1, vocab]
///
/// A Model keeps scratch buffers between calls: use one Model per thread.
class Model {
 public:
  /// Takes the weights (and how to compute); throws std::invalid_argument naming a tensor whose
  /// shape is not the config's.
  explicit Model(Weights weights, ModelOptions options = {}) : w_(std::move(weights)), options_(options) {
    w_.config.validate();
    if (w_.layers.size() != w_.config.layers) {
      throw std::invalid_argument("qwen3::Model: layers: expected " + std::to_string(w_.config.layers) + ", given " +
                                  std::to_string(w_.layers.size()));
    }
    for_each_tensor(std::as_const(w_), [](const std::string& name, const auto& tensor, const auto& expected) {
      if (shape_of(tensor) != expected) {
        throw std::invalid_argument("qwen3::Model: " + name + ": expected shape " + shape_str(expected) + ", given " +
                                    shape_str(shape_of(tensor)));
      }
    });
    const std::size_t half = w_.config.head_dim / 2;
    inv_freq_.resize(half);
    for (std::size_t i = 0; i < half; ++i) {
      inv_freq_[i] =
          std::pow(w_.config.rope_theta, -static_cast<double>(2 * i) / static_cast<double>(w_.config.head_dim));
    }
  }

  [[nodiscard]] const Config& config() const noexcept { return w_.config; }
  [[nodiscard]] const Weights& weights() const noexcept { return w_; }

  /// Logits [T, vocab] (or [1, vocab] for Logits::last) of `tokens` at positions
  /// cache.length() + 0..T-1, writing their K and V into `cache` (batch 1, the config's kv
  /// heads and head_dim) as float: the cache rounds or quantizes them into its format once.
  /// Throws std::out_of_range for a token outside the vocabulary before touching the cache; a
  /// cache error propagates with the cache rolled back to where it was.
  template <kvcache::kv_cache_protocol<float> Cache>
  Matrix forward(std::span<const TokenId> tokens, Cache& cache, Logits which = Logits::all) {
    check_tokens(tokens);
    const std::size_t start = cache.length();
    try {
      auto attend = [&](std::size_t layer, const Projections& p) {
        const Attention a = p.rows(0, 1, tokens.size());
        const auto history = cache.update(layer, a.k, a.v, a.positions);
        kvcache::causal_attention(a.q, a.positions, history, a.out, options_.attention);
      };
      run(tokens, sequence_positions(start, tokens.size()), attend);
      return logits(0, tokens.size(), which);
    } catch (...) {
      try {
        cache.truncate(start);  // puts back layers a failed pass had already extended
      } catch (...) {
        // The cache cannot go back (a ring that has dropped the window); its length() now
        // names the layers that disagree, which is the most useful thing left to report.
      }
      throw;
    }
  }

  /// One sequence of a batch: the cache row that holds it and its next tokens.
  struct RowTokens {
    std::size_t row = 0;
    std::span<const TokenId> tokens;
  };

  /// One forward pass over a batch of sequences held in the rows of `cache`, each at positions
  /// continuing its own row's length: logits per sequence in the order given, [T_i, vocab] (or
  /// [1, vocab] for Logits::last). The weights are read once for every token of the batch;
  /// sequences advancing by equal counts share one update and one attention call per layer.
  /// Throws std::out_of_range for a bad token and std::invalid_argument for a row listed twice
  /// before touching the cache; a cache error propagates with every row rolled back.
  template <kvcache::row_cache_protocol<float> Cache>
  std::vector<Matrix> forward(std::span<const RowTokens> batch, Cache& cache, Logits which = Logits::all) {
    std::vector<std::size_t> order(batch.size());  // sequences grouped by token count
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return batch[a].tokens.size() < batch[b].tokens.size(); });
    std::vector<TokenId> tokens;
    std::vector<std::int64_t> positions;
    std::vector<std::size_t> rows, starts, first(batch.size());
    for (const std::size_t i : order) {
      check_tokens(batch[i].tokens);
      for (const std::size_t row : rows) {
        if (row == batch[i].row) {
          throw std::invalid_argument("qwen3::Model: batch rows: expected each row once, given row " +
                                      std::to_string(row) + " twice");
        }
      }
      rows.push_back(batch[i].row);
      starts.push_back(cache.row_length(batch[i].row));
      first[i] = tokens.size();
      tokens.insert(tokens.end(), batch[i].tokens.begin(), batch[i].tokens.end());
      const auto p = sequence_positions(starts.back(), batch[i].tokens.size());
      positions.insert(positions.end(), p.begin(), p.end());
    }
    try {
      auto attend = [&](std::size_t layer, const Projections& p) {
        for (std::size_t g = 0, token = 0; g < order.size();) {  // a group: sequences of one count
          const std::size_t count = batch[order[g]].tokens.size();
          std::size_t end = g;
          while (end < order.size() && batch[order[end]].tokens.size() == count) ++end;
          if (count != 0) {
            const Attention a = p.rows(token, end - g, count);
            const auto history = cache.update(layer, a.k, a.v, a.positions, kvcache::Rows(rows.data() + g, end - g));
            kvcache::causal_attention(a.q, a.positions, history, a.out, options_.attention);
          }
          token += (end - g) * count;
          g = end;
        }
      };
      run(tokens, positions, attend);
    } catch (...) {
      for (std::size_t g = 0; g < rows.size(); ++g) {
        try {
          cache.truncate(rows[g], starts[g]);
        } catch (...) {  // NOLINT(bugprone-empty-catch): the first error is the one to report
        }
      }
      throw;
    }
    std::vector<Matrix> out;
    out.reserve(batch.size());
    for (std::size_t i = 0; i < batch.size(); ++i) out.push_back(logits(first[i], batch[i].tokens.size(), which));
    return out;
  }

  /// Logits of the whole sequence at positions 0..T-1 with no cache, masked by `window`.
  /// T is the format K and V are stored in before attention reads them, so a cache of any
  /// format can be compared with the same rounding; float leaves them exact. Every other format
  /// goes through a KvCache<T> fed the whole sequence in one update per layer, with `scales` for
  /// a format that keeps a scale per head (as a KvCacheConfig's key_scales and value_scales).
  template <kvcache::storage_format T = float>
  Matrix forward_uncached(std::span<const TokenId> tokens, Window window = {}, Logits which = Logits::all,
                          HeadScales scales = {}) {
    check_tokens(tokens);
    kvcache::AttentionOptions options = options_.attention;
    options.window = window.size;
    options.sinks = window.sinks;
    const auto positions = sequence_positions(0, tokens.size());
    if constexpr (std::is_same_v<T, float>) {
      auto attend = [&](std::size_t, const Projections& p) {
        const Attention a = p.rows(0, 1, tokens.size());
        const kvcache::Segment<float> everything{a.k, a.v, a.positions};
        const kvcache::History<float> history{std::span<const kvcache::Segment<float>>(&everything, 1)};
        kvcache::causal_attention(a.q, a.positions, history, a.out, options);
      };
      run(tokens, positions, attend);
    } else {
      const Config& c = w_.config;
      kvcache::KvCache<T> stored({.layers = c.layers,
                                  .kv_heads = c.kv_heads,
                                  .head_dim = c.head_dim,
                                  .capacity = std::max<std::size_t>(tokens.size(), 1),
                                  .key_scales = scales.keys,
                                  .value_scales = scales.values});
      auto attend = [&](std::size_t layer, const Projections& p) {
        const Attention a = p.rows(0, 1, tokens.size());
        const auto history = stored.update(layer, a.k, a.v, a.positions);
        kvcache::causal_attention(a.q, a.positions, history, a.out, options);
      };
      run(tokens, positions, attend);
    }
    return logits(0, tokens.size(), which);
  }

 private:
  /// One attention call's inputs: q [R, H_q, T, D], k and v [R, H_kv, T, D] as strided views
  /// of the projection outputs (no transposes), positions per row, and where to write.
  struct Attention {
    kvcache::TensorView<const float> q;
    kvcache::TensorView<const float> k;
    kvcache::TensorView<const float> v;
    kvcache::Positions positions;
    kvcache::TensorView<float> out;
  };

  /// One layer's projections of every token, [N, heads * D] row-major each, with the tokens'
  /// positions.
  struct Projections {
    const float* q;
    const float* k;
    const float* v;
    float* out;
    const std::int64_t* positions;
    std::size_t q_heads, kv_heads, head_dim;

    /// `rows` sequences of `tokens` tokens each, packed one after another from token `first`.
    [[nodiscard]] Attention rows(std::size_t first, std::size_t rows, std::size_t tokens) const noexcept {
      const auto view = [&](auto* data, std::size_t heads) {
        // [rows * T, heads * D] row-major is [rows, heads, T, D] with token stride heads * D.
        using V = kvcache::TensorView<std::remove_pointer_t<decltype(data)>>;
        const std::size_t width = heads * head_dim;
        return V(data + first * width, {rows, heads, tokens, head_dim}, {tokens * width, head_dim, width});
      };
      return {view(q, q_heads), view(k, kv_heads), view(v, kv_heads),
              kvcache::Positions(positions + first, tokens, rows > 1 ? tokens : 0), view(out, q_heads)};
    }
  };

  /// start, start + 1, ..., start + count - 1, in scratch kept between calls.
  std::span<const std::int64_t> sequence_positions(std::size_t start, std::size_t count) {
    positions_.resize(count);
    std::iota(positions_.begin(), positions_.end(), static_cast<std::int64_t>(start));
    return positions_;
  }

  static std::string shape_str(const std::vector<std::size_t>& shape) {
    std::string s = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (i != 0) s += ", ";
      s += std::to_string(shape[i]);
    }
    return s + "]";
  }

  void check_tokens(std::span<const TokenId> tokens) const {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] < 0 || static_cast<std::size_t>(tokens[i]) >= w_.config.vocab) {
        throw std::out_of_range("qwen3::Model: token " + std::to_string(i) + ": expected an id in [0, " +
                                std::to_string(w_.config.vocab) + "), given " + std::to_string(tokens[i]));
      }
    }
  }

  static Eigen::Index idx(std::size_t n) noexcept { return static_cast<Eigen::Index>(n); }

  /// out.row(t) = x.row(t) / rms(x.row(t)) * weight, for every row.
  template <class X>
  void rms_norm(const Eigen::MatrixBase<X>& x, const Vector& weight, Matrix& out) const {
    out.resize(x.rows(), x.cols());
    const auto n = static_cast<float>(x.cols());
    for (Eigen::Index t = 0; t < x.rows(); ++t) {
      const float inv = 1.0F / std::sqrt(x.row(t).squaredNorm() / n + w_.config.rms_eps);
      out.row(t) = (x.row(t).array() * inv * weight.array()).matrix();
    }
  }

  /// Per-head RMSNorm, then the rotary embedding of each head_dim slice of `m` [T, heads * D].
  void norm_and_rotate(Matrix& m, std::size_t heads, const Vector& weight) const {
    const std::size_t dim = w_.config.head_dim;
    const std::size_t half = dim / 2;
    for (Eigen::Index t = 0; t < m.rows(); ++t) {
      const float* cos = rope_cos_.row(t).data();
      const float* sin = rope_sin_.row(t).data();
      for (std::size_t h = 0; h < heads; ++h) {
        Eigen::Map<Vector> x(m.row(t).data() + h * dim, idx(dim));
        const float inv = 1.0F / std::sqrt(x.squaredNorm() / static_cast<float>(dim) + w_.config.rms_eps);
        x = (x.array() * inv * weight.array()).matrix();
        // Rotate-half: pairs are (i, i + D/2), not adjacent elements.
        for (std::size_t i = 0; i < half; ++i) {
          const float a = x[idx(i)];
          const float b = x[idx(i + half)];
          x[idx(i)] = a * cos[i] - b * sin[i];
          x[idx(i + half)] = b * cos[i] + a * sin[i];
        }
      }
    }
  }

  /// A non-owning reference to a callable: run() is compiled once, not once per cache type.
  class AttendRef {
   public:
    template <class F>
    AttendRef(F& f) noexcept  // NOLINT(google-explicit-constructor)
        : object_(&f),
          call_([](void* o, std::size_t layer, const Projections& p) { (*static_cast<F*>(o))(layer, p); }) {}
    void operator()(std::size_t layer, const Projections& p) const { call_(object_, layer, p); }

   private:
    void* object_;
    void (*call_)(void*, std::size_t, const Projections&);
  };

  /// The layers over `tokens` at `positions`, with attention delegated to
  /// `attend(layer, Projections)`; leaves the last residual stream in x_.
  void run(std::span<const TokenId> tokens, std::span<const std::int64_t> positions, AttendRef attend) {
    const Config& c = w_.config;
    const std::size_t n = tokens.size();
    x_.resize(idx(n), idx(c.hidden));
    if (n == 0) return;
    // Angles in double: at position 30000 a float angle is already off by milliradians.
    rope_cos_.resize(idx(n), idx(c.head_dim / 2));
    rope_sin_.resize(idx(n), idx(c.head_dim / 2));
    for (std::size_t t = 0; t < n; ++t) {
      for (std::size_t i = 0; i < inv_freq_.size(); ++i) {
        const double angle = static_cast<double>(positions[t]) * inv_freq_[i];
        rope_cos_(idx(t), idx(i)) = static_cast<float>(std::cos(angle));
        rope_sin_(idx(t), idx(i)) = static_cast<float>(std::sin(angle));
      }
    }
    for (std::size_t t = 0; t < n; ++t) x_.row(idx(t)) = w_.embed.row(tokens[t]);

    for (std::size_t l = 0; l < c.layers; ++l) {
      const LayerWeights& lw = w_.layers[l];
      rms_norm(x_, lw.input_norm, h_);
      project(h_, lw.q_proj, q_);
      project(h_, lw.k_proj, k_);
      project(h_, lw.v_proj, v_);
      norm_and_rotate(q_, c.q_heads, lw.q_norm);
      norm_and_rotate(k_, c.kv_heads, lw.k_norm);
      attn_.resize(idx(n), idx(c.q_width()));
      attend(l, Projections{q_.data(), k_.data(), v_.data(), attn_.data(), positions.data(), c.q_heads, c.kv_heads,
                            c.head_dim});
      project(attn_, lw.o_proj, x_, true);

      rms_norm(x_, lw.post_norm, h_);
      project(h_, lw.gate_proj, gate_);
      project(h_, lw.up_proj, up_);
      silu_times(up_, gate_);
      project(gate_, lw.down_proj, x_, true);
    }
  }

  /// Logits of tokens [first, first + count) of the last run (or of the last of them).
  Matrix logits(std::size_t first, std::size_t count, Logits which) {
    const Config& c = w_.config;
    if (count == 0) return Matrix(0, idx(c.vocab));  // NOLINT(modernize-return-braced-init-list): rows, cols
    const std::size_t from = which == Logits::last ? first + count - 1 : first;
    rms_norm(x_.middleRows(idx(from), idx(first + count - from)), w_.final_norm, h_);
    Matrix out;
    project(h_, c.tied ? w_.embed : w_.lm_head, out);
    return out;
  }

  /// gate := silu(gate) * up, elementwise; a row at a time (each in storage of its own) where
  /// the options ask for batch invariance, since a vectorized exp rounds a value otherwise than
  /// the scalar one that takes an unaligned tail.
  void silu_times(const Matrix& up, Matrix& gate) const {
    if (!options_.batch_invariant) {
      gate.array() = gate.array() / (1.0F + (-gate.array()).exp()) * up.array();
      return;
    }
    Vector g;
    Vector u;
    for (Eigen::Index t = 0; t < gate.rows(); ++t) {
      g = gate.row(t);
      u = up.row(t);
      g.array() = g.array() / (1.0F + (-g.array()).exp()) * u.array();
      gate.row(t) = g;
    }
  }

  /// out = x W^T (out += x W^T where `add`): one matrix product, or one matrix-vector product a
  /// row where the options ask for batch invariance.
  void project(const Matrix& x, const Matrix& w, Matrix& out, bool add = false) const {
    if (!options_.batch_invariant) {
      if (add) {
        out.noalias() += x * w.transpose();
      } else {
        out.noalias() = x * w.transpose();
      }
      return;
    }
    if (!add) out.resize(x.rows(), w.rows());
    Vector in;
    Vector row;
    for (Eigen::Index t = 0; t < x.rows(); ++t) {
      in = x.row(t);  // storage of its own, so that the row's alignment never varies
      row.noalias() = in * w.transpose();
      if (add) {
        out.row(t) += row;
      } else {
        out.row(t) = row;
      }
    }
  }

  Weights w_;
  ModelOptions options_;
  std::vector<double> inv_freq_;  // theta^(-2i/D), i < D/2
  // Scratch reused across calls, so a decode step allocates (almost) nothing.
  std::vector<std::int64_t> positions_;
  Matrix rope_cos_, rope_sin_, x_, h_, q_, k_, v_, attn_, gate_, up_;
};

}  // namespace qwen3
