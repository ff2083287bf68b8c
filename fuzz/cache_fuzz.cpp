// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness for every cache variant and storage format. The input's first bytes choose
// a variant, a format and a small geometry; the rest is a sequence of operations: updates of any
// layer and chunk size, bad calls, truncate, reset, and each variant's own (slots acquired,
// written by rows and released; paged sequences forked, dropped, started from a reused prefix,
// run out of blocks). After each one every layer's history is compared, position by position,
// with a reference of what each position was given (for a ring, what its window lets attention
// read); a bad call must throw the documented type and change nothing; and attention over a
// history now and then must match a naive softmax over the reference's decoded rows. Slot caches
// and pools may have a window (half the inputs), and paged sequences are also written and read
// as the rows of a PagedBatch. Any difference prints what differed and traps, so that libFuzzer
// keeps the input.

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "kvcache/attention.hpp"
#include "kvcache/concat_kv_cache.hpp"
#include "kvcache/kv_cache.hpp"
#include "kvcache/paged_batch.hpp"
#include "kvcache/paged_kv_cache.hpp"
#include "kvcache/quantized.hpp"
#include "kvcache/ring_kv_cache.hpp"
#include "kvcache/slot_kv_cache.hpp"
#include "support/formats.hpp"

namespace kvcache::fuzz {
namespace {

// What the harness is doing, for the message of a failure.
std::string g_context;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "cache_fuzz: %s\n  while: %s\n", what.c_str(), g_context.c_str());
  std::fflush(stderr);
  __builtin_trap();
}

// The message is built only when the check fails.
#define CACHE_FUZZ_REQUIRE(ok, message) \
  do {                                  \
    if (!(ok)) fail(message);           \
  } while (false)

std::string str(std::size_t n) { return std::to_string(n); }

