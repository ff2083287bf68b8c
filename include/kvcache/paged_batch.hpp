// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcache/codec.hpp"
#include "kvcache/concepts.hpp"
#include "kvcache/detail/cache_base.hpp"
#include "kvcache/detail/checks.hpp"
#include "kvcache/paged_kv_cache.hpp"
#include "kvcache/version.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// Several sequences of one BlockPool as the rows of a batch, so that a forward pass writes them
/// together and attention reads them in one call: batch row i is sequence i. A view of their
/// block tables: the sequences keep their tokens and the pool its counts, and both must outlive
/// it (a sequence moved elsewhere must not be read through it). Blocks several sequences hold
/// (after fork or reuse_prefix) are read once for all of them by causal_attention, each
/// sequence's queries scored against them together. It follows the row protocol as SlotKvCache
/// does, so a model that serves a batch from a slot cache serves one from a pool unchanged.
///
///   kvcache::PagedKvCache<float> a(pool);                     // ... prefill a ...
///   kvcache::PagedKvCache<float> b = a.fork();
///   kvcache::PagedBatch<float> batch({&a, &b});
///   auto history = batch.update(layer, k, v, positions, {0, 1});  // k [2, H_kv, T, D]
///   kvcache::causal_attention(q, positions, history, out);        // q [2, H_q, T, D]
template <class T>
class PagedBatch : public detail::ComputeTypeUpdates<PagedBatch<T>, T>, public detail::RowUpdates<PagedBatch<T>, T> {
 public:
  using value_type = T;

  /// A batch of `sequences`, in that order: std::invalid_argument unless there is at least one,
  /// each in a pool (not moved from), all in one pool, none twice.
  explicit PagedBatch(std::span<PagedKvCache<T>* const> sequences) : sequences_(sequences.begin(), sequences.end()) {
    const auto refuse = [](const std::string& what, const std::string& expected, const std::string& given) {
      throw std::invalid_argument(detail::expected_given("PagedBatch: " + what, expected, given));
    };
    if (sequences_.empty()) refuse("sequences", "at least one", "none");
    for (std::size_t i = 0; i < sequences_.size(); ++i) {
      const std::string what = "sequences[" + std::to_string(i) + "]";
      if (sequences_[i] == nullptr || sequences_[i]->pool_ == nullptr) {
        refuse(what, "a sequence in a pool", sequences_[i] == nullptr ? "null" : "a moved-from sequence");
      }
      if (sequences_[i]->pool_ != sequences_[0]->pool_)
        refuse(what, "a sequence of sequences[0]'s pool", "another pool's");
      for (std::size_t j = 0; j < i; ++j) {
        if (sequences_[j] == sequences_[i])
          refuse(what, "a sequence not listed before", "sequences[" + std::to_string(j) + "]'s");
      }
    }
    pool_ = sequences_[0]->pool_;
    every_row_.resize(sequences_.size());
    std::iota(every_row_.begin(), every_row_.end(), std::size_t{0});
    views_.resize(pool_->layers());
    read_views_.resize(pool_->layers());
  }
  PagedBatch(std::initializer_list<PagedKvCache<T>*> sequences)
      : PagedBatch(std::span<PagedKvCache<T>* const>(sequences.begin(), sequences.size())) {}

  // update(layer, k, v, positions, rows), from RowUpdates: writes k, v [rows, H_kv, T, D] into the
  // listed sequences (each once), with positions per row (or one list, for rows of equal length)
  // continuing each sequence's own length in that layer, and returns the listed sequences'
  // histories, batch row i reading sequence rows[i]. Everything is checked first, the blocks of
  // every sequence counted together: std::out_of_range (layer, a row past the batch),
  // std::invalid_argument (shapes, positions, a repeated row) or std::length_error (capacity,
  // blocks), and nothing changes then.
  using detail::RowUpdates<PagedBatch<T>, T>::update;
  // update(layer, k, v, positions), from ComputeTypeUpdates: every sequence, k's batch row i to
  // sequence i.
  using detail::ComputeTypeUpdates<PagedBatch<T>, T>::update;

  /// Sequences in the batch.
  [[nodiscard]] std::size_t size() const noexcept { return sequences_.size(); }
  /// Sequence `row`; std::out_of_range for a row past the batch.
  [[nodiscard]] PagedKvCache<T>& sequence(std::size_t row) const {
    check_row("PagedBatch::sequence", "row", row);
    return *sequences_[row];
  }
  [[nodiscard]] std::size_t layers() const noexcept { return pool_->layers(); }
  /// The most tokens a sequence may reach.
  [[nodiscard]] std::size_t capacity() const noexcept { return pool_->capacity(); }
  /// Bytes of the blocks the sequences hold, each block once however many hold it.
  [[nodiscard]] std::size_t bytes() const {
    std::vector<std::size_t> held;
    for (const PagedKvCache<T>* s : sequences_) {
      for (const std::size_t b : s->table_)
        if (b != PagedKvCache<T>::kReleased) held.push_back(b);
    }
    std::sort(held.begin(), held.end());
    return static_cast<std::size_t>(std::unique(held.begin(), held.end()) - held.begin()) * pool_->block_bytes();
  }

