// SPDX-License-Identifier: Apache-2.0
#pragma once

// What cache_fuzz's harnesses share (contiguous_fuzz.cpp for KvCache, ConcatKvCache and
// RingKvCache, slot_fuzz.cpp, paged_fuzz.cpp): the input read a byte at a time, the header's
// geometry, the exception a call must throw, seeded chunks, and the checks of a history and of
// attention against the reference model (tests/support/reference_model.hpp). A difference
// prints what differed and traps, so that libFuzzer keeps the input.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "kvcache/attention.hpp"
#include "kvcache/quantized.hpp"
#include "support/formats.hpp"
#include "support/reference_model.hpp"

namespace kvcache::fuzz {

using testing::StoredToken;
using testing::Stream;
using testing::WindowRule;

// What the harness is doing, for the message of a failure.
inline std::string g_context;

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "cache_fuzz: %s\n  while: %s\n", what.c_str(), g_context.c_str());
  std::fflush(stderr);
  __builtin_trap();
}

// The message is built only when the check fails.
#define CACHE_FUZZ_REQUIRE(ok, message) \
  do {                                  \
    if (!(ok)) fail(message);           \
  } while (false)

inline std::string str(std::size_t n) { return std::to_string(n); }

inline constexpr std::size_t kMaxOps = 48;

