// SPDX-License-Identifier: Apache-2.0
// cache_fuzz's harness for the caches whose batch rows advance together: KvCache, ConcatKvCache
// and RingKvCache. Updates of any layer and chunk size (passes stopped part-way), truncates,
// resets, bad calls and attention over a layer's history; after each, every layer's history is
// checked position by position against what each position was given (for a ring, what its
// window lets attention read).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "harness.hpp"
#include "kvcache/concat_kv_cache.hpp"
#include "kvcache/kv_cache.hpp"
#include "kvcache/ring_kv_cache.hpp"

namespace kvcache::fuzz {
namespace {

template <class Cache>
inline constexpr bool kIsRing = false;
template <class T>
inline constexpr bool kIsRing<RingKvCache<T>> = true;

template <class Cache>
class ContiguousHarness : public Harness<ContiguousHarness<Cache>, typename Cache::value_type> {
  using T = typename Cache::value_type;
  using Base = Harness<ContiguousHarness<Cache>, T>;
  using Base::format_;
  using Base::rule_;
  using Base::s_;
  using Base::unchanged;
  using Base::window_from;
  using typename Base::In;
  static constexpr bool kRing = kIsRing<Cache>;

 public:
  explicit ContiguousHarness(const Setup& s)
      : Base(s, kRing ? WindowRule{s.window, s.sinks} : WindowRule{}),
        cache_(config()),
        ref_(s.layers, std::vector<Stream<T>>(s.batch)) {
    furthest_.assign(s.layers, 0);
    held_.assign(s.layers, {});
  }

  void step(Bytes& in, Snapshot& last) {
    const std::uint8_t kind = in.byte();
    switch (kind % 10) {
      case 0:
      case 1:
      case 2:
        pass(in);
        break;
      case 3: {
        const std::size_t layer = in.pick(0, s_.layers - 1);
        update(in, layer, chunk_tokens(in));
        break;
      }
      case 4:
        truncate(in, last);
        break;
      case 5:
        if (kind / 10 % 3 == 0) {
          g_context = "reset";
          cache_.reset();
          for (auto& layer : ref_)
            for (auto& stream : layer) stream.clear();
          furthest_.assign(s_.layers, 0);
        } else {
          read_attention(in);
        }
        break;
      default:
        bad_call(in, last);
    }
  }

 private:
  static constexpr const char* kName = kRing                                     ? "RingKvCache"
                                       : std::is_same_v<Cache, ConcatKvCache<T>> ? "ConcatKvCache"
                                                                                 : "KvCache";

  [[nodiscard]] KvCacheConfig config() const {
    KvCacheConfig c{.layers = s_.layers, .batch = s_.batch, .kv_heads = s_.kv_heads, .head_dim = s_.head_dim};
    if constexpr (kRing) {
      c.capacity = s_.ring_capacity;
      c.window = s_.window;
      c.sinks = s_.sinks;
      c.slack = s_.slack;
    } else {
      c.capacity = s_.capacity;
    }
    c.key_scales = format_.config_keys();
    c.value_scales = format_.config_values();
    return c;
  }
  [[nodiscard]] std::size_t capacity() const {
    if constexpr (kRing) return s_.ring_capacity == 0 ? std::numeric_limits<std::size_t>::max() : s_.ring_capacity;
    return s_.capacity;
  }
  [[nodiscard]] std::size_t length(std::size_t layer) const { return ref_[layer][0].size(); }
  [[nodiscard]] std::size_t common() const {
    std::size_t n = length(0);
    for (std::size_t l = 1; l < s_.layers; ++l) n = std::min(n, length(l));
    return n;
  }

  // A forward pass: the same chunk size through the layers in order, maybe stopped part-way.
  void pass(Bytes& in) {
    const std::size_t tokens = chunk_tokens(in);
    const std::size_t stop = in.one_in(5) ? in.pick(1, s_.layers) : s_.layers;
    for (std::size_t layer = 0; layer < stop; ++layer)
      if (!update(in, layer, tokens)) break;
  }

