// SPDX-License-Identifier: Apache-2.0
#pragma once

// The tiled kernel behind causal_attention. A work item is one (batch row, kv head, block of
// queries) and, when there are fewer items than threads, a range of the keys. Its rows are the
// G = H_q / H_kv query heads that share the kv head times the block's queries, so every K and V
// row is read from memory once for all of them. Keys stream past in tiles: scores for the tile,
// mask, online max-subtracted softmax update, accumulate. Memory is bounded by a tile.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvcache/detail/assert.hpp"
#include "kvcache/detail/attention_math.hpp"
#include "kvcache/detail/processor.hpp"
#include "kvcache/detail/row_fetcher.hpp"
#include "kvcache/detail/worker_pool.hpp"
#include "kvcache/views.hpp"

namespace kvcache::detail {

/// Which keys a query at position p may read: causal, and inside every window that applies.
/// Sinks are the positions [0, sinks): a negative key position is never one.
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

  /// The lowest position a key other than a sink needs to be visible to `query`: the latest
  /// start of the windows that apply (the lowest position there is, with none).
  [[nodiscard]] std::int64_t window_start(std::int64_t query) const noexcept {
    std::int64_t start = std::numeric_limits<std::int64_t>::min();
    for (std::size_t i = 0; i < 2; ++i) {
      if (windows_[i] != 0) start = std::max(start, query - to_signed(windows_[i]) + 1);
    }
    return start;
  }

  /// Whether a window applies at all.
  [[nodiscard]] bool windowed() const noexcept { return windows_[0] != 0 || windows_[1] != 0; }

  /// One past the last sink position of any window that applies: keys from here on are never sinks.
  [[nodiscard]] std::int64_t sinks_end() const noexcept {
    std::int64_t end = 0;
    for (std::size_t i = 0; i < 2; ++i) {
      if (windows_[i] != 0) end = std::max(end, to_signed(sinks_[i]));
    }
    return end;
  }

  enum class Cover { kNone, kSome, kAll };

  /// Whether none, some or all of the keys with positions in [low, high] are visible to `query`;
  /// kSome may be returned when none or all are (the caller then masks key by key).
  [[nodiscard]] Cover cover(std::int64_t query, std::int64_t low, std::int64_t high) const noexcept {
    if (low > query) return Cover::kNone;
    bool all = high <= query;
    for (std::size_t i = 0; i < 2; ++i) {
      if (windows_[i] == 0) continue;
      const std::int64_t oldest = query - to_signed(windows_[i]) + 1;  // the window's first position
      const std::int64_t sinks = to_signed(sinks_[i]);
      const bool no_sink = low >= sinks || high < 0;
      const bool all_sinks = low >= 0 && high < sinks;
      if (high < oldest && no_sink) return Cover::kNone;
      all = all && (low >= oldest || all_sinks);
    }
    return all ? Cover::kAll : Cover::kSome;
  }

 private:
  static std::int64_t to_signed(std::size_t n) noexcept {
    return static_cast<std::int64_t>(std::min<std::size_t>(n, std::numeric_limits<std::int64_t>::max() / 4));
  }
  std::size_t windows_[2];
  std::size_t sinks_[2];
};

/// One work item: queries [first_query, first_query + queries) of kv head `kv_head` in batch
/// row `batch`, over the keys [key_begin, key_end) of the history taken as one sequence.
struct AttentionItem {
  std::size_t batch = 0;
  std::size_t kv_head = 0;
  std::size_t first_query = 0;
  std::size_t queries = 0;
  std::size_t key_begin = 0;
  std::size_t key_end = 0;
  std::size_t partial = 0;  // where a split item leaves its running state (unused when unsplit)
};

/// Stored rows T, queries and outputs Q, accumulated in Acc, in vectors of B bytes (the build's
/// width, or 32 under AVX-512 where narrow_vectors_pay).
template <class T, class Q, class Acc, std::size_t B = kVectorBytes>
class AttentionKernel {
 public:
  /// Scratch of one worker: a block's queries and accumulators, a tile's scores and, for rows
  /// that do not widen in registers, the tile converted to Acc. The tile-sized buffers are left
  /// uninitialized (every value is written before it is read): a call over a short history
  /// would otherwise spend a good part of its time zeroing them.
  struct Workspace {
    std::vector<Acc> queries, acc, max, sum;
    std::vector<Q> given_queries;                      // the block's queries as given (pairs_)
    std::unique_ptr<std::uint16_t[]> rounded_weights;  // a tile's weights in bfloat16 (pairs_)
    std::unique_ptr<Acc[]> scores, keys, values;
    std::vector<VisibilityRule::Cover> covers;
    std::vector<std::size_t> readers;  // the rows whose query may see a key of the current tile
    std::vector<std::size_t> active;   // the readers that do
  };

  AttentionKernel(TensorView<const Q> q, std::span<const std::int64_t> q_positions, const History<T>& history,
                  TensorView<Q> out, const VisibilityRule& rule, Acc scale,
                  const AttentionForms& forms = AttentionForms::of_this_processor())
      : q_(q),
        q_positions_(q_positions),
        segments_(history.segments),
        out_(out),
        rule_(rule),
        scale_(scale),
        dim_(q.head_dim()),
        group_(q.heads() / history.segments.front().keys.heads()),
        block_queries_(block_queries_for(group_, q.tokens())),
        rows_(group_ * block_queries_),
        tile_(tile_keys(dim_, rows_, forms.long_tiles)),
        pairs_(kScoresPairs && forms.pair_products),
        plain_one_row_(forms.plain_one_row),
        four_rows_in_order_(forms.four_rows_in_order && block_queries_ == 1) {
    offsets_.reserve(segments_.size() + 1);
    offsets_.push_back(0);
    for (const Segment<T>& s : segments_) offsets_.push_back(offsets_.back() + s.tokens());
    // Found for every call, decode included: a tile of ascending positions is then bounded by its
    // first and last, where decode had scanned every tile's positions for each kv head (2% of a
    // call: bf16 at H_q = 32, one core, S = 32,768; 2-core AMD EPYC).
    ascending_.reserve(segments_.size());
    for (const Segment<T>& s : segments_) ascending_.push_back(std::is_sorted(s.positions.begin(), s.positions.end()));
  }

  /// The queries of a block, given G query heads per kv head and T queries.
  [[nodiscard]] static std::size_t block_queries_for(std::size_t group, std::size_t tokens) noexcept {
    return std::clamp<std::size_t>(kTargetRows / std::max<std::size_t>(group, 1), 1, std::max<std::size_t>(tokens, 1));
  }

  [[nodiscard]] std::size_t keys() const noexcept { return offsets_.back(); }
  [[nodiscard]] std::size_t head_dim() const noexcept { return dim_; }
  [[nodiscard]] std::size_t block_queries() const noexcept { return block_queries_; }
  [[nodiscard]] std::size_t rows() const noexcept { return rows_; }
  [[nodiscard]] std::size_t tile() const noexcept { return tile_; }
  /// Acc values a split item's running state takes: max, sum and acc of every row.
  [[nodiscard]] std::size_t partial_size() const noexcept { return rows_ * (dim_ + 2); }