constexpr std::size_t kMaxOps = 48;

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
float magnitude_of(std::uint8_t code) noexcept {
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

const char* name_of(Expect e) {
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

bool is(const std::exception& e, Expect expected) {
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

Setup read_setup(Bytes& in) {
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
std::size_t chunk_tokens(Bytes& in) {
  const std::uint8_t c = in.byte();
  if (c % 16 == 0) return 0;
  if (c % 4 == 1) return 2 + c / 16 % 15;
  return 1;
}

std::vector<std::int64_t> arange(std::size_t first, std::size_t count) {
  std::vector<std::int64_t> p(count);
  for (std::size_t i = 0; i < count; ++i) p[i] = static_cast<std::int64_t>(first + i);
  return p;
}

/// What one position of one stream (a batch row of a layer) was given, as format T stores it.
template <class T>
struct Entry {
  std::vector<typename storage_codec<T>::unit> keys, values;  // [H_kv, units]
  std::vector<float> key_scales, value_scales;                // [H_kv], formats with a scale per row
};

/// A stream's reference: entry p is position p; positions continue from 0.
template <class T>
using Stream = std::vector<Entry<T>>;

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

/// Format T's side of the reference: how it encodes and decodes, and the head scales it keeps.
template <class T>
class Format {
 public:
  using Codec = storage_codec<T>;
  using Unit = typename Codec::unit;
  using In = std::conditional_t<compute_type<T>, T, float>;
  static constexpr bool kHeadScales = detail::has_head_scales<T>;
  static constexpr bool kRowScales = detail::has_row_scales<T>;
  static constexpr bool kChecksInput = detail::checks_input<T>;

  Format(const Setup& s, std::size_t layers) : heads_(s.kv_heads), dim_(s.head_dim), units_(Codec::units(s.head_dim)) {
    static constexpr std::array<float, 4> kScales = {1.0F / 448.0F, 1.0F / 64.0F, 2.0F, 1e-3F};
    if constexpr (kHeadScales) {
      for (std::size_t i = 0; i < layers * heads_; ++i) {
        config_keys_.push_back(kScales[(s.seed + i) % 4]);
        config_values_.push_back(kScales[(s.seed + 3 * i + 1) % 4]);
      }
    }
    reset_scales();
  }

  [[nodiscard]] std::span<const float> config_keys() const { return config_keys_; }
  [[nodiscard]] std::span<const float> config_values() const { return config_values_; }
  [[nodiscard]] std::size_t clipped() const { return clipped_; }

  /// What reset() does to the head scales: they stay the config's.
  void reset_scales() {
    keys_ = config_keys_;
    values_ = config_values_;
  }

  /// The head scales an update of `layer` encodes with: the config's.
  [[nodiscard]] std::pair<std::vector<float>, std::vector<float>> prepared(std::size_t layer,
                                                                           const Chunk<In>& /*c*/) const {
    std::vector<float> k, v;
    if constexpr (kHeadScales) {
      k.assign(keys_.begin() + static_cast<std::ptrdiff_t>(layer * heads_),
               keys_.begin() + static_cast<std::ptrdiff_t>((layer + 1) * heads_));
      v.assign(values_.begin() + static_cast<std::ptrdiff_t>(layer * heads_),
               values_.begin() + static_cast<std::ptrdiff_t>((layer + 1) * heads_));
    }
    return {std::move(k), std::move(v)};
  }
  void commit(std::size_t layer, const std::pair<std::vector<float>, std::vector<float>>& scales) {
    if constexpr (kHeadScales) {
      std::copy(scales.first.begin(), scales.first.end(), keys_.begin() + static_cast<std::ptrdiff_t>(layer * heads_));
      std::copy(scales.second.begin(), scales.second.end(),
                values_.begin() + static_cast<std::ptrdiff_t>(layer * heads_));
    }
  }

  /// Token t of batch row b of a chunk, encoded once as the cache must store it.
  Entry<T> encode(const Chunk<In>& c, std::size_t b, std::size_t t,
                  const std::pair<std::vector<float>, std::vector<float>>& scales) {
    Entry<T> e;
    for (const bool values : {false, true}) {
      auto& units = values ? e.values : e.keys;
      auto& row_scales = values ? e.value_scales : e.key_scales;
      units.resize(heads_ * units_);
      const TensorView<const In> x = c.kv(values);
      for (std::size_t h = 0; h < heads_; ++h) {
        if constexpr (kHeadScales) {
          const float s = (values ? scales.second : scales.first)[h];
          clipped_ += Codec::encode(x.row(b, h, t), units.data() + h * units_, dim_, s != 0.0F ? s : 1.0F);
        } else {
          const float s = Codec::encode(x.row(b, h, t), units.data() + h * units_, dim_);
          if constexpr (kRowScales) row_scales.push_back(s);
        }
      }
    }
    return e;
  }

  /// encode()'s row for a token a reused block already holds: nothing is written, so nothing
  /// saturates again.
  Entry<T> encode_held(const Chunk<In>& c, std::size_t b, std::size_t t,
                       const std::pair<std::vector<float>, std::vector<float>>& scales) {
    const std::size_t before = clipped_;
    Entry<T> e = encode(c, b, t, scales);
    clipped_ = before;
    return e;
  }

  /// The scale the history must give row `e`'s head h (0 for formats without).
  [[nodiscard]] float scale_of(const Entry<T>& e, std::size_t layer, std::size_t h, bool values) const {
    if constexpr (kHeadScales) return (values ? values_ : keys_)[layer * heads_ + h];
    if constexpr (kRowScales) return (values ? e.value_scales : e.key_scales)[h];
    return 0.0F;
  }
  /// Head h of row `e`, decoded (and rotated back, for a rotated format): the values attention reads.
  [[nodiscard]] std::vector<double> decode(const Entry<T>& e, std::size_t layer, std::size_t h, bool values) const {
    const Unit* row = (values ? e.values : e.keys).data() + h * units_;
    std::vector<float> x(dim_);
    for (std::size_t d = 0; d < dim_; ++d) {
      x[d] = static_cast<float>(Codec::value(row, d));
      if constexpr (detail::reads_scales<Codec>) x[d] *= scale_of(e, layer, h, values);
    }
    if constexpr (detail::is_rotated<T>) Codec::unrotate(x.data(), dim_);
    return {x.begin(), x.end()};
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
        const Entry<T>& e = ref[at];
        for (std::size_t h = 0; h < heads_; ++h) {
          for (const bool values : {false, true}) {
            const TensorView<const Unit>& view = values ? seg.values : seg.keys;
            const Unit* expected = (values ? e.values : e.keys).data() + h * units_;
            CACHE_FUZZ_REQUIRE(std::memcmp(view.row(stored, h, j), expected, units_ * sizeof(Unit)) == 0,
                               where() + (values ? "values" : "keys") + " of position " + str(at) + " head " + str(h) +
                                   " differ from what was written");
            if constexpr (detail::reads_scales<Codec>) {
              const RowScales& scales = values ? seg.value_scales : seg.key_scales;
              CACHE_FUZZ_REQUIRE(!scales.empty(), where() + "no scales");
              const float got = *scales.at(stored, h, j);
              const float want = scale_of(e, layer, h, values);
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
  /// compares it with a naive softmax over the decoded rows of streams[b], the window rule
  /// (window, sinks; 0: none) applied by position.
  void check_attention(const History<T>& history, std::size_t layer, const std::vector<const Stream<T>*>& streams,
                       const std::vector<std::vector<std::int64_t>>& q_positions, std::size_t window, std::size_t sinks,
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

    const double scale = 1.0 / std::sqrt(static_cast<double>(dim_));
    const double base = sizeof(In) == 2 ? 1e-2 : 1e-4;
    for (std::size_t b = 0; b < batch; ++b) {
      const Stream<T>& ref = *streams[b];
      for (std::size_t hq = 0; hq < shape.heads; ++hq) {
        const std::size_t h = hq / group;
        for (std::size_t t = 0; t < tokens; ++t) {
          const std::int64_t qp = q_positions[b][t];
          std::vector<std::size_t> visible;
          for (std::size_t p = 0; p < ref.size() && static_cast<std::int64_t>(p) <= qp; ++p) {
            if (window == 0 || p < sinks || static_cast<std::size_t>(qp) - p < window) visible.push_back(p);
          }
          std::vector<double> scores(visible.size());
          std::vector<std::vector<double>> values(visible.size());
          double top = -1e300, kmax = 0.0, vmax = 0.0;
          for (std::size_t i = 0; i < visible.size(); ++i) {
            const std::vector<double> keys = decode(ref[visible[i]], layer, h, false);
            values[i] = decode(ref[visible[i]], layer, h, true);
            double s = 0.0;
            for (std::size_t d = 0; d < dim_; ++d) {
              kmax = std::max(kmax, std::fabs(keys[d]));
              vmax = std::max(vmax, std::fabs(values[i][d]));
              s += static_cast<double>(detail::widen(q[((b * shape.heads + hq) * tokens + t) * dim_ + d])) * keys[d];
            }
            scores[i] = s * scale;
            top = std::max(top, scores[i]);
          }
          if (kmax > 64.0) continue;  // scores so large that float rounding would dominate
          double sum = 0.0;
          for (double& s : scores) sum += (s = std::exp(s - top));
          for (std::size_t d = 0; d < dim_; ++d) {
            double expected = 0.0;
            for (std::size_t i = 0; i < visible.size(); ++i) expected += scores[i] / sum * values[i][d];
            const auto given =
                static_cast<double>(detail::widen(out[((b * shape.heads + hq) * tokens + t) * dim_ + d]));
            CACHE_FUZZ_REQUIRE(std::fabs(given - expected) <= base * (1.0 + vmax),
                               "causal_attention layer " + str(layer) + " batch row " + str(b) + " q head " + str(hq) +
                                   " query at " + std::to_string(qp) + " index " + str(d) + ": expected " +
                                   std::to_string(expected) + ", given " + std::to_string(given) + " over " +
                                   str(visible.size()) + " keys");
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
  std::size_t heads_, dim_, units_;
  std::vector<float> config_keys_, config_values_;
  std::vector<float> keys_, values_;  // [layer, head], formats with head scales
  std::size_t clipped_ = 0;
};

/// What a check after an operation saw; a bad call must leave it as it was.
struct Snapshot {
  std::vector<std::vector<char>> present;  // per stream, the positions its history holds
  std::vector<std::size_t> numbers;        // lengths, bytes, and a variant's own bookkeeping
  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};

/// The reference for one layer of a chunk that ends an update: checks what it returned.
void check_required(const std::vector<char>& present, std::size_t from, std::size_t end, std::size_t sinks,
                    const char* what, std::size_t layer) {
  for (std::size_t p = 0; p < end; ++p) {
    const bool needed = p >= from || p < sinks;
    CACHE_FUZZ_REQUIRE(!needed || (p < present.size() && present[p] != 0),
                       std::string(what) + " layer " + str(layer) + ": position " + str(p) + " missing");
  }
}

// ---- KvCache, ConcatKvCache, RingKvCache -----------------------------------------------------

template <class Cache>
inline constexpr bool kIsRing = false;
template <class T>
inline constexpr bool kIsRing<RingKvCache<T>> = true;

template <class Cache>
class DenseHarness {
  using T = typename Cache::value_type;
  using In = typename Format<T>::In;

 public:
  explicit DenseHarness(const Setup& s)
      : s_(s), format_(s, s.layers), cache_(config()), ref_(s.layers, std::vector<Stream<T>>(s.batch)) {
    furthest_.assign(s.layers, 0);
    held_.assign(s.layers, {});
  }

  void run(Bytes& in) {
    Snapshot last = check_all();
    for (std::size_t op = 0; op < kMaxOps && !in.empty(); ++op) {
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
            format_.reset_scales();
            furthest_.assign(s_.layers, 0);
          } else {
            read_attention(in);
          }
          break;
        default:
          bad_call(in, last);
      }
      last = check_all();
    }
  }

 private:
  static constexpr bool kRing = kIsRing<Cache>;
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
  /// The first position a query at `query` reads besides the sinks.
  [[nodiscard]] std::size_t window_from(std::size_t query) const {
    if constexpr (kRing) return query + 1 > s_.window ? query + 1 - s_.window : 0;
    return 0;
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
    const auto scales = format_.prepared(layer, c);
    History<T> history;
    expect(Expect::none, "update", [&] { history = cache_.update(layer, c.kv(false), c.kv(true), positions); });
    format_.commit(layer, scales);
    for (std::size_t b = 0; b < s_.batch; ++b)
      for (std::size_t t = 0; t < tokens; ++t) ref_[layer][b].push_back(format_.encode(c, b, t, scales));
    furthest_[layer] = std::max(furthest_[layer], start + tokens);

    // Every key some query of the chunk may read must be there (for a ring: its window and sinks).
    std::vector<const Stream<T>*> streams;
    for (std::size_t b = 0; b < s_.batch; ++b) {
      const std::vector<char> present = format_.check(history, b, layer, ref_[layer][b], "update's history");
      check_required(present, window_from(start), start + tokens, kRing ? s_.sinks : 0, "update's history", layer);
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
      format_.check_attention(history, layer, streams, std::vector<std::vector<std::int64_t>>(s_.batch, positions),
                              kRing ? s_.window : 0, kRing ? s_.sinks : 0, s_.group, in);
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
    format_.check_attention(history, layer, streams, std::vector<std::vector<std::int64_t>>(s_.batch, {next}),
                            kRing ? s_.window : 0, kRing ? s_.sinks : 0, s_.group, in);
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

  /// A failed call left everything as the last check saw it.
  void unchanged(const Snapshot& last) {
    const Snapshot now = check_all();
    CACHE_FUZZ_REQUIRE(now == last, "a failed call changed the cache");
  }

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
          check_required(present, window_from(n), n, s_.sinks, "history", layer);
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

  Setup s_;
  Format<T> format_;
  Cache cache_;
  std::vector<std::vector<Stream<T>>> ref_;  // [layer][batch row]
  std::vector<std::size_t> furthest_;        // ring: the most tokens each layer reached since reset
  std::vector<std::vector<char>> held_;      // ring: what each layer's history held at the last check
};

// ---- SlotKvCache -----------------------------------------------------------------------------

template <class T>
class SlotHarness {
  using In = typename Format<T>::In;

 public:
  explicit SlotHarness(const Setup& s)
      : s_(s),
        format_(s, s.layers),
        cache_(config()),
        ref_(s.layers, std::vector<Stream<T>>(s.slots)),
        acquired_(s.slots, 0),
        furthest_(s.layers, std::vector<std::size_t>(s.slots, 0)),
        held_(s.layers, std::vector<std::vector<char>>(s.slots)) {}

  void run(Bytes& in) {
    Snapshot last = check_all();
    for (std::size_t op = 0; op < kMaxOps && !in.empty(); ++op) {
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
            format_.reset_scales();
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
      last = check_all();
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
  [[nodiscard]] std::size_t window() const { return s_.windowed ? s_.window : 0; }
  [[nodiscard]] std::size_t sinks() const { return s_.windowed ? s_.sinks : 0; }
  /// The first position a query at `query` reads besides the sinks.
  [[nodiscard]] std::size_t window_from(std::size_t query) const {
    return s_.windowed && query + 1 > s_.window ? query + 1 - s_.window : 0;
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
    check_required(present, window_from(from), ref.size(), s_.sinks, what, layer);
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
    const auto scales = format_.prepared(layer, c);
    History<T> history;
    expect(Expect::none, "row update",
           [&] { history = cache_.update(layer, c.kv(false), c.kv(true), p.view(tokens), listed); });
    format_.commit(layer, scales);
    std::vector<const Stream<T>*> streams;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      for (std::size_t t = 0; t < tokens; ++t) ref_[layer][rows[i]].push_back(format_.encode(c, i, t, scales));
      furthest_[layer][rows[i]] = std::max(furthest_[layer][rows[i]], ref_[layer][rows[i]].size());
    }
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Stream<T>& ref = ref_[layer][rows[i]];
      const std::vector<char> present = format_.check(history, i, layer, ref, "row update's history");
      check_held(present, ref, p.per_row[i].empty() ? ref.size() : static_cast<std::size_t>(p.per_row[i][0]),
                 "row update's history", layer);
      streams.push_back(&ref);
    }
    CACHE_FUZZ_REQUIRE(rows.empty() || (history.window == window() && history.sinks == sinks()),
                       "row update's history: window");
    if (rows.empty()) CACHE_FUZZ_REQUIRE(history.tokens() == 0, "an update of no rows returned keys");
    if (in.one_in(2)) {  // a read of the layer is no mutating call: what update() returned stays valid
      expect(Expect::none, "history", [&] { (void)cache_.history(layer); });
      for (std::size_t i = 0; i < rows.size(); ++i)
        (void)format_.check(history, i, layer, ref_[layer][rows[i]], "row update's history after history(layer)");
    }
    if (in.one_in(3)) format_.check_attention(history, layer, streams, p.per_row, window(), sinks(), s_.group, in);
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
    const auto scales = format_.prepared(layer, c);
    format_.commit(layer, scales);
    for (std::size_t r = 0; r < s_.slots; ++r) {
      acquired_[r] = 1;
      for (std::size_t t = 0; t < tokens; ++t) ref_[layer][r].push_back(format_.encode(c, r, t, scales));
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
    format_.check_attention(history, layer, streams, queries, window(), sinks(), s_.group, in);
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

  void unchanged(const Snapshot& last) {
    const Snapshot now = check_all();
    CACHE_FUZZ_REQUIRE(now == last, "a failed call changed the cache");
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

  Setup s_;
  Format<T> format_;
  SlotKvCache<T> cache_;
  std::vector<std::vector<Stream<T>>> ref_;  // [layer][slot]
  std::vector<int> acquired_;
  std::vector<std::vector<std::size_t>> furthest_;    // [layer][slot]: the most tokens since it was emptied
  std::vector<std::vector<std::vector<char>>> held_;  // [layer][slot]: what its history held at the last check
};

// ---- PagedKvCache over a BlockPool -----------------------------------------------------------

template <class T>
class PagedHarness {
  using In = typename Format<T>::In;
  static constexpr std::size_t kSequences = 4;

 public:
  explicit PagedHarness(const Setup& s)
      : s_(s),
        format_(s, s.layers),
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

  void run(Bytes& in) {
    Snapshot last = check_all();
    for (std::size_t op = 0; op < kMaxOps && !in.empty(); ++op) {
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
      last = check_all();
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

  [[nodiscard]] std::size_t window() const { return s_.windowed ? s_.window : 0; }
  [[nodiscard]] std::size_t sinks() const { return s_.windowed ? s_.sinks : 0; }
  /// The first position a query at `query` reads besides the sinks.
  [[nodiscard]] std::size_t window_from(std::size_t query) const {
    return s_.windowed && query + 1 > s_.window ? query + 1 - s_.window : 0;
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
    check_required(present, from, n, s_.sinks, what, layer);
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
    const auto scales = format_.prepared(layer, c);
    History<T> history;
    expect(Expect::none, "update", [&] { history = s.cache->update(layer, c.kv(false), c.kv(true), positions); });
    format_.commit(layer, scales);
    for (std::size_t t = 0; t < tokens; ++t) s.layers[layer].push_back(format_.encode(c, 0, t, scales));
    s.needs[layer] = std::max(s.needs[layer], window_from(start));
    const std::vector<char> present = format_.check(history, 0, layer, s.layers[layer], "update's history");
    check_held(s, present, layer, s.needs[layer], "update's history");
    CACHE_FUZZ_REQUIRE(history.window == window() && history.sinks == sinks(), "update's history: window");
    if (in.one_in(3)) {
      format_.check_attention(history, layer, {&s.layers[layer]}, {positions}, window(), sinks(), s_.group, in);
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
      format_.check_attention(history, layer, streams, queries, window(), sinks(), s_.group, in);
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
      const auto scales = format_.prepared(layer, c);
      History<T> history;
      expect(Expect::none, "PagedBatch update", [&] { history = batch.update(layer, c.kv(false), c.kv(true), given); });
      format_.commit(layer, scales);
      std::vector<const Stream<T>*> streams;
      std::vector<std::vector<std::int64_t>> queries;
      for (std::size_t i = 0; i < rows.size(); ++i) {
        Seq& s = seqs_[rows[i]];
        const std::size_t start = length(s, layer);
        for (std::size_t t = 0; t < tokens; ++t) s.layers[layer].push_back(format_.encode(c, i, t, scales));
        s.needs[layer] = std::max(s.needs[layer], window_from(start));
        const std::vector<char> present =
            format_.check(history, i, layer, s.layers[layer], "PagedBatch update's history");
        check_held(s, present, layer, s.needs[layer], "PagedBatch update's history");
        streams.push_back(&s.layers[layer]);
        queries.push_back(arange(start, tokens));
      }
      CACHE_FUZZ_REQUIRE(history.window == window() && history.sinks == sinks(), "PagedBatch history: window");
      if (in.one_in(3)) format_.check_attention(history, layer, streams, queries, window(), sinks(), s_.group, in);
    }
    (void)last;
  }

  void read_attention(Bytes& in, std::size_t at) {
    Seq& s = seqs_[at];
    const std::size_t layer = in.pick(0, s_.layers - 1);
    g_context = "PagedKvCache attention over history(" + str(layer) + ")";
    History<T> history;
    expect(Expect::none, "history", [&] { history = s.cache->history(layer); });
    format_.check_attention(history, layer, {&s.layers[layer]}, {{static_cast<std::int64_t>(length(s, layer))}},
                            window(), sinks(), s_.group, in);
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
      const auto scales = format_.prepared(layer, c);  // the pool's own: a reused block was written with them
      for (std::size_t t = 0; t < skip; ++t) s.layers[layer].push_back(format_.encode_held(c, 0, t, scales));
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
    const bool gone = gap_end > gap_begin && n > gap_begin && std::max(sinks(), window_from(n)) < gap_end;
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

  void unchanged(const Snapshot& last) {
    const Snapshot now = check_all();
    CACHE_FUZZ_REQUIRE(now == last, "a failed call changed the pool or a sequence");
  }

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

  Setup s_;
  Format<T> format_;
  BlockPool<T> pool_;
  std::size_t capacity_;
  std::array<Seq, kSequences> seqs_{};
  std::array<std::vector<TokenId>, 4> prompts_{};  // ids of sequences dropped, for prefix reuse
  std::size_t next_prompt_ = 0;
};

template <class T>
void run_format(std::size_t variant, const Setup& s, Bytes& in) {
  switch (variant) {
    case 0:
      DenseHarness<KvCache<T>>(s).run(in);
      break;
    case 1:
      DenseHarness<ConcatKvCache<T>>(s).run(in);
      break;
    case 2:
      DenseHarness<RingKvCache<T>>(s).run(in);
      break;
    case 3:
      SlotHarness<T>(s).run(in);
      break;
    default:
      PagedHarness<T>(s).run(in);
  }
}

}  // namespace
}  // namespace kvcache::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvcache;
  fuzz::Bytes in(data, size);
  const std::size_t variant = in.byte() % 5;
  // The format byte indexes storage_formats, in its order: what the corpus' files were written for.
  const std::size_t format = in.byte() % testing::formats::size;
  const fuzz::Setup setup = fuzz::read_setup(in);
  testing::formats::visit(format, [&]<class T>() { fuzz::run_format<T>(variant, setup, in); });
  return 0;
}