  /// A valid update of `layer` (or past capacity, which must throw length_error and change
  /// nothing); returns whether it was written.
  bool update(Bytes& in, std::size_t layer, std::size_t tokens) {
    const std::size_t start = length(layer);
    g_context = std::string(kName) + " update layer " + str(layer) + " at " + str(start) + " tokens " + str(tokens);
    Rng rng(in.byte() * 0x10001ULL + s_.seed);
    const Chunk<In> c = format_.chunk(s_.batch, tokens, magnitude_of(in.byte()), rng);
    const std::vector<std::int64_t> positions = arange(start, tokens);
    if (tokens > capacity() - start) {
      const Snapshot before = check_all();  // earlier layers of a pass changed the cache
      expect(Expect::length_error, "update past capacity",
             [&] { (void)cache_.update(layer, c.kv(false), c.kv(true), positions); });
      unchanged(before);
      return false;
    }
    History<T> history;
    expect(Expect::none, "update", [&] { history = cache_.update(layer, c.kv(false), c.kv(true), positions); });
    for (std::size_t b = 0; b < s_.batch; ++b)
      for (std::size_t t = 0; t < tokens; ++t) ref_[layer][b].push_back(format_.encode(c, b, t, layer));
    furthest_[layer] = std::max(furthest_[layer], start + tokens);

    // Every key some query of the chunk may read must be there (for a ring: its window and sinks).
    std::vector<const Stream<T>*> streams;
    for (std::size_t b = 0; b < s_.batch; ++b) {
      const std::vector<char> present = format_.check(history, b, layer, ref_[layer][b], "update's history");
      check_required(present, window_from(start), start + tokens, rule_.sinks, "update's history", layer);
      if constexpr (kRing) {
        const std::size_t held = static_cast<std::size_t>(std::count(present.begin(), present.end(), 1));
        CACHE_FUZZ_REQUIRE(held <= s_.sinks + s_.window - 1 + tokens,
                           "update's history: " + str(held) + " keys, more than any query of the chunk reads");
        CACHE_FUZZ_REQUIRE(history.window == s_.window && history.sinks == s_.sinks, "update's history: window");
      }
      streams.push_back(&ref_[layer][b]);
    }
    if (in.one_in(2)) {  // a read of the layer is no mutating call: what update() returned stays valid
      expect(Expect::none, "history", [&] { (void)cache_.history(layer); });
      for (std::size_t b = 0; b < s_.batch; ++b)
        (void)format_.check(history, b, layer, ref_[layer][b], "update's history after history(layer)");
    }
    if (in.one_in(3)) {
      this->check_attention(history, streams, std::vector<std::vector<std::int64_t>>(s_.batch, positions), in);
    }
    return true;
  }

  // Attention for a next token, over the layer's history as read without writing.
  void read_attention(Bytes& in) {
    const std::size_t layer = in.pick(0, s_.layers - 1);
    g_context = std::string(kName) + " attention over history(" + str(layer) + ")";
    History<T> history;
    expect(Expect::none, "history", [&] { history = cache_.history(layer); });
    std::vector<const Stream<T>*> streams;
    for (std::size_t b = 0; b < s_.batch; ++b) streams.push_back(&ref_[layer][b]);
    const auto next = static_cast<std::int64_t>(length(layer));
    this->check_attention(history, streams, std::vector<std::vector<std::int64_t>>(s_.batch, {next}), in);
  }

  void truncate(Bytes& in, Snapshot& last) {
    const std::size_t n = in.pick(0, common() + 2);
    g_context = std::string(kName) + " truncate(" + str(n) + ")";
    bool must = n <= common();
    bool may = must;
    if constexpr (kRing) {
      // Guaranteed while every layer holds what a query at n reads (as its last history showed),
      // or n is at most slack + 1 short of the furthest the layer reached; otherwise it may throw.
      for (std::size_t layer = 0; layer < s_.layers && must; ++layer) {
        bool held = true;
        for (std::size_t p = std::max(s_.sinks, window_from(n)); p < n; ++p)
          held = held && p < held_[layer].size() && held_[layer][p] != 0;
        must = held || n + s_.slack + 1 >= furthest_[layer];
      }
    }
    bool taken = true;
    try {
      cache_.truncate(n);
    } catch (const std::exception& e) {
      CACHE_FUZZ_REQUIRE(!must, std::string("truncate threw ") + e.what());
      CACHE_FUZZ_REQUIRE(is(e, Expect::out_of_range),
                         std::string("truncate threw other than out_of_range: ") + e.what());
      taken = false;
    }
    CACHE_FUZZ_REQUIRE(!taken || may, "truncate past the tokens held returned");
    if (!taken) {
      unchanged(last);
      return;
    }
    for (auto& layer : ref_)
      for (auto& stream : layer) stream.resize(n);
  }