  [[nodiscard]] Workspace workspace() const {
    constexpr bool convert = !std::is_same_v<Stored, T>;  // rows that do not widen in registers
    Workspace w;
    w.queries.resize(rows_ * dim_);
    if (pairs_) w.given_queries.resize(rows_ * dim_);
    if (pairs_) w.rounded_weights = std::unique_ptr<std::uint16_t[]>(new std::uint16_t[rows_ * tile_]);
    w.acc.resize(rows_ * dim_);
    w.max.resize(rows_);
    w.sum.resize(rows_);
    w.scores = std::unique_ptr<Acc[]>(new Acc[rows_ * tile_]);
    if (convert) {
      w.keys = std::unique_ptr<Acc[]>(new Acc[tile_ * dim_]);
      w.values = std::unique_ptr<Acc[]>(new Acc[tile_ * dim_]);
    }
    w.covers.resize(block_queries_);
    w.readers.reserve(rows_);
    w.active.reserve(rows_);
    return w;
  }

  /// Runs one item; writes out, or the running state to `partials` for a split item.
  void run(const AttentionItem& item, Workspace& w, Acc* partials) const noexcept {
    const std::size_t rows = item.queries * group_;
    load_queries(item, w);
    std::fill_n(w.max.begin(), rows, -std::numeric_limits<Acc>::infinity());
    std::fill_n(w.sum.begin(), rows, Acc{0});
    std::fill_n(w.acc.begin(), rows * dim_, Acc{0});
    for (std::size_t s = 0; s < segments_.size(); ++s) {
      const std::size_t lo = std::max(item.key_begin, offsets_[s]);
      const std::size_t hi = std::min(item.key_end, offsets_[s + 1]);
      for (std::size_t j = lo; j < hi; j += tile_) {
        const std::size_t count = std::min(tile_, hi - j);
        run_tile(item, segments_[s], ascending_[s] != 0, j - offsets_[s], count, hi - j - count, w);
      }
    }
    if (partials != nullptr) {
      Acc* p = partials + item.partial * partial_size();
      std::copy_n(w.max.begin(), rows, p);
      std::copy_n(w.sum.begin(), rows, p + rows_);
      std::copy_n(w.acc.begin(), rows * dim_, p + 2 * rows_);
      return;
    }
    for (std::size_t r = 0; r < rows; ++r) write_row(item, r, w.acc.data() + r * dim_, w.sum[r]);
  }

  /// Combines the running states of `splits` items over the same rows (log-sum-exp) and writes out.
  void merge(const AttentionItem& item, const Acc* partials, std::size_t splits, std::vector<Acc>& row) const {
    const std::size_t rows = item.queries * group_;
    row.resize(dim_);
    for (std::size_t r = 0; r < rows; ++r) {
      Acc max = -std::numeric_limits<Acc>::infinity();
      for (std::size_t i = 0; i < splits; ++i) max = std::max(max, partials[(item.partial + i) * partial_size() + r]);
      std::fill(row.begin(), row.end(), Acc{0});
      Acc sum = 0;
      if (max != -std::numeric_limits<Acc>::infinity()) {
        for (std::size_t i = 0; i < splits; ++i) {
          const Acc* p = partials + (item.partial + i) * partial_size();
          const Acc weight = exp_nonpositive(p[r] - max);
          if (weight == 0) continue;
          sum += weight * p[rows_ + r];
          const Acc* acc = p + 2 * rows_ + r * dim_;
          for (std::size_t d = 0; d < dim_; ++d) row[d] += weight * acc[d];
        }
      }
      write_row(item, r, row.data(), sum);
    }
  }

 private:
  static constexpr std::size_t kTargetRows = 16;  // query rows per block, shared K/V tile
  // Stored K rows per tile. A tile's K and V stay in L2 (here 1 MiB) for the passes that read
  // them again; a longer tile spreads its fixed costs (softmax bookkeeping, accumulators to
  // registers and back) over more keys, and the reads switch between the K and the V stream
  // less often: 128 KiB read 5-10% faster from memory than 32 KiB, 384 KiB another 0.01-0.07
  // closer to the plain read on one core (0.03-0.07 at four query rows per kv head), and 512 KiB
  // (a float tile's K and V then fill the L2) 1-2 GB/s more for float at four query rows per kv
  // head, one core, S = 32k (nine interleaved pairs of runs); 768 KiB did no better, and 1-2 MiB
  // lost it again (AVX-512 AMD EPYC). The bytes are those the passes read (Stored), so a 16-bit
  // tile holds twice the keys of a float one: bf16 and half at D = 128 in tiles of 2,048 keys
  // instead of 1,024 read +0.017 and +0.027 closer to the plain read at four query rows per kv
  // head on one core, +0.028 and +0.016 on two (medians of 14 interleaved pairs of calls, S =
  // 16,384 and 32,768; 12-13 of 14 gained), float unchanged; 4,096 keys (1 MiB) gained no more,
  // and 8,192 or 16,384 lost up to 0.15 and 0.22 on two cores. kMaxTileKeys bounds the scores a
  // row keeps (8 KiB). On Intel, blocks that one pass over K and one over V serve whole take
  // longer tiles (long_tiles_pay).
  static constexpr std::size_t kTileBytes = 524288;
  static constexpr std::size_t kMaxTileKeys = 2048;

