// SPDX-License-Identifier: Apache-2.0
#pragma once

// The kernel behind causal_attention. A work item is one (batch row, kv head, block of queries),
// or several batch rows that read the same keys, over a range of keys (attention_plan.hpp forms
// them). Its rows are the G = H_q / H_kv query heads that share the kv head times the block's
// queries, of every batch row it serves, so every K and V row read from memory serves all of
// them. The key cursor hands out runs of consecutive keys of one
// segment; each run is scored, masked, folded into an online max-subtracted softmax and summed
// into the rows' accumulators before the next, so K and V are read as two interleaved streams.
// Rows are read only through the format's storage codec, and memory is bounded by a run.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#include "kvcache/attention_tuning.hpp"
#include "kvcache/codec.hpp"
#include "kvcache/detail/attention_plan.hpp"
#include "kvcache/detail/key_cursor.hpp"
#include "kvcache/detail/simd.hpp"
#include "kvcache/detail/worker_pool.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

/// Which keys a query at position p may read: causal, and inside every window that applies (the
/// cache's own and the call's). Sinks are the positions [0, sinks): a negative key is never one.
class VisibilityRule {
 public:
  VisibilityRule(std::size_t window_a, std::size_t sinks_a, std::size_t window_b, std::size_t sinks_b) noexcept
      : windows_{window_a, window_b}, sinks_{sinks_a, sinks_b} {}

  [[nodiscard]] bool visible(std::int64_t query, std::int64_t key) const noexcept {
    if (key > query) return false;
    for (std::size_t i = 0; i < 2; ++i) {
      const bool in_window = windows_[i] == 0 || (key >= 0 && key < to_signed(sinks_[i])) ||
                             static_cast<std::uint64_t>(query - key) < static_cast<std::uint64_t>(windows_[i]);
      if (!in_window) return false;
    }
    return true;
  }

  /// The lowest position a key other than a sink needs to be visible to `query`.
  [[nodiscard]] std::int64_t window_start(std::int64_t query) const noexcept {
    std::int64_t start = std::numeric_limits<std::int64_t>::min();
    for (std::size_t i = 0; i < 2; ++i) {
      if (windows_[i] != 0) start = std::max(start, query - to_signed(windows_[i]) + 1);
    }
    return start;
  }

  /// One past the last sink position of the windows that apply.
  [[nodiscard]] std::int64_t sinks_end() const noexcept {
    std::int64_t end = 0;
    for (std::size_t i = 0; i < 2; ++i) {
      if (windows_[i] != 0) end = std::max(end, to_signed(sinks_[i]));
    }
    return end;
  }

 private:
  static std::int64_t to_signed(std::size_t n) noexcept {
    return static_cast<std::int64_t>(std::min<std::size_t>(n, std::numeric_limits<std::int64_t>::max() / 4));
  }
  std::size_t windows_[2];
  std::size_t sinks_[2];
};

/// The queries and outputs of a call in the engine's type behind two functions, so that the
/// kernel is compiled once per storage format and width, not once per query type as well.
template <class Acc>
struct QueryRows {
  const unsigned char* q = nullptr;
  unsigned char* out = nullptr;
  Shape shape;
  Strides q_strides, out_strides;
  std::size_t value_bytes = 0;
  Positions positions;
  void (*read)(const void* row, Acc* to, std::size_t n, Acc scale) noexcept = nullptr;
  void (*write)(void* row, const Acc* from, std::size_t n, Acc inverse) noexcept = nullptr;

  [[nodiscard]] std::size_t offset(const Strides& s, std::size_t b, std::size_t h, std::size_t t) const noexcept {
    return (b * s.batch + h * s.heads + t * s.tokens) * value_bytes;
  }
  [[nodiscard]] std::int64_t position(std::size_t b, std::size_t t) const noexcept { return positions.row(b)[t]; }
};

