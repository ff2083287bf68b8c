// SPDX-License-Identifier: Apache-2.0
// cache_fuzz's harness for PagedKvCache: up to four sequences over one BlockPool (with or
// without a window), forked, dropped, started from a reused prefix, given token ids, truncated,
// run out of blocks, and written and read as the rows of a PagedBatch. After each operation the
// pool's invariants hold, every sequence's history matches what each position was given (made
// from the ids before it, as a model's K and V are, so that reused blocks hold what the
// reference expects), and attention matches the reference model; a bad call changes nothing.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "harness.hpp"
#include "kvcache/paged_batch.hpp"
#include "kvcache/paged_kv_cache.hpp"

namespace kvcache::fuzz {
namespace {

template <class T>
class PagedHarness : public Harness<PagedHarness<T>, T> {
  using Base = Harness<PagedHarness<T>, T>;
  using Base::format_;
  using Base::rule_;
  using Base::s_;
  using Base::unchanged;
  using Base::window_from;
  using typename Base::In;
  static constexpr std::size_t kSequences = 4;

 public:
  explicit PagedHarness(const Setup& s)
      : Base(s, s.windowed ? WindowRule{s.window, s.sinks} : WindowRule{}),
        pool_(BlockPoolConfig{.layers = s.layers,
                              .kv_heads = s.kv_heads,
                              .head_dim = s.head_dim,
                              .block_tokens = s.block_tokens,
                              .blocks = s.blocks,
                              .capacity = s.pool_capacity,
                              .window = s.windowed ? s.window : 0,
                              .sinks = s.windowed ? s.sinks : 0,
                              .slack = s.windowed ? s.slack : 0,
                              .key_scales = format_.config_keys(),
                              .value_scales = format_.config_values()}),
        capacity_(s.pool_capacity != 0 ? s.pool_capacity
                  : s.windowed         ? std::numeric_limits<std::size_t>::max()
                                       : s.blocks * s.block_tokens) {}

  void step(Bytes& in, Snapshot& last) {
    const std::uint8_t kind = in.byte();
    std::size_t at = in.pick(0, kSequences - 1);
    if (!seqs_[at].cache && kind % 13 != 7) {
      open(at);
      last = check_all();
    }
    switch (kind % 13) {
      case 0:
      case 1:
      case 2: {
        const std::size_t tokens = chunk_tokens(in);
        const std::size_t stop = in.one_in(5) ? in.pick(1, s_.layers) : s_.layers;
        for (std::size_t layer = 0; layer < stop; ++layer)
          if (!update(in, at, layer, tokens)) break;
        break;
      }
      case 3:
        if (kind / 13 % 2 == 0) {
          update(in, at, in.pick(0, s_.layers - 1), chunk_tokens(in));
        } else {
          batch(in, last);
        }
        break;
      case 4:
        reuse_prefix(in, at, last);
        break;
      case 5:
        add_token_ids(in, at, last);
        break;
      case 6:
        fork(in, at);
        break;
      case 7:
        drop(at);
        break;
      case 8:
        truncate(in, at, last);
        break;
      case 9:
        if (kind / 13 % 3 == 0) {
          g_context = "PagedKvCache reset";
          seqs_[at].cache->reset();
          seqs_[at] = Seq{std::move(seqs_[at].cache),
                          {},
                          {},
                          0,
                          std::vector<Stream<T>>(s_.layers),
                          std::vector<std::size_t>(s_.layers, 0)};
        } else {
          read_attention(in, at);
        }
        break;
      default:
        bad_call(in, at, last);
    }
  }

 private:
  /// A sequence and its reference: the ids its positions were given (and those it will be),
  /// which of them the cache knows, and what each layer holds.
  struct Seq {
    std::unique_ptr<PagedKvCache<T>> cache;
    std::vector<TokenId> ids;
    std::vector<std::uint64_t> prefix;  // a hash of ids[0..p], which position p's data is made from
    std::size_t known = 0;              // ids the cache was given
    std::vector<Stream<T>> layers;
    std::vector<std::size_t> needs;  // per layer, the first position its history reads besides the sinks
  };