  /// Keys per tile at head size `dim` for blocks of `rows` query rows: kTileBytes of Stored K rows,
  /// at most kMaxTileKeys. Both four times as many for one query row and twice for two to four
  /// where `long_tiles` and the rows are read once a tile (D = 128: one pass over K and one over V
  /// serve up to four query rows).
  static std::size_t tile_keys(std::size_t dim, std::size_t rows, bool long_tiles) noexcept {
    const std::size_t times = long_tiles && dim == kThroughL1Dim && rows <= 4 ? (rows == 1 ? 4 : 2) : 1;
    const std::size_t keys = times * kTileBytes / (std::max<std::size_t>(dim, 1) * sizeof(Stored));
    return std::clamp<std::size_t>(keys, kW, times * kMaxTileKeys) / kW * kW;
  }
  static constexpr std::size_t kW = kVector<Acc, B>;  // keys scored at once
  // How K and V rows are read: in place when they widen in registers, else from a converted tile.
  using Stored = std::conditional_t<kConvertsInRegisters<T, Acc>, T, Acc>;
  // bfloat16 queries over bfloat16 keys: four query rows are scored by pair products
  // (score_key_pairs), half the K pass's multiply-adds, where the processor gains by them
  // (pair_products_pay: pairs_). bf16 at H_q = 32, S = 16,384 and 32,768:
  // one core 0.71-0.88 -> 0.76-0.95 of the plain read, two 0.91-1.07 -> 0.97-1.18 (three runs
  // of bench/ab, every cell closer; one core median +0.07), 13.3-13.6 -> 11.0-11.1 ns a key in
  // cache. Two rows (H_q = 16) ran faster in cache (8.6 -> 7.5 ns a key) but 0.00-0.07 further
  // from the plain read from memory (six pairs of runs), so they keep score_keys (AVX-512 AMD
  // EPYC).
  static constexpr bool kScoresPairs = KVCACHE_BF16_PAIRS && B == kVectorBytes && std::is_same_v<T, Eigen::bfloat16> &&
                                       std::is_same_v<Q, Eigen::bfloat16> && std::is_same_v<Acc, float>;
  // Their passes over V (ThroughL1<4>) by pair products too, two keys a step, the weights
  // rounded to bfloat16, the precision of the values they multiply (accumulate_pairs_in_l1).
  // bf16 at four query rows a kv head, one core, in cache: 10.9-12.2 -> 9.7-10.9 ns a key in six
  // interleaved runs while the core ran at full speed, -14% to +6% in five while other work on
  // the host slowed it to 14-20 ns a key. From memory at H_q = 32, S = 16,384 and 32,768, against
  // the plain read (three runs): one core -0.03 to +0.08 (median +0.01), two cores -0.01 to
  // +0.08 (median +0.06) (AVX-512 AMD EPYC).
  static constexpr bool kWeighsPairs = kScoresPairs;
  // Four query rows scored together, where their registers fit (kScoreRegisters): every type
  // under AVX-512 and AVX2. Float at four query rows per kv head under AVX2, one core, S = 32,768:
  // 0.45 -> 0.51 of the plain read against two pairs of rows (one interleaved run, 2-core AMD
  // EPYC); bf16 see kHoldsKeys.
  static constexpr bool kScoresFour = B >= 32 && kW % 4 == 0 && kScoreRegisters<4, Stored, Acc, B> <= kRegisters;
  // The longest V row that R rows of accumulators hold in registers at once.
  template <std::size_t R>
  static constexpr std::size_t whole_row() noexcept {
    return kBlockRegisters<R, Stored, Acc, B> * kW;
  }

  /// Row r of a block is query first_query + r / G of query head kv_head * G + r % G.
  [[nodiscard]] std::size_t head_of(const AttentionItem& item, std::size_t r) const noexcept {
    return item.kv_head * group_ + r % group_;
  }

  void load_queries(const AttentionItem& item, Workspace& w) const noexcept {
    for (std::size_t r = 0; r < item.queries * group_; ++r) {
      Acc* dst = w.queries.data() + r * dim_;
      const Q* src = q_.row(item.batch, head_of(item, r), item.first_query + r / group_);
      // Scaled, so that scores come out scaled; in the order the K rows are read in.
      for (std::size_t d = 0; d < dim_; ++d) dst[d] = load_as<Acc>(src, d) * scale_;
      reorder_row<Stored, Acc, true, B>(dst, dim_);
      if (pairs_) std::copy_n(src, dim_, w.given_queries.data() + r * dim_);
    }
  }

  /// Writes row r's output from its sums `acc`, which are in lane_of order and put back in order.
  void write_row(const AttentionItem& item, std::size_t r, Acc* acc, Acc sum) const noexcept {
    Q* dst = out_.row(item.batch, head_of(item, r), item.first_query + r / group_);
    const Acc inverse = sum > 0 ? Acc{1} / sum : Acc{0};  // no visible key: zeros
    reorder_row<Stored, Acc, false, B>(acc, dim_);
    for (std::size_t d = 0; d < dim_; ++d) {
      if constexpr (std::is_same_v<Q, Eigen::half> || std::is_same_v<Q, Eigen::bfloat16>) {
        dst[d] = static_cast<Q>(static_cast<float>(acc[d] * inverse));
      } else {
        dst[d] = static_cast<Q>(acc[d] * inverse);
      }
    }
  }

  /// Calls read(rows, stride, fetch) with the rows of `view` for (batch, kv_head), keys [first,
  /// first + count), of which `end` exist from `first` on: in place when they widen in
  /// registers (the pass that reads them from memory asks for rows `distance` ahead through
  /// `fetch`), else converted once into `scratch` for all the rows that share them (the
  /// conversion asks).
  template <class Read>
  void with_rows(const TensorView<const T>& view, const AttentionItem& item, std::size_t first, std::size_t count,
                 std::size_t end, const FetchDistance& distance, const std::unique_ptr<Acc[]>& scratch,
                 const Read& read) const noexcept {
    const RowFetcher fetch(view.row(item.batch, item.kv_head, first), view.strides().tokens * sizeof(T),
                           dim_ * sizeof(T), end, distance);
    if constexpr (std::is_same_v<Stored, T>) {
      read(view.row(item.batch, item.kv_head, first), view.strides().tokens, fetch);
    } else {
      for (std::size_t j = 0; j < count; ++j) {
        fetch(j);
        convert_row(view.row(item.batch, item.kv_head, first + j), scratch.get() + j * dim_, dim_);
      }
      read(static_cast<const Acc*>(scratch.get()), dim_, RowFetcher{});
    }
  }

