// SPDX-License-Identifier: Apache-2.0
// cache_fuzz's harness for SlotKvCache: slots acquired, written by lists of rows (each from its
// own length) or all at once, truncated by row or together, released and reset, with or without
// a window (half the inputs); bad calls must throw the documented type and change nothing. After
// each operation every slot's history, read by layer and by row, is checked against what each
// position was given, and attention over scattered rows against the reference model.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "harness.hpp"
#include "kvcache/slot_kv_cache.hpp"

namespace kvcache::fuzz {
namespace {

template <class T>
class SlotHarness : public Harness<SlotHarness<T>, T> {
  using Base = Harness<SlotHarness<T>, T>;
  using Base::format_;
  using Base::rule_;
  using Base::s_;
  using Base::taken;
  using Base::unchanged;
  using Base::window_from;
  using typename Base::In;

 public:
  explicit SlotHarness(const Setup& s)
      : Base(s, s.windowed ? WindowRule{s.window, s.sinks} : WindowRule{}),
        cache_(config()),
        ref_(s.layers, std::vector<Stream<T>>(s.slots)),
        acquired_(s.slots, 0),
        furthest_(s.layers, std::vector<std::size_t>(s.slots, 0)),
        held_(s.layers, std::vector<std::vector<char>>(s.slots)) {}

  void step(Bytes& in, Snapshot& last) {
    const std::uint8_t kind = in.byte();
    switch (kind % 12) {
      case 0:
      case 1: {  // rows through every layer, maybe stopped part-way
        const std::vector<std::size_t> rows = pick_rows(in);
        const std::size_t tokens = chunk_tokens(in);
        const std::size_t stop = in.one_in(5) ? in.pick(1, s_.layers) : s_.layers;
        for (std::size_t layer = 0; layer < stop; ++layer)
          if (!update(in, layer, rows, tokens)) break;
        break;
      }
      case 2: {
        const std::vector<std::size_t> rows = pick_rows(in);
        update(in, in.pick(0, s_.layers - 1), rows, chunk_tokens(in));
        break;
      }
      case 3:
        acquire(last);
        break;
      case 4:
        release(in, last);
        break;
      case 5:
        truncate_row(in, last);
        break;
      case 6:
        truncate(in, last);
        break;
      case 7:
        if (kind / 12 % 3 == 0) {
          g_context = "SlotKvCache reset";
          cache_.reset();
          for (auto& layer : ref_)
            for (auto& stream : layer) stream.clear();
          std::fill(acquired_.begin(), acquired_.end(), 0);
          for (auto& layer : furthest_) std::fill(layer.begin(), layer.end(), 0);
        } else {
          read_attention(in);
        }
        break;
      case 8:
        every_slot(in, last);
        break;
      default:
        bad_call(in, last);
    }
  }

 private:
  [[nodiscard]] KvCacheConfig config() const {
    KvCacheConfig c{.layers = s_.layers,
                    .batch = s_.slots,
                    .kv_heads = s_.kv_heads,
                    .head_dim = s_.head_dim,
                    .capacity = s_.capacity};
    if (s_.windowed) {
      c.window = s_.window;
      c.sinks = s_.sinks;
      c.slack = s_.slack;
    }
    c.key_scales = format_.config_keys();
    c.value_scales = format_.config_values();
    return c;
  }
  /// Whether a chunk of `tokens` from `length` wraps a windowed slot's ring further than its
  /// slack lets it (std::length_error).
  [[nodiscard]] bool wraps(std::size_t length, std::size_t tokens) const {
    return s_.windowed && tokens > s_.slack + 1 && length + tokens > s_.sinks + s_.window + s_.slack;
  }
  /// A history of a row holding `ref`: every position a query from `from` on reads, and (with a
  /// window) no more than the ring holds.
  void check_held(const std::vector<char>& present, const Stream<T>& ref, std::size_t from, const char* what,
                  std::size_t layer) const {
    if (!s_.windowed) {
      CACHE_FUZZ_REQUIRE(std::count(present.begin(), present.end(), 1) == static_cast<std::ptrdiff_t>(ref.size()),
                         std::string(what) + ": positions missing");
      return;
    }
    check_required(present, window_from(from), ref.size(), rule_.sinks, what, layer);
    CACHE_FUZZ_REQUIRE(
        static_cast<std::size_t>(std::count(present.begin(), present.end(), 1)) <= s_.sinks + s_.window + s_.slack,
        std::string(what) + ": more positions than the ring holds");
  }
  /// Whether row `row` must take truncate(n) (a window: while each layer holds what a query at n
  /// reads, or n is at most slack + 1 short of the furthest it reached); it may anyway.
  [[nodiscard]] bool must_truncate(std::size_t row, std::size_t n) const {
    for (std::size_t layer = 0; layer < s_.layers && s_.windowed; ++layer) {
      bool held = true;
      for (std::size_t p = std::max(s_.sinks, window_from(n)); p < n; ++p)
        held = held && p < held_[layer][row].size() && held_[layer][row][p] != 0;
      if (!held && n + s_.slack + 1 < furthest_[layer][row]) return false;
    }
    return true;
  }
  [[nodiscard]] std::size_t min_over_layers(std::size_t row) const {
    std::size_t n = ref_[0][row].size();
    for (std::size_t l = 1; l < s_.layers; ++l) n = std::min(n, ref_[l][row].size());
    return n;
  }