template <class Acc, class Q>
QueryRows<Acc> query_rows(const TensorView<const Q>& q, const Positions& positions, const TensorView<Q>& out) {
  QueryRows<Acc> rows;
  rows.q = reinterpret_cast<const unsigned char*>(q.data());
  rows.out = reinterpret_cast<unsigned char*>(out.data());
  rows.shape = q.shape();
  rows.q_strides = q.strides();
  rows.out_strides = out.strides();
  rows.value_bytes = sizeof(Q);
  rows.positions = positions;
  rows.read = [](const void* row, Acc* to, std::size_t n, Acc scale) noexcept {
    for (std::size_t d = 0; d < n; ++d) to[d] = static_cast<Acc>(widen(static_cast<const Q*>(row)[d])) * scale;
  };
  rows.write = [](void* row, const Acc* from, std::size_t n, Acc inverse) noexcept {
    for (std::size_t d = 0; d < n; ++d) static_cast<Q*>(row)[d] = narrow<Q>(from[d] * inverse);
  };
  return rows;
}

/// 2^e, exactly, at compile time.
template <class Acc>
constexpr Acc power_of_two(int e) noexcept {
  Acc x = 1;
  for (; e > 0; --e) x *= 2;
  for (; e < 0; ++e) x /= 2;
  return x;
}

/// The kernel for storage format T in registers of B bytes; the head size must be a multiple
/// of the register's lanes or take the scalar tail. Dim, where not 0, is the head size known at
/// compile time.
template <class T, std::size_t B, std::size_t Dim = 0>
class AttentionKernel {
 public:
  using Codec = storage_codec<T>;
  using Acc = typename Codec::acc;
  using Unit = typename Codec::unit;
  using V = Vec<Acc, B>;
  using Run = KeyRun<Unit>;
  static constexpr std::size_t W = kLanes<V>;
  // Registers a codec's load_split fills at once, from S W values: register s, lane l holds value
  // S l + s of the group. Queries and sums keep that order over the whole groups of a row.
  static constexpr std::size_t S = split_of<T>();

  // A codec's load may leave 2^-e out of its values (load_exponent): 2^(e/2) goes back in the
  // queries and the V weights, the rest in the scores and the output, so that products of small
  // values stay in float's normal range (and survive flush-to-zero).
  static constexpr int kLoadExponent = load_exponent<T>();
  static_assert(kLoadExponent == 0 || reads_scales<Codec>, "a load exponent is put back with the row scales");
  static constexpr Acc kLowerHalf = power_of_two<Acc>(kLoadExponent / 2);
  static constexpr Acc kUpperHalf = power_of_two<Acc>(kLoadExponent - kLoadExponent / 2);
  static constexpr Acc kUnload = power_of_two<Acc>(-kLoadExponent);  // for values read one at a time

  /// One worker's scratch: a block's queries and running state, a run's scores.
  struct Workspace {
    std::vector<Acc> queries, acc, max, sum, scores;
    std::vector<std::size_t> active;
    std::vector<std::int64_t> query_positions;  // of each row of the item
  };

  /// `starts`: the history's consecutive_starts for q's batch rows.
  AttentionKernel(const QueryRows<Acc>& q, const History<T>& history, std::span<const std::int64_t> starts,
                  const VisibilityRule& rule, Acc scale, const AttentionTuning& tuning) noexcept
      : q_(q),
        segments_(history.segments),
        starts_(starts),
        rule_(rule),
        scale_(scale * kLowerHalf),
        dim_(q.shape.head_dim),
        group_(q.shape.heads / history.segments.front().keys.heads()),
        split_dim_(S > 1 ? q.shape.head_dim / (S * W) * (S * W) : 0),
        block_queries_(std::clamp<std::size_t>(kTargetRows / group_, 1, std::max<std::size_t>(q.shape.tokens, 1))),
        rows_(group_ * block_queries_),
        in_cache_bytes_(tuning.in_cache_bytes),
        run_keys_(std::clamp<std::size_t>(tuning.run_keys, 1, kMaxRunKeys)),
        cached_run_keys_(std::clamp<std::size_t>(tuning.cached_run_keys, 1, kMaxRunKeys)),
        prefetch_keys_(tuning.prefetch_bytes / row_bytes(dim_)) {}

  /// Whether batch row b's stored K and V (every kv head) are taken to be in cache. Found per
  /// row, so that how a row's keys are read never depends on the other rows of the call.
  [[nodiscard]] bool row_in_cache(std::size_t b) const noexcept {
    std::size_t keys = 0;
    for (const Segment<T>& s : segments_) keys += s.tokens(b);
    return 2 * keys * segments_.front().keys.heads() * row_bytes(dim_) < in_cache_bytes_;
  }