  /// One tile of keys [first, first + count) of a segment, whose positions may ascend; `ahead`
  /// keys follow it in the same item.
  void run_tile(const AttentionItem& item, const Segment<T>& segment, bool ascending_segment, std::size_t first,
                std::size_t count, std::size_t ahead, Workspace& w) const noexcept {
    using Cover = VisibilityRule::Cover;
    std::span<const std::int64_t> positions = segment.positions.subspan(first, count);
    // Sinks in front of other keys in one tile: the sinks as a tile of their own, so that the
    // keys after them can be trimmed to the queries' windows (visible_range).
    if (const std::int64_t sinks_end = rule_.sinks_end();
        ascending_segment && positions.front() < sinks_end && positions.back() >= sinks_end) {
      const auto sinks =
          static_cast<std::size_t>(std::lower_bound(positions.begin(), positions.end(), sinks_end) - positions.begin());
      run_tile(item, segment, true, first, sinks, count - sinks + ahead, w);
      run_tile(item, segment, true, first + sinks, count - sinks, ahead, w);
      return;
    }
    std::int64_t low = positions.front();
    std::int64_t high = positions.back();
    if (!ascending_segment) {
      // Values, not iterators (std::minmax_element): a loop the compiler vectorizes.
      for (const std::int64_t p : positions) {
        low = std::min(low, p);
        high = std::max(high, p);
      }
    }
    bool any = false;
    bool some = false;  // a query that sees part of the tile
    for (std::size_t t = 0; t < item.queries; ++t) {
      w.covers[t] = rule_.cover(q_positions_[item.first_query + t], low, high);
      any = any || w.covers[t] != Cover::kNone;
      some = some || w.covers[t] == Cover::kSome;
    }
    if (!any) return;  // a tile no query may read is never loaded
    const bool ascending = some && ascending_segment;
    const auto [skip, end] = visible_range(item, positions, ascending, w);
    if (skip == end) return;
    first += skip;
    count = end - skip;
    positions = positions.subspan(skip, count);

    w.readers.clear();
    w.active.clear();
    for (std::size_t t = 0; t < item.queries; ++t) {
      if (w.covers[t] == Cover::kNone) continue;
      for (std::size_t r = t * group_; r < (t + 1) * group_; ++r) w.readers.push_back(r);
    }
    // The first pass over K reads the tile from memory and asks for rows ahead (RowFetcher)
    // where two or more query rows share it (two and four float rows gained 5-15%, bf16 rows
    // 5-15%). One row does so little arithmetic a byte that the hardware prefetcher keeps up,
    // and asking cost: float 10%; bf16 and half, asking neither for K nor for V rows at one
    // query row per kv head, one core, S = 16,384 and 32,768: 0.74-0.81 -> 0.83-0.87 of the
    // plain read, two cores 0.71-0.82 -> 0.77-0.82 (15 interleaved calls each; the fetch policy
    // keeps asking on Intel, where it was measured so, unless the one-row passes are plain
    // streams there: plain_one_row_passes). The first pass over V reads whole rows
    // in order and asks for 16-bit rows (bf16 gained 5-10% at two and four query rows; float
    // lost 5-10%, and up to 30% before the tiles grew to 128 KiB), and for float rows where the
    // fetch policy says (Intel Xeon) or where that pass keeps its rows' sums in L1 (float V
    // alone at two and four query rows per kv head under AVX2, one core, S = 32,768: 1.33-1.38
    // -> 1.52-1.54 and 1.07-1.13 -> 1.27-1.33 times as fast as the plain read of K and V, two
    // interleaved runs; 2-core AMD EPYC). The other passes read the tile from cache. (All
    // measured on an AVX-512 AMD EPYC, where not said otherwise.)
    const RowFetcher none;
    constexpr bool sixteen_bit = sizeof(T) < sizeof(Acc);
    const FetchPolicy& policy = fetch_policy();
    const bool one_row_asks = sixteen_bit && policy.one_row && !plain_one_row_;
    const bool fetch_keys = w.readers.size() >= 2 || one_row_asks;
    const bool keys_by_groups = w.readers.size() >= 2 && !first_group_scores_in_order(w.readers.size());
    with_rows(segment.keys, item, first, count, fetch_keys ? count + ahead : 0,
              keys_by_groups ? policy.keys_by_groups : policy.rows, w.keys,
              [&](const Stored* keys, std::size_t stride, const RowFetcher& fetch) {
                // Four rows at a time where 32 registers hold their queries, then two, then one:
                // each K row read (and widened) serves them all.
                std::size_t i = 0;
                if constexpr (kScoresFour) {
                  for (; i + 4 <= w.readers.size(); i += 4) score<4>(w, i, keys, stride, count, i == 0 ? fetch : none);
                }
                if constexpr (kW % 2 == 0) {
                  for (; i + 2 <= w.readers.size(); i += 2) score<2>(w, i, keys, stride, count, i == 0 ? fetch : none);
                }
                for (; i < w.readers.size(); ++i) score<1>(w, i, keys, stride, count, i == 0 ? fetch : none);
                for (std::size_t t = 0; t < item.queries; ++t) {
                  if (w.covers[t] == Cover::kNone) continue;
                  const std::int64_t query = q_positions_[item.first_query + t];
                  for (std::size_t r = t * group_; r < (t + 1) * group_; ++r) {
                    Acc* scores = w.scores.get() + r * tile_;
                    if (w.covers[t] == Cover::kSome) mask_invisible(query, positions, ascending, scores);
                    if (rescale_for_tile(scores, count, w.max[r], w.sum[r], w.acc.data() + r * dim_)) {
                      w.active.push_back(r);
                    }
                  }
                }
              });
    if (w.active.empty()) return;
    // 16-bit V rows are asked for ahead, and the first pass over them (for bf16, the one from
    // memory) also turns its rows' scores into weights as it goes, W keys at a time: there the
    // multiply-add units wait on the rows (bf16 at four query rows per kv head, one core:
    // 0.02-0.04 closer to the plain read than weights made in a loop of their own, AVX-512 AMD
    // EPYC; float lost 0.02-0.03, so its weights are made first). Rows of the groups that read
    // the tile from cache, or keep their sums in L1, are weighed just before their pass (16-bit
    // rows at two query rows per kv head through L1, one core: 0.67-0.74 -> 0.77-0.80, two
    // interleaved pairs of runs; 2-core AMD EPYC).
    // A row shorter than one read is summed by scalars, which call no hook: weighed first.
    const bool plain_pass = plain_one_row_ && sixteen_bit && w.active.size() == 1;
    const bool weigh_in_pass =
        kWeighInPass && sixteen_bit && dim_ >= RowReader<Stored, Acc, B>::kSplit * kW && !plain_pass;
    const bool fetch_values = (sixteen_bit && (w.active.size() >= 2 || one_row_asks)) ||
                              (policy.float_values && !plain_pass) || rows_through_l1(w.active.size()) != 0;
    with_rows(segment.values, item, first, count, fetch_values ? count + ahead : 0, policy.rows, w.values,
              [&](const Stored* values, std::size_t stride, const RowFetcher& fetch) {
                for_each_value_group(w.active.size(), [&](auto group, std::size_t i) {
                  constexpr std::size_t R = rows_of(group);
                  Acc* scores[R];
                  Acc max[R];
                  for (std::size_t r = 0; r < R; ++r) {
                    scores[r] = w.scores.get() + w.active[i + r] * tile_;
                    max[r] = w.max[w.active[i + r]];
                  }
#if KVCACHE_BF16_PAIRS
                  if constexpr (kWeighsPairs && sums_in_l1(group)) {
                    if (pairs_) {
                      Acc* acc[R];
                      const std::uint16_t* rounded[R];
                      for (std::size_t r = 0; r < R; ++r) {
                        const std::size_t row = w.active[i + r];
                        std::uint16_t* const weights = w.rounded_weights.get() + row * tile_;
                        weigh(scores[r], count, max[r]);
                        w.sum[row] += round_weights(scores[r], count, weights);
                        rounded[r] = weights;
                        acc[r] = w.acc.data() + row * dim_;
                      }
                      accumulate_pairs_in_l1<R, kThroughL1Dim, kHeldRows<R>>(acc, rounded, values, stride, count,
                                                                             i == 0 ? fetch : none);
                      return;
                    }
                  }
#endif
                  if constexpr (!sums_in_l1(group)) {
                    if (weigh_in_pass && i == 0) {
                      const auto fetch_and_weigh = [&](std::size_t j) KVCACHE_ALWAYS_INLINE {
                        fetch(j);
                        if (j % kW == 0) {
                          for (std::size_t r = 0; r < R; ++r) weigh(scores[r] + j, std::min(kW, count - j), max[r]);
                        }
                      };
                      accumulate(group, w, i, values, stride, count, fetch_and_weigh);
                      for (std::size_t r = 0; r < R; ++r) w.sum[w.active[i + r]] += sum_of(scores[r], count);
                      return;
                    }
                  }
                  for (std::size_t r = 0; r < R; ++r) w.sum[w.active[i + r]] += weigh(scores[r], count, max[r]);
                  accumulate(group, w, i, values, stride, count, i == 0 ? fetch : none);
                });
              });
  }