/// The fuzzer's input, a byte at a time; past its end every byte is 0.
class Bytes {
 public:
  Bytes(const std::uint8_t* data, std::size_t size) noexcept : data_(data), size_(size) {}
  [[nodiscard]] bool empty() const noexcept { return at_ >= size_; }
  std::uint8_t byte() noexcept { return at_ < size_ ? data_[at_++] : std::uint8_t{0}; }
  /// A value in [lo, hi].
  std::size_t pick(std::size_t lo, std::size_t hi) noexcept { return hi <= lo ? lo : lo + byte() % (hi - lo + 1); }
  bool one_in(unsigned n) noexcept { return byte() % n == 0; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t at_ = 0;
};

/// Values for k, v and q: a few input bytes seed it, so that the input stays short.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) noexcept : state_(seed) {}
  std::uint64_t next() noexcept {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  /// Uniform in [-1, 1).
  float unit() noexcept { return static_cast<float>(next() >> 40) * 0x1p-23F - 1.0F; }

 private:
  std::uint64_t state_;
};

/// A chunk's magnitude: mostly [-1, 1], sometimes zeros, large values (that fp8 clips) or tiny.
inline float magnitude_of(std::uint8_t code) noexcept {
  switch (code % 8) {
    case 5:
      return 0.0F;
    case 6:
      return 1000.0F;
    case 7:
      return 1e-30F;
    default:
      return 1.0F;
  }
}

/// Which exception a call must throw (by exact type), or none.
enum class Expect { none, out_of_range, invalid_argument, length_error, logic_error, runtime_error };

inline const char* name_of(Expect e) {
  switch (e) {
    case Expect::none:
      return "no exception";
    case Expect::out_of_range:
      return "std::out_of_range";
    case Expect::invalid_argument:
      return "std::invalid_argument";
    case Expect::length_error:
      return "std::length_error";
    case Expect::logic_error:
      return "std::logic_error";
    case Expect::runtime_error:
      return "std::runtime_error";
  }
  return "?";
}

inline bool is(const std::exception& e, Expect expected) {
  const std::type_info& t = typeid(e);
  switch (expected) {
    case Expect::out_of_range:
      return t == typeid(std::out_of_range);
    case Expect::invalid_argument:
      return t == typeid(std::invalid_argument);
    case Expect::length_error:
      return t == typeid(std::length_error);
    case Expect::logic_error:
      return t == typeid(std::logic_error);
    case Expect::runtime_error:
      return t == typeid(std::runtime_error);
    case Expect::none:
      return false;
  }
  return false;
}

/// Runs `call` and traps unless it throws exactly `expected` (or nothing, for none).
template <class Call>
void expect(Expect expected, const char* what, const Call& call) {
  try {
    call();
  } catch (const std::exception& e) {
    if (!is(e, expected)) {
      fail(std::string(what) + ": expected " + name_of(expected) + ", threw " + typeid(e).name() + ": " + e.what());
    }
    return;
  }
  if (expected != Expect::none) fail(std::string(what) + ": expected " + name_of(expected) + ", returned");
}

/// Everything the header bytes choose, whatever the variant.
struct Setup {
  std::size_t layers = 1, kv_heads = 1, head_dim = 1, group = 1, batch = 1, slots = 1, capacity = 1;
  std::size_t window = 1, sinks = 0, slack = 0, ring_capacity = 0;
  std::size_t block_tokens = 1, blocks = 1, pool_capacity = 0;
  bool windowed = false;  // a slot cache or a pool with the ring's window, sinks and slack
  std::uint64_t seed = 0;
};

inline Setup read_setup(Bytes& in) {
  static constexpr std::array<std::size_t, 10> kHeadDims = {3, 8, 1, 32, 5, 16, 64, 2, 33, 128};
  Setup s;
  s.layers = in.pick(1, 3);
  s.kv_heads = in.pick(1, 2);
  s.head_dim = kHeadDims[in.byte() % kHeadDims.size()];
  s.group = in.pick(1, 2);
  const std::uint8_t rows = in.byte();
  s.batch = 1 + rows % 2;
  s.slots = 1 + rows / 2 % 4;
  s.capacity = in.pick(1, 48);
  s.window = in.pick(1, 8);
  s.sinks = in.pick(0, 3);
  s.slack = in.pick(0, 4);
  const std::uint8_t ring_capacity = in.byte();
  s.ring_capacity = ring_capacity % 2 == 0 ? 0 : 8 + ring_capacity / 2 % 48;
  s.block_tokens = in.pick(1, 5);
  s.blocks = in.pick(1, 16);
  const std::uint8_t pool_capacity = in.byte();
  s.pool_capacity = pool_capacity % 2 == 0 ? 0 : 1 + pool_capacity / 2 % (s.blocks * s.block_tokens + 4);
  // Once whether head scales were given (a format with them now requires them); now whether the
  // slot cache and the pool have a window.
  s.windowed = in.byte() / 2 % 2 == 1;
  s.seed = in.byte();
  return s;
}

/// Tokens of a chunk: mostly one, sometimes up to 16, now and then none.
inline std::size_t chunk_tokens(Bytes& in) {
  const std::uint8_t c = in.byte();
  if (c % 16 == 0) return 0;
  if (c % 4 == 1) return 2 + c / 16 % 15;
  return 1;
}

inline std::vector<std::int64_t> arange(std::size_t first, std::size_t count) {
  std::vector<std::int64_t> p(count);
  for (std::size_t i = 0; i < count; ++i) p[i] = static_cast<std::int64_t>(first + i);
  return p;
}

/// k and v of one update, owned: [B, H_kv, T, D] of the compute type.
template <class In>
struct Chunk {
  Shape shape;
  std::vector<In> k, v;
  [[nodiscard]] TensorView<const In> kv(bool values) const { return {(values ? v : k).data(), shape}; }
};

/// causal_attention for float storage, through every kernel form it dispatches to by head size;
/// for the other formats the form every head size can take, called as causal_attention calls it.
/// The kernel's head-size forms, compiled for every format, would triple this file's build time.
template <class T, class In>
void attend(const std::vector<In>& q, const Shape& shape, const Positions& positions, const History<T>& history,
            std::vector<In>& out, const AttentionOptions& options) {
  const TensorView<const In> q_view(q.data(), shape);
  const TensorView<In> out_view(out.data(), shape);
  if constexpr (std::is_same_v<T, float>) {
    causal_attention(q_view, positions, history, out_view, options);
  } else {
    using Acc = acc_type<T>;
    detail::check_attention(q_view, positions, history, out_view);
    if (history.tokens() == 0) {
      std::fill(out.begin(), out.end(), detail::narrow<In>(0.0F));
      return;
    }
    const Acc scale = Acc{1} / std::sqrt(static_cast<Acc>(shape.head_dim));
    const detail::VisibilityRule rule(history.window, history.sinks, options.window, options.sinks);
    if constexpr (detail::is_rotated<T>) {
      detail::with_rotated_queries<T>(q_view, out_view, [&](const TensorView<float>& rows) {
        detail::attend<16>(detail::query_rows<float>(TensorView<const float>(rows), positions, rows), history, rule,
                           scale, options);
      });
    } else {
      detail::attend<16>(detail::query_rows<Acc>(q_view, positions, out_view), history, rule, scale, options);
    }
  }
}

/// Format T as the harnesses see it: its head scales, seeded chunks, what a cache must store for
/// them (the reference model's encoding), and the checks of a history and of attention over it.
template <class T>
class Format {
 public:
  using Codec = storage_codec<T>;
  using Unit = typename Codec::unit;
  using In = std::conditional_t<compute_type<T>, T, float>;
  static constexpr bool kHeadScales = detail::has_head_scales<T>;
  static constexpr bool kChecksInput = detail::checks_input<T>;