  /// Bytes of one stored K (or V) row at head size `dim`.
  [[nodiscard]] static std::size_t row_bytes(std::size_t dim) noexcept {
    return std::max<std::size_t>(Codec::units(dim) * sizeof(Unit), 1);
  }
  [[nodiscard]] std::size_t block_queries() const noexcept { return block_queries_; }
  /// Acc values a split item's running state takes: max, sum and acc of every row.
  [[nodiscard]] std::size_t partial_size() const noexcept { return rows_ * (dim_ + 2); }
  /// Query rows of one batch row's block: an item scores this many per batch row it serves.
  [[nodiscard]] std::size_t block_rows() const noexcept { return rows_; }

  /// Sizes a worker's scratch for this call; kept by the thread between calls, so a call
  /// allocates only when it needs more than the thread's last one did.
  void prepare(Workspace& w, std::size_t max_rows) const {
    const auto fit = [](auto& v, std::size_t n) {
      if (v.size() < n) v.resize(n);
    };
    const std::size_t rows = std::max(rows_, max_rows);
    fit(w.queries, rows * dim_);
    fit(w.acc, rows * dim_);
    fit(w.max, rows);
    fit(w.sum, rows);
    fit(w.query_positions, rows);
    fit(w.scores, rows * scores_stride());
    w.active.reserve(rows);
  }

  /// Runs one item; writes out, or each member's running state to its slot of `partials`.
  void run(const AttentionItem& item, Workspace& w, Acc* partials) const noexcept {
    // Row r serves member r / per_member, as row r % per_member of that member's block.
    const std::size_t per_member = item.queries * group_;
    const std::size_t rows = per_member * item.member_count();
    KeyBounds bounds{std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max(),
                     rule_.sinks_end()};
    for (std::size_t r = 0; r < rows; ++r) {
      const std::size_t b = item.member(r / per_member);
      const std::size_t t = item.first_query + r % per_member / group_;
      q_.read(q_.q + q_.offset(q_.q_strides, b, head_of(item, r), t), w.queries.data() + r * dim_, dim_, scale_);
      to_split_order(w.queries.data() + r * dim_);
      w.query_positions[r] = q_.position(b, t);
      bounds.latest = std::max(bounds.latest, w.query_positions[r]);
      bounds.oldest = std::min(bounds.oldest, rule_.window_start(w.query_positions[r]));
    }
    std::fill_n(w.max.begin(), rows, -std::numeric_limits<Acc>::infinity());
    std::fill_n(w.sum.begin(), rows, Acc{0});
    std::fill_n(w.acc.begin(), rows * dim_, Acc{0});
    KeyCursor<T> cursor(segments_, starts_.data(), q_.shape.batch, item.batch, item.kv_head, item.key_begin,
                        item.key_end - item.key_begin);
    // A prefill block (several queries a kv head): arithmetic a key, not the read, limits it, and
    // its next block reads the same keys again, so it reads as from cache. Decode rows sharing
    // keys read them once, from memory, and ask for them ahead.
    const bool in_cache = item.queries > 1 || row_in_cache(item.batch);
    const std::size_t run_length = in_cache ? cached_run_keys_ : memory_run_keys(rows);
    const std::size_t ahead = in_cache ? 0 : prefetch_keys_;
    Run keys;
    while (cursor.next(keys, run_length, bounds)) run_keys(rows, keys, cursor, ahead, w);
    if (!item.slots.empty()) {
      for (std::size_t m = 0; m < item.member_count(); ++m) {
        const std::size_t from = m * per_member;
        Acc* p = partials + item.slots[m] * partial_size();
        std::copy_n(w.max.begin() + static_cast<std::ptrdiff_t>(from), per_member, p);
        std::copy_n(w.sum.begin() + static_cast<std::ptrdiff_t>(from), per_member, p + rows_);
        std::copy_n(w.acc.begin() + static_cast<std::ptrdiff_t>(from * dim_), per_member * dim_, p + 2 * rows_);
      }
      return;
    }
    for (std::size_t r = 0; r < rows; ++r) write_row(item, r, w.acc.data() + r * dim_, w.sum[r]);
  }