  /// Sets the scores of the keys `query` may not see to -inf. Over ascending positions the keys
  /// from the latest window start up to the query are all visible: those past the query are
  /// masked by one fill, and only those before that start (sinks, older keys) are checked one by
  /// one. A chunk's diagonal tiles then cost no check a key (causal prefill from 0, 512 tokens:
  /// checking every key had taken about a seventh of the time; AVX-512 AMD EPYC).
  void mask_invisible(std::int64_t query, std::span<const std::int64_t> positions, bool ascending,
                      Acc* scores) const noexcept {
    std::size_t check_end = positions.size();
    if (ascending) {
      const auto end = std::upper_bound(positions.begin(), positions.end(), query);
      const auto start = std::lower_bound(positions.begin(), end, rule_.window_start(query));
      std::fill(scores + (end - positions.begin()), scores + positions.size(), -std::numeric_limits<Acc>::infinity());
      check_end = static_cast<std::size_t>(start - positions.begin());
    }
    for (std::size_t j = 0; j < check_end; ++j) {
      if (!rule_.visible(query, positions[j])) scores[j] = -std::numeric_limits<Acc>::infinity();
    }
  }

  /// The keys [skip, end) of a tile worth reading. Where some query sees only part of the tile
  /// and the positions ascend (`ascending`; every cache's segments do), the keys after the last
  /// one any query of the block may see, and those before the earliest start of their windows
  /// (where the tile holds no sink), are invisible to all of them: a chunk's tiles then cost what
  /// their visible part does, causally and under a window.
  [[nodiscard]] std::pair<std::size_t, std::size_t> visible_range(const AttentionItem& item,
                                                                  std::span<const std::int64_t> positions,
                                                                  bool ascending, const Workspace& w) const noexcept {
    if (!ascending) return {0, positions.size()};
    std::int64_t latest = std::numeric_limits<std::int64_t>::min();
    std::int64_t oldest = std::numeric_limits<std::int64_t>::max();
    for (std::size_t t = 0; t < item.queries; ++t) {
      if (w.covers[t] == VisibilityRule::Cover::kNone) continue;
      const std::int64_t query = q_positions_[item.first_query + t];
      latest = std::max(latest, query);
      oldest = std::min(oldest, rule_.window_start(query));
    }
    const bool trims_end = positions.back() > latest;
    const bool trims_start = positions.front() < oldest && positions.front() >= rule_.sinks_end();
    if (!(trims_end || trims_start)) return {0, positions.size()};
    const auto begin = trims_start ? std::lower_bound(positions.begin(), positions.end(), oldest) : positions.begin();
    const auto end = trims_end ? std::upper_bound(begin, positions.end(), latest) : positions.end();
    return {static_cast<std::size_t>(begin - positions.begin()), static_cast<std::size_t>(end - positions.begin())};
  }

#if defined(__clang__)
  // Clang 14 keeps part of the hooked pass's accumulators and pointers on the stack, reloading
  // them every key: there weights made first read bf16 at four query rows per kv head 0.71-0.74
  // of the plain read instead of 0.43-0.48 (one core, AVX-512 AMD EPYC).
  static constexpr bool kWeighInPass = false;
#else
  static constexpr bool kWeighInPass = true;
#endif

  /// R rows whose one pass over V reads whole rows and keeps the sums of those the registers do
  /// not hold in L1 (accumulate_whole_rows_in_l1).
  template <std::size_t R>
  struct ThroughL1 {};
  /// The head size ThroughL1 is compiled for (the one measured).
  static constexpr std::size_t kThroughL1Dim = 128;

  /// The query rows a group of for_each_value_group reads V for.
  template <std::size_t R>
  static constexpr std::size_t rows_of(std::integral_constant<std::size_t, R>) noexcept {
    return R;
  }
  template <std::size_t R>
  static constexpr std::size_t rows_of(ThroughL1<R>) noexcept {
    return R;
  }
  /// Whether a group of for_each_value_group keeps its sums in L1.
  template <class Group>
  static constexpr bool sums_in_l1(Group) noexcept {
    return false;
  }
  template <std::size_t R>
  static constexpr bool sums_in_l1(ThroughL1<R>) noexcept {
    return true;
  }
  /// The rows of the first group of for_each_value_group when it keeps its sums in L1 (ThroughL1),
  /// given n active rows; 0 when it does not. At D = 128 under AVX2 or AVX-512: four rows, whose
  /// sums no register file holds; two where the registers do not hold theirs either (AVX2, where
  /// one row's take all 16). Under AVX2, four 16-bit rows store their sums once for two keys (see
  /// accumulate_whole_rows_in_l1): bf16 and half at H_q = 32, one core, S = 16,384 and 32,768,
  /// 0.47-0.61 -> 0.65-0.74 of the plain read against two rows through L1 and two from cache, two
  /// interleaved pairs of runs (2-core AMD EPYC). Under AVX-512, four rows in one pass, two of
  /// them held in registers, against two whole rows and two first halves, then the second halves
  /// from cache (which left the memory idle while it ran): H_q = 32, S = 16,384 and 32,768, one
  /// core float / bf16 / half 0.78-0.86 / 0.64-0.69 / 0.65-0.70 -> 0.78-0.89 / 0.71-0.75 /
  /// 0.69-0.73, two cores 0.80-0.81 / 0.71-0.84 / 0.69-0.92 -> 0.82-0.92 / 0.79-0.89 / 0.76-0.95
  /// (two runs of 15 calls of each build timed in turn as bench/ab does; 2-core AMD EPYC with
  /// AVX-512).
  [[nodiscard]] std::size_t rows_through_l1(std::size_t n) const noexcept {
    if (B < 32 || dim_ != kThroughL1Dim) return 0;
    if (n >= 4) return 4;
    if (n >= 2 && dim_ > whole_row<2>()) return 2;
    return 0;
  }
  /// The rows of a ThroughL1<R> group whose sums stay in registers: as many whole rows as half
  /// the registers hold, the other half left to the rows read and the weights.
  template <std::size_t R>
  static constexpr std::size_t kHeldRows = std::min<std::size_t>(R - 1, kAccumulators / (kThroughL1Dim / kW));