  void open(std::size_t at) {
    g_context = "PagedKvCache open";
    seqs_[at] = Seq{std::make_unique<PagedKvCache<T>>(pool_), {}, {}, 0, std::vector<Stream<T>>(s_.layers),
                    std::vector<std::size_t>(s_.layers, 0)};
  }
  void drop(std::size_t at) {
    g_context = "PagedKvCache drop";
    if (!seqs_[at].ids.empty()) prompts_[next_prompt_++ % prompts_.size()] = seqs_[at].ids;
    seqs_[at] = Seq{};
  }

  [[nodiscard]] std::size_t length(const Seq& s, std::size_t layer) const { return s.layers[layer].size(); }
  [[nodiscard]] std::size_t longest(const Seq& s) const {
    std::size_t n = 0;
    for (const auto& l : s.layers) n = std::max(n, l.size());
    return n;
  }
  [[nodiscard]] std::size_t shortest(const Seq& s) const {
    std::size_t n = s.layers[0].size();
    for (const auto& l : s.layers) n = std::min(n, l.size());
    return n;
  }

  void set_ids(Seq& s, std::vector<TokenId> ids) {
    s.ids = std::move(ids);
    s.prefix.clear();
    extend_prefix(s);
  }
  void extend_prefix(Seq& s) {
    for (std::size_t p = s.prefix.size(); p < s.ids.size(); ++p) {
      std::uint64_t h = (p == 0 ? 0x243F6A8885A308D3ULL : s.prefix[p - 1]) ^ static_cast<std::uint32_t>(s.ids[p]);
      h = Rng(h).next();
      s.prefix.push_back(h);
    }
  }
  /// Ids from a small alphabet, so that sequences share prefixes.
  void ensure_ids(Bytes& in, Seq& s, std::size_t count) {
    while (s.ids.size() < count) s.ids.push_back(static_cast<TokenId>(in.byte() % 4));
    extend_prefix(s);
  }

  /// K and V of positions [start, start + tokens) of `layer`: made from the ids up to each, as a
  /// model's are, so that a block reused by prefix holds what the reference expects.
  Chunk<In> canonical(const Seq& s, std::size_t layer, std::size_t start, std::size_t tokens) const {
    Chunk<In> c{{1, format_.heads(), tokens, format_.dim()}, {}, {}};
    c.k.resize(c.shape.size());
    c.v.resize(c.shape.size());
    for (std::size_t t = 0; t < tokens; ++t) {
      const std::uint64_t h = s.prefix[start + t];
      Rng rng(h ^ (0x9E3779B97F4A7C15ULL * (layer + 1)));
      const float m = magnitude_of(static_cast<std::uint8_t>(h >> 56));
      for (std::size_t head = 0; head < format_.heads(); ++head) {
        for (std::size_t d = 0; d < format_.dim(); ++d) {
          const std::size_t i = (head * tokens + t) * format_.dim() + d;
          c.k[i] = detail::narrow<In>(rng.unit() * m);
          c.v[i] = detail::narrow<In>(rng.unit() * m);
        }
      }
    }
    return c;
  }