  /// Combines the running states in `splits` slots from item.partial on, of one batch row's block
  /// over parts of its keys (log-sum-exp), and writes out.
  void merge(const AttentionItem& item, const Acc* partials, std::size_t splits, std::vector<Acc>& row) const {
    row.resize(dim_);
    for (std::size_t r = 0; r < item.queries * group_; ++r) {
      Acc max = -std::numeric_limits<Acc>::infinity();
      for (std::size_t i = 0; i < splits; ++i) max = std::max(max, partials[(item.partial + i) * partial_size() + r]);
      std::fill(row.begin(), row.end(), Acc{0});
      Acc sum = 0;
      for (std::size_t i = 0; i < splits && max != -std::numeric_limits<Acc>::infinity(); ++i) {
        const Acc* p = partials + (item.partial + i) * partial_size();
        const Acc weight = exp_nonpositive(p[r] - max);
        sum += weight * p[rows_ + r];
        for (std::size_t d = 0; d < dim_; ++d) row[d] += weight * p[2 * rows_ + r * dim_ + d];
      }
      write_row(item, r, row.data(), sum);
    }
  }

 private:
  static constexpr std::size_t kTargetRows = 16;  // query rows a block shares K and V among
  static constexpr std::size_t kMaxRunKeys = 256;
  static constexpr std::size_t kAccumulators = kRegisters / 2;  // registers a V pass sums in

  /// Scores a row keeps: a run's, and room for the last group of keys to be written whole.
  [[nodiscard]] std::size_t scores_stride() const noexcept {
    return std::max(memory_run_keys(kMaxRunKeys), cached_run_keys_) + W;
  }
  /// Rows under 16 bits a value take more arithmetic to decode than their read costs, so from
  /// memory arithmetic limits them: their runs grow with the rows, spreading a run's fixed costs.
  static constexpr bool kDecoded = Codec::units(256) * sizeof(Unit) < 256 * 2;
  /// Whether loading a stored row does more than read it: widening or decoding to Acc.
  static constexpr bool kDecodesOnLoad = !std::is_same_v<Unit, Acc>;
  /// Keys a run from memory takes for an item of `rows` query rows.
  [[nodiscard]] std::size_t memory_run_keys(std::size_t rows) const noexcept {
    if constexpr (kDecoded) {
      return std::min(kMaxRunKeys, run_keys_ * std::clamp<std::size_t>(2 * rows, 2, 8));
    } else {
      return run_keys_;
    }
  }

  /// Row r of a block is query first_query + r / G of query head kv_head * G + r % G.
  [[nodiscard]] std::size_t head_of(const AttentionItem& item, std::size_t r) const noexcept {
    return item.kv_head * group_ + r % group_;
  }

  /// Puts a row's whole groups of S W values into load_split's order (register s, lane l: value
  /// S l + s), and back.
  void to_split_order(Acc* row) const noexcept {
    if constexpr (S > 1) {
      Acc group[S * W];
      for (std::size_t g = 0; g < split_dim_; g += S * W) {
        std::copy_n(row + g, S * W, group);
        for (std::size_t l = 0; l < W; ++l) {
          for (std::size_t s = 0; s < S; ++s) row[g + s * W + l] = group[S * l + s];
        }
      }
    }
  }
  void to_value_order(Acc* row) const noexcept {
    if constexpr (S > 1) {
      Acc group[S * W];
      for (std::size_t g = 0; g < split_dim_; g += S * W) {
        std::copy_n(row + g, S * W, group);
        for (std::size_t l = 0; l < W; ++l) {
          for (std::size_t s = 0; s < S; ++s) row[g + S * l + s] = group[s * W + l];
        }
      }
    }
  }

  /// Writes a row's sums (in split order, put back here) over its softmax's sum.
  void write_row(const AttentionItem& item, std::size_t r, Acc* acc, Acc sum) const noexcept {
    to_value_order(acc);
    const std::size_t t = item.first_query + r / group_;
    q_.write(q_.out + q_.offset(q_.out_strides, item.batch, head_of(item, r), t), acc, dim_,
             sum > 0 ? kUpperHalf / sum : Acc{0});  // no visible key: zeros
  }