  Format(const Setup& s, std::size_t layers) : heads_(s.kv_heads), dim_(s.head_dim), units_(Codec::units(s.head_dim)) {
    static constexpr std::array<float, 4> kScales = {1.0F / 448.0F, 1.0F / 64.0F, 2.0F, 1e-3F};
    if constexpr (kHeadScales) {
      for (std::size_t i = 0; i < layers * heads_; ++i) {
        keys_.push_back(kScales[(s.seed + i) % 4]);
        values_.push_back(kScales[(s.seed + 3 * i + 1) % 4]);
      }
    }
  }

  /// The head scales the config gives ([layer, head]); they stay the cache's through reset().
  [[nodiscard]] std::span<const float> config_keys() const { return keys_; }
  [[nodiscard]] std::span<const float> config_values() const { return values_; }

  /// Token t of batch row b of a chunk written into `layer`, encoded once as the cache must store it.
  StoredToken<T> encode(const Chunk<In>& c, std::size_t b, std::size_t t, std::size_t layer) {
    return testing::store_token<T>(c.kv(false), c.kv(true), b, t, layer_scales(keys_, layer),
                                   layer_scales(values_, layer), &clipped_);
  }
  /// encode()'s row for a token a reused block already holds: nothing is written, so nothing
  /// saturates again.
  StoredToken<T> encode_held(const Chunk<In>& c, std::size_t b, std::size_t t, std::size_t layer) const {
    return testing::store_token<T>(c.kv(false), c.kv(true), b, t, layer_scales(keys_, layer),
                                   layer_scales(values_, layer));
  }