  [[nodiscard]] std::size_t sink_blocks() const {
    return s_.windowed ? (s_.sinks + s_.block_tokens - 1) / s_.block_tokens : 0;
  }
  [[nodiscard]] static std::size_t given_back(const Seq& s) {
    const std::span<const std::size_t> table = s.cache->block_table();
    return static_cast<std::size_t>(std::count(table.begin(), table.end(), PagedKvCache<T>::kReleased));
  }
  /// The blocks [first, end) of the table an update of `layer` from `start` gives back: those
  /// wholly before every layer's window less the slack, past the sinks' and those given back.
  [[nodiscard]] std::pair<std::size_t, std::size_t> releases(const Seq& s, std::size_t layer, std::size_t start) const {
    const std::size_t first = sink_blocks() + given_back(s);
    if (!s_.windowed) return {first, first};
    std::size_t bound = std::max(s.needs[layer], window_from(start));
    for (std::size_t l = 0; l < s_.layers; ++l)
      if (l != layer) bound = std::min(bound, s.needs[l]);
    bound = bound > s_.slack ? bound - s_.slack : 0;
    return {first, std::max(first, std::min(bound / s_.block_tokens, s.cache->block_table().size()))};
  }
  /// Whether updates of `layer` writing `tokens` into each of `rows` (sequences, from their own
  /// lengths) find their blocks, counted together in order: the free ones and those the writes
  /// give back; a shared one each writes into is copied unless it is the last holder.
  [[nodiscard]] bool fits(const std::vector<std::size_t>& rows, std::size_t layer, std::size_t tokens) const {
    std::map<std::size_t, std::size_t> counts;
    std::size_t free = pool_.free_blocks();
    const auto count = [&](std::size_t b) {
      const auto it = counts.find(b);
      return it == counts.end() ? holders(b) : it->second;
    };
    for (const std::size_t r : rows) {
      const Seq& s = seqs_[r];
      const std::size_t start = length(s, layer), b = s_.block_tokens;
      const std::span<const std::size_t> table = s.cache->block_table();
      const auto [first, end] = releases(s, layer, start);
      for (std::size_t j = first; j < end; ++j) {
        counts[table[j]] = count(table[j]) - 1;
        if (counts[table[j]] == 0) ++free;
      }
      std::size_t needed = 0;
      for (std::size_t j = start / b; tokens != 0 && j <= (start + tokens - 1) / b; ++j) {
        if (j >= table.size()) {
          ++needed;
        } else if (count(table[j]) > 1) {
          ++needed;
          counts[table[j]] = count(table[j]) - 1;
        }
      }
      if (needed > free) return false;
      free -= needed;
    }
    return true;
  }
  [[nodiscard]] bool fits(std::size_t at, std::size_t layer, std::size_t tokens) const {
    return fits(std::vector<std::size_t>{at}, layer, tokens);
  }
  /// A history of sequence s in `layer`: every position a query from `from` on reads, and with a
  /// window nothing before its window but the sinks' blocks and the window's first block.
  void check_held(const Seq& s, const std::vector<char>& present, std::size_t layer, std::size_t from,
                  const char* what) const {
    const std::size_t n = length(s, layer);
    if (!s_.windowed) {
      CACHE_FUZZ_REQUIRE(std::count(present.begin(), present.end(), 1) == static_cast<std::ptrdiff_t>(n),
                         std::string(what) + ": positions missing");
      return;
    }
    check_required(present, from, n, rule_.sinks, what, layer);
    const std::size_t b = s_.block_tokens;
    for (std::size_t p = sink_blocks() * b; p < from / b * b && p < present.size(); ++p) {
      CACHE_FUZZ_REQUIRE(present[p] == 0, std::string(what) + " layer " + str(layer) + ": position " + str(p) +
                                              " returned, before the window from " + str(from));
    }
  }
  [[nodiscard]] std::size_t holders(std::size_t block) const {
    std::size_t n = 0;
    for (const Seq& s : seqs_)
      if (s.cache)
        n += static_cast<std::size_t>(std::count(s.cache->block_table().begin(), s.cache->block_table().end(), block));
    return n;
  }

  bool update(Bytes& in, std::size_t at, std::size_t layer, std::size_t tokens) {
    Seq& s = seqs_[at];
    const std::size_t start = length(s, layer);
    g_context =
        "PagedKvCache " + str(at) + " update layer " + str(layer) + " at " + str(start) + " tokens " + str(tokens);
    ensure_ids(in, s, start + tokens);
    const Chunk<In> c = canonical(s, layer, start, tokens);
    const std::vector<std::int64_t> positions = arange(start, tokens);
    if (tokens > capacity_ - std::min(capacity_, start) || !fits(at, layer, tokens)) {
      const Snapshot before = check_all();  // earlier layers of a pass changed the cache
      expect(Expect::length_error, "update past capacity or out of blocks",
             [&] { (void)s.cache->update(layer, c.kv(false), c.kv(true), positions); });
      unchanged(before);
      return false;
    }
    History<T> history;
    expect(Expect::none, "update", [&] { history = s.cache->update(layer, c.kv(false), c.kv(true), positions); });
    for (std::size_t t = 0; t < tokens; ++t) s.layers[layer].push_back(format_.encode(c, 0, t, layer));
    s.needs[layer] = std::max(s.needs[layer], window_from(start));
    const std::vector<char> present = format_.check(history, 0, layer, s.layers[layer], "update's history");
    check_held(s, present, layer, s.needs[layer], "update's history");
    CACHE_FUZZ_REQUIRE(history.window == rule_.window && history.sinks == rule_.sinks, "update's history: window");
    if (in.one_in(3)) {
      this->check_attention(history, {&s.layers[layer]}, {positions}, in);
    }
    return true;
  }