  /// One run of keys, read from memory once: scores of every row, mask, softmax, weighted sum
  /// of V. The rows `ahead` keys on (0: none) are asked for while it is scored, so both streams
  /// stay in flight.
  void run_keys(std::size_t rows, const Run& keys, const KeyCursor<T>& cursor, std::size_t ahead,
                Workspace& w) const noexcept {
    const std::size_t n = keys.count;
    const Run next = ahead == 0 ? Run{} : cursor.upcoming(ahead);
    const Run* fetch = ahead == 0 ? nullptr : &next;
    std::size_t r = 0;
    // Rows read from memory that a load decodes (any but the accumulator's own type) are scored
    // eight query rows a pass, so each is decoded once for them, not once per four. In cache, and
    // for rows loaded as they are, four rows a pass load fewer queries a key.
    if constexpr (W % 8 == 0 && kDecodesOnLoad) {
      if (ahead != 0) {
        for (; r + 8 <= rows; r += 8) score<8>(w, r, keys, r == 0 ? fetch : nullptr);
      }
    }
    if constexpr (W % 4 == 0) {
      for (; r + 4 <= rows; r += 4) score<4>(w, r, keys, r == 0 ? fetch : nullptr);
    }
    if constexpr (W % 2 == 0) {
      for (; r + 2 <= rows; r += 2) score<2>(w, r, keys, r == 0 ? fetch : nullptr);
    }
    for (; r < rows; ++r) score<1>(w, r, keys, r == 0 ? fetch : nullptr);

    w.active.clear();
    for (r = 0; r < rows; ++r) {
      Acc* scores = w.scores.data() + r * scores_stride();
      if constexpr (reads_scales<Codec>) {
        for (std::size_t j = 0; j < n; ++j) scores[j] *= keys.key_scale(j) * kUpperHalf;
      }
      mask(w.query_positions[r], keys, scores);
      if (!softmax_step(scores, n, w.max[r], w.sum[r], w.acc.data() + r * dim_)) continue;
      if constexpr (reads_scales<Codec>) {
        for (std::size_t j = 0; j < n; ++j) scores[j] *= keys.value_scale(j) * kLowerHalf;
      }
      w.active.push_back(r);
    }
    std::size_t i = 0;
    for (; i + 4 <= w.active.size(); i += 4) accumulate<4>(w, i, keys);
    for (; i + 2 <= w.active.size(); i += 2) accumulate<2>(w, i, keys);
    for (; i < w.active.size(); ++i) accumulate<1>(w, i, keys);
  }

  /// Asks for the K and V rows `prefetch_keys_` keys past key j of the run: in the run, or in
  /// `next` (the keys after it, through the cursor, across a segment's end).
  KVCACHE_ALWAYS_INLINE void prefetch_ahead(const Run& keys, const Run& next, std::size_t j) const noexcept {
    const std::size_t ahead = j + prefetch_keys_;
    if (ahead < keys.count) {
      prefetch_row(keys, ahead);
    } else if (ahead - keys.count < next.count) {
      prefetch_row(next, ahead - keys.count);
    }
  }

  /// Asks for key j's K and V rows of a run, a line at a time. Always inlined: GCC takes a
  /// function that only prefetches for one without effects and drops its calls.
  KVCACHE_ALWAYS_INLINE void prefetch_row(const Run& keys, std::size_t j) const noexcept {
    const auto* k = reinterpret_cast<const char*>(keys.key(j));
    const auto* v = reinterpret_cast<const char*>(keys.value(j));
    const std::size_t bytes = Dim != 0 ? row_bytes(Dim) : row_bytes(dim_);
    for (std::size_t line = 0; line < bytes; line += 64) {
      prefetch(k + line);
      prefetch(v + line);
    }
  }

  /// Sets the scores of the run's keys that `query` may not see to -inf. Over ascending
  /// positions, those past the query are one fill, and only those before its window's start are
  /// checked one by one.
  void mask(std::int64_t query, const Run& keys, Acc* scores) const noexcept {
    constexpr Acc kNone = -std::numeric_limits<Acc>::infinity();
    const std::int64_t start = rule_.window_start(query);
    if (keys.highest <= query && keys.lowest >= start) return;  // the whole run is visible
    const std::int64_t* p = keys.positions;
    std::size_t check_end = keys.count;
    if (keys.consecutive) {
      // Keys past the query from its index on, those before the window's start below it.
      const std::int64_t end =
          std::clamp<std::int64_t>(query - keys.lowest + 1, 0, static_cast<std::int64_t>(keys.count));
      std::fill(scores + end, scores + keys.count, kNone);
      // start may be the lowest int64 (no window): compared, never subtracted from.
      check_end = start <= keys.lowest ? 0 : static_cast<std::size_t>(std::min<std::int64_t>(start - keys.lowest, end));
      for (std::size_t j = 0; j < check_end; ++j) {
        if (!rule_.visible(query, keys.lowest + static_cast<std::int64_t>(j))) scores[j] = kNone;
      }
      return;
    }
    if (keys.ascending) {
      const std::int64_t* end = std::upper_bound(p, p + keys.count, query);
      std::fill(scores + (end - p), scores + keys.count, kNone);
      check_end = static_cast<std::size_t>(std::lower_bound(p, end, start) - p);
    }
    for (std::size_t j = 0; j < check_end; ++j) {
      if (!rule_.visible(query, p[j])) scores[j] = kNone;
    }
  }