  /// Some acquired rows, distinct, in any order (sometimes none).
  std::vector<std::size_t> pick_rows(Bytes& in) {
    std::vector<std::size_t> free_to_pick;
    for (std::size_t r = 0; r < s_.slots; ++r)
      if (acquired_[r] != 0) free_to_pick.push_back(r);
    std::vector<std::size_t> rows;
    const std::size_t count = in.pick(free_to_pick.empty() ? 0 : 1, free_to_pick.size());
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t at = in.pick(0, free_to_pick.size() - 1);
      rows.push_back(free_to_pick[at]);
      free_to_pick.erase(free_to_pick.begin() + static_cast<std::ptrdiff_t>(at));
    }
    return rows;
  }

  /// Each row's positions continuing its own length in `layer`, as one list if they agree and
  /// the input says so.
  struct RowPositions {
    std::vector<std::int64_t> flat;
    std::vector<std::vector<std::int64_t>> per_row;
    bool shared = false;
    [[nodiscard]] Positions view(std::size_t tokens) const {
      return shared ? Positions(flat.data(), tokens) : Positions(flat.data(), tokens, tokens);
    }
  };
  RowPositions positions_of(Bytes& in, std::size_t layer, const std::vector<std::size_t>& rows, std::size_t tokens) {
    RowPositions p;
    bool equal = true;
    for (const std::size_t r : rows) {
      p.per_row.push_back(arange(ref_[layer][r].size(), tokens));
      equal = equal && ref_[layer][r].size() == ref_[layer][rows[0]].size();
    }
    p.shared = rows.empty() || tokens == 0 || (equal && in.one_in(2));
    if (p.shared) {
      if (!rows.empty()) p.flat = p.per_row[0];
    } else {
      for (const auto& r : p.per_row) p.flat.insert(p.flat.end(), r.begin(), r.end());
    }
    return p;
  }