  /// Some live sequences, distinct and in any order, as the rows of one PagedBatch: a chunk of
  /// equal size into each through every layer (maybe stopped part-way; out of blocks or capacity
  /// must throw std::length_error and change nothing), or attention over the batch's history.
  void batch(Bytes& in, Snapshot& last) {
    std::vector<std::size_t> rows;
    for (std::size_t i = 0; i < kSequences; ++i) {
      if (seqs_[i].cache && in.one_in(2))
        rows.insert(rows.begin() + static_cast<std::ptrdiff_t>(in.pick(0, rows.size())), i);
    }
    if (rows.empty()) return;
    std::vector<PagedKvCache<T>*> members;
    for (const std::size_t r : rows) members.push_back(seqs_[r].cache.get());
    g_context = "PagedBatch of " + str(rows.size());
    PagedBatch<T> batch(members);
    if (in.one_in(4)) {  // a read: every row's next query over the batch's history
      const std::size_t layer = in.pick(0, s_.layers - 1);
      History<T> history;
      expect(Expect::none, "PagedBatch history", [&] { history = batch.history(layer); });
      std::vector<const Stream<T>*> streams;
      std::vector<std::vector<std::int64_t>> queries;
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const Seq& s = seqs_[rows[i]];
        const std::vector<char> present = format_.check(history, i, layer, s.layers[layer], "PagedBatch history");
        check_held(s, present, layer, s.needs[layer], "PagedBatch history");
        streams.push_back(&s.layers[layer]);
        queries.push_back({static_cast<std::int64_t>(length(s, layer))});
      }
      this->check_attention(history, streams, queries, in);
      return;
    }
    const std::size_t tokens = chunk_tokens(in);
    const std::size_t stop = in.one_in(5) ? in.pick(1, s_.layers) : s_.layers;
    for (std::size_t layer = 0; layer < stop; ++layer) {
      g_context = "PagedBatch of " + str(rows.size()) + " update layer " + str(layer) + " tokens " + str(tokens);
      Chunk<In> c{{rows.size(), format_.heads(), tokens, format_.dim()}, {}, {}};
      std::vector<std::int64_t> positions;
      bool room = true;
      for (const std::size_t r : rows) {
        Seq& s = seqs_[r];
        const std::size_t start = length(s, layer);
        ensure_ids(in, s, start + tokens);
        const Chunk<In> own = canonical(s, layer, start, tokens);
        c.k.insert(c.k.end(), own.k.begin(), own.k.end());
        c.v.insert(c.v.end(), own.v.begin(), own.v.end());
        const std::vector<std::int64_t> p = arange(start, tokens);
        positions.insert(positions.end(), p.begin(), p.end());
        room = room && tokens <= capacity_ - std::min(capacity_, start);
      }
      if (positions.empty()) positions.push_back(0);  // a valid pointer for no tokens
      const Positions given(positions.data(), tokens, tokens);
      if (!room || !fits(rows, layer, tokens)) {
        const Snapshot before = check_all();  // earlier layers of a pass changed the cache
        expect(Expect::length_error, "PagedBatch update past capacity or out of blocks",
               [&] { (void)batch.update(layer, c.kv(false), c.kv(true), given); });
        unchanged(before);
        return;
      }
      History<T> history;
      expect(Expect::none, "PagedBatch update", [&] { history = batch.update(layer, c.kv(false), c.kv(true), given); });
      std::vector<const Stream<T>*> streams;
      std::vector<std::vector<std::int64_t>> queries;
      for (std::size_t i = 0; i < rows.size(); ++i) {
        Seq& s = seqs_[rows[i]];
        const std::size_t start = length(s, layer);
        for (std::size_t t = 0; t < tokens; ++t) s.layers[layer].push_back(format_.encode(c, i, t, layer));
        s.needs[layer] = std::max(s.needs[layer], window_from(start));
        const std::vector<char> present =
            format_.check(history, i, layer, s.layers[layer], "PagedBatch update's history");
        check_held(s, present, layer, s.needs[layer], "PagedBatch update's history");
        streams.push_back(&s.layers[layer]);
        queries.push_back(arange(start, tokens));
      }
      CACHE_FUZZ_REQUIRE(history.window == rule_.window && history.sinks == rule_.sinks, "PagedBatch history: window");
      if (in.one_in(3)) this->check_attention(history, streams, queries, in);
    }
    (void)last;
  }