  void bad_call(Bytes& in, Snapshot& last) {
    const std::size_t layer = in.pick(0, s_.layers - 1);
    const std::size_t start = length(layer);
    const std::size_t room = capacity() - start;
    std::size_t tokens = std::min<std::size_t>(in.pick(1, 4), room);
    Rng rng(in.byte() + 77 * s_.seed);
    Chunk<In> c = format_.chunk(s_.batch, tokens, 1.0F, rng);
    std::vector<std::int64_t> positions = arange(start, tokens);
    std::size_t at = layer;
    TensorView<const In> k = c.kv(false), v = c.kv(true);
    Positions given = positions;
    Expect expected = Expect::invalid_argument;
    Chunk<In> other;
    std::vector<std::int64_t> per_row;
    std::uint8_t kind = in.byte() % 8;
    if (kind == 5 && !Format<T>::kChecksInput) kind = 2;
    if (tokens == 0 && kind != 0 && kind != 4) kind = 0;  // the others need a token
    switch (kind) {
      case 0:
        at = s_.layers + in.pick(0, 2);
        expected = Expect::out_of_range;
        break;
      case 1: {
        const std::size_t i = in.pick(0, tokens - 1);
        positions[i] += (in.one_in(2) || positions[i] == 0) ? static_cast<std::int64_t>(1 + in.pick(0, 3)) : -1;
        given = positions;
        break;
      }
      case 2: {
        Shape shape = c.shape;
        switch (in.byte() % 5) {
          case 0:
            shape.heads = shape.heads + 1;
            break;
          case 1:
            shape.head_dim = shape.head_dim + 1;
            break;
          case 2:
            shape.head_dim = shape.head_dim > 1 ? shape.head_dim - 1 : 2;
            break;
          case 3:
            shape.batch = shape.batch + 1;
            break;
          default:
            shape.tokens = shape.tokens + 1;  // v only: v's shape differs from k's
        }
        other = format_.chunk(shape.batch, shape.tokens, 1.0F, rng);
        other.shape.heads = shape.heads;
        other.shape.head_dim = shape.head_dim;
        other.k.resize(shape.size());
        other.v.resize(shape.size());
        if (shape.tokens != c.shape.tokens) {
          v = other.kv(true);
        } else {
          k = other.kv(false);
          v = other.kv(true);
        }
        break;
      }
      case 3:
        positions.push_back(static_cast<std::int64_t>(start + tokens));
        given = Positions(positions.data(), tokens - 1 + 2 * in.pick(0, 1));
        break;
      case 4:
        if (capacity() - start > 64) {  // an unbounded ring: an out-of-range layer instead
          at = s_.layers;
          expected = Expect::out_of_range;
          break;
        }
        tokens = capacity() - start + 1 + in.pick(0, 2);
        c = format_.chunk(s_.batch, tokens, 1.0F, rng);
        positions = arange(start, tokens);
        given = positions;
        k = c.kv(false);
        v = c.kv(true);
        expected = Expect::length_error;
        break;
      case 5:
        if constexpr (Format<T>::kChecksInput) format_.poison(c, in);
        break;
      case 6:
        per_row.clear();
        for (std::size_t b = 0; b < s_.batch; ++b) per_row.insert(per_row.end(), positions.begin(), positions.end());
        given = Positions(per_row.data(), tokens, tokens);
        break;
      default:
        k = TensorView<const In>(nullptr, c.shape);
    }
    g_context = std::string(kName) + " bad update " + str(kind) + " layer " + str(at) + " at " + str(start);
    expect(expected, "bad update", [&] { (void)cache_.update(at, k, v, given); });
    unchanged(last);
  }

 public:
  Snapshot check_all() {
    Snapshot snap;
    bool agree = true;
    for (std::size_t layer = 0; layer < s_.layers; ++layer) {
      std::size_t n = 0;
      expect(Expect::none, "length(layer)", [&] { n = cache_.length(layer); });
      CACHE_FUZZ_REQUIRE(n == length(layer), std::string(kName) + " length(" + str(layer) + "): expected " +
                                                 str(length(layer)) + ", given " + str(n));
      agree = agree && n == length(0);
      snap.numbers.push_back(n);
      History<T> history;
      expect(Expect::none, "history", [&] { history = cache_.history(layer); });
      for (std::size_t b = 0; b < s_.batch; ++b) {
        std::vector<char> present = format_.check(history, b, layer, ref_[layer][b], "history");
        if constexpr (kRing) {
          // A ring holds at least what a query at the next position reads.
          check_required(present, window_from(n), n, rule_.sinks, "history", layer);
          CACHE_FUZZ_REQUIRE(history.window == s_.window && history.sinks == s_.sinks, "history: window");
          if (b == 0) held_[layer] = present;
        } else {
          CACHE_FUZZ_REQUIRE(std::count(present.begin(), present.end(), 1) == static_cast<std::ptrdiff_t>(n),
                             "history: positions missing");
        }
        snap.present.push_back(std::move(present));
      }
    }
    if (agree) {
      CACHE_FUZZ_REQUIRE(cache_.length() == length(0), "length()");
    } else {
      expect(Expect::runtime_error, "length() with layers that disagree", [&] { (void)cache_.length(); });
    }
    expect(Expect::out_of_range, "length(layers)", [&] { (void)cache_.length(s_.layers); });
    expect(Expect::out_of_range, "history(layers)", [&] { (void)cache_.history(s_.layers); });
    CACHE_FUZZ_REQUIRE(cache_.capacity() == capacity() && cache_.layers() == s_.layers, "capacity() or layers()");
    format_.check_counts(cache_);
    snap.numbers.push_back(cache_.bytes());
    return snap;
  }

 private:
  Cache cache_;
  std::vector<std::vector<Stream<T>>> ref_;  // [layer][batch row]
  std::vector<std::size_t> furthest_;        // ring: the most tokens each layer reached since reset
  std::vector<std::vector<char>> held_;      // ring: what each layer's history held at the last check
};
}  // namespace

void run_contiguous(std::size_t variant, std::size_t format, const Setup& s, Bytes& in) {
  testing::formats::visit(format, [&]<class T>() {
    switch (variant) {
      case 0:
        ContiguousHarness<KvCache<T>>(s).run(in);
        break;
      case 1:
        ContiguousHarness<ConcatKvCache<T>>(s).run(in);
        break;
      default:
        ContiguousHarness<RingKvCache<T>>(s).run(in);
    }
  });
}

}  // namespace kvcache::fuzz