  /// Checks batch row b of a history of `layer` against `ref`, the stream it reads: every key it
  /// returns must be a position the stream holds, once, with the stored bytes and scales the
  /// reference expects. Returns which positions it holds.
  std::vector<char> check(const History<T>& history, std::size_t b, std::size_t layer, const Stream<T>& ref,
                          const char* what) const {
    std::vector<char> present(ref.size(), 0);
    const auto where = [&] { return std::string(what) + " layer " + str(layer) + " batch row " + str(b) + ": "; };
    for (std::size_t s = 0; s < history.segments.size(); ++s) {
      const Segment<T>& seg = history.segments[s];
      CACHE_FUZZ_REQUIRE(
          seg.keys.shape() == seg.values.shape(),
          where() + "segment " + str(s) + " keys " + seg.keys.shape().str() + " values " + seg.values.shape().str());
      CACHE_FUZZ_REQUIRE(seg.positions.tokens() == seg.keys.tokens(),
                         where() + "segment " + str(s) + " positions " + str(seg.positions.tokens()));
      CACHE_FUZZ_REQUIRE(seg.keys.heads() == heads_ && seg.keys.head_dim() == units_,
                         where() + "segment " + str(s) + " shape " + seg.keys.shape().str());
      CACHE_FUZZ_REQUIRE(b < seg.batch(), where() + "segment " + str(s) + " has " + str(seg.batch()) + " rows");
      const std::size_t stored = seg.stored_row(b);
      CACHE_FUZZ_REQUIRE(stored < seg.keys.batch(), where() + "stored row " + str(stored));
      const std::span<const std::int64_t> positions = seg.positions.row(stored);
      for (std::size_t j = 0; j < seg.tokens(b); ++j) {
        const std::int64_t p = positions[j];
        if (p == -1) continue;  // a slot's row that holds no position since a truncate
        CACHE_FUZZ_REQUIRE(
            p >= 0 && static_cast<std::size_t>(p) < ref.size(),
            where() + "position " + std::to_string(p) + " returned, the stream holds " + str(ref.size()));
        const auto at = static_cast<std::size_t>(p);
        CACHE_FUZZ_REQUIRE(present[at] == 0, where() + "position " + str(at) + " returned twice");
        present[at] = 1;
        const StoredToken<T>& e = ref[at];
        for (std::size_t h = 0; h < heads_; ++h) {
          for (const bool values : {false, true}) {
            const TensorView<const Unit>& view = values ? seg.values : seg.keys;
            const Unit* expected = e.units(values).data() + h * units_;
            CACHE_FUZZ_REQUIRE(std::memcmp(view.row(stored, h, j), expected, units_ * sizeof(Unit)) == 0,
                               where() + (values ? "values" : "keys") + " of position " + str(at) + " head " + str(h) +
                                   " differ from what was written");
            if constexpr (detail::reads_scales<Codec>) {
              const RowScales& scales = values ? seg.value_scales : seg.key_scales;
              CACHE_FUZZ_REQUIRE(!scales.empty(), where() + "no scales");
              const float got = *scales.at(stored, h, j);
              const float want = e.scales(values)[h];
              CACHE_FUZZ_REQUIRE(std::memcmp(&got, &want, sizeof got) == 0,
                                 where() + "scale of position " + str(at) + " head " + str(h) + ": expected " +
                                     std::to_string(want) + ", given " + std::to_string(got));
            }
          }
        }
      }
    }
    return present;
  }