  void read_attention(Bytes& in, std::size_t at) {
    Seq& s = seqs_[at];
    const std::size_t layer = in.pick(0, s_.layers - 1);
    g_context = "PagedKvCache attention over history(" + str(layer) + ")";
    History<T> history;
    expect(Expect::none, "history", [&] { history = s.cache->history(layer); });
    this->check_attention(history, {&s.layers[layer]}, {{static_cast<std::int64_t>(length(s, layer))}}, in);
  }

  void reuse_prefix(Bytes& in, std::size_t at, Snapshot& last) {
    std::vector<TokenId> prompt;
    switch (in.byte() % 4) {
      case 0:  // an earlier sequence's ids, cut or continued
        prompt = prompts_[in.byte() % prompts_.size()];
        break;
      case 1: {  // a live sequence's
        const Seq& other = seqs_[in.pick(0, kSequences - 1)];
        prompt = other.ids;
        break;
      }
      case 2:
        break;
      default:
        return reuse_prefix_of(at, {}, last);
    }
    prompt.resize(std::min(prompt.size(), in.pick(0, 24)));
    for (std::size_t extra = in.pick(0, 6); extra > 0; --extra) prompt.push_back(static_cast<TokenId>(in.byte() % 4));
    reuse_prefix_of(at, std::move(prompt), last);
  }

  void reuse_prefix_of(std::size_t at, std::vector<TokenId> prompt, Snapshot& last) {
    Seq& s = seqs_[at];
    g_context = "PagedKvCache " + str(at) + " reuse_prefix of " + str(prompt.size()) + " ids";
    const bool empty = longest(s) == 0 && s.known == 0;
    std::size_t skip = 0;
    expect(empty ? Expect::none : Expect::logic_error, "reuse_prefix", [&] { skip = s.cache->reuse_prefix(prompt); });
    if (!empty) {
      unchanged(last);
      return;
    }
    // Whole blocks, but never the whole prompt: a prompt found whole leaves its last token to feed.
    const bool whole = !prompt.empty() && skip + 1 == prompt.size() && prompt.size() % s_.block_tokens == 0;
    CACHE_FUZZ_REQUIRE((skip % s_.block_tokens == 0 || whole) && (skip < prompt.size() || prompt.empty()),
                       "reuse_prefix returned " + str(skip) + " of " + str(prompt.size()));
    s.known = prompt.size();
    set_ids(s, std::move(prompt));
    std::fill(s.needs.begin(), s.needs.end(), window_from(skip));
    for (std::size_t layer = 0; layer < s_.layers; ++layer) {
      const Chunk<In> c = canonical(s, layer, 0, skip);
      // Encoded with the pool's head scales, as a reused block was written.
      for (std::size_t t = 0; t < skip; ++t) s.layers[layer].push_back(format_.encode_held(c, 0, t, layer));
    }
  }

  /// Ids of the next tokens, given before they are fed (a generated token's); refused once the
  /// sequence holds tokens fed without their ids, since given then they could name other tokens.
  void add_token_ids(Bytes& in, std::size_t at, Snapshot& last) {
    Seq& s = seqs_[at];
    const std::size_t count = in.pick(0, 6);
    g_context = "PagedKvCache " + str(at) + " add_token_ids of " + str(count);
    if (s.known < longest(s) && count != 0) {
      const std::vector<TokenId> late(count, 1);
      expect(Expect::logic_error, "add_token_ids after their tokens", [&] { s.cache->add_token_ids(late); });
      unchanged(last);
      return;
    }
    ensure_ids(in, s, s.known + count);
    expect(Expect::none, "add_token_ids",
           [&] { s.cache->add_token_ids(std::span<const TokenId>(s.ids).subspan(s.known, count)); });
    s.known += count;
    CACHE_FUZZ_REQUIRE(s.cache->token_ids().size() == s.known, "token_ids() after add_token_ids");
  }

