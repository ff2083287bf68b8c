// SPDX-License-Identifier: Apache-2.0
#pragma once

// The one reference model of the tests and the fuzz harnesses, so that what a cache must do is
// defined once: what a cache of format T stores for a K or V row (each codec's encode, and the
// values attention reads back from it), which positions a query reads (the window rule by
// position), and the uncached attention over the rows a cache should hold. It knows nothing of
// how any variant lays its tokens out.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "kvcache/quantized.hpp"
#include "kvcache/views.hpp"

namespace kvcache::testing {

/// The window a cache was given (0: none), as the contract applies it to positions.
struct WindowRule {
  std::size_t window = 0, sinks = 0;

  /// The first position past the sinks that a query at `query` reads.
  [[nodiscard]] constexpr std::size_t first_read(std::size_t query) const {
    return window != 0 && query + 1 > window ? query + 1 - window : 0;
  }
  /// Whether a query at `query` reads the key at position p.
  [[nodiscard]] constexpr bool reads(std::size_t query, std::size_t p) const {
    return p <= query && (window == 0 || p < sinks || query - p < window);
  }
  /// Whether some query at `first_query` or later reads the key at position p.
  [[nodiscard]] constexpr bool read_from(std::size_t first_query, std::size_t p) const {
    return window == 0 || p < sinks || p >= first_read(first_query);
  }
};

/// Row x of `dim` values encoded as format T stores it, into `units`. Returns the scale a history
/// gives the row: `head_scale` for a format with head scales (encoded with it, or with 1 if it
/// is 0), the scale encode chose for one with a scale per row, 0 for the others. Adds to
/// `clipped`, if given, the values that saturated.
template <class T, class In>
float encode_row(const In* x, std::size_t dim, typename storage_codec<T>::unit* units, float head_scale,
                 std::size_t* clipped = nullptr) {
  using Codec = storage_codec<T>;
  const float given = detail::has_head_scales<T> && head_scale != 0.0F ? head_scale : 1.0F;
  const EncodedRow stored = Codec::encode(x, units, dim, given);
  if (clipped != nullptr) *clipped += stored.clipped;
  if constexpr (detail::has_head_scales<T>) return head_scale;
  return detail::reads_scales<Codec> ? stored.scale : 0.0F;
}

/// A row format T stores, decoded (and rotated back, for a rotated format): the values
/// attention reads.
template <class T>
std::vector<double> decode_row(const typename storage_codec<T>::unit* row, float scale, std::size_t dim) {
  using Codec = storage_codec<T>;
  std::vector<float> x(dim);
  for (std::size_t d = 0; d < dim; ++d) {
    x[d] = static_cast<float>(Codec::value(row, d));
    if constexpr (detail::reads_scales<Codec>) x[d] *= scale;
  }
  if constexpr (detail::is_rotated<T>) Codec::unrotate(x.data(), dim);
  return {x.begin(), x.end()};
}

/// One position of one stream (a batch row of a layer) as format T stores it: every head's
/// units, keys and values, and the scale a history gives each head's row (0 without).
template <class T>
struct StoredToken {
  std::vector<typename storage_codec<T>::unit> keys, values;  // [H_kv, units]
  std::vector<float> key_scales, value_scales;                // [H_kv]

  [[nodiscard]] std::span<const typename storage_codec<T>::unit> units(bool value) const {
    return value ? values : keys;
  }
  [[nodiscard]] const std::vector<float>& scales(bool value) const { return value ? value_scales : key_scales; }
};

/// What a stream was given: entry p is position p, positions continuing from 0.
template <class T>
using Stream = std::vector<StoredToken<T>>;

/// Token t of batch row b of k and v ([B, H_kv, T, D]), stored as format T stores it, each head
/// encoded once; `key_scales` and `value_scales` are the layer's head scales ([H_kv]) for a
/// format with them. Adds to `clipped`, if given, the values that saturated.
template <class T, class In>
StoredToken<T> store_token(const TensorView<const In>& k, const TensorView<const In>& v, std::size_t b, std::size_t t,
                           std::span<const float> key_scales, std::span<const float> value_scales,
                           std::size_t* clipped = nullptr) {
  const std::size_t heads = k.heads(), dim = k.head_dim(), units = storage_codec<T>::units(dim);
  StoredToken<T> token;
  for (const bool value : {false, true}) {
    auto& out = value ? token.values : token.keys;
    auto& scales = value ? token.value_scales : token.key_scales;
    const TensorView<const In>& x = value ? v : k;
    const std::span<const float> head_scales = value ? value_scales : key_scales;
    out.resize(heads * units);
    for (std::size_t h = 0; h < heads; ++h) {
      const float given = h < head_scales.size() ? head_scales[h] : 0.0F;
      scales.push_back(encode_row<T>(x.row(b, h, t), dim, out.data() + h * units, given, clipped));
    }
  }
  return token;
}

/// Head h of a stored token, keys or values, decoded as attention reads it.
template <class T>
std::vector<double> decode_head(const StoredToken<T>& token, std::size_t h, std::size_t dim, bool value) {
  const std::size_t units = storage_codec<T>::units(dim);
  return decode_row<T>(token.units(value).data() + h * units, token.scales(value)[h], dim);
}

/// The uncached attention of one query row over a stream: the output, and what bounds its
/// rounding (the largest |key| and |value| it read) and how many keys it read.
struct ReferenceAttention {
  std::vector<double> out;
  double key_max = 0.0, value_max = 0.0;
  std::size_t keys = 0;
};

/// softmax(q . k / sqrt(D)) v in double, over the decoded rows of KV head h of every position of
/// `stream` that a query at `query` reads by `rule`.
template <class T>
ReferenceAttention reference_attention(std::span<const double> q, const Stream<T>& stream, std::size_t h,
                                       std::size_t query, const WindowRule& rule) {
  const std::size_t dim = q.size();
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  ReferenceAttention r;
  std::vector<double> scores;
  std::vector<std::vector<double>> values;
  double top = -1e300;
  for (std::size_t p = 0; p < stream.size(); ++p) {
    if (!rule.reads(query, p)) continue;
    const std::vector<double> keys = decode_head(stream[p], h, dim, false);
    values.push_back(decode_head(stream[p], h, dim, true));
    double s = 0.0;
    for (std::size_t d = 0; d < dim; ++d) {
      r.key_max = std::max(r.key_max, std::fabs(keys[d]));
      r.value_max = std::max(r.value_max, std::fabs(values.back()[d]));
      s += q[d] * keys[d];
    }
    scores.push_back(s * scale);
    top = std::max(top, scores.back());
  }
  r.keys = scores.size();
  double sum = 0.0;
  for (double& s : scores) sum += (s = std::exp(s - top));
  r.out.assign(dim, 0.0);
  for (std::size_t d = 0; d < dim; ++d)
    for (std::size_t i = 0; i < scores.size(); ++i) r.out[d] += scores[i] / sum * values[i][d];
  return r;
}

}  // namespace kvcache::testing