  /// Runs causal_attention over `history` for batch row b's queries at q_positions[b] and
  /// compares it with the reference model's uncached attention over streams[b].
  void check_attention(const History<T>& history, const std::vector<const Stream<T>*>& streams,
                       const std::vector<std::vector<std::int64_t>>& q_positions, const WindowRule& rule,
                       std::size_t group, Bytes& in) const {
    const std::size_t batch = streams.size();
    if (batch == 0 || q_positions[0].empty()) return;
    const std::size_t tokens = q_positions[0].size();
    const Shape shape{batch, heads_ * group, tokens, dim_};
    Rng rng(in.byte() + 0x5151ULL * tokens);
    std::vector<In> q(shape.size()), out(shape.size());
    for (In& x : q) x = detail::narrow<In>(rng.unit());
    std::vector<std::int64_t> flat;
    bool shared = true;
    for (const auto& p : q_positions) {
      flat.insert(flat.end(), p.begin(), p.end());
      shared = shared && p == q_positions[0];
    }
    const Positions positions = shared ? Positions(flat.data(), tokens) : Positions(flat.data(), tokens, tokens);
    // Runs of every length, the prefetch reaching past a run's segment or not at all.
    const std::size_t run = in.one_in(2) ? std::size_t{16} : in.pick(1, 40);
    const std::size_t ahead = in.one_in(2) ? std::size_t{1024} : std::size_t{64} * in.pick(0, 8);
    // Either as from memory (runs of `run`, rows asked for ahead) or as from cache.
    const std::size_t in_cache_bytes = in.one_in(2) ? std::size_t{0} : AttentionTuning{}.in_cache_bytes;
    const AttentionOptions options{.threads = 1,
                                   .tuning = {.run_keys = run,
                                              .prefetch_bytes = ahead,
                                              .in_cache_bytes = in_cache_bytes,
                                              .cached_run_keys = in.pick(1, 256)}};
    expect(Expect::none, "causal_attention", [&] { attend(q, shape, positions, history, out, options); });

    const double base = sizeof(In) == 2 ? 1e-2 : 1e-4;
    std::vector<double> q_row(dim_);
    for (std::size_t b = 0; b < batch; ++b) {
      for (std::size_t hq = 0; hq < shape.heads; ++hq) {
        for (std::size_t t = 0; t < tokens; ++t) {
          const std::size_t row = ((b * shape.heads + hq) * tokens + t) * dim_;
          for (std::size_t d = 0; d < dim_; ++d) q_row[d] = static_cast<double>(detail::widen(q[row + d]));
          const auto query = static_cast<std::size_t>(q_positions[b][t]);
          const testing::ReferenceAttention expected =
              testing::reference_attention(q_row, *streams[b], hq / group, query, rule);
          if (expected.key_max > 64.0) continue;  // scores so large that float rounding would dominate
          for (std::size_t d = 0; d < dim_; ++d) {
            const auto given = static_cast<double>(detail::widen(out[row + d]));
            CACHE_FUZZ_REQUIRE(std::fabs(given - expected.out[d]) <= base * (1.0 + expected.value_max),
                               "causal_attention batch row " + str(b) + " q head " + str(hq) + " query at " +
                                   str(query) + " index " + str(d) + ": expected " + std::to_string(expected.out[d]) +
                                   ", given " + std::to_string(given) + " over " + str(expected.keys) + " keys");
          }
        }
      }
    }
  }

  /// Checks the cache's head scales and clipped count against the reference's.
  template <class Cache>
  void check_counts(const Cache& cache) const {
    CACHE_FUZZ_REQUIRE(cache.clipped() == clipped_,
                       "clipped(): expected " + str(clipped_) + ", given " + str(cache.clipped()));
    if constexpr (kHeadScales) {
      CACHE_FUZZ_REQUIRE(cache.key_head_scales() == keys_ && cache.value_head_scales() == values_,
                         "key_head_scales() or value_head_scales() differ from the reference's");
    } else {
      CACHE_FUZZ_REQUIRE(cache.key_head_scales().empty(), "key_head_scales() of a format without");
    }
  }

  /// A chunk [batch, H_kv, tokens, D] of seeded values of the given magnitude.
  [[nodiscard]] Chunk<In> chunk(std::size_t batch, std::size_t tokens, float magnitude, Rng& rng) const {
    Chunk<In> c{{batch, heads_, tokens, dim_}, {}, {}};
    c.k.resize(c.shape.size());
    c.v.resize(c.shape.size());
    for (In& x : c.k) x = detail::narrow<In>(rng.unit() * magnitude);
    for (In& x : c.v) x = detail::narrow<In>(rng.unit() * magnitude);
    return c;
  }

  /// Puts a value the format refuses (not finite, or beyond its range) somewhere in a chunk.
  void poison(Chunk<In>& c, Bytes& in) const requires kChecksInput {
    static constexpr std::array<float, 4> kBad = {std::numeric_limits<float>::quiet_NaN(),
                                                  std::numeric_limits<float>::infinity(),
                                                  -std::numeric_limits<float>::infinity(), 70000.0F};
    float bad = kBad[in.byte() % kBad.size()];
    if (std::isfinite(bad) && bad <= Codec::max_magnitude) bad = std::numeric_limits<float>::quiet_NaN();
    auto& x = in.one_in(2) ? c.k : c.v;
    if (!x.empty()) x[in.byte() % x.size()] = detail::narrow<In>(bad);
  }

