// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcache/codec.hpp"
#include "kvcache/concepts.hpp"
#include "kvcache/config.hpp"
#include "kvcache/detail/cache_base.hpp"
#include "kvcache/detail/checks.hpp"
#include "kvcache/detail/row_store.hpp"
#include "kvcache/version.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// A cache for continuous batching: `batch` slots, each a row with a length of its own, so a
/// server admits a request into a free slot while others are mid-generation, and a finished
/// one's slot is reused. Each slot holds up to `capacity` tokens, preallocated like KvCache,
/// in any storage format; nothing is padded, stored or attended beyond a row's own length.
///
/// An update writes the listed rows, each continuing its own length. Rows that advance by
/// different counts in one forward pass (one prefilling a chunk while others decode a token)
/// are separate updates of the same layer, one per group of equal counts, each followed by its
/// attention call: the returned history holds the listed rows only, in the order listed.
///
///   kvcache::SlotKvCache<float> cache({.layers = 28, .batch = 8, .kv_heads = 8, .head_dim = 128, .capacity = 4096});
///   std::size_t row = cache.acquire();                               // admit a request
///   auto history = cache.update(layer, k, v, positions, rows);       // k [rows, H_kv, T, D]
///   kvcache::causal_attention(q, positions, history, out);           // q [rows, H_q, T, D]
///   cache.release(row);                                              // it finished
///
/// What a slot stores depends on its own sequence alone, in every format: a scale is per row,
/// or (fp8_e4m3_heads) a static one per head that the config gives.
///
/// With a `window` (and `sinks`, `slack`, as RingKvCache's), each slot keeps the last `window`
/// positions of its sequence, its first `sinks` and `slack` more in a ring of sinks + window +
/// slack rows, so memory is bounded however long a sequence runs (`capacity` then bounds its
/// tokens, 0 for none). A chunk that wraps a slot's ring may be at most slack + 1 tokens: size
/// `slack` for the largest chunk.
template <class T>
class SlotKvCache : public detail::CacheGeometry,
                    public detail::HeadScales,
                    public detail::ComputeTypeUpdates<SlotKvCache<T>, T>,
                    public detail::RowUpdates<SlotKvCache<T>, T> {
  static_assert(detail::check_codec<T>(), "SlotKvCache<T>: T must be a storage format (a type with a storage_codec).");

 public:
  using value_type = T;

  /// Allocates `batch` slots of `capacity` tokens (sinks + window + slack with a window) in every
  /// layer, all free; throws std::invalid_argument for a zero size, or sinks or slack without a
  /// window, std::length_error for a size whose bytes overflow std::size_t.
  explicit SlotKvCache(const KvCacheConfig& config)
      : CacheGeometry("SlotKvCache", check_config(config)),
        HeadScales(layers()),
        window_(config.window),
        sinks_(config.sinks),
        ring_(config.window + config.slack),
        rows_per_slot_(detail::check_footprint("SlotKvCache", geometry(),
                                               window_ == 0 ? std::size_t{config.capacity} : sinks_ + ring_,
                                               sizeof(typename storage_codec<T>::unit))),
        capacity_(window_ != 0 && config.capacity == 0 ? std::numeric_limits<std::size_t>::max()
                                                       : std::size_t{config.capacity}),
        positions_(window_ == 0 ? rows_per_slot_ : 0),
        every_row_(batch()),
        lengths_(layers() * batch(), 0),
        acquired_(batch()),
        views_(layers()),
        read_views_(layers()) {
    std::iota(positions_.begin(), positions_.end(), std::int64_t{0});
    std::iota(every_row_.begin(), every_row_.end(), std::size_t{0});
    std::fill(acquired_.begin(), acquired_.end(), 0);
    init_scales<T>(name(), geometry(), config);
    rows_.reserve(layers());
    for (std::size_t l = 0; l < layers(); ++l) rows_.emplace_back(batch(), kv_heads(), head_dim(), rows_per_slot_);
    if (window_ != 0) {
      ring_positions_.assign(layers(), std::vector<std::int64_t>(batch() * rows_per_slot_, -1));
      oldest_.assign(layers() * batch(), 0);
    }
    for (LayerView& lv : views_) {  // so that an update's view never allocates after writing
      lv.rows.reserve(batch());
      lv.row_tokens.reserve(batch());
    }
  }

  /// Admits a sequence: the lowest free slot, empty in every layer. std::length_error if every
  /// slot is in use.
  [[nodiscard]] std::size_t acquire() {
    const auto free = std::find(acquired_.begin(), acquired_.end(), 0);
    if (free == acquired_.end()) {
      throw std::length_error(detail::expected_given("SlotKvCache::acquire", "a free slot",
                                                     "all " + std::to_string(batch()) + " slots in use"));
    }
    *free = 1;
    return static_cast<std::size_t>(free - acquired_.begin());
  }

  /// Finishes the sequence in `row`: forgets its tokens in every layer and frees the slot, whose
  /// memory stays resident for the next sequence (shrink_to_fit() gives it back).
  /// std::out_of_range for a row past the slots, std::invalid_argument for a free one.
  void release(std::size_t row) {
    check_acquired("SlotKvCache::release", "row", row);
    for (std::size_t l = 0; l < layers(); ++l) empty_slot(l, row);
    acquired_[row] = 0;
  }

  /// Whether `row` holds a sequence; std::out_of_range for a row past the slots.
  [[nodiscard]] bool acquired(std::size_t row) const {
    check_row("SlotKvCache::acquired", "row", row);
    return in_use(row);
  }
  [[nodiscard]] std::size_t slots() const noexcept { return acquired_.size(); }
  [[nodiscard]] std::size_t free_slots() const noexcept {
    return static_cast<std::size_t>(std::count(acquired_.begin(), acquired_.end(), 0));
  }

  // update(layer, k, v, positions, rows), from RowUpdates: writes k, v [rows, H_kv, T, D] in any
  // compute type the format accepts into the listed rows (acquired, distinct), with positions
  // per row (or one list, for rows of equal length) continuing each row's own length in that
  // layer. Returns the listed rows' whole histories, batch row i reading rows[i]. Throws
  // std::out_of_range (layer, a row past the slots), std::invalid_argument (shapes, positions,
  // a free or repeated row) or std::length_error (a row's capacity); the cache is unchanged then.
  using detail::RowUpdates<SlotKvCache<T>, T>::update;
  // update(layer, k, v, positions), from ComputeTypeUpdates: the protocol's form, for slots
  // used as one batch: writes every slot (k's batch is the slot count), admitting free ones.
  using detail::ComputeTypeUpdates<SlotKvCache<T>, T>::update;

  /// Tokens the longest row holds; std::runtime_error if a row's layers disagree.
  [[nodiscard]] std::size_t length() const {
    std::size_t longest = 0;
    for (std::size_t row = 0; row < slots(); ++row) longest = std::max(longest, row_length(row));
    return longest;
  }
  /// Tokens `row` holds in every layer; std::out_of_range for a row past the slots,
  /// std::runtime_error naming the layers if they disagree (a forward pass stopped part-way).
  [[nodiscard]] std::size_t row_length(std::size_t row) const {
    check_row("SlotKvCache::row_length", "row", row);
    const std::size_t first = layers() == 0 ? 0 : lengths_[at(0, row)];
    for (std::size_t l = 1; l < layers(); ++l) {
      if (lengths_[at(l, row)] != first) {
        throw std::runtime_error("SlotKvCache::row_length: row " + std::to_string(row) +
                                 ": layers disagree (a forward pass stopped part-way): expected every layer to hold "
                                 "the same number of tokens, given " +
                                 detail::describe_layer_lengths(layer_lengths(row)) +
                                 "; truncate(row, n) or release(row) repairs it");
      }
    }
    return first;
  }
  /// Tokens `row` holds in `layer`; std::out_of_range for either out of range.
  [[nodiscard]] std::size_t row_length(std::size_t row, std::size_t layer) const {
    check_row("SlotKvCache::row_length", "row", row);
    if (layer >= layers()) detail::check_layer("SlotKvCache::row_length", layer, layers());
    return lengths_[at(layer, row)];
  }

  /// The most tokens a row may hold.
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  /// The window each row attends (0: none) and the positions it keeps visible through it.
  [[nodiscard]] std::size_t window() const noexcept { return window_; }
  [[nodiscard]] std::size_t sinks() const noexcept { return sinks_; }
  /// Rows each slot stores in a layer: capacity, or sinks + window + slack with a window.
  [[nodiscard]] std::size_t rows_per_slot() const noexcept { return rows_per_slot_; }
  /// Bytes allocated for K and V of every slot (and their scales, for formats that have them).
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t total = scale_bytes();
    for (const auto& r : rows_) total += r.bytes();
    return total;
  }

  /// Forgets everything after `row`'s first `length` tokens in every layer, copying nothing
  /// (rollback; repairs a part-way pass). std::out_of_range for a bad row, a layer holding fewer,
  /// or, with a window, a layer that no longer holds what a query at `length` reads (`slack`
  /// keeps that for rollbacks that short).
  void truncate(std::size_t row, std::size_t length) {
    check_row("SlotKvCache::truncate", "row", row);
    const std::size_t held = min_over_layers(row);
    if (length > held) {
      throw std::out_of_range(detail::expected_given("SlotKvCache::truncate: row " + std::to_string(row) + " length",
                                                     "<= " + std::to_string(held) + " (tokens the row holds)",
                                                     std::to_string(length)));
    }
    check_window_truncate(row, length);
    for (std::size_t l = 0; l < layers(); ++l) cut(l, row, length);
  }
  /// Every row keeps at most its first `length` tokens. std::out_of_range if no row holds that
  /// many in every layer (what the protocol's truncate refuses on the other variants).
  void truncate(std::size_t length) {
    std::size_t held = 0;
    for (std::size_t row = 0; row < slots(); ++row) held = std::max(held, min_over_layers(row));
    if (length > held) {
      throw std::out_of_range(detail::expected_given("SlotKvCache::truncate: length",
                                                     "<= " + std::to_string(held) + " (tokens the longest row holds)",
                                                     std::to_string(length)));
    }
    for (std::size_t row = 0; row < slots(); ++row) check_window_truncate(row, std::min(length, min_over_layers(row)));
    for (std::size_t l = 0; l < layers(); ++l) {
      for (std::size_t row = 0; row < slots(); ++row) cut(l, row, std::min(lengths_[at(l, row)], length));
    }
  }
  /// Empties and frees every slot, as constructed (head scales given in the config are kept).
  void reset() noexcept {
    for (std::size_t l = 0; l < layers(); ++l)
      for (std::size_t row = 0; row < slots(); ++row) empty_slot(l, row);
    std::fill(acquired_.begin(), acquired_.end(), 0);
  }

  /// Gives the memory of every free slot, and of each held slot's positions past its length,
  /// back to the system (whole pages; Linux): what released slots held stops being resident
  /// until a sequence admitted there writes it again. Addresses and bytes() stay the same.
  void shrink_to_fit() noexcept {
    for (std::size_t l = 0; l < layers(); ++l) {
      for (std::size_t row = 0; row < slots(); ++row) {
        const std::size_t held = lengths_[at(l, row)];
        rows_[l].release(held, capacity_ - held, row);
      }
    }
  }

  /// Every slot's history in `layer` as update() returns it, without writing: batch row b reads
  /// slot b (a free slot, nothing). Valid until the next mutating call on that layer or the next
  /// history() of it; leaves what update() returned intact.
  [[nodiscard]] History<T> history(std::size_t layer) { return history(layer, Rows(every_row_)); }
  /// The listed rows' histories in `layer`, batch row i reading rows[i], valid as history(layer)'s;
  /// std::out_of_range for a bad layer or row.
  [[nodiscard]] History<T> history(std::size_t layer, const RowsArg& listed) {
    const Rows& rows = listed.view();
    if (layer >= layers()) detail::check_layer("SlotKvCache::history", layer, layers());
    for (std::size_t i = 0; i < rows.size(); ++i)
      check_row("SlotKvCache::history", "rows[" + std::to_string(i) + "]", rows[i]);
    return view(read_views_[layer], layer, rows);
  }

 private:
  friend class detail::ComputeTypeUpdates<SlotKvCache<T>, T>;
  friend class detail::RowUpdates<SlotKvCache<T>, T>;

  /// What a layer's last history points at: the rows it reads and how many keys each.
  struct LayerView {
    Segment<T> segment;
    std::vector<std::size_t> rows;
    std::vector<std::size_t> row_tokens;
  };

  [[nodiscard]] std::size_t at(std::size_t layer, std::size_t row) const noexcept { return layer * slots() + row; }

  static detail::Geometry check_config(const KvCacheConfig& c) {
    if (c.window == 0 && (c.sinks != 0 || c.slack != 0)) {
      throw std::invalid_argument("SlotKvCache: config.sinks/slack: expected 0 without a window, given " +
                                  std::to_string(c.sinks) + "/" + std::to_string(c.slack));
    }
    if (c.window == 0) return detail::check_dense_config("SlotKvCache", c);
    const detail::Geometry g = detail::check_config("SlotKvCache", c);
    constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
    if (c.slack > max - c.window || c.sinks > max - c.window - c.slack) {
      throw std::length_error("SlotKvCache: config.sinks + window + slack: expected to fit in std::size_t, given " +
                              std::to_string(c.sinks) + " + " + std::to_string(c.window) + " + " +
                              std::to_string(c.slack));
    }
    return g;
  }

  /// The row of a slot that holds `position`, with a window (the sinks', then a ring).
  [[nodiscard]] std::size_t ring_row(std::size_t position) const noexcept {
    return position < sinks_ ? position : sinks_ + (position - sinks_) % ring_;
  }
  /// The position each stored row of `row` holds in `layer` (-1: none), with a window.
  [[nodiscard]] std::int64_t* ring_positions(std::size_t layer, std::size_t row) noexcept {
    return ring_positions_[layer].data() + row * rows_per_slot_;
  }

  /// Empties `row` in `layer`.
  void empty_slot(std::size_t layer, std::size_t row) noexcept {
    lengths_[at(layer, row)] = 0;
    if (window_ == 0) return;
    oldest_[at(layer, row)] = 0;
    std::fill_n(ring_positions(layer, row), rows_per_slot_, std::int64_t{-1});
  }
  /// Cuts `row` to `length` tokens in `layer` (checked); with a window, the rows that held later
  /// positions hold none, so that no query reads them before they are written again.
  void cut(std::size_t layer, std::size_t row, std::size_t length) noexcept {
    lengths_[at(layer, row)] = length;
    if (window_ == 0) return;
    std::int64_t* p = ring_positions(layer, row);
    for (std::size_t i = 0; i < rows_per_slot_; ++i)
      if (p[i] >= static_cast<std::int64_t>(length)) p[i] = -1;
    oldest_[at(layer, row)] = std::min(oldest_[at(layer, row)], length);
  }
  /// std::out_of_range unless every layer of `row` still holds what a query at `length` reads
  /// (the positions the ring has not overwritten), as RingKvCache::truncate.
  void check_window_truncate(std::size_t row, std::size_t length) const {
    if (window_ == 0) return;
    for (std::size_t l = 0; l < layers(); ++l) {
      const std::size_t held_from = std::max(sinks_, oldest_[at(l, row)]);
      const std::size_t needed_from = std::max(sinks_, length + 1 > window_ ? length + 1 - window_ : 0);
      if (needed_from < length && held_from > needed_from) {
        throw std::out_of_range(detail::expected_given(
            "SlotKvCache::truncate: row " + std::to_string(row) + " length",
            ">= " + std::to_string(held_from + window_ - 1) + " or <= " + std::to_string(sinks_) + " (layer " +
                std::to_string(l) + " holds positions from " + std::to_string(held_from) + " on; a query reads the " +
                std::to_string(window_) + " positions up to itself)",
            std::to_string(length)));
      }
    }
  }

  template <class What>
  void check_row(const char* call, const What& what, std::size_t row) const {
    if (row >= slots()) {
      throw std::out_of_range(detail::expected_given(std::string(call) + ": " + what,
                                                     "a slot < " + std::to_string(slots()), std::to_string(row)));
    }
  }
  template <class What>
  void check_acquired(const char* call, const What& what, std::size_t row) const {
    check_row(call, what, row);
    if (!in_use(row)) {
      throw std::invalid_argument(detail::expected_given(std::string(call) + ": " + what,
                                                         "an acquired slot (acquire() admits one)",
                                                         "slot " + std::to_string(row) + ", which is free"));
    }
  }

  [[nodiscard]] bool in_use(std::size_t row) const noexcept { return acquired_[row] != 0; }

  friend struct detail::StateAccess;

  // State files (state_file.hpp): SLOT holds which slots are acquired and the tokens of each
  // (layer, slot) (BASE's per-layer lengths stay 0); ROWS[l] every slot's rows up to the
  // layer's longest. With a window, SWIN[l] before ROWS[l]: each slot's oldest position not
  // overwritten and the position each of its rows holds.
  template <class Settings>
  void state_settings(Settings& settings) const {
    settings.may_differ("capacity", capacity_ == std::numeric_limits<std::size_t>::max() ? 0 : capacity_);
    settings.must_match("window", window_);
    settings.must_match("sinks", sinks_);
    settings.must_match("slack", ring_ - window_);
  }
  /// The rows a state file holds of `layer`: every slot's, up to the longest slot's tokens.
  [[nodiscard]] std::size_t saved_rows(std::span<const std::size_t> lengths, std::size_t layer) const noexcept {
    return std::min(longest(lengths.subspan(layer * slots(), slots())), rows_per_slot_);
  }
  /// SWIN[l] as loaded: std::runtime_error unless every slot's rows hold what its history reads.
  template <class Fields>
  void check_ring(Fields& fields, std::size_t layer, std::span<const std::size_t> lengths,
                  std::span<const std::size_t> oldest, std::span<const std::int64_t> positions) const {
    for (std::size_t row = 0; row < slots(); ++row) {
      const std::size_t n = lengths[at(layer, row)], from = oldest[row];
      const std::int64_t* held = positions.data() + row * rows_per_slot_;
      const std::string slot = "slot " + std::to_string(row) + " ";
      fields.require(from <= n, (slot + "oldest").c_str(), "<= its tokens " + std::to_string(n), std::to_string(from));
      for (std::size_t i = 0; i < rows_per_slot_; ++i) {
        const std::int64_t p = held[i];
        const bool none = p == -1,
                   own = p >= 0 && static_cast<std::size_t>(p) < n && ring_row(static_cast<std::size_t>(p)) == i;
        fields.require(none || own, (slot + "positions").c_str(),
                       "-1 or a position below its tokens that row " + std::to_string(i) + " holds", std::to_string(p));
        // A row read with no position is one no query from n on sees: before every window.
        fields.require(!none || i >= n || n >= window_, (slot + "positions").c_str(),
                       "a position in row " + std::to_string(i) + ", which a history reads", "-1");
      }
      const std::size_t held_from = std::max(sinks_, from);
      fields.require(n <= held_from || n - held_from <= ring_, (slot + "oldest").c_str(),
                     ">= its tokens - " + std::to_string(ring_) + " (the rows after the sinks)", std::to_string(from));
      const auto expect_held = [&](std::size_t p) {
        fields.require(held[ring_row(p)] == static_cast<std::int64_t>(p), (slot + "positions").c_str(),
                       std::to_string(p) + " in row " + std::to_string(ring_row(p)) + ", which a history reads",
                       std::to_string(held[ring_row(p)]));
      };
      for (std::size_t p = 0; p < std::min(sinks_, n); ++p) expect_held(p);
      for (std::size_t p = held_from; p < n; ++p) expect_held(p);
    }
  }
  [[nodiscard]] static std::size_t longest(std::span<const std::size_t> layer_lengths) noexcept {
    return layer_lengths.empty() ? 0 : *std::max_element(layer_lengths.begin(), layer_lengths.end());
  }
  template <class Out>
  void save_sections(Out& out) const {
    out.section("SLOT", [&](auto& fields) {
      for (std::size_t row = 0; row < slots(); ++row) fields.u8(in_use(row));
      for (const std::size_t n : lengths_) fields.u64(n);
    });
    for (std::size_t l = 0; l < layers(); ++l) {
      if (window_ != 0) {
        out.section("SWIN", l, [&](auto& fields) {
          for (std::size_t row = 0; row < slots(); ++row) fields.u64(oldest_[at(l, row)]);
          fields.i64s(ring_positions_[l]);
        });
      }
      out.rows("ROWS", l, rows_[l], 0, saved_rows(lengths_, l));
    }
  }
  template <class In>
  auto load_sections(In& in) {
    auto fields = in.section("SLOT", slots() + 8 * lengths_.size());
    std::vector<unsigned char> acquired(slots());
    for (unsigned char& a : acquired) a = fields.u8("acquired") ? 1 : 0;
    std::vector<std::size_t> lengths(lengths_.size());
    for (std::size_t& n : lengths) n = fields.u64("length");
    fields.finish();
    for (std::size_t l = 0; l < in.lengths().size(); ++l) {
      const std::string where = "BASE's layer " + std::to_string(l) + " tokens";
      fields.require(in.lengths()[l] == 0, where.c_str(), "0 (a slot cache's tokens are its slots', held here)",
                     std::to_string(in.lengths()[l]));
    }
    for (std::size_t l = 0; l < layers(); ++l) {
      for (std::size_t row = 0; row < slots(); ++row) {
        const std::size_t n = lengths[at(l, row)];
        const std::string where = "layer " + std::to_string(l) + " slot " + std::to_string(row) + " tokens";
        fields.require(acquired[row] != 0 || n == 0, where.c_str(), "0 (the slot is free)", std::to_string(n));
        if (n > capacity_) {
          throw std::invalid_argument("kvcache::load_state: the file's " + where +
                                      ": expected <= " + std::to_string(capacity_) +
                                      " (the capacity of the cache loaded into), found " + std::to_string(n));
        }
      }
    }
    // BASE says no layer holds tokens: this cache's rows are read before they are overwritten
    // if any slot holds some.
    if (std::any_of(lengths_.begin(), lengths_.end(), [](std::size_t n) { return n != 0; })) in.verify_first();
    std::vector<std::size_t> oldest(window_ != 0 ? lengths.size() : 0);
    std::vector<std::vector<std::int64_t>> positions;
    for (std::size_t l = 0; l < layers(); ++l) {
      if (window_ != 0) {
        auto ring = in.section("SWIN", l, 8 * slots() * (1 + rows_per_slot_));
        for (std::size_t row = 0; row < slots(); ++row) oldest[at(l, row)] = ring.u64("oldest");
        positions.push_back(ring.i64s("positions", slots() * rows_per_slot_));
        ring.finish();
        check_ring(ring, l, lengths, std::span<const std::size_t>(oldest).subspan(l * slots(), slots()),
                   positions.back());
      }
      in.rows("ROWS", l, rows_[l], 0, saved_rows(lengths, l));
    }
    return [this, acquired = std::move(acquired), lengths = std::move(lengths), oldest = std::move(oldest),
            positions = std::move(positions)]() mutable noexcept {
      lengths_ = std::move(lengths);
      for (std::size_t row = 0; row < acquired.size(); ++row) acquired_[row] = acquired[row];
      if (window_ != 0) {
        oldest_ = std::move(oldest);
        ring_positions_ = std::move(positions);
      }
    };
  }

  [[nodiscard]] std::vector<std::size_t> layer_lengths(std::size_t row) const {
    std::vector<std::size_t> held(layers());
    for (std::size_t l = 0; l < layers(); ++l) held[l] = lengths_[at(l, row)];
    return held;
  }
  [[nodiscard]] std::size_t min_over_layers(std::size_t row) const noexcept {
    std::size_t held = layers() == 0 ? 0 : lengths_[at(0, row)];
    for (std::size_t l = 1; l < layers(); ++l) held = std::min(held, lengths_[at(l, row)]);
    return held;
  }

  template <class In>
  History<T> store(std::size_t layer, const TensorView<const In>& k, const TensorView<const In>& v,
                   const Positions& positions) {
    return write(layer, k, v, positions, Rows(every_row_), true);
  }
  template <class In>
  History<T> store(std::size_t layer, const TensorView<const In>& k, const TensorView<const In>& v,
                   const Positions& positions, Rows rows) {
    return write(layer, k, v, positions, rows, false);
  }

  /// Validates everything, then writes each listed row at its own length. `admit`: free rows
  /// are acquired (the protocol's form) rather than refused.
  template <class In>
  History<T> write(std::size_t layer, const TensorView<const In>& k, const TensorView<const In>& v,
                   const Positions& positions, Rows rows, bool admit) {
    const auto call = [] { return std::string("SlotKvCache::update"); };
    if (layer >= layers()) detail::check_layer(call(), layer, layers());
    detail::check_update_shapes(call, geometry(), rows.size(), k, v, positions);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const auto what = [&] { return "rows[" + std::to_string(i) + "]"; };
      if (rows[i] >= slots() || (!admit && !in_use(rows[i]))) {
        admit ? check_row(call().c_str(), what(), rows[i]) : check_acquired(call().c_str(), what(), rows[i]);
      }
      for (std::size_t j = 0; j < i; ++j) {
        if (rows[j] == rows[i]) {
          throw std::invalid_argument(
              detail::expected_given(call() + ": " + what(), "a slot not listed before",
                                     "slot " + std::to_string(rows[i]) + ", also rows[" + std::to_string(j) + "]"));
        }
      }
      const auto row_call = [&] { return call() + ": " + what() + " (slot " + std::to_string(rows[i]) + ")"; };
      const std::size_t length = lengths_[at(layer, rows[i])];
      detail::check_continues(row_call, positions.row(i), length, capacity_,
                              [&] { return "slot " + std::to_string(rows[i]) + " in layer " + std::to_string(layer); });
      // Writing position p overwrites p - ring: a chunk's first query still reads that if the
      // chunk is longer than slack + 1 and reaches past the ring.
      const std::size_t tokens = k.tokens();
      if (window_ != 0 && tokens > ring_ - window_ + 1 && length + tokens > sinks_ + ring_) {
        throw std::length_error(detail::expected_given(
            row_call() + ": tokens of a chunk that wraps the window",
            "at most slack + 1 = " + std::to_string(ring_ - window_ + 1) + " (config.slack sizes the largest chunk)",
            std::to_string(tokens)));
      }
    }
    check_values<T>(name(), layer, k, v);

    std::size_t clipped = 0;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const std::size_t row = rows[i];
      if (admit && !in_use(row)) acquired_[row] = 1;
      const TensorView<const In> k_row(k.row(i, 0, 0), {1, k.heads(), k.tokens(), k.head_dim()}, k.strides());
      const TensorView<const In> v_row(v.row(i, 0, 0), {1, v.heads(), v.tokens(), v.head_dim()}, v.strides());
      std::size_t& length = lengths_[at(layer, row)];
      if (window_ == 0) {
        clipped += rows_[layer].encode(k_row, v_row, 0, k.tokens(), length, head_scale_view(layer),
                                       std::span<const std::size_t>(rows.data() + i, 1));
      } else {
        clipped += write_ring(layer, row, k_row, v_row, length, head_scale_view(layer));
      }
      length += k.tokens();
    }
    count_clipped(layer, clipped);
    return view(views_[layer], layer, rows);
  }

  /// Writes a row's chunk k, v [1, H_kv, T, D] from position `first` into its ring, skipping the
  /// positions later ones of the chunk overwrite; returns the values that saturated.
  template <class In>
  std::size_t write_ring(std::size_t layer, std::size_t row, const TensorView<const In>& k,
                         const TensorView<const In>& v, std::size_t first, detail::HeadScaleView scales) noexcept {
    const std::size_t end = first + k.tokens();
    std::int64_t* held = ring_positions(layer, row);
    std::size_t clipped = 0;
    const auto store_run = [&](std::size_t from, std::size_t to) {  // rows that abut
      const std::size_t slot = ring_row(from);
      clipped +=
          rows_[layer].encode(k, v, from - first, to - from, slot, scales, std::span<const std::size_t>(&row, 1));
      for (std::size_t p = from; p < to; ++p) held[slot + p - from] = static_cast<std::int64_t>(p);
    };
    if (first < sinks_) store_run(first, std::min(end, sinks_));
    for (std::size_t from = std::max({first, sinks_, end > ring_ ? end - ring_ : 0}); from < end;) {
      const std::size_t to = std::min(end, from + (sinks_ + ring_ - ring_row(from)));
      store_run(from, to);
      from = to;
    }
    if (end > ring_) oldest_[at(layer, row)] = std::max(oldest_[at(layer, row)], end - ring_);
    return clipped;
  }

  /// The history of `rows` in `layer`: one segment over the layer's slots, each batch row
  /// reading its slot's first keys (with a window, the rows of its ring that hold a position;
  /// attention applies the window).
  History<T> view(LayerView& lv, std::size_t layer, Rows rows) {
    if (rows.empty()) return {};  // no batch row (an empty list of rows would read them all)
    lv.rows.assign(rows.begin(), rows.end());
    lv.row_tokens.resize(rows.size());
    std::size_t longest = 0;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      lv.row_tokens[i] = std::min(lengths_[at(layer, rows[i])], rows_per_slot_);
      longest = std::max(longest, lv.row_tokens[i]);
    }
    const Positions positions = window_ == 0 ? Positions(positions_.data(), longest)
                                             : Positions(ring_positions_[layer].data(), longest, rows_per_slot_);
    lv.segment = rows_[layer].segment(0, longest, positions, head_scale_view(layer));
    lv.segment.rows = lv.rows;
    lv.segment.row_tokens = lv.row_tokens;
    return {std::span<const Segment<T>>(&lv.segment, 1), window_, sinks_};
  }

  std::size_t window_, sinks_, ring_;  // ring_: window + slack
  std::size_t rows_per_slot_;
  std::size_t capacity_;
  std::vector<detail::RowStore<T>> rows_;  // per layer, [slots, H_kv, rows_per_slot, D]
  std::vector<std::int64_t> positions_;    // 0, 1, ..., rows_per_slot - 1: every row's key positions (no window)
  // With a window, per layer [slots, rows_per_slot]: the position each stored row holds (-1:
  // none); and per [layer, slot] no position >= max(sinks, oldest) below its length is overwritten.
  std::vector<std::vector<std::int64_t>> ring_positions_;
  std::vector<std::size_t> oldest_;
  std::vector<std::size_t> every_row_;  // 0, 1, ..., slots - 1
  std::vector<std::size_t> lengths_;    // [layer, slot]
  // Per slot. Atomic: the protocol's update admits free slots, and updates of distinct layers
  // may run on different threads.
  std::vector<std::atomic<unsigned char>> acquired_;
  std::vector<LayerView> views_;  // per layer, what the last update returned
  // Per layer, what the last history() returned: a read leaves the last update's view intact.
  std::vector<LayerView> read_views_;
};

static_assert(row_cache_protocol<SlotKvCache<float>>);

}  // namespace KVCACHE_ABI
}  // namespace kvcache