  /// Tokens the longest sequence holds; std::runtime_error if a sequence's layers disagree.
  [[nodiscard]] std::size_t length() const {
    std::size_t longest = 0;
    for (const PagedKvCache<T>* s : sequences_) longest = std::max(longest, s->length());
    return longest;
  }
  /// Tokens sequence `row` holds in every layer (its length()); std::out_of_range for a bad row.
  [[nodiscard]] std::size_t row_length(std::size_t row) const {
    check_row("PagedBatch::row_length", "row", row);
    return sequences_[row]->length();
  }
  /// Tokens sequence `row` holds in `layer`; std::out_of_range for either out of range.
  [[nodiscard]] std::size_t row_length(std::size_t row, std::size_t layer) const {
    check_row("PagedBatch::row_length", "row", row);
    return sequences_[row]->length(layer);
  }

  /// Sequence `row`'s truncate(length); std::out_of_range for a bad row, or as it throws.
  void truncate(std::size_t row, std::size_t length) {
    check_row("PagedBatch::truncate", "row", row);
    sequences_[row]->truncate(length);
  }
  /// Every sequence keeps at most its first `length` tokens (and a sequence whose layers
  /// disagree, at most those of its shortest layer). std::out_of_range, changing nothing, if no
  /// sequence holds that many in every layer or a windowed one gave back what a query there reads.
  void truncate(std::size_t length) {
    std::size_t held = 0;
    for (const PagedKvCache<T>* s : sequences_) held = std::max(held, shortest(*s));
    if (length > held) {
      throw std::out_of_range(detail::expected_given(
          "PagedBatch::truncate: length", "<= " + std::to_string(held) + " (tokens the longest sequence holds)",
          std::to_string(length)));
    }
    for (const PagedKvCache<T>* s : sequences_)
      s->check_window_truncate("PagedBatch::truncate", std::min(length, shortest(*s)));
    for (PagedKvCache<T>* s : sequences_) s->truncate(std::min(length, shortest(*s)));
  }
  /// Empties every sequence.
  void reset() noexcept {
    for (PagedKvCache<T>* s : sequences_) s->reset();
  }

  /// Every sequence's history in `layer` as update() returns it, without writing: batch row i
  /// reads sequence i. Valid until the next mutating call on that layer of any of them, or the
  /// next history() of it; leaves what update() returned intact. std::out_of_range for a bad layer.
  [[nodiscard]] History<T> history(std::size_t layer) { return history(layer, Rows(every_row_)); }
  /// The listed sequences' histories in `layer`, batch row i reading sequence rows[i], valid as
  /// history(layer)'s; std::out_of_range for a bad layer or row.
  [[nodiscard]] History<T> history(std::size_t layer, Rows rows) {
    if (layer >= layers()) detail::check_layer("PagedBatch::history", layer, layers());
    for (std::size_t i = 0; i < rows.size(); ++i)
      check_row("PagedBatch::history", "rows[" + std::to_string(i) + "]", rows[i]);
    return view(read_views_[layer], layer, rows);
  }

 private:
  friend class detail::ComputeTypeUpdates<PagedBatch<T>, T>;
  friend class detail::RowUpdates<PagedBatch<T>, T>;

  /// What a layer's last history points at: a segment per block index some listed sequence
  /// reads, each listing the block every batch row reads there ([blocks read, rows]).
  struct LayerView {
    std::vector<Segment<T>> segments;
    std::vector<std::size_t> rows, row_tokens;
  };

  template <class What>
  void check_row(const char* call, const What& what, std::size_t row) const {
    if (row >= sequences_.size()) {
      throw std::out_of_range(detail::expected_given(
          std::string(call) + ": " + what, "a row < " + std::to_string(sequences_.size()), std::to_string(row)));
    }
  }

  [[nodiscard]] static std::size_t shortest(const PagedKvCache<T>& s) noexcept {
    std::size_t n = s.layers() == 0 ? 0 : s.length(0);
    for (std::size_t l = 1; l < s.layers(); ++l) n = std::min(n, s.length(l));
    return n;
  }