  /// Folds a run's scores into a row's running max, sum and accumulators and turns them into
  /// weights; false if the row sees none of the run's keys.
  bool softmax_step(Acc* scores, std::size_t n, Acc& max, Acc& sum, Acc* acc) const noexcept {
    V top = splat<V>(-std::numeric_limits<Acc>::infinity());
    std::size_t j = 0;
    for (; j + W <= n; j += W) {
      const V s = load<V>(scores + j);
      top = top > s ? top : s;
    }
    Acc run_max = reduce_max(top);
    for (; j < n; ++j) run_max = std::max(run_max, scores[j]);
    if (run_max == -std::numeric_limits<Acc>::infinity()) return false;
    if (run_max > max) {
      const Acc correction = exp_nonpositive(max - run_max);  // 0 when max was -inf
      sum *= correction;
      if (correction != Acc{1}) {
        for (std::size_t d = 0; d < dim_; ++d) acc[d] *= correction;
      }
      max = run_max;
    }
    V total = V{};
    for (j = 0; j + W <= n; j += W) {
      const V weights = exp_nonpositive(load<V>(scores + j) - max);
      store(scores + j, weights);
      total += weights;
    }
    Acc added = reduce_add(total);
    for (; j < n; ++j) {
      scores[j] = exp_nonpositive(scores[j] - max);
      added += scores[j];
    }
    sum += added;
    return true;
  }

