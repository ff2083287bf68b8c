// SPDX-License-Identifier: Apache-2.0
#pragma once

// Causal attention over what a cache's update() returns: any number of segments, any storage
// format (read through its codec), queries in any compute type, grouped-query heads, a mask
// computed from positions alone. Needs no Eigen: half and bfloat16 are read by their bits.

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

#include "kvcache/attention_tuning.hpp"
#include "kvcache/codec.hpp"
#include "kvcache/detail/attention_kernel.hpp"
#include "kvcache/detail/checks.hpp"
#include "kvcache/version.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// How causal_attention scores and masks, with designated initializers:
///
///   kvcache::causal_attention(q, positions, history, out, {.window = 4096, .sinks = 4, .threads = 1});
///
/// Threads besides the caller's are kept between calls, blocked while idle, and shared by the
/// process; a call that finds them busy with another thread's call starts its own.
struct AttentionOptions {
  float scale = 0.0f;        // 0 = 1/sqrt(D)
  std::size_t window = 0;    // 0 = none; key k visible to query p iff p - window < k <= p (or 0 <= k < sinks)
  std::size_t sinks = 0;     // positions 0 .. sinks - 1 stay visible through the window
  std::size_t threads = 0;   // 0 = automatic (a thread per tuning.bytes_per_thread of K and V read); 1 = caller's only
  AttentionTuning tuning{};  // tile, prefetch and thread sizes; results never depend on them
};

