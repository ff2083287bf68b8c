// SPDX-License-Identifier: Apache-2.0
#pragma once

// Causal attention over what a cache's update() returns: any number of segments, any element
// type, grouped-query heads, a mask computed from positions alone.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "kvcache/detail/attention_kernel.hpp"
#include "kvcache/detail/checks.hpp"
#include "kvcache/views.hpp"

namespace kvcache {

/// How causal_attention scores and masks, with designated initializers:
///
///   kvcache::causal_attention(q, positions, history, out, {.window = 4096, .sinks = 4, .threads = 1});
///
/// Threads besides the caller's are kept between calls, blocked while idle, and shared by the
/// process; a call that finds them busy with another thread's call starts its own.
struct AttentionOptions {
  float scale = 0.0f;       // 0 = 1/sqrt(D)
  std::size_t window = 0;   // 0 = none; key k visible to query p iff p - window < k <= p (or 0 <= k < sinks)
  std::size_t sinks = 0;    // positions 0 .. sinks - 1 stay visible through the window
  std::size_t threads = 0;  // 0 = automatic (a thread per MiB of K and V read, half MiB on Intel); 1 = caller's only
};

namespace detail {

/// Validates causal_attention's arguments; throws std::invalid_argument naming expected and given.
template <class T, class Q>
void check_attention(const TensorView<const Q>& q, std::span<const std::int64_t> q_positions, const History<T>& history,
                     const TensorView<Q>& out) {
  // Messages are built only when a check fails: a call that passes allocates nothing.
  const auto call = [] { return std::string("causal_attention"); };
  if (out.shape() != q.shape()) {
    throw std::invalid_argument(
        expected_given(call() + ": out shape", q.shape().str() + " (the shape of q)", out.shape().str()));
  }
  if (q_positions.size() != q.tokens()) {
    throw std::invalid_argument(expected_given(call() + ": q_positions count",
                                               "q's tokens " + std::to_string(q.tokens()),
                                               std::to_string(q_positions.size())));
  }
  if (q.shape().size() != 0 && (q.data() == nullptr || out.data() == nullptr)) {
    throw std::invalid_argument(call() + ": q and out data: expected non-null pointers for shape " + q.shape().str() +
                                ", given null");
  }
  for (std::size_t s = 0; s < history.segments.size(); ++s) {
    const Segment<T>& seg = history.segments[s];
    const auto name = [&] { return call() + ": history.segments[" + std::to_string(s) + "]"; };
    const Shape& k = seg.keys.shape();
    if (seg.values.shape() != k) {
      throw std::invalid_argument(
          expected_given(name() + " values shape", k.str() + " (the shape of its keys)", seg.values.shape().str()));
    }
    if (seg.positions.size() != k.tokens) {
      throw std::invalid_argument(expected_given(name() + " positions count",
                                                 "its keys' tokens " + std::to_string(k.tokens),
                                                 std::to_string(seg.positions.size())));
    }
    if (k.batch != q.batch()) {
      throw std::invalid_argument(
          expected_given(name() + " batch", "q's batch " + std::to_string(q.batch()), std::to_string(k.batch)));
    }
    if (k.head_dim != q.head_dim()) {
      throw std::invalid_argument(expected_given(name() + " head_dim", "q's head_dim " + std::to_string(q.head_dim()),
                                                 std::to_string(k.head_dim)));
    }
    const std::size_t kv_heads = history.segments[0].keys.heads();
    if (k.heads != kv_heads) {
      throw std::invalid_argument(expected_given(
          name() + " kv_heads", "segment 0's kv_heads " + std::to_string(kv_heads), std::to_string(k.heads)));
    }
    if (k.size() != 0 && (seg.keys.data() == nullptr || seg.values.data() == nullptr)) {
      throw std::invalid_argument(name() + " keys and values data: expected non-null pointers for shape " + k.str() +
                                  ", given null");
    }
  }
  if (!history.segments.empty()) {
    const std::size_t kv_heads = history.segments[0].keys.heads();
    if (kv_heads == 0 || q.heads() % kv_heads != 0) {
      throw std::invalid_argument(expected_given(call() + ": q heads",
                                                 "a multiple of the history's kv_heads " + std::to_string(kv_heads),
                                                 std::to_string(q.heads())));
    }
  }
}

/// Runs the kernel with vectors of B bytes.
template <std::size_t B, class T, class Q, class Acc>
void attend(TensorView<const Q> q, std::span<const std::int64_t> q_positions, const History<T>& history,
            TensorView<Q> out, const VisibilityRule& rule, Acc scale, std::size_t threads) {
  const AttentionKernel<T, Q, Acc, B> kernel(q, q_positions, history, out, rule, scale);
  run_attention(kernel, q.batch(), history.segments.front().keys.heads(), q.tokens(), threads);
}

}  // namespace detail

/// out[b, h, t] = softmax over the visible keys of q[b, h, t] . k / sqrt(D), times v.
/// q, out: [B, H_q, T, D]; q_positions: the T queries' absolute positions (every batch row);
/// history: what update() returned, [B, H_kv, S, D] in segments, H_q a multiple of H_kv.
/// out may be q itself (the same view): every query row is read before its output is written.
/// Throws std::invalid_argument for mismatched shapes before writing anything.
template <class T, class Q>
void causal_attention(TensorView<const Q> q, std::span<const std::int64_t> q_positions, const History<T>& history,
                      TensorView<Q> out, const AttentionOptions& options = {}) {
  static_assert(!std::is_const_v<Q>, "causal_attention: out must be a mutable view (TensorView<float>, not const).");
  detail::check_attention(q, q_positions, history, out);
  using Acc = std::conditional_t<std::is_same_v<T, double> || std::is_same_v<Q, double>, double, float>;
  if (q.shape().size() == 0) return;
  if (history.tokens() == 0) {
    // No key at all (this also covers a history of zero segments, whose kv_heads is unknown).
    for (std::size_t b = 0; b < q.batch(); ++b)
      for (std::size_t h = 0; h < q.heads(); ++h)
        for (std::size_t t = 0; t < q.tokens(); ++t) std::fill_n(out.row(b, h, t), q.head_dim(), Q(0));
    return;
  }
  const Acc scale =
      options.scale != 0.0f ? static_cast<Acc>(options.scale) : Acc{1} / std::sqrt(static_cast<Acc>(q.head_dim()));
  const detail::VisibilityRule rule(history.window, history.sinks, options.window, options.sinks);
  if constexpr (detail::kVectorBytes == 64 && std::is_same_v<Acc, float>) {
    // One code path at either width: the processor decides which reads faster (narrow_vectors_pay).
    const std::size_t group = q.heads() / history.segments.front().keys.heads();
    const std::size_t rows = group * detail::AttentionKernel<T, Q, Acc, 32>::block_queries_for(group, q.tokens());
    if (detail::narrow_vectors_pay(rows, sizeof(T) < sizeof(Acc))) {
      return detail::attend<32>(q, q_positions, history, out, rule, scale, options.threads);
    }
  }
  detail::attend<detail::kVectorBytes>(q, q_positions, history, out, rule, scale, options.threads);
}

/// causal_attention for a mutable q view, so TensorView<float> works without a cast.
template <class T, class Q>
requires(!std::is_const_v<Q>) void causal_attention(TensorView<Q> q, std::span<const std::int64_t> q_positions,
                                                    const History<T>& history, TensorView<Q> out,
                                                    const AttentionOptions& options = {}) {
  causal_attention(TensorView<const Q>(q), q_positions, history, out, options);
}

}  // namespace kvcache