  void fork(Bytes& in, std::size_t at) {
    std::size_t to = in.pick(0, kSequences - 1);
    if (to == at) to = (at + 1) % kSequences;
    g_context = "PagedKvCache fork " + str(at) + " into " + str(to);
    drop(to);
    Seq& s = seqs_[at];
    const std::size_t free = pool_.free_blocks();
    Seq copy;
    expect(Expect::none, "fork", [&] { copy.cache = std::make_unique<PagedKvCache<T>>(s.cache->fork()); });
    CACHE_FUZZ_REQUIRE(pool_.free_blocks() == free, "fork took blocks");
    const std::size_t held = longest(s);
    copy.known = std::min(held, s.known);
    set_ids(copy, std::vector<TokenId>(s.ids.begin(), s.ids.begin() + static_cast<std::ptrdiff_t>(held)));
    copy.layers = s.layers;
    copy.needs = s.needs;
    seqs_[to] = std::move(copy);
  }

  void truncate(Bytes& in, std::size_t at, Snapshot& last) {
    Seq& s = seqs_[at];
    const std::size_t n = in.pick(0, shortest(s) + 1);
    g_context = "PagedKvCache " + str(at) + " truncate(" + str(n) + ")";
    // A windowed sequence cannot go back into the blocks it gave back, nor to a query that reads them.
    const std::size_t gap_begin = sink_blocks() * s_.block_tokens;
    const std::size_t gap_end = (sink_blocks() + given_back(s)) * s_.block_tokens;
    const bool gone = gap_end > gap_begin && n > gap_begin && std::max(rule_.sinks, window_from(n)) < gap_end;
    const Expect expected = n > shortest(s) || gone ? Expect::out_of_range : Expect::none;
    expect(expected, "truncate", [&] { s.cache->truncate(n); });
    if (expected != Expect::none) {
      unchanged(last);
      return;
    }
    for (auto& layer : s.layers) layer.resize(n);
    s.ids.resize(std::min(s.ids.size(), n));
    s.prefix.resize(s.ids.size());
    s.known = std::min(s.known, n);
    std::fill(s.needs.begin(), s.needs.end(), window_from(n));
  }

  void bad_call(Bytes& in, std::size_t at, Snapshot& last) {
    Seq& s = seqs_[at];
    const std::size_t layer = in.pick(0, s_.layers - 1);
    const std::size_t start = length(s, layer);
    std::uint8_t kind = in.byte() % 10;
    if (kind == 8) {  // reuse_prefix on a sequence that holds something
      if (longest(s) != 0 || s.known != 0) return reuse_prefix_of(at, {1, 2, 3}, last);
      kind = 0;
    }
    if (kind == 5 && !Format<T>::kChecksInput) kind = 2;
    const std::size_t room = capacity_ - std::min(capacity_, start);
    std::size_t tokens = std::min<std::size_t>(in.pick(1, 3), room);
    // Out of blocks: the fewest tokens, within capacity, that need more blocks than are free.
    if (kind == 6) {
      tokens = 0;
      for (std::size_t t = 1; t <= std::min<std::size_t>(room, 64) && tokens == 0; ++t)
        if (!fits(at, layer, t)) tokens = t;
    }
    if (kind == 7) {  // past capacity, which a windowed pool without one has not
      tokens = room + 1 + in.pick(0, 2);
      if (capacity_ == std::numeric_limits<std::size_t>::max()) tokens = 0;
    }
    if (tokens == 0) kind = 0;
    Rng rng(in.byte() + 55 * s_.seed);
    Chunk<In> c = format_.chunk(1, tokens, 1.0F, rng);
    std::vector<std::int64_t> positions = arange(start, tokens);
    TensorView<const In> k = c.kv(false), v = c.kv(true);
    Positions given = positions;
    std::size_t at_layer = layer;
    // Values are looked at after the blocks are counted.
    const bool blocks_short = kind == 5 && !fits(at, layer, tokens);
    Expect expected = Expect::invalid_argument;
    Chunk<In> other;
    switch (kind) {
      case 0:
        at_layer = s_.layers + in.pick(0, 2);
        expected = Expect::out_of_range;
        break;
      case 1:
        positions[in.pick(0, tokens - 1)] += start == 0 || in.one_in(2) ? 1 : -1;
        given = positions;
        break;
      case 2:  // a second batch row, or another head count
        other = format_.chunk(in.one_in(2) ? 2 : 1, tokens, 1.0F, rng);
        if (other.shape.batch == 1) {
          other.shape.heads = other.shape.heads + 1;
          other.k.resize(other.shape.size());
          other.v.resize(other.shape.size());
        }
        k = other.kv(false);
        v = other.kv(true);
        break;
      case 3:
        given = Positions(positions.data(), tokens - 1);
        break;
      case 4:
        given = Positions(positions.data(), tokens, tokens);  // a list per row
        break;
      case 5:
        if constexpr (Format<T>::kChecksInput) format_.poison(c, in);
        if (blocks_short) expected = Expect::length_error;
        break;
      case 6:
      case 7:
        expected = Expect::length_error;
        break;
      default:
        v = TensorView<const In>(nullptr, c.shape);
    }
    g_context = "PagedKvCache " + str(at) + " bad update " + str(kind) + " layer " + str(at_layer) + " at " +
                str(start) + " tokens " + str(tokens);
    expect(expected, "bad update", [&] { (void)s.cache->update(at_layer, k, v, given); });
    unchanged(last);
  }