  /// Calls f(std::integral_constant<std::size_t, R>{}, i) for groups of rows [i, i + R) covering
  /// [0, n), each of which reads a tile's V rows once for all its rows. The first group takes
  /// the tile from memory and reads row after row in order, which the hardware prefetcher
  /// follows (it does not follow a pass over half rows, then over the other halves): as many
  /// rows as keep a whole V row in registers (whole_row), else the rows of rows_through_l1 with
  /// the sums the registers do not hold in L1 (ThroughL1), so that the one pass over V, from
  /// memory, serves them all. Under AVX2, where only one row keeps a whole row (D = 128): two
  /// rows, medians of `vs_read` over twelve interleaved pairs
  /// of runs (S = 16,384 and 32,768), float / bf16 / half: one core 0.68 / 0.64 / 0.65 -> 0.69 /
  /// 0.69 / 0.67, two cores 0.73 / 0.70 / 0.71 -> 0.76 / 0.73 / 0.75, against one row whole and
  /// one from cache (2-core AMD EPYC). Else that one row (float at four query rows per kv head,
  /// one core, S = 32,768: 0.38-0.46 -> 0.52-0.58 of the plain read, against four rows over a
  /// quarter of each row at a time). The rest read the tile from cache four rows at a time,
  /// then two, then one; where pairs_, four rows at D = 128 by pair products too (causal
  /// prefill with bfloat16 queries, 16 query heads, one core: of the multiply-add peak 0.79-0.82
  /// -> 0.82-0.86 from position 0, 0.91-0.94 -> 0.96-0.99 after 2,048 tokens, two interleaved
  /// runs; AVX-512 AMD EPYC).
  template <class F>
  void for_each_value_group(std::size_t n, const F& f) const {
    using Four = std::integral_constant<std::size_t, 4>;
    using Two = std::integral_constant<std::size_t, 2>;
    using One = std::integral_constant<std::size_t, 1>;
    std::size_t i = 0;
    const std::size_t through_l1 = rows_through_l1(n);
    if (n >= 4 && dim_ <= whole_row<4>()) {
      f(Four{}, i);
      i += 4;
    } else if (through_l1 == 4) {
      f(ThroughL1<4>{}, i);
      i += 4;
    } else if (n >= 2 && dim_ <= whole_row<2>()) {
      f(Two{}, i);
      i += 2;
    } else if (through_l1 == 2) {
      f(ThroughL1<2>{}, i);
      i += 2;
    } else if (B == 32 && n >= 2 && dim_ <= whole_row<1>()) {
      f(One{}, i);
      i += 1;
    }
    for (; i + 4 <= n; i += 4) {
      if (pairs_ && dim_ == kThroughL1Dim) {
        f(ThroughL1<4>{}, i);  // pair products from cache as well
      } else {
        f(Four{}, i);
      }
    }
    for (; i + 2 <= n; i += 2) f(Two{}, i);
    for (; i < n; ++i) f(One{}, i);
  }

  /// f(std::integral_constant<std::size_t, Dim>{}) with Dim = dim_ for the common head sizes,
  /// whose loops over a row are unrolled at compile time, else with Dim = 0.
  template <class F>
  decltype(auto) with_head_size(const F& f) const {
    switch (dim_) {
      case 64:
        return f(std::integral_constant<std::size_t, 64>{});
      case 128:
        return f(std::integral_constant<std::size_t, 128>{});
      case 256:
        return f(std::integral_constant<std::size_t, 256>{});
      default:
        return f(std::integral_constant<std::size_t, 0>{});
    }
  }

  /// Scores the tile's keys for readers [i, i + R). For the common head sizes the loop over a
  /// row is unrolled at compile time (score_fixed); any other size takes the loop of score_rows.
  template <std::size_t R>
  void score(Workspace& w, std::size_t i, const Stored* keys, std::size_t stride, std::size_t count,
             const RowFetcher& fetch) const noexcept {
    with_head_size([&](auto dim) KVCACHE_ALWAYS_INLINE {
      if constexpr (dim == 0) {
        score_rows<R, 0>(w, i, keys, stride, count, fetch);
      } else {
        score_fixed<R, dim>(w, i, keys, stride, count, fetch);
      }
    });
  }

  // Whether score<R> reads the tile's K rows in order (score_in_order) at a head size Dim known at
  // compile time (0: not known): always, or (kMayReadInOrder) for four 16-bit rows where
  // four_rows_in_order_, in the group that reads the tile from memory (scores_in_order).
  template <std::size_t Dim>
  static constexpr bool kWholeReads = Dim != 0 && Dim % (RowReader<Stored, Acc, B>::kSplit * kW) == 0;
  template <std::size_t R, std::size_t Dim>
  static constexpr bool kAlwaysInOrder = kWholeReads<Dim> && (B == 32 || (R == 1 && Dim / kW <= kAccumulators));
  template <std::size_t R, std::size_t Dim>
  static constexpr bool kMayReadInOrder = kAlwaysInOrder<R, Dim> ||
                                          (kWholeReads<Dim> && R == 4 && sizeof(Stored) < sizeof(Acc));

  /// Whether score<R> reads the tile's K rows in order for readers [i, i + R).
  template <std::size_t R, std::size_t Dim>
  [[nodiscard]] bool scores_in_order(std::size_t i) const noexcept {
    return kAlwaysInOrder<R, Dim> || (kMayReadInOrder<R, Dim> && four_rows_in_order_ && i == 0);
  }

  /// Whether the first score() group of `readers` rows, the one that reads the tile from memory,
  /// reads the K rows in order.
  [[nodiscard]] bool first_group_scores_in_order(std::size_t readers) const noexcept {
    return with_head_size([&](auto dim) {
      if (kScoresFour && readers >= 4) return scores_in_order<4, dim>(0);
      if (kW % 2 == 0 && readers >= 2) return scores_in_order<2, dim>(0);
      return scores_in_order<1, dim>(0);
    });
  }

  // Clang 14 as well, now that the steps' lambdas are forced inline (float at two query rows per
  // kv head, one core: 0.76 -> 0.79-0.82 of the plain read).
  static constexpr std::size_t kMaxFixedKeys = 8;