namespace detail {

/// Validates causal_attention's arguments; throws std::invalid_argument naming expected and given.
template <class T, class Q>
void check_attention(const TensorView<const Q>& q, const Positions& q_positions, const History<T>& history,
                     const TensorView<Q>& out) {
  // Messages are built only when a check fails: a call that passes allocates nothing.
  const auto call = [] { return std::string("causal_attention"); };
  if (out.shape() != q.shape()) {
    throw std::invalid_argument(
        expected_given(call() + ": out shape", q.shape().str() + " (the shape of q)", out.shape().str()));
  }
  if (q_positions.tokens() != q.tokens()) {
    throw std::invalid_argument(expected_given(call() + ": q_positions count",
                                               "q's tokens " + std::to_string(q.tokens()),
                                               std::to_string(q_positions.tokens())));
  }
  if (q.shape().size() != 0 && (q.data() == nullptr || out.data() == nullptr || q_positions.data() == nullptr)) {
    throw std::invalid_argument(call() + ": q, out and q_positions data: expected non-null pointers for shape " +
                                q.shape().str() + ", given null");
  }
  const std::size_t units = storage_codec<T>::units(q.head_dim());
  for (std::size_t s = 0; s < history.segments.size(); ++s) {
    const Segment<T>& seg = history.segments[s];
    const auto name = [&] { return call() + ": history.segments[" + std::to_string(s) + "]"; };
    const Shape& k = seg.keys.shape();
    if (seg.values.shape() != k) {
      throw std::invalid_argument(
          expected_given(name() + " values shape", k.str() + " (the shape of its keys)", seg.values.shape().str()));
    }
    if (seg.positions.tokens() != k.tokens) {
      throw std::invalid_argument(expected_given(name() + " positions count",
                                                 "its keys' tokens " + std::to_string(k.tokens),
                                                 std::to_string(seg.positions.tokens())));
    }
    if (seg.batch() != q.batch()) {
      throw std::invalid_argument(expected_given(name() + (seg.rows.empty() ? " batch" : " rows count"),
                                                 "q's batch " + std::to_string(q.batch()),
                                                 std::to_string(seg.batch())));
    }
    for (std::size_t b = 0; b < seg.rows.size(); ++b) {
      if (seg.rows[b] >= k.batch) {
        throw std::invalid_argument(expected_given(name() + " rows[" + std::to_string(b) + "]",
                                                   "a stored row < " + std::to_string(k.batch),
                                                   std::to_string(seg.rows[b])));
      }
    }
    if (k.head_dim != units) {
      throw std::invalid_argument(
          expected_given(name() + " row length",
                         std::to_string(units) + " stored values (q's head_dim " + std::to_string(q.head_dim()) + ")",
                         std::to_string(k.head_dim)));
    }
    const std::size_t kv_heads = history.segments[0].keys.heads();
    if (k.heads != kv_heads) {
      throw std::invalid_argument(expected_given(
          name() + " kv_heads", "segment 0's kv_heads " + std::to_string(kv_heads), std::to_string(k.heads)));
    }
    if (!seg.row_tokens.empty() && seg.row_tokens.size() != seg.batch()) {
      throw std::invalid_argument(expected_given(name() + " row_tokens count",
                                                 "its batch " + std::to_string(seg.batch()),
                                                 std::to_string(seg.row_tokens.size())));
    }
    if (k.size() != 0 &&
        (seg.keys.data() == nullptr || seg.values.data() == nullptr || seg.positions.data() == nullptr)) {
      throw std::invalid_argument(name() + " keys, values and positions data: expected non-null pointers for shape " +
                                  k.str() + ", given null");
    }
    if (detail::reads_scales<storage_codec<T>> && k.size() != 0 &&
        (seg.key_scales.empty() || seg.value_scales.empty())) {
      throw std::invalid_argument(name() + " key_scales and value_scales: expected a scale per row for this format, " +
                                  "given none");
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

/// Runs the kernel in registers of B bytes, for head size Dim (0: any).
template <std::size_t B, class T, std::size_t Dim = 0>
void attend(const QueryRows<acc_type<T>>& q, const History<T>& history, const VisibilityRule& rule, acc_type<T> scale,
            const AttentionOptions& options) {
  const std::vector<std::int64_t> starts = consecutive_starts(history.segments, q.shape.batch);
  const AttentionKernel<T, B, Dim> kernel(q, history, starts, rule, scale, options.tuning);
  run_attention(kernel, history, q.shape.batch, history.segments.front().keys.heads(), q.shape.tokens, q.shape.head_dim,
                options.threads, options.tuning);
}

/// The widest registers whose lanes divide the head size (the scalar tail takes the rest).
template <class T>
void attend_by_width(const QueryRows<acc_type<T>>& q, const History<T>& history, const VisibilityRule& rule,
                     acc_type<T> scale, const AttentionOptions& options) {
  const std::size_t dim = q.shape.head_dim;
  constexpr std::size_t kAcc = sizeof(acc_type<T>);
  // The head sizes most models use, known at compile time (see AttentionKernel's score).
  if (dim == 128) return attend<kNativeBytes, T, 128>(q, history, rule, scale, options);
  if (dim == 64) return attend<kNativeBytes, T, 64>(q, history, rule, scale, options);
  if (dim % (kNativeBytes / kAcc) == 0) return attend<kNativeBytes>(q, history, rule, scale, options);
  if constexpr (kNativeBytes >= 64) {
    if (dim % (32 / kAcc) == 0) return attend<32>(q, history, rule, scale, options);
  }
  if constexpr (kNativeBytes >= 32) return attend<16>(q, history, rule, scale, options);
  return attend<kNativeBytes>(q, history, rule, scale, options);
}

/// Attention over a rotated format's rows (is_rotated<T>): the queries rotated into float rows
/// once, `attend(rows)` run on them (the kernel, reading its queries from rows and writing its
/// output there), and the output rotated back into out. q . k is unchanged by an orthogonal
/// transform of both, and the weighted sum of rotated V rows is the rotated sum.
template <class T, class Q, class Attend>
void with_rotated_queries(const TensorView<const Q>& q, const TensorView<Q>& out, const Attend& attend) {
  static_assert(std::is_same_v<acc_type<T>, float>, "a rotated format is summed in float");
  const Shape shape = q.shape();
  std::vector<float> rows(shape.size());  // [B, H_q, T, D]: the queries, then the output in place
  const TensorView<float> view(rows.data(), shape);
  const auto each_row = [&](const auto& f) {
    for (std::size_t b = 0; b < shape.batch; ++b)
      for (std::size_t h = 0; h < shape.heads; ++h)
        for (std::size_t t = 0; t < shape.tokens; ++t) f(b, h, t);
  };
  each_row([&](std::size_t b, std::size_t h, std::size_t t) {
    float* row = view.row(b, h, t);
    const Q* from = q.row(b, h, t);
    for (std::size_t d = 0; d < shape.head_dim; ++d) row[d] = static_cast<float>(widen(from[d]));
    storage_codec<T>::rotate(row, shape.head_dim);
  });
  attend(view);
  each_row([&](std::size_t b, std::size_t h, std::size_t t) {
    float* row = view.row(b, h, t);
    storage_codec<T>::unrotate(row, shape.head_dim);
    Q* to = out.row(b, h, t);
    for (std::size_t d = 0; d < shape.head_dim; ++d) to[d] = narrow<Q>(row[d]);
  });
}

}  // namespace detail

// The attention kernel of format T, compiled once for a whole engine: every translation unit
// that calls causal_attention over a history of format T compiles T's kernel, most of what it
// costs to compile. A header included everywhere declares it, one file compiles it:
//
//   KVCACHE_EXTERN_ATTENTION(kvcache::bfloat16);       // in the engine's header, at global scope
//   KVCACHE_INSTANTIATE_ATTENTION(kvcache::bfloat16);  // in one .cpp file
//
// Whatever the query type, the kernel is one per storage format (and per -m flags: compile the
// instance with the flags of the rest).
#define KVCACHE_ATTENTION_KERNEL_OF(T)                                                                         \
  void kvcache::detail::attend_by_width<T>(const kvcache::detail::QueryRows<kvcache::acc_type<T>>&,            \
                                           const kvcache::History<T>&, const kvcache::detail::VisibilityRule&, \
                                           kvcache::acc_type<T>, const kvcache::AttentionOptions&)
#define KVCACHE_EXTERN_ATTENTION(T) extern template KVCACHE_ATTENTION_KERNEL_OF(T)
#define KVCACHE_INSTANTIATE_ATTENTION(T) template KVCACHE_ATTENTION_KERNEL_OF(T)

/// out[b, h, t] = softmax over the visible keys of q[b, h, t] . k / sqrt(D), times v.
/// q, out: [B, H_q, T, D] in any compute type; q_positions: the T queries' absolute positions
/// (shared by every batch row, or a list per row); history: what update() returned, [B, H_kv,
/// S, D] in segments of any storage format, H_q a multiple of H_kv. out may be q itself (the
/// same view): every query row is read before its output is written. A rotated format's rows
/// (int4_rotated) are read against queries rotated alike, and the output rotated back. Throws
/// std::invalid_argument for mismatched shapes before writing anything.
template <class T, class Q>
void causal_attention(TensorView<const Q> q, const PositionsArg& positions, const History<T>& history,
                      TensorView<Q> out, const AttentionOptions& options = {}) {
  static_assert(!std::is_const_v<Q>, "causal_attention: out must be a mutable view (TensorView<float>, not const).");
  static_assert(compute_type<Q>,
                "causal_attention: q and out hold float, double, kvcache::half, kvcache::bfloat16, Eigen::half or "
                "Eigen::bfloat16.");
  static_assert(detail::check_codec<T>(),
                "causal_attention: the history's format needs a storage_codec specialization.");
  detail::require_complete<Q>();
  const Positions& q_positions = positions.view();
  detail::check_attention(q, q_positions, history, out);
  using Acc = acc_type<T>;
  if (q.shape().size() == 0) return;
  if (history.tokens() == 0) {
    // No key at all (this also covers a history of zero segments, whose kv_heads is unknown).
    for (std::size_t b = 0; b < q.batch(); ++b)
      for (std::size_t h = 0; h < q.heads(); ++h)
        for (std::size_t t = 0; t < q.tokens(); ++t)
          std::fill_n(out.row(b, h, t), q.head_dim(), detail::narrow<Q>(0.0F));
    return;
  }
  const Acc scale =
      options.scale != 0.0f ? static_cast<Acc>(options.scale) : Acc{1} / std::sqrt(static_cast<Acc>(q.head_dim()));
  const detail::VisibilityRule rule(history.window, history.sinks, options.window, options.sinks);
  if constexpr (detail::is_rotated<T>) {
    detail::with_rotated_queries<T>(q, out, [&](const TensorView<float>& rows) {
      detail::attend_by_width(detail::query_rows<float>(TensorView<const float>(rows), q_positions, rows), history,
                              rule, scale, options);
    });
  } else {
    detail::attend_by_width(detail::query_rows<Acc>(q, q_positions, out), history, rule, scale, options);
  }
}

/// causal_attention for a mutable q view, so TensorView<float> works without a cast.
template <class T, class Q>
requires(!std::is_const_v<Q>) void causal_attention(TensorView<Q> q, const PositionsArg& q_positions,
                                                    const History<T>& history, TensorView<Q> out,
                                                    const AttentionOptions& options = {}) {
  causal_attention(TensorView<const Q>(q), q_positions.view(), history, out, options);
}

}  // namespace KVCACHE_ABI
}  // namespace kvcache