  [[nodiscard]] std::size_t heads() const { return heads_; }
  [[nodiscard]] std::size_t dim() const { return dim_; }

 private:
  [[nodiscard]] std::span<const float> layer_scales(const std::vector<float>& scales, std::size_t layer) const {
    if constexpr (kHeadScales) return std::span<const float>(scales).subspan(layer * heads_, heads_);
    return {};
  }

  std::size_t heads_, dim_, units_;
  std::vector<float> keys_, values_;  // [layer, head], formats with head scales
  std::size_t clipped_ = 0;
};

/// What a check after an operation saw; a bad call must leave it as it was.
struct Snapshot {
  std::vector<std::vector<char>> present;  // per stream, the positions its history holds
  std::vector<std::size_t> numbers;        // lengths, bytes, and a variant's own bookkeeping
  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};

/// Checks that a history holds every position below `end` from `from` on, and the sinks.
inline void check_required(const std::vector<char>& present, std::size_t from, std::size_t end, std::size_t sinks,
                           const char* what, std::size_t layer) {
  for (std::size_t p = 0; p < end; ++p) {
    const bool needed = p >= from || p < sinks;
    CACHE_FUZZ_REQUIRE(!needed || (p < present.size() && present[p] != 0),
                       std::string(what) + " layer " + str(layer) + ": position " + str(p) + " missing");
  }
}

/// The loop every harness runs, over what it derives: Derived::step(in, last) runs one
/// operation and Derived::check_all() checks everything against the reference, returning what
/// it saw.
template <class Derived, class T>
class Harness {
 public:
  using In = typename Format<T>::In;

  void run(Bytes& in) {
    Snapshot last = self().check_all();
    for (std::size_t op = 0; op < kMaxOps && !in.empty(); ++op) {
      self().step(in, last);
      last = self().check_all();
    }
  }

 protected:
  Harness(const Setup& s, const WindowRule& rule) : s_(s), rule_(rule), format_(s, s.layers) {}

  /// A failed call left everything as the last check saw it.
  void unchanged(const Snapshot& last) {
    const Snapshot now = self().check_all();
    CACHE_FUZZ_REQUIRE(now == last, "a failed call changed what the last check saw");
  }
  /// Runs a call that may throw std::out_of_range (and nothing else); returns whether it returned.
  template <class Call>
  bool taken(const char* what, const Call& call) {
    try {
      call();
    } catch (const std::exception& e) {
      CACHE_FUZZ_REQUIRE(is(e, Expect::out_of_range),
                         std::string(what) + " threw other than out_of_range: " + e.what());
      return false;
    }
    return true;
  }
  /// Attention over a history of the streams, each row's queries at its positions.
  void check_attention(const History<T>& history, const std::vector<const Stream<T>*>& streams,
                       const std::vector<std::vector<std::int64_t>>& queries, Bytes& in) const {
    format_.check_attention(history, streams, queries, rule_, s_.group, in);
  }
  /// The first position past the sinks that a query at `query` reads.
  [[nodiscard]] std::size_t window_from(std::size_t query) const { return rule_.first_read(query); }

  Setup s_;
  WindowRule rule_;  // the window and sinks the cache was given (0: none)
  Format<T> format_;

 private:
  Derived& self() { return static_cast<Derived&>(*this); }
};

/// KvCache (variant 0), ConcatKvCache (1) or RingKvCache (2) of every format, from the header.
void run_contiguous(std::size_t variant, std::size_t format, const Setup& s, Bytes& in);
/// SlotKvCache of every format.
void run_slot(std::size_t format, const Setup& s, Bytes& in);
/// PagedKvCache sequences over a BlockPool of every format.
void run_paged(std::size_t format, const Setup& s, Bytes& in);

}  // namespace kvcache::fuzz