  /// score() for a head size Dim known at compile time. Where the rows are read in order
  /// (score_in_order), one whole K row after another, every load moves by one row stride, which
  /// the hardware prefetcher follows: one query row whose query fits in registers does so (float
  /// from memory ran 10-15% faster than W keys at a time, a register of each, whose loads jump
  /// between rows), and under AVX2 every group of rows does, their queries read from L1 where
  /// the registers do not hold them. One query row per kv head read 0.77-0.91 of the plain read
  /// that way instead of 0.43-0.78; over one long stream of K rows, with their queries copied
  /// into the function's own array first, two rows 0.80-0.93 of the plain read and four
  /// 0.74-0.90 in float (bf16 0.62-0.85) instead of 0.56-0.75 W / R keys at a time (read from
  /// the query rows at every step, 0.60-0.66), and in the kernel float at two query rows per kv
  /// head, two cores, 0.71-0.76 -> 0.80-0.87 (2-core AMD EPYC). Under AVX-512, where two rows
  /// in order ran no faster in float and slower in bf16, and four, whose queries did not fit in
  /// registers, slower, more rows read kVector / R keys at a time (but for four 16-bit rows at
  /// decode on the Intel Xeon: four_rows_in_order_pay). Their loop over a row is
  /// unrolled where a call reads at most kMaxFixedKeys rows (the loads of more unrolled rows are
  /// more than the hardware prefetcher tracks) and a row is at most 16 reads (past that, at
  /// narrow vector widths, unrolling gained nothing, only code to compile). Measured on an
  /// AVX-512 AMD EPYC where not said otherwise.
  template <std::size_t R, std::size_t Dim>
  void score_fixed(Workspace& w, std::size_t i, const Stored* keys, std::size_t stride, std::size_t count,
                   const RowFetcher& fetch) const noexcept {
    constexpr std::size_t kRead = RowReader<Stored, Acc, B>::kSplit * kW;
    if constexpr (kMayReadInOrder<R, Dim>) {
      if (scores_in_order<R, Dim>(i)) return score_fixed_in_order<R, Dim>(w, i, keys, stride, count, fetch);
    }
    if constexpr (kW / R <= kMaxFixedKeys && Dim % kRead == 0 && Dim / kRead <= 16) {
      score_rows<R, Dim>(w, i, keys, stride, count, fetch);
    } else {
      score_rows<R, 0>(w, i, keys, stride, count, fetch);
    }
  }

  /// score_fixed for rows read in order.
  template <std::size_t R, std::size_t Dim>
  void score_fixed_in_order(Workspace& w, std::size_t i, const Stored* keys, std::size_t stride, std::size_t count,
                            const RowFetcher& fetch) const noexcept {
    const Acc* q[R];
    Acc* out[R];
    for (std::size_t r = 0; r < R; ++r) {
      q[r] = w.queries.data() + w.readers[i + r] * dim_;
      out[r] = w.scores.get() + w.readers[i + r] * tile_;
    }
    if constexpr (R == 1 && std::is_same_v<Stored, Eigen::bfloat16>) {
      if (plain_one_row_ && w.readers.size() == 1) {
        return score_in_order<R, Dim, true, B>(q, keys, stride, count, out, fetch);
      }
    }
    score_in_order<R, Dim, false, B>(q, keys, stride, count, out, fetch);
  }

  /// score() for a head size known at compile time (Dim), or not (0): kW / R keys at a time, by
  /// score_key_pairs from the queries as given for four rows where pairs_, else by score_keys.
  template <std::size_t R, std::size_t Dim>
  void score_rows(Workspace& w, std::size_t i, const Stored* keys, std::size_t stride, std::size_t count,
                  const RowFetcher& fetch) const noexcept {
    if constexpr (kScoresPairs && R == 4 && Dim != 0 && Dim % (2 * kW) == 0) {
      if (pairs_) return score_rows_by<R, Dim, true>(w, i, keys, stride, count, fetch);
    }
    score_rows_by<R, Dim, false>(w, i, keys, stride, count, fetch);
  }

  /// score_rows by score_key_pairs (`pairs`) or by score_keys.
  template <std::size_t R, std::size_t Dim, bool pairs>
  void score_rows_by(Workspace& w, std::size_t i, const Stored* keys, std::size_t stride, std::size_t count,
                     const RowFetcher& fetch) const noexcept {
    constexpr std::size_t kKeys = kW / R;
    using Query = std::conditional_t<pairs, Q, Acc>;
    const Query* queries = nullptr;
    if constexpr (pairs) {
      queries = w.given_queries.data();
    } else {
      queries = w.queries.data();
    }
    const Query* q[R];
    Acc* out[R];
    // Found once: found at every step, they were loaded again each time (the scores' stores may
    // alias w's fields for all GCC knows). In cache, medians of six: four rows 4-6% faster
    // (float 15.6 -> 15.0, bf16 13.4 -> 12.5, bf16 queries 10.4 -> 10.0 ns a key), two 1-6%.
    for (std::size_t r = 0; r < R; ++r) {
      q[r] = queries + w.readers[i + r] * dim_;
      out[r] = w.scores.get() + w.readers[i + r] * tile_;
    }
    for (std::size_t j = 0; j < count; j += kKeys) {
      const Stored* rows[kKeys];
      for (std::size_t k = 0; k < kKeys; ++k) rows[k] = keys + std::min(j + k, count - 1) * stride;
      // Rows of up to four lines asked for line by line, unrolled, not by RowFetcher's loop (in
      // cache, medians of ten: two rows 2-4% faster in every type, four bf16-query rows 5-6%,
      // bf16 1-6%, half 0.5-2% slower; float's 512-byte rows lost 3% so and keep the loop).
      if constexpr (Dim != 0 && Dim * sizeof(Stored) <= 256) {
        for (std::size_t k = j; k < std::min(j + kKeys, count); ++k) fetch.template row<Dim * sizeof(Stored)>(k);
      } else {
        for (std::size_t k = j; k < std::min(j + kKeys, count); ++k) fetch(k);
      }
      Acc* at[R];
      for (std::size_t r = 0; r < R; ++r) at[r] = out[r] + j;
      if constexpr (pairs) {
        score_key_pairs<R, Dim>(q, rows, scale_, at);
      } else {
        score_keys<R, Dim, B>(q, rows, dim_, at);
      }
    }
  }

  /// The running sums and the tile's weights of active rows [i, i + R).
  template <std::size_t R>
  void sums_and_weights(Workspace& w, std::size_t i, Acc* (&acc)[R], const Acc* (&weights)[R]) const noexcept {
    for (std::size_t r = 0; r < R; ++r) {
      acc[r] = w.acc.data() + w.active[i + r] * dim_;
      weights[r] = w.scores.get() + w.active[i + r] * tile_;
    }
  }

  /// Adds the weighted V rows of the tile into the accumulators of active rows [i, i + R).
  template <std::size_t R, class Fetch>
  void accumulate(std::integral_constant<std::size_t, R>, Workspace& w, std::size_t i, const Stored* values,
                  std::size_t stride, std::size_t count, const Fetch& fetch) const noexcept {
    Acc* acc[R];
    const Acc* weights[R];
    sums_and_weights(w, i, acc, weights);
    if constexpr (R == 1 && std::is_same_v<Stored, Eigen::bfloat16>) {
      if (plain_one_row_ && w.active.size() == 1) {
        return accumulate_rows<R, kBlockRegisters<R, Stored, Acc, B>, true, B>(acc, weights, values, stride, count,
                                                                               dim_, fetch);
      }
    }
    accumulate_rows<R, kBlockRegisters<R, Stored, Acc, B>, false, B>(acc, weights, values, stride, count, dim_, fetch);
  }