  /// Scores of R query rows from r0 on against every key of the run: W / R keys at a time, R x
  /// W / R accumulators summed together by transpose_sum, so each K row read serves R rows. The
  /// first group of rows, which reads the run from memory, asks for the rows ahead (`next`).
  template <std::size_t R>
  void score(Workspace& w, std::size_t r0, const Run& keys, const Run* next) const noexcept {
    constexpr std::size_t K = W / R;
    const std::size_t n = keys.count;
    const std::size_t body = (Dim != 0 ? Dim : dim_) / W * W;
    const Acc* q[R];
    Acc* out[R];
    for (std::size_t r = 0; r < R; ++r) {
      q[r] = w.queries.data() + (r0 + r) * dim_;
      out[r] = w.scores.data() + (r0 + r) * scores_stride();
    }
    for (std::size_t j = 0; j < n; j += K) {
      const Unit* rows[K];
      for (std::size_t k = 0; k < K; ++k) rows[k] = keys.key(std::min(j + k, n - 1));
      if (next != nullptr && prefetch_keys_ != 0) {
        for (std::size_t k = 0; k < K; ++k) prefetch_ahead(keys, *next, j + k);
      }
      V acc[W];
      unroll<W>([&](auto i) KVCACHE_ALWAYS_INLINE { acc[i] = V{}; });
      const auto step = [&](std::size_t d) KVCACHE_ALWAYS_INLINE {
        V qv[R];
        unroll<R>([&](auto r) KVCACHE_ALWAYS_INLINE { qv[r] = in_register(load<V>(q[r] + d)); });
        unroll<K>([&](auto k) KVCACHE_ALWAYS_INLINE {
          const V x = in_register(Codec::template load<B>(rows[k], d));
          unroll<R>([&](auto r) KVCACHE_ALWAYS_INLINE { acc[r * K + k] += qv[r] * x; });
        });
      };
      // A group of S W values of each key at a time, split as load_split gives them.
      const auto split_step = [&](std::size_t d) KVCACHE_ALWAYS_INLINE {
        if constexpr (S > 1) {
          V x[K][S];
          unroll<K>([&](auto k) KVCACHE_ALWAYS_INLINE { Codec::template load_split<B>(rows[k], d, x[k]); });
          unroll<S>([&](auto s) KVCACHE_ALWAYS_INLINE {
            unroll<R>([&](auto r) KVCACHE_ALWAYS_INLINE {
              const V qv = in_register(load<V>(q[r] + d + s * W));
              unroll<K>([&](auto k) KVCACHE_ALWAYS_INLINE { acc[r * K + k] += qv * in_register(x[k][s]); });
            });
          });
        }
      };
      if constexpr (Dim != 0 && S > 1 && Dim % (S * W) == 0) {
        unroll<Dim / (S * W)>([&](auto i) KVCACHE_ALWAYS_INLINE { split_step(i * S * W); });
      } else if constexpr (Dim != 0 && R == 1 && S == 1) {
        // One query row: its query stays in registers, and each key's row is read whole, in order.
        V qv[Dim / W];
        unroll<Dim / W>([&](auto i) KVCACHE_ALWAYS_INLINE { qv[i] = load<V>(q[0] + i * W); });
        unroll<K>([&](auto k) KVCACHE_ALWAYS_INLINE {
          unroll<Dim / W>([&](auto i) KVCACHE_ALWAYS_INLINE {
            acc[k] += qv[i] * in_register(Codec::template load<B>(rows[k], i * W));
          });
        });
      } else if constexpr (Dim != 0 && S == 1) {
        unroll<Dim / W>([&](auto i) KVCACHE_ALWAYS_INLINE { step(i * W); });
      } else {
        std::size_t d = 0;
        if constexpr (S > 1) {
          for (; d < split_dim_; d += S * W) split_step(d);
        }
        for (; d < body; d += W) step(d);
      }
      Acc lanes[W];
      store(lanes, transpose_sum(acc));
      for (std::size_t d = body; d < dim_; ++d) {
        for (std::size_t i = 0; i < W; ++i) {
          lanes[i] += q[i / K][d] * static_cast<Acc>(Codec::value(rows[i % K], d)) * kUnload;
        }
      }
      // Whole groups of K, a fixed-size copy: a row's scores have room for a group past the run.
      for (std::size_t r = 0; r < R; ++r) std::memcpy(out[r] + j, lanes + r * K, K * sizeof(Acc));
    }
  }

  /// acc[r] += sum over the run of weight[r][j] V[j] for R active rows from i on, in passes of
  /// C registers of each row's accumulators over the run's V rows.
  template <std::size_t R>
  void accumulate(Workspace& w, std::size_t i, const Run& keys) const noexcept {
    Acc* acc[R];
    const Acc* weights[R];
    for (std::size_t r = 0; r < R; ++r) {
      acc[r] = w.acc.data() + w.active[i + r] * dim_;
      weights[r] = w.scores.data() + w.active[i + r] * scores_stride();
    }
    std::size_t d = 0;
    if constexpr (S > 1) cover<R, true>(acc, weights, keys, d, split_dim_ / W);
    cover<R, false>(acc, weights, keys, d, dim_ / W);
    for (; d < dim_; ++d) {
      for (std::size_t j = 0; j < keys.count; ++j) {
        const auto x = static_cast<Acc>(Codec::value(keys.value(j), d));
        for (std::size_t r = 0; r < R; ++r) acc[r][d] += weights[r][j] * x * kUnload;
      }
    }
  }

  /// Passes over the run's V rows that cover the registers from d / W to `vectors`: as many of
  /// half the register file as fit, then halves down to one register (S, split).
  template <std::size_t R, bool Split>
  void cover(Acc* const (&acc)[R], const Acc* const (&weights)[R], const Run& keys, std::size_t& d,
             std::size_t vectors) const noexcept {
    constexpr std::size_t kWidest = kAccumulators / R;
    while (d / W + kWidest <= vectors) pass<R, kWidest, Split>(acc, weights, keys, d);
    chunks<R, kWidest / 2, Split>(acc, weights, keys, d, vectors);
  }

  /// The passes of C, C / 2, ..., 1 registers (S, split) that cover what is left of `vectors`.
  template <std::size_t R, std::size_t C, bool Split>
  void chunks(Acc* const (&acc)[R], const Acc* const (&weights)[R], const Run& keys, std::size_t& d,
              std::size_t vectors) const noexcept {
    if constexpr (C >= (Split ? S : 1)) {
      if (d / W + C <= vectors) pass<R, C, Split>(acc, weights, keys, d);
      chunks<R, C / 2, Split>(acc, weights, keys, d, vectors);
    }
  }