 public:
  Snapshot check_all() {
    Snapshot snap;
    try {
      pool_.check_invariants();
    } catch (const std::exception& e) {
      fail(e.what());
    }
    std::vector<char> held(s_.blocks, 0);
    for (std::size_t i = 0; i < kSequences; ++i) {
      Seq& s = seqs_[i];
      if (!s.cache) {
        snap.numbers.push_back(~std::size_t{0});
        continue;
      }
      bool agree = true;
      for (std::size_t layer = 0; layer < s_.layers; ++layer) {
        const std::size_t n = length(s, layer);
        CACHE_FUZZ_REQUIRE(s.cache->length(layer) == n, "sequence " + str(i) + " length(" + str(layer) +
                                                            "): expected " + str(n) + ", given " +
                                                            str(s.cache->length(layer)));
        agree = agree && n == length(s, 0);
        History<T> history;
        expect(Expect::none, "history", [&] { history = s.cache->history(layer); });
        std::vector<char> present = format_.check(history, 0, layer, s.layers[layer], "sequence history");
        check_held(s, present, layer, s.needs[layer], "sequence history");
        snap.present.push_back(std::move(present));
      }
      if (agree) {
        CACHE_FUZZ_REQUIRE(s.cache->length() == length(s, 0), "length()");
      } else {
        expect(Expect::runtime_error, "length() with layers that disagree", [&] { (void)s.cache->length(); });
      }
      expect(Expect::out_of_range, "length(layers)", [&] { (void)s.cache->length(s_.layers); });
      const std::span<const std::size_t> table = s.cache->block_table();
      const std::size_t blocks = (longest(s) + s_.block_tokens - 1) / s_.block_tokens;
      CACHE_FUZZ_REQUIRE(table.size() == blocks, "sequence " + str(i) + " holds " + str(table.size()) + " blocks for " +
                                                     str(longest(s)) + " tokens");
      CACHE_FUZZ_REQUIRE(longest(s) <= capacity_, "sequence " + str(i) + " holds " + str(longest(s)) +
                                                      " tokens, past its capacity " + str(capacity_));
      CACHE_FUZZ_REQUIRE(s.cache->bytes() == (table.size() - given_back(s)) * pool_.block_bytes(), "bytes()");
      CACHE_FUZZ_REQUIRE(s.cache->capacity() == capacity_, "capacity()");
      format_.check_counts(*s.cache);
      snap.numbers.push_back(table.size());
      snap.numbers.insert(snap.numbers.end(), table.begin(), table.end());
      for (const std::size_t b : table)
        if (b != PagedKvCache<T>::kReleased) held[b] = 1;
    }
    const auto used = static_cast<std::size_t>(std::count(held.begin(), held.end(), 1));
    CACHE_FUZZ_REQUIRE(pool_.free_blocks() == s_.blocks - used,
                       "free_blocks(): expected " + str(s_.blocks - used) + ", given " + str(pool_.free_blocks()));
    format_.check_counts(pool_);
    snap.numbers.push_back(pool_.free_blocks());
    snap.numbers.push_back(pool_.keyed_blocks());
    return snap;
  }

 private:
  BlockPool<T> pool_;
  std::size_t capacity_;
  std::array<Seq, kSequences> seqs_{};
  std::array<std::vector<TokenId>, 4> prompts_{};  // ids of sequences dropped, for prefix reuse
  std::size_t next_prompt_ = 0;
};
}  // namespace

void run_paged(std::size_t format, const Setup& s, Bytes& in) {
  testing::formats::visit(format, [&]<class T>() { PagedHarness<T>(s).run(in); });
}

}  // namespace kvcache::fuzz