  /// The same for active rows [i, i + R) as ThroughL1<R> (dim_ == kThroughL1Dim).
  template <std::size_t R, class Fetch>
  void accumulate(ThroughL1<R>, Workspace& w, std::size_t i, const Stored* values, std::size_t stride,
                  std::size_t count, const Fetch& fetch) const noexcept {
    Acc* acc[R];
    const Acc* weights[R];
    sums_and_weights(w, i, acc, weights);
    accumulate_whole_rows_in_l1<R, kThroughL1Dim, kHeldRows<R>, B>(acc, weights, values, stride, count, fetch);
  }

  /// Online softmax, first half: raises a row's running max to its tile's, rescaling the running
  /// sum and accumulator when it grows. Returns false when no key of the tile is visible to the
  /// row. weigh() then turns the scores into weights against that max and sums them.
  bool rescale_for_tile(const Acc* scores, std::size_t count, Acc& max, Acc& sum, Acc* acc) const noexcept {
    const Acc tile_max = max_of(scores, count);
    if (tile_max == -std::numeric_limits<Acc>::infinity()) return false;
    if (tile_max > max) {
      const Acc correction = exp_nonpositive(max - tile_max);  // 0 when max was -inf
      sum *= correction;
      for (std::size_t d = 0; d < dim_; ++d) acc[d] *= correction;
      max = tile_max;
    }
    return true;
  }

  /// scores[j] = e^(scores[j] - max) for j < n: whole registers by the lane-wise exp, the tail
  /// by the scalar one. Returns their sum, added as sum_of adds (the pass over V that weighs as
  /// it goes discards it and calls sum_of after).
  KVCACHE_ALWAYS_INLINE static Acc weigh(Acc* scores, std::size_t n, Acc max) noexcept {
    using V = Vector<Acc, B>;
    std::size_t j = 0;
    Acc total = 0;
    if constexpr (KVCACHE_VECTOR_EXP && std::is_same_v<Acc, float>) {
      V lanes = splat<B>(Acc{0});
      for (; j + kW <= n; j += kW) {
        const V weights = exp_nonpositive(load_vector<V>(scores + j) - splat<B>(max));
        store_vector(scores + j, weights);
        lanes += weights;
      }
      total = fold_halves<kW / 2>(lanes, [](const V& a, const V& b) { return a + b; })[0];
    }
    for (; j < n; ++j) {
      scores[j] = exp_nonpositive(scores[j] - max);
      total += scores[j];
    }
    return total;
  }

  TensorView<const Q> q_;
  std::span<const std::int64_t> q_positions_;
  std::span<const Segment<T>> segments_;
  TensorView<Q> out_;
  VisibilityRule rule_;
  Acc scale_;
  std::size_t dim_;
  std::size_t group_;
  std::size_t block_queries_;
  std::size_t rows_;
  std::size_t tile_;
  bool pairs_;          // kScoresPairs and kWeighsPairs, where AttentionForms::pair_products
  bool plain_one_row_;  // one query row's passes as plain streams (plain_one_row_passes)
  // Four 16-bit query rows score the K rows they read from memory in order (four_rows_in_order_pay):
  // where a block holds one query (decode), each tile is read once a call.
  bool four_rows_in_order_;
  std::vector<std::size_t> offsets_;  // segment s holds keys [offsets_[s], offsets_[s + 1])
  // Whether segment s's positions ascend (every cache's do; a hand-built history's need not),
  // where a call needs to know: found once a call, not once a tile of every block.
  std::vector<char> ascending_;
};

/// Threads for `work_bytes` of K and V reads: `requested`, or for 0 one per `per_thread` bytes
/// of work (bytes_per_thread(): what waking a kept thread pays for on this processor), at least
/// one and at most the hardware's.
inline std::size_t attention_threads(std::size_t requested, std::size_t work_bytes,
                                     std::size_t per_thread = bytes_per_thread()) noexcept {
  if (requested != 0) return requested;
  const std::size_t wanted = work_bytes / std::max<std::size_t>(per_thread, 1);
  if (wanted <= 1) return 1;
  // Asked once: glibc reads /sys for it on every call (5-6 us a decode call here).
  static const std::size_t hardware = std::max<std::size_t>(std::thread::hardware_concurrency(), 1);
  return std::min(wanted, hardware);
}

/// Plans the work items and runs them: blocks of queries per (batch, kv head), and when that
/// leaves threads idle over a long history, the keys split among them and merged at the end.
template <class T, class Q, class Acc, std::size_t B>
void run_attention(const AttentionKernel<T, Q, Acc, B>& kernel, std::size_t batch, std::size_t kv_heads,
                   std::size_t queries, std::size_t requested_threads) {
  constexpr std::size_t kMinSplitKeys = 512;
  const std::size_t keys = kernel.keys();
  const std::size_t block = kernel.block_queries();
  const std::size_t blocks = (queries + block - 1) / block;
  const std::size_t base_items = batch * kv_heads * blocks;
  const std::size_t work_bytes = 2 * batch * kv_heads * keys * kernel.head_dim() * sizeof(T) * blocks;
  std::size_t threads = attention_threads(requested_threads, work_bytes);
  std::size_t splits = 1;
  if (threads > base_items && keys >= 2 * kMinSplitKeys) {
    splits = std::min((threads + base_items - 1) / base_items, keys / kMinSplitKeys);
  }
  std::vector<AttentionItem> items;
  items.reserve(base_items * splits);
  for (std::size_t b = 0; b < batch; ++b) {
    for (std::size_t h = 0; h < kv_heads; ++h) {
      for (std::size_t first = 0; first < queries; first += block) {
        for (std::size_t s = 0; s < splits; ++s) {
          const std::size_t partial = items.size();
          items.push_back(
              {b, h, first, std::min(block, queries - first), keys * s / splits, keys * (s + 1) / splits, partial});
        }
      }
    }
  }
  threads = std::min(threads, items.size());
  // Every allocation happens here, before a thread starts: a worker never throws.
  std::vector<typename AttentionKernel<T, Q, Acc, B>::Workspace> workspaces;
  workspaces.reserve(threads);
  for (std::size_t i = 0; i < threads; ++i) workspaces.push_back(kernel.workspace());
  std::vector<Acc> partials(splits > 1 ? items.size() * kernel.partial_size() : 0);
  Acc* partial_data = splits > 1 ? partials.data() : nullptr;

  std::atomic<std::size_t> next{0};
  run_workers(threads, [&](std::size_t worker) {
    for (std::size_t i = next.fetch_add(1, std::memory_order_relaxed); i < items.size();
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      kernel.run(items[i], workspaces[worker], partial_data);
    }
  });
  if (splits > 1) {
    std::vector<Acc> row;
    for (std::size_t i = 0; i < items.size(); i += splits) kernel.merge(items[i], partial_data, splits, row);
  }
}

}  // namespace kvcache::detail