  /// One pass over the run's V rows for values [d, d + C W) of R rows, loaded split (in groups
  /// of S registers) or in order; advances d.
  template <std::size_t R, std::size_t C, bool Split>
  KVCACHE_ALWAYS_INLINE void pass(Acc* const (&acc)[R], const Acc* const (&weights)[R], const Run& keys,
                                  std::size_t& d) const noexcept {
    V sums[R][C];
    unroll<R>([&](auto r) KVCACHE_ALWAYS_INLINE {
      unroll<C>([&](auto c) KVCACHE_ALWAYS_INLINE { sums[r][c] = load<V>(acc[r] + d + c * W); });
    });
    for (std::size_t j = 0; j < keys.count; ++j) {
      const Unit* row = keys.value(j);
      if constexpr (Split) {
        static_assert(C % S == 0, "a split pass covers whole groups");
        unroll<C / S>([&](auto g) KVCACHE_ALWAYS_INLINE {
          V x[S];
          Codec::template load_split<B>(row, d + g * S * W, x);
          unroll<S>([&](auto s) KVCACHE_ALWAYS_INLINE {
            unroll<R>([&](auto r)
                          KVCACHE_ALWAYS_INLINE { sums[r][g * S + s] += splat<V>(weights[r][j]) * in_register(x[s]); });
          });
        });
      } else {
        unroll<C>([&](auto c) KVCACHE_ALWAYS_INLINE {
          const V x = in_register(Codec::template load<B>(row, d + c * W));
          unroll<R>([&](auto r) KVCACHE_ALWAYS_INLINE { sums[r][c] += splat<V>(weights[r][j]) * x; });
        });
      }
    }
    unroll<R>([&](auto r) KVCACHE_ALWAYS_INLINE {
      unroll<C>([&](auto c) KVCACHE_ALWAYS_INLINE { store(acc[r] + d + c * W, sums[r][c]); });
    });
    d += C * W;
  }

  QueryRows<Acc> q_;
  std::span<const Segment<T>> segments_;
  std::span<const std::int64_t> starts_;
  VisibilityRule rule_;
  Acc scale_;
  std::size_t dim_;
  std::size_t group_;
  std::size_t split_dim_;  // values of a row in whole groups of S W, kept in split order
  std::size_t block_queries_;
  std::size_t rows_;
  std::size_t in_cache_bytes_;
  std::size_t run_keys_;
  std::size_t cached_run_keys_;
  std::size_t prefetch_keys_;
};

/// Runs the kernel over every item of a call (attention_plan.hpp) and merges what several items
/// computed of one batch row's block.
template <class T, std::size_t B, std::size_t Dim>
void run_attention(const AttentionKernel<T, B, Dim>& kernel, const History<T>& history, std::size_t batch,
                   std::size_t kv_heads, std::size_t queries, std::size_t head_dim, std::size_t requested_threads,
                   const AttentionTuning& tuning) {
  using Kernel = AttentionKernel<T, B, Dim>;
  using Acc = typename Kernel::Acc;
  const AttentionPlan plan = plan_attention(history.segments,
                                            {.batch = batch,
                                             .kv_heads = kv_heads,
                                             .queries = queries,
                                             .block_queries = kernel.block_queries(),
                                             .group = kernel.block_rows() / kernel.block_queries(),
                                             .row_bytes = Kernel::row_bytes(head_dim)},
                                            requested_threads, tuning.bytes_per_thread);
  std::vector<Acc> partials(plan.partial_slots * kernel.partial_size());

  std::atomic<std::size_t> next{0};
  run_workers(plan.threads, [&](std::size_t) {
    thread_local typename Kernel::Workspace workspace;
    kernel.prepare(workspace, plan.max_rows);
    for (std::size_t i = next.fetch_add(1, std::memory_order_relaxed); i < plan.items.size();
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      kernel.run(plan.items[i], workspace, partials.data());
    }
  });
  std::vector<Acc> row;
  for (const MergeUnit& m : plan.merges) kernel.merge(m.unit, partials.data(), m.pieces, row);
}

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