  template <class In>
  History<T> store(std::size_t layer, const TensorView<const In>& k, const TensorView<const In>& v,
                   const Positions& positions) {
    return store(layer, k, v, positions, Rows(every_row_));
  }

  /// Checks everything (the blocks of every listed sequence counted together), then writes each.
  template <class In>
  History<T> store(std::size_t layer, const TensorView<const In>& k, const TensorView<const In>& v,
                   const Positions& positions, Rows rows) {
    const auto call = [] { return std::string("PagedBatch::update"); };
    if (layer >= layers()) detail::check_layer(call(), layer, layers());
    detail::check_update_shapes(call, pool_->geometry(), rows.size(), k, v, positions);
    std::vector<std::size_t> starts(rows.size());
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const auto what = [&] { return "rows[" + std::to_string(i) + "]"; };
      check_row(call().c_str(), what(), rows[i]);
      for (std::size_t j = 0; j < i; ++j) {
        if (rows[j] == rows[i]) {
          throw std::invalid_argument(
              detail::expected_given(call() + ": " + what(), "a row not listed before",
                                     "sequence " + std::to_string(rows[i]) + ", also rows[" + std::to_string(j) + "]"));
        }
      }
      starts[i] = sequences_[rows[i]]->length(layer);
      const auto row_call = [&] { return call() + ": " + what() + " (sequence " + std::to_string(rows[i]) + ")"; };
      detail::check_continues(row_call, positions.row(i), starts[i], capacity(), [&] {
        return "sequence " + std::to_string(rows[i]) + " in layer " + std::to_string(layer);
      });
    }
    typename BlockPool<T>::Counts counts(*pool_);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      sequences_[rows[i]]->check_blocks(layer, starts[i], k.tokens(), counts, [&] {
        return call() + ": rows[" + std::to_string(i) + "] (sequence " + std::to_string(rows[i]) + ") layer " +
               std::to_string(layer) + ": blocks";
      });
    }
    pool_->template check_values<T>(pool_->name(), layer, k, v);
    std::size_t clipped = 0;
    for (std::size_t i = 0; i < rows.size(); ++i) clipped += sequences_[rows[i]]->write(layer, k, v, i, starts[i]);
    pool_->count_clipped(layer, clipped);
    return view(views_[layer], layer, rows);
  }

  /// The history of the listed sequences in `layer`: one segment per block index some of them
  /// read, over the pool's layer seen as [blocks, H_kv, block_tokens] rows, each batch row
  /// reading its own block there (and none where it reads nothing).
  History<T> view(LayerView& lv, std::size_t layer, Rows rows) {
    if (rows.empty()) return {};  // no batch row (an empty list of rows would read them all)
    const std::size_t n = rows.size(), b = pool_->block_tokens();
    std::size_t blocks = 0;
    for (const std::size_t r : rows) blocks = std::max(blocks, (sequences_[r]->length(layer) + b - 1) / b);
    lv.rows.assign(blocks * n, 0);
    lv.row_tokens.assign(blocks * n, 0);
    for (std::size_t i = 0; i < n; ++i) {
      const PagedKvCache<T>& s = *sequences_[rows[i]];
      const std::size_t end = s.length(layer);
      for (std::size_t j = 0; j * b < end; ++j) {
        if (!s.reads(layer, j)) continue;
        lv.rows[j * n + i] = s.table_[j];
        lv.row_tokens[j * n + i] = std::min(b, end - j * b);
      }
    }
    const Segment<T> every_block =
        pool_->rows_[layer].block_segment(b, Positions(pool_->positions_.data(), b, b), pool_->head_scale_view(layer));
    lv.segments.clear();
    for (std::size_t j = 0; j < blocks; ++j) {
      const std::span<const std::size_t> tokens = std::span<const std::size_t>(lv.row_tokens).subspan(j * n, n);
      if (std::all_of(tokens.begin(), tokens.end(), [](std::size_t t) { return t == 0; })) continue;
      Segment<T> s = every_block;
      s.rows = std::span<const std::size_t>(lv.rows).subspan(j * n, n);
      s.row_tokens = tokens;
      lv.segments.push_back(s);
    }
    return {std::span<const Segment<T>>(lv.segments), pool_->window(), pool_->sinks()};
  }

  std::vector<PagedKvCache<T>*> sequences_;
  BlockPool<T>* pool_ = nullptr;
  std::vector<std::size_t> every_row_;  // 0, 1, ..., size - 1
  std::vector<LayerView> views_;        // per layer, what the last update returned
  std::vector<LayerView> read_views_;   // per layer, what the last history() returned
};

static_assert(row_cache_protocol<PagedBatch<float>>);

}  // namespace KVCACHE_ABI
}  // namespace kvcache