  bool update(Bytes& in, std::size_t layer, const std::vector<std::size_t>& rows, std::size_t tokens) {
    g_context = "SlotKvCache update layer " + str(layer) + " of " + str(rows.size()) + " rows, tokens " + str(tokens);
    Rng rng(in.byte() * 0x10001ULL + s_.seed);
    const Chunk<In> c = format_.chunk(rows.size(), tokens, magnitude_of(in.byte()), rng);
    const RowPositions p = positions_of(in, layer, rows, tokens);
    const Rows listed(rows.data(), rows.size());
    Expect expected = Expect::none;
    for (const std::size_t r : rows)
      if (tokens > s_.capacity - ref_[layer][r].size() || wraps(ref_[layer][r].size(), tokens))
        expected = Expect::length_error;
    if (expected != Expect::none) {
      const Snapshot before = check_all();  // earlier layers of a pass changed the cache
      expect(expected, "row update past capacity",
             [&] { (void)cache_.update(layer, c.kv(false), c.kv(true), p.view(tokens), listed); });
      unchanged(before);
      return false;
    }
    History<T> history;
    expect(Expect::none, "row update",
           [&] { history = cache_.update(layer, c.kv(false), c.kv(true), p.view(tokens), listed); });
    std::vector<const Stream<T>*> streams;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      for (std::size_t t = 0; t < tokens; ++t) ref_[layer][rows[i]].push_back(format_.encode(c, i, t, layer));
      furthest_[layer][rows[i]] = std::max(furthest_[layer][rows[i]], ref_[layer][rows[i]].size());
    }
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Stream<T>& ref = ref_[layer][rows[i]];
      const std::vector<char> present = format_.check(history, i, layer, ref, "row update's history");
      check_held(present, ref, p.per_row[i].empty() ? ref.size() : static_cast<std::size_t>(p.per_row[i][0]),
                 "row update's history", layer);
      streams.push_back(&ref);
    }
    CACHE_FUZZ_REQUIRE(rows.empty() || (history.window == rule_.window && history.sinks == rule_.sinks),
                       "row update's history: window");
    if (rows.empty()) CACHE_FUZZ_REQUIRE(history.tokens() == 0, "an update of no rows returned keys");
    if (in.one_in(2)) {  // a read of the layer is no mutating call: what update() returned stays valid
      expect(Expect::none, "history", [&] { (void)cache_.history(layer); });
      for (std::size_t i = 0; i < rows.size(); ++i)
        (void)format_.check(history, i, layer, ref_[layer][rows[i]], "row update's history after history(layer)");
    }
    if (in.one_in(3)) this->check_attention(history, streams, p.per_row, in);
    return true;
  }

  // The protocol's form: every slot written, free ones admitted.
  void every_slot(Bytes& in, Snapshot& last) {
    const std::size_t layer = in.pick(0, s_.layers - 1);
    const std::size_t tokens = chunk_tokens(in);
    const std::size_t start = ref_[layer][in.pick(0, s_.slots - 1)].size();
    g_context = "SlotKvCache update of every slot, layer " + str(layer) + " at " + str(start);
    Rng rng(in.byte() * 0x10001ULL + s_.seed);
    const Chunk<In> c = format_.chunk(s_.slots, tokens, magnitude_of(in.byte()), rng);
    const std::vector<std::int64_t> positions = arange(start, tokens);
    Expect expected = Expect::none;
    for (std::size_t r = 0; r < s_.slots && expected == Expect::none && tokens != 0; ++r) {
      if (ref_[layer][r].size() != start)
        expected = Expect::invalid_argument;
      else if (tokens > s_.capacity - start || wraps(start, tokens))
        expected = Expect::length_error;
    }
    History<T> history;
    expect(expected, "update of every slot",
           [&] { history = cache_.update(layer, c.kv(false), c.kv(true), positions); });
    if (expected != Expect::none) {
      unchanged(last);
      return;
    }
    for (std::size_t r = 0; r < s_.slots; ++r) {
      acquired_[r] = 1;
      for (std::size_t t = 0; t < tokens; ++t) ref_[layer][r].push_back(format_.encode(c, r, t, layer));
      furthest_[layer][r] = std::max(furthest_[layer][r], ref_[layer][r].size());
      const std::vector<char> present = format_.check(history, r, layer, ref_[layer][r], "update's history");
      // No tokens: the slots may hold different counts, each read by a query at its own length.
      check_held(present, ref_[layer][r], tokens == 0 ? ref_[layer][r].size() : start, "update's history", layer);
    }
  }

  void read_attention(Bytes& in) {
    const std::size_t layer = in.pick(0, s_.layers - 1);
    g_context = "SlotKvCache attention over history(" + str(layer) + ")";
    History<T> history;
    expect(Expect::none, "history", [&] { history = cache_.history(layer); });
    std::vector<const Stream<T>*> streams;
    std::vector<std::vector<std::int64_t>> queries;
    for (std::size_t r = 0; r < s_.slots; ++r) {
      streams.push_back(&ref_[layer][r]);
      queries.push_back({static_cast<std::int64_t>(ref_[layer][r].size())});
    }
    this->check_attention(history, streams, queries, in);
  }

  void acquire(Snapshot& last) {
    g_context = "SlotKvCache acquire";
    const auto free = std::find(acquired_.begin(), acquired_.end(), 0);
    if (free == acquired_.end()) {
      expect(Expect::length_error, "acquire with every slot in use", [&] { (void)cache_.acquire(); });
      unchanged(last);
      return;
    }
    std::size_t row = 0;
    expect(Expect::none, "acquire", [&] { row = cache_.acquire(); });
    CACHE_FUZZ_REQUIRE(row == static_cast<std::size_t>(free - acquired_.begin()),
                       "acquire: expected the lowest free slot, given " + str(row));
    *free = 1;
  }

  void release(Bytes& in, Snapshot& last) {
    const std::size_t row = in.pick(0, s_.slots);
    g_context = "SlotKvCache release(" + str(row) + ")";
    const Expect expected = row >= s_.slots       ? Expect::out_of_range
                            : acquired_[row] == 0 ? Expect::invalid_argument
                                                  : Expect::none;
    expect(expected, "release", [&] { cache_.release(row); });
    if (expected != Expect::none) {
      unchanged(last);
      return;
    }
    acquired_[row] = 0;
    for (auto& layer : ref_) layer[row].clear();
    for (auto& layer : furthest_) layer[row] = 0;
  }

  void truncate_row(Bytes& in, Snapshot& last) {
    const std::size_t row = in.pick(0, s_.slots);
    const std::size_t n = in.pick(0, (row < s_.slots ? min_over_layers(row) : 0) + 1);
    g_context = "SlotKvCache truncate(" + str(row) + ", " + str(n) + ")";
    const Expect expected = row >= s_.slots || n > min_over_layers(row) ? Expect::out_of_range : Expect::none;
    if (expected == Expect::none && !must_truncate(row, n)) {  // a window may have lost what n reads
      if (!taken("truncate(row, n)", [&] { cache_.truncate(row, n); })) return unchanged(last);
    } else {
      expect(expected, "truncate(row, n)", [&] { cache_.truncate(row, n); });
    }
    if (expected != Expect::none) {
      unchanged(last);
      return;
    }
    for (auto& layer : ref_) layer[row].resize(n);
  }

  void truncate(Bytes& in, Snapshot& last) {
    std::size_t held = 0;
    for (std::size_t r = 0; r < s_.slots; ++r) held = std::max(held, min_over_layers(r));
    const std::size_t n = in.pick(0, held + 1);
    g_context = "SlotKvCache truncate(" + str(n) + ")";
    const Expect expected = n > held ? Expect::out_of_range : Expect::none;
    bool must = true;
    for (std::size_t r = 0; r < s_.slots; ++r) must = must && must_truncate(r, std::min(n, min_over_layers(r)));
    if (expected == Expect::none && !must) {
      if (!taken("truncate(n)", [&] { cache_.truncate(n); })) return unchanged(last);
    } else {
      expect(expected, "truncate(n)", [&] { cache_.truncate(n); });
    }
    if (expected != Expect::none) {
      unchanged(last);
      return;
    }
    for (auto& layer : ref_)
      for (auto& stream : layer) stream.resize(std::min(stream.size(), n));
  }

  void bad_call(Bytes& in, Snapshot& last) {
    const std::size_t layer = in.pick(0, s_.layers - 1);
    std::vector<std::size_t> rows = pick_rows(in);
    const std::size_t tokens = in.pick(1, 3);
    std::size_t at = layer;
    Expect expected = Expect::invalid_argument;
    std::uint8_t kind = in.byte() % 9;
    const auto free = std::find(acquired_.begin(), acquired_.end(), 0);
    if (kind == 2 && free == acquired_.end()) kind = 1;
    if ((kind == 3 || kind == 5) && rows.empty()) kind = 1;
    if (kind == 7 && !Format<T>::kChecksInput) kind = 8;
    if (kind == 7 && rows.empty()) kind = 1;
    // Each row's positions continue it; the bad row is listed last, after valid ones.
    std::size_t room = s_.capacity;
    for (const std::size_t r : rows) room = std::min(room, s_.capacity - ref_[layer][r].size());
    std::size_t count = kind == 6 ? room + 1 : std::min(tokens, room);
    if (s_.windowed && kind != 6) count = std::min(count, s_.slack + 1);  // no valid row's chunk wraps
    if (count == 0 && kind != 0 && kind != 1 && kind != 2 && kind != 3 && kind != 6) kind = 0;
    switch (kind) {
      case 0:
        at = s_.layers + in.pick(0, 2);
        expected = Expect::out_of_range;
        break;
      case 1:
        rows.push_back(s_.slots + in.pick(0, 2));
        expected = Expect::out_of_range;
        break;
      case 2:
        rows.push_back(static_cast<std::size_t>(free - acquired_.begin()));
        break;
      case 3:
        rows.push_back(rows[in.pick(0, rows.size() - 1)]);
        break;
      case 6:
        if (rows.empty()) {
          at = s_.layers;
          expected = Expect::out_of_range;
        } else {
          expected = Expect::length_error;
        }
        break;
      default:
        break;
    }
    std::vector<std::int64_t> flat;
    for (const std::size_t r : rows) {
      const std::size_t from = r < s_.slots && at < s_.layers ? ref_[at][r].size() : 0;
      const std::vector<std::int64_t> p = arange(from, count);
      flat.insert(flat.end(), p.begin(), p.end());
    }
    if (kind == 4 && !flat.empty()) {
      flat[in.pick(0, flat.size() - 1)] += 1;
    } else if (kind == 4) {
      at = s_.layers;
      expected = Expect::out_of_range;
    }
    Rng rng(in.byte() + 99 * s_.seed);
    Chunk<In> c = format_.chunk(rows.size() + (kind == 5 ? 1 : 0), count, 1.0F, rng);
    if constexpr (Format<T>::kChecksInput) {
      if (kind == 7) format_.poison(c, in);
    }
    if (kind == 8) {
      c.shape.head_dim = c.shape.head_dim + 1;
      c.k.resize(c.shape.size());
      c.v.resize(c.shape.size());
      if (c.shape.size() == 0) {  // nothing to see a head size in: an out-of-range layer instead
        at = s_.layers;
        expected = Expect::out_of_range;
      }
    }
    if (flat.empty()) flat.push_back(0);  // a valid pointer for no rows
    const Positions positions(flat.data(), count, count);
    const Rows listed(rows.data(), rows.size());
    g_context = "SlotKvCache bad update " + str(kind) + " layer " + str(at) + " of " + str(rows.size()) + " rows";
    expect(expected, "bad row update", [&] { (void)cache_.update(at, c.kv(false), c.kv(true), positions, listed); });
    unchanged(last);
  }

 public:
  Snapshot check_all() {
    Snapshot snap;
    std::size_t longest = 0;
    bool agree = true;
    for (std::size_t layer = 0; layer < s_.layers; ++layer) {
      History<T> every;
      expect(Expect::none, "history(layer)", [&] { every = cache_.history(layer); });
      for (std::size_t r = 0; r < s_.slots; ++r) {
        const Stream<T>& ref = ref_[layer][r];
        CACHE_FUZZ_REQUIRE(cache_.row_length(r, layer) == ref.size(),
                           "row_length(" + str(r) + ", " + str(layer) + "): expected " + str(ref.size()) + ", given " +
                               str(cache_.row_length(r, layer)));
        agree = agree && ref.size() == ref_[0][r].size();
        longest = std::max(longest, ref.size());
        std::vector<char> present = format_.check(every, r, layer, ref, "history(layer)");
        check_held(present, ref, ref.size(), "history(layer)", layer);
        held_[layer][r] = present;
        snap.present.push_back(std::move(present));
      }
      for (std::size_t r = 0; r < s_.slots; ++r) {
        History<T> one;
        expect(Expect::none, "history(layer, row)", [&] { one = cache_.history(layer, Rows(&r, 1)); });
        CACHE_FUZZ_REQUIRE(
            format_.check(one, 0, layer, ref_[layer][r], "history(layer, row)") == snap.present[layer * s_.slots + r],
            "history(layer, row) differs from history(layer)");
      }
    }
    for (std::size_t r = 0; r < s_.slots; ++r) {
      bool row_agrees = true;
      for (std::size_t l = 1; l < s_.layers; ++l) row_agrees = row_agrees && ref_[l][r].size() == ref_[0][r].size();
      if (row_agrees) {
        CACHE_FUZZ_REQUIRE(cache_.row_length(r) == ref_[0][r].size(), "row_length(row)");
      } else {
        expect(Expect::runtime_error, "row_length(row) with layers that disagree", [&] { (void)cache_.row_length(r); });
      }
      CACHE_FUZZ_REQUIRE(cache_.acquired(r) == (acquired_[r] != 0), "acquired(" + str(r) + ")");
      CACHE_FUZZ_REQUIRE(acquired_[r] != 0 || ref_[0][r].empty(), "a free slot holds tokens");
      snap.numbers.push_back(acquired_[r] != 0 ? 1 : 0);
    }
    if (agree) {
      CACHE_FUZZ_REQUIRE(cache_.length() == longest, "length()");
    } else {
      expect(Expect::runtime_error, "length() with a row whose layers disagree", [&] { (void)cache_.length(); });
    }
    expect(Expect::out_of_range, "row_length(slots)", [&] { (void)cache_.row_length(s_.slots); });
    expect(Expect::out_of_range, "acquired(slots)", [&] { (void)cache_.acquired(s_.slots); });
    expect(Expect::out_of_range, "history(layers)", [&] { (void)cache_.history(s_.layers); });
    CACHE_FUZZ_REQUIRE(
        cache_.free_slots() == static_cast<std::size_t>(std::count(acquired_.begin(), acquired_.end(), 0)),
        "free_slots()");
    format_.check_counts(cache_);
    snap.numbers.push_back(cache_.bytes());
    return snap;
  }

 private:
  SlotKvCache<T> cache_;
  std::vector<std::vector<Stream<T>>> ref_;  // [layer][slot]
  std::vector<int> acquired_;
  std::vector<std::vector<std::size_t>> furthest_;    // [layer][slot]: the most tokens since it was emptied
  std::vector<std::vector<std::vector<char>>> held_;  // [layer][slot]: what its history held at the last check
};
}  // namespace

void run_slot(std::size_t format, const Setup& s, Bytes& in) {
  testing::formats::visit(format, [&]<class T>() { SlotHarness<T>(s).run(in); });
}

}  // namespace kvcache::fuzz
