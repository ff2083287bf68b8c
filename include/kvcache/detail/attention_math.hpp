// SPDX-License-Identifier: Apache-2.0
#pragma once

// The inner loops of causal_attention. They work on whole vector registers (GCC/Clang vector
// extensions, or a plain array elsewhere) of the width the including translation unit is
// compiled for, so one code path runs at SSE2, AVX2 and AVX-512 alike. Scores come out W keys
// at a time: W dot products kept in W accumulators, summed together by a transpose-and-add
// tree, never one horizontal reduction per key. 16-bit rows are widened in registers, except
// where bfloat16 queries meet bfloat16 keys on a CPU that multiplies bfloat16 pairs.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#if defined(__AVX512F__) || (defined(__AVX__) && defined(__F16C__))
#include <immintrin.h>
#endif

#if defined(__GNUC__) || defined(__clang__)
// For code that must end up inside the loop that calls it: the steps of an unrolled row (each
// its own instructions, see for_each_step), and prefetches (GCC finds a function that only
// prefetches free of side effects and deletes calls to it before inlining them).
#define KVCACHE_ALWAYS_INLINE __attribute__((always_inline))
#else
#define KVCACHE_ALWAYS_INLINE
#endif

namespace kvcache::detail {

// The vector register width this translation unit is compiled for (the library is header-only,
// so this is the user's -m flags).
#if defined(__AVX512F__)
inline constexpr std::size_t kVectorBytes = 64;
#elif defined(__AVX__)
inline constexpr std::size_t kVectorBytes = 32;
#else
inline constexpr std::size_t kVectorBytes = 16;
#endif

/// Acc values per vector register of B bytes (the build's width, or under AVX-512 a narrower one
/// a kernel may be compiled for besides: narrow_vectors_pay).
template <class Acc, std::size_t B = kVectorBytes>
inline constexpr std::size_t kVector = B / sizeof(Acc);

/// Vector registers: AVX-512 has 32 (of every width), SSE2 and AVX2 have 16.
inline constexpr std::size_t kRegisters = kVectorBytes == 64 ? 32 : 16;

/// Vector registers of accumulators a loop may hold without spilling, with room left for its
/// operands.
inline constexpr std::size_t kAccumulators = kRegisters / 2;

/// A vector register as an array with element-wise operators: what Vector is where GCC/Clang
/// vector extensions are missing (the same results, left to the optimizer), and what the tests
/// run the shuffles on to check that path.
template <class E, std::size_t W>
struct LoopVector {
  E lane[W];
  E& operator[](std::size_t i) noexcept { return lane[i]; }
  E operator[](std::size_t i) const noexcept { return lane[i]; }
  LoopVector& operator+=(const LoopVector& o) noexcept {
    for (std::size_t i = 0; i < W; ++i) lane[i] += o.lane[i];
    return *this;
  }
  friend LoopVector operator+(LoopVector a, const LoopVector& b) noexcept { return a += b; }
  friend LoopVector operator*(LoopVector a, const LoopVector& b) noexcept {
    for (std::size_t i = 0; i < W; ++i) a.lane[i] *= b.lane[i];
    return a;
  }
  friend LoopVector operator<<(LoopVector a, int bits) noexcept {
    for (std::size_t i = 0; i < W; ++i) a.lane[i] = static_cast<E>(a.lane[i] << bits);
    return a;
  }
  friend LoopVector operator&(LoopVector a, E mask) noexcept {
    for (std::size_t i = 0; i < W; ++i) a.lane[i] &= mask;
    return a;
  }
};

#if defined(__GNUC__) || defined(__clang__)
#define KVCACHE_VECTOR_EXTENSIONS 1
/// E[B / sizeof(E)] as one register: GCC/Clang vector extensions.
/// Spelled out for each width: GCC ignores vector_size with a size that is a template parameter.
template <class E, std::size_t B>
struct VectorOf;
#define KVCACHE_VECTOR_OF(E, B)                     \
  template <>                                       \
  struct VectorOf<E, B> {                           \
    using type = E __attribute__((vector_size(B))); \
  };
#define KVCACHE_VECTORS_OF(E) KVCACHE_VECTOR_OF(E, 16) KVCACHE_VECTOR_OF(E, 32) KVCACHE_VECTOR_OF(E, 64)
KVCACHE_VECTORS_OF(float)
KVCACHE_VECTORS_OF(double)
KVCACHE_VECTORS_OF(std::uint32_t)
KVCACHE_VECTORS_OF(std::int32_t)
KVCACHE_VECTORS_OF(std::uint16_t)
KVCACHE_VECTOR_OF(std::uint16_t, 8)  // half of the narrowest register: its halves, to be widened
#undef KVCACHE_VECTORS_OF
#undef KVCACHE_VECTOR_OF
#else
#define KVCACHE_VECTOR_EXTENSIONS 0
template <class E, std::size_t B>
struct VectorOf {
  using type = LoopVector<E, B / sizeof(E)>;
};
#endif

template <class E, std::size_t B = kVectorBytes>
using Vector = typename VectorOf<E, B>::type;

/// Calls f(std::integral_constant<std::size_t, i>) for i in [0, N), unrolled: arrays of
/// registers indexed this way stay in registers. The inner lambda is forced inline too: Clang 14
/// kept it as a call per V row in a pass over V (float at H_q = 4 H_kv ran at half
/// GCC's rate with the history in cache), and GCC 12 kept some at D = 256.
template <std::size_t N, class F>
KVCACHE_ALWAYS_INLINE inline void unroll(const F& f) noexcept {
  [&]<std::size_t... I>(std::index_sequence<I...>) KVCACHE_ALWAYS_INLINE {
    (f(std::integral_constant<std::size_t, I>{}), ...);
  }
  (std::make_index_sequence<N>{});
}

template <class V, class E>
inline V load_vector(const E* p) noexcept {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class V, class E>
inline void store_vector(E* p, const V& v) noexcept {
  std::memcpy(p, &v, sizeof v);
}

/// v, kept in a register. GCC folds a loaded vector into every multiply-add that uses it, so a
/// row read once for R query rows becomes R loads; past two loads a cycle, the loads and not
/// the multiply-adds set the pace (measured on an AVX-512 AMD EPYC).
template <class V>
inline V in_register(V v) noexcept {
#if KVCACHE_VECTOR_EXTENSIONS && (defined(__x86_64__) || defined(__i386__)) && defined(__SSE2__)
  if constexpr (!std::is_class_v<V>) asm("" : "+v"(v));
#endif
  return v;
}

template <std::size_t B = kVectorBytes, class Acc>
inline Vector<Acc, B> splat(Acc x) noexcept {
  if constexpr (std::is_class_v<Vector<Acc, B>>) {
    Vector<Acc, B> v;
    for (std::size_t i = 0; i < kVector<Acc, B>; ++i) v[i] = x;
    return v;
  } else {
    return x - Vector<Acc, B>{};  // the scalar is broadcast; x - 0 is x, so no add is left
  }
}

/// Converts n stored values to the accumulation type.
template <class Acc, class T>
inline void convert_row(const T* __restrict src, Acc* __restrict dst, std::size_t n) noexcept {
  if constexpr (std::is_same_v<T, Eigen::bfloat16> && std::is_same_v<Acc, float>) {
    // bfloat16 is the top half of a float: a shift, which vectorizes, instead of a call per value.
    static_assert(sizeof(Eigen::bfloat16) == sizeof(std::uint16_t));
    for (std::size_t i = 0; i < n; ++i) {
      std::uint16_t bits;
      std::memcpy(&bits, src + i, sizeof bits);
      dst[i] = std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
    }
  } else if constexpr (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<Acc>(static_cast<float>(src[i]));
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<Acc>(src[i]);
  }
}

/// p[i] as Acc; for bfloat16 the same shift as convert_row.
template <class Acc, class T>
inline Acc load_as(const T* p, std::size_t i) noexcept {
  if constexpr (std::is_same_v<T, Eigen::bfloat16> && std::is_same_v<Acc, float>) {
    std::uint16_t bits;
    std::memcpy(&bits, p + i, sizeof bits);
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
  } else if constexpr (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>) {
    return static_cast<Acc>(static_cast<float>(p[i]));
  } else {
    return static_cast<Acc>(p[i]);
  }
}

// Half rows widen in registers wherever vectors do: by one instruction under AVX-512F or F16C,
// else by integer operations and one multiply (floats_from_half_bits).
#if KVCACHE_VECTOR_EXTENSIONS && (defined(__AVX512F__) || (defined(__AVX__) && defined(__F16C__)))
#define KVCACHE_HALF_INSTRUCTION 1
#else
#define KVCACHE_HALF_INSTRUCTION 0
#endif

/// Whether rows of T are read into Acc registers as they are (RowReader<T, Acc>), so that no
/// converted copy of a tile is ever made.
template <class T, class Acc>
inline constexpr bool kConvertsInRegisters = std::is_same_v<T, Acc> ||
                                             (std::is_same_v<T, Eigen::bfloat16> && std::is_same_v<Acc, float>) ||
                                             (KVCACHE_VECTOR_EXTENSIONS && std::is_same_v<T, Eigen::half> &&
                                              std::is_same_v<Acc, float>);

/// How rows of T are read into Acc registers: kSplit registers from each kSplit * W stored
/// values. A bfloat16 is the top half of a float, so W 32-bit words of bfloat16 pairs give the
/// even values by a shift and the odd ones by a mask, two integer operations and no shuffle.
/// Queries and accumulators are kept in the same order as the registers (lane(d)), so a dot
/// product or a weighted sum never has to put the values back in order until the output.
template <class T, class Acc, std::size_t B = kVectorBytes>
struct RowReader {
  static_assert(std::is_same_v<T, Acc>, "RowReader: rows are read as Acc, or as bfloat16 or half into float.");
  static constexpr std::size_t kSplit = 1;
  static void load(const T* p, Vector<Acc, B> (&out)[kSplit]) noexcept { out[0] = load_vector<Vector<Acc, B>>(p); }
};

template <std::size_t B>
struct RowReader<Eigen::bfloat16, float, B> {
  static_assert(sizeof(Eigen::bfloat16) == 2);
  static constexpr std::size_t kSplit = 2;
  using V = Vector<float, B>;
  static void load(const Eigen::bfloat16* p, V (&out)[kSplit]) noexcept {
    // One load: GCC would fold it into both operations and read every line twice from L1
    // (one bf16 query row ran 5-10% faster from memory with one).
    const auto pairs = in_register(load_vector<Vector<std::uint32_t, B>>(p));
    out[0] = std::bit_cast<V>(pairs << 16);                                      // even values
    out[1] = std::bit_cast<V>(pairs & static_cast<std::uint32_t>(0xFFFF0000U));  // odd values
  }
  /// The same values, each of the two operations taking the line from memory itself (where GCC
  /// folds the load into both): the form a plain one-row pass reads in (plain_one_row_passes).
  static void load_per_use(const Eigen::bfloat16* p, V (&out)[kSplit]) noexcept {
    const auto pairs = load_vector<Vector<std::uint32_t, B>>(p);
    out[0] = std::bit_cast<V>(pairs << 16);
    out[1] = std::bit_cast<V>(pairs & static_cast<std::uint32_t>(0xFFFF0000U));
  }
};

#if KVCACHE_VECTOR_EXTENSIONS
/// Half-precision bit patterns, one in the low 16 bits of each lane, as floats, exactly.
template <class Bits>
inline auto floats_from_half_bits(const Bits& bits) noexcept {
  using Signed = Vector<std::int32_t, sizeof(Bits)>;
  const Bits magnitude = bits & 0x7FFFU;
  // Exponent and mantissa moved to where a float keeps them: read as a float, that is the half's
  // value times 2^-112, subnormal halves included (they become float subnormals or normals
  // scaled alike), so one exact multiply rebases the exponent. (A program that sets
  // denormals-are-zero, as -ffast-math may, reads half subnormals, below 6.1e-5, as 0.)
  const Bits scaled = std::bit_cast<Bits>(std::bit_cast<Vector<float, sizeof(Bits)>>(magnitude << 13) * 0x1p112F);
  // Infinity and NaN (exponent all ones, now 2^16 times 1.mantissa) get a float's all-ones
  // exponent; a signed comparison, which SSE2 has, as the magnitude fits in 15 bits.
  const Bits special = std::bit_cast<Bits>(std::bit_cast<Signed>(magnitude) > 0x7BFF);
  return std::bit_cast<Vector<float, sizeof(Bits)>>(scaled | (special & 0x7F800000U) | ((bits & 0x8000U) << 16));
}

template <std::size_t B>
struct RowReader<Eigen::half, float, B> {
  static_assert(sizeof(Eigen::half) == 2);
  static constexpr std::size_t kSplit = 1;
  using V = Vector<float, B>;
  // A register's worth of halves is half a register, widened to one register in order.
  static void load(const Eigen::half* p, V (&out)[kSplit]) noexcept {
#if KVCACHE_HALF_INSTRUCTION && defined(__AVX512F__)
    if constexpr (B == 64) {
      // The zero-masked form with every lane kept: the plain one passes GCC 12 an undefined
      // register, which -Wmaybe-uninitialized reports once inlined.
      const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      out[0] = std::bit_cast<V>(_mm512_maskz_cvtph_ps(static_cast<__mmask16>(0xFFFF), halves));
      return;
    }
#endif
#if KVCACHE_HALF_INSTRUCTION
    if constexpr (B == 32) {
      out[0] = std::bit_cast<V>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      return;
    }
#endif
    using Halves = Vector<std::uint16_t, B / 2>;
    out[0] = floats_from_half_bits(__builtin_convertvector(load_vector<Halves>(p), Vector<std::uint32_t, B>));
  }
};
#endif

/// RowReader<T, Acc, B>::load, or for bfloat16 rows where PerUse, load_per_use.
template <bool PerUse, std::size_t B, class T, class Acc>
KVCACHE_ALWAYS_INLINE inline void read_row(const T* p, Vector<Acc, B> (&out)[RowReader<T, Acc, B>::kSplit]) noexcept {
  if constexpr (PerUse && std::is_same_v<T, Eigen::bfloat16>) {
    RowReader<T, Acc, B>::load_per_use(p, out);
  } else {
    RowReader<T, Acc, B>::load(p, out);
  }
}

/// Where value d of a row of `dim` lives in the register order of RowReader<T, Acc>: whole
/// groups of kSplit * W values are split into even and odd halves; the tail stays in order.
template <class T, class Acc, std::size_t B = kVectorBytes>
inline std::size_t lane_of(std::size_t d, std::size_t dim) noexcept {
  constexpr std::size_t split = RowReader<T, Acc, B>::kSplit;
  constexpr std::size_t group = split * kVector<Acc, B>;
  if (split == 1 || d >= dim / group * group) return d;
  const std::size_t base = d / group * group;
  const std::size_t i = d - base;
  return base + (i % split) * kVector<Acc, B> + i / split;
}

/// Lane l of the even (odd false) or odd values of two registers read as one run (split_lane),
/// and lane l of the low or high half of that run put back from its even and odd registers
/// (joined_lane): lanes from w on are the second register's.
constexpr int split_lane(bool odd, std::size_t l) noexcept { return static_cast<int>(2 * l + (odd ? 1 : 0)); }
constexpr int joined_lane(std::size_t w, bool high, std::size_t l) noexcept {
  const std::size_t i = l / 2 + (high ? w / 2 : 0);
  return static_cast<int>(l % 2 == 0 ? i : w + i);
}

/// Puts a row of `dim` values from their order into lane_of<T, Acc> order in place (ToLanes), or
/// back: the queries go in once per row and the outputs come out. Whole groups move by two
/// shuffles a register; a value at a time, a bf16 decode call over 8 kv heads of 16 keys
/// (H_q = 32, one core) took 6.3-6.5 us instead of 4.5-4.7 (ShortAB, AVX-512 AMD EPYC).
template <class T, class Acc, bool ToLanes, std::size_t B = kVectorBytes>
inline void reorder_row(Acc* row, std::size_t dim) noexcept {
  constexpr std::size_t split = RowReader<T, Acc, B>::kSplit;
  if constexpr (split > 1) {
    static_assert(split == 2, "reorder_row: a read splits into even and odd values.");
    using V = Vector<Acc, B>;
    constexpr std::size_t W = kVector<Acc, B>;
    for (std::size_t base = 0; base + 2 * W <= dim; base += 2 * W) {
      const V a = load_vector<V>(row + base);
      const V b = load_vector<V>(row + base + W);
      V first;
      V second;
      if constexpr (std::is_class_v<V>) {
        for (std::size_t l = 0; l < W; ++l) {
          const auto pick = [&](int from) {
            const auto i = static_cast<std::size_t>(from);
            return i < W ? a[i] : b[i - W];
          };
          first[l] = pick(ToLanes ? split_lane(false, l) : joined_lane(W, false, l));
          second[l] = pick(ToLanes ? split_lane(true, l) : joined_lane(W, true, l));
        }
      } else {
#if KVCACHE_VECTOR_EXTENSIONS
        [&]<std::size_t... L>(std::index_sequence<L...>) {
          if constexpr (ToLanes) {
            first = __builtin_shufflevector(a, b, split_lane(false, L)...);
            second = __builtin_shufflevector(a, b, split_lane(true, L)...);
          } else {
            first = __builtin_shufflevector(a, b, joined_lane(W, false, L)...);
            second = __builtin_shufflevector(a, b, joined_lane(W, true, L)...);
          }
        }
        (std::make_index_sequence<W>{});
#endif
      }
      store_vector(row + base, first);
      store_vector(row + base + W, second);
    }
  }
}

/// Lane l of one half of a pair sum with blocks of 2h lanes: the low (or high) h lanes of each
/// block of x, then those of the same block of y (lane W + i of the pair is y[i]).
constexpr int pair_lane(std::size_t w, std::size_t h, bool high, std::size_t l) noexcept {
  const std::size_t block = l / (2 * h) * (2 * h);
  const std::size_t i = l % (2 * h);
  const std::size_t offset = high ? h : 0;
  return static_cast<int>(i < h ? block + offset + i : w + block + offset + i - h);
}

template <std::size_t H, bool High, class V, std::size_t... L>
inline V pick_halves(const V& x, const V& y, std::index_sequence<L...>) noexcept {
  constexpr std::size_t W = sizeof...(L);
  if constexpr (std::is_class_v<V>) {
    V out;
    for (std::size_t l = 0; l < W; ++l) {
      const auto from = static_cast<std::size_t>(pair_lane(W, H, High, l));
      out[l] = from < W ? x[from] : y[from - W];
    }
    return out;
  } else {
#if KVCACHE_VECTOR_EXTENSIONS
    return __builtin_shufflevector(x, y, pair_lane(W, H, High, L)...);
#endif
  }
}

/// The index whose log2(w) low bits are those of i reversed.
constexpr std::size_t reverse_bits(std::size_t i, std::size_t w) noexcept {
  std::size_t r = 0;
  for (std::size_t bit = 1; bit < w; bit <<= 1, i >>= 1) r = (r << 1) | (i & 1);
  return r;
}

/// Sums N registers of W lanes into one, lane l holding the sum of a[reverse_bits(l, W)]:
/// each level adds the low and high halves of every block of a pair, so W registers cost W - 1
/// pair sums (two shuffles and an add each) instead of W horizontal reductions.
template <std::size_t W, std::size_t H, class V, std::size_t N>
inline V transpose_sum(const V (&a)[N]) noexcept {
  if constexpr (N == 1) {
    return a[0];
  } else {
    static_assert(N % 2 == 0 && H >= 1, "transpose_sum: N must be a power of two no larger than the lanes.");
    V b[N / 2];
    unroll<N / 2>([&](auto i) {
      b[i] = pick_halves<H, false>(a[2 * i], a[2 * i + 1], std::make_index_sequence<W>{}) +
             pick_halves<H, true>(a[2 * i], a[2 * i + 1], std::make_index_sequence<W>{});
    });
    return transpose_sum<W, H / 2>(b);
  }
}

/// Calls f(d) for d = 0, Step, 2 Step, ... while d + Step <= dim. Unrolled when Dim (the same
/// dim, known at compile time) is given, d then an integral_constant: every load in f is an
/// instruction of its own (f is instantiated once per step, inlined or not) that moves by one
/// constant stride from call to call, a pattern the hardware prefetcher follows.
template <std::size_t Dim, std::size_t Step, class F>
KVCACHE_ALWAYS_INLINE inline void for_each_step(std::size_t dim, const F& f) noexcept {
  if constexpr (Dim != 0) {
    static_assert(Dim % Step == 0, "for_each_step: Dim must be a whole number of steps.");
    unroll<Dim / Step>([&](auto i) KVCACHE_ALWAYS_INLINE { f(std::integral_constant<std::size_t, i * Step>{}); });
  } else {
    for (std::size_t d = 0; d + Step <= dim; d += Step) f(d);
  }
}

/// Whether score_keys<R> holds the read of every one of its K = W / R keys and one query register
/// at a time (W accumulators + K S + 1 registers, a read being S registers) rather than every query
/// row's read and one key's (W + R S + S): only where the latter does not fit. So four bf16 query
/// rows share one K pass under AVX2 (13 registers, not 18) instead of two passes of two rows. In L1
/// both cost the same (45 cycles a key); from memory K is read once: one core, S = 16,384 and
/// 32,768, 0.34-0.48 -> 0.45-0.57 of the plain read, two cores 0.42-0.53 -> 0.48-0.60 (ten and
/// seven interleaved pairs of runs, AVX2 AMD EPYC).
template <std::size_t R, class T, class Acc, std::size_t B = kVectorBytes>
inline constexpr bool kHoldsKeys = kVector<Acc, B> + (R + 1) * RowReader<T, Acc, B>::kSplit > kRegisters;

/// The vector registers score_keys<R> takes.
template <std::size_t R, class T, class Acc, std::size_t B = kVectorBytes>
inline constexpr std::size_t kScoreRegisters = kVector<Acc, B> +
                                               (kHoldsKeys<R, T, Acc, B>
                                                    ? kVector<Acc, B> / R * RowReader<T, Acc, B>::kSplit + 1
                                                    : (R + 1) * RowReader<T, Acc, B>::kSplit);

/// out[r][k] = q[r] . keys[k] for R query rows and K = W / R keys (W = kVector<Acc>): R x K = W
/// accumulators, summed together by transpose_sum, so each key row read (and widened) serves R
/// rows. q is in lane_of order; out[r] gets K values. Dim is dim when known at compile time
/// (a multiple of a read), else 0.
template <std::size_t R, std::size_t Dim = 0, std::size_t B = kVectorBytes, class T, class Acc>
KVCACHE_ALWAYS_INLINE inline void score_keys(const Acc* const (&q)[R], const T* const (&keys)[kVector<Acc, B> / R],
                                             std::size_t dim, Acc* const (&out)[R]) noexcept {
  using V = Vector<Acc, B>;
  using Reader = RowReader<T, Acc, B>;
  constexpr std::size_t W = kVector<Acc, B>;
  constexpr std::size_t S = Reader::kSplit;
  constexpr std::size_t K = W / R;
  static_assert(K * R == W, "score_keys: R must divide the lanes.");
  const std::size_t body = dim / (S * W) * (S * W);
  V acc[W];  // row r, key k at r * K + k
  unroll<W>([&](auto i) { acc[i] = V{}; });
  for_each_step<Dim, S * W>(dim, [&](auto d) KVCACHE_ALWAYS_INLINE {
    if constexpr (kHoldsKeys<R, T, Acc, B>) {
      V kv[K][S];
      unroll<K>([&](auto k) { Reader::load(keys[k] + d, kv[k]); });
      unroll<S>([&](auto s) {
        unroll<R>([&](auto r) {
          const V qv = in_register(load_vector<V>(q[r] + d + s * W));
          unroll<K>([&](auto k) { acc[r * K + k] += qv * in_register(kv[k][s]); });
        });
      });
    } else {
      V qv[R][S];
      unroll<R>([&](auto r) { unroll<S>([&](auto s) { qv[r][s] = in_register(load_vector<V>(q[r] + d + s * W)); }); });
      unroll<K>([&](auto k) {
        V kv[S];
        Reader::load(keys[k] + d, kv);
        unroll<S>([&](auto s) {
          const V x = in_register(kv[s]);
          unroll<R>([&](auto r) { acc[r * K + k] += qv[r][s] * x; });
        });
      });
    }
  });
  V ordered[W];
  unroll<W>([&](auto l) { ordered[l] = acc[reverse_bits(l, W)]; });
  V sums = transpose_sum<W, W / 2>(ordered);
  if (body < dim) {
    Acc tail[W] = {};
    for (std::size_t r = 0; r < R; ++r) {
      for (std::size_t k = 0; k < K; ++k) {
        for (std::size_t d = body; d < dim; ++d) tail[r * K + k] += q[r][d] * load_as<Acc>(keys[k], d);
      }
    }
    sums += load_vector<V>(tail);
  }
  Acc lanes[W];
  store_vector(lanes, sums);
  unroll<R>([&](auto r) { std::memcpy(out[r], lanes + r * K, K * sizeof(Acc)); });
}

#if KVCACHE_VECTOR_EXTENSIONS && defined(__AVX512BF16__) && defined(__AVX512F__)
#define KVCACHE_BF16_PAIRS 1
/// acc plus, in lane i, a[2i] b[2i] + a[2i + 1] b[2i + 1] for registers of bfloat16 pairs (AVX-512
/// BF16): each product is exact in float (8 x 8 significant bits), each addition a float one, as
/// a multiply-add's, with subnormal inputs and results taken as zero.
inline Vector<float> add_pair_products(Vector<float> acc, const Vector<std::uint32_t>& a,
                                       const Vector<std::uint32_t>& b) noexcept {
  return std::bit_cast<Vector<float>>(
      _mm512_dpbf16_ps(std::bit_cast<__m512>(acc), std::bit_cast<__m512bh>(a), std::bit_cast<__m512bh>(b)));
}

/// out[r][k] = scale (q[r] . keys[k]) for R bfloat16 query rows and K = W / R bfloat16 keys, Dim
/// values each (a multiple of 2W): as score_keys, but a register of a key's 2W values serves each
/// query row by one instruction (add_pair_products) instead of two multiply-adds, and is never
/// widened. The queries are as given, in order, unscaled, so that no rounding is added to them:
/// the scale multiplies the sums.
template <std::size_t R, std::size_t Dim>
KVCACHE_ALWAYS_INLINE inline void score_key_pairs(const Eigen::bfloat16* const (&q)[R],
                                                  const Eigen::bfloat16* const (&keys)[kVector<float> / R], float scale,
                                                  float* const (&out)[R]) noexcept {
  using V = Vector<float>;
  using Pairs = Vector<std::uint32_t>;
  constexpr std::size_t W = kVector<float>;
  constexpr std::size_t K = W / R;
  static_assert(K * R == W, "score_key_pairs: R must divide the lanes.");
  V acc[W];  // row r, key k at r * K + k
  unroll<W>([&](auto i) { acc[i] = V{}; });
  for_each_step<Dim, 2 * W>(Dim, [&](auto d) KVCACHE_ALWAYS_INLINE {
    Pairs qv[R];
    unroll<R>([&](auto r) { qv[r] = in_register(load_vector<Pairs>(q[r] + d)); });
    unroll<K>([&](auto k) {
      const Pairs x = in_register(load_vector<Pairs>(keys[k] + d));
      unroll<R>([&](auto r) { acc[r * K + k] = add_pair_products(acc[r * K + k], qv[r], x); });
    });
  });
  V ordered[W];
  unroll<W>([&](auto l) { ordered[l] = acc[reverse_bits(l, W)]; });
  const V sums = transpose_sum<W, W / 2>(ordered) * splat(scale);
  float lanes[W];
  store_vector(lanes, sums);
  unroll<R>([&](auto r) { std::memcpy(out[r], lanes + r * K, K * sizeof(float)); });
}

/// acc[r] += sum_j w[r][j] * rows[j] for R query rows over bfloat16 rows of Dim values, two keys
/// a step by pair products: the two keys' values at each d are paired in one 32-bit lane and
/// multiplied by the pair of their bfloat16 weights (`weights[r]`, round_weights' output) in
/// one instruction, into float sums in lane_of order (even values, then odd, as RowReader reads
/// them). The first Held rows' sums stay in registers, the others' in L1, as in
/// accumulate_whole_rows_in_l1, whose fetch.line protocol this follows.
template <std::size_t R, std::size_t Dim, std::size_t Held, class Fetch>
inline void accumulate_pairs_in_l1(float* const (&acc)[R], const std::uint16_t* const (&weights)[R],
                                   const Eigen::bfloat16* rows, std::size_t stride, std::size_t count,
                                   const Fetch& given_fetch) noexcept {
  const Fetch fetch = given_fetch;  // a copy of its own, whose fields the registers keep
  using V = Vector<float>;
  using Pairs = Vector<std::uint32_t>;
  constexpr std::size_t W = kVector<float>;
  constexpr std::size_t kRead = 2 * W;  // values a load takes
  constexpr std::size_t L = R - Held;   // rows summed in L1
  static_assert(Dim % kRead == 0, "accumulate_pairs_in_l1: Dim must be a whole number of reads.");
  static_assert(Held < R, "accumulate_pairs_in_l1: at least one row is summed in L1.");
  V held[std::max<std::size_t>(Held, 1)][Dim / W];
  alignas(64) float sums[L][Dim];
  unroll<Held>([&](auto r) { unroll<Dim / W>([&](auto c) { held[r][c] = load_vector<V>(acc[r] + c * W); }); });
  for (std::size_t r = 0; r < L; ++r) std::copy_n(acc[Held + r], Dim, sums[r]);
  // Keys j and j + 1 (a row of zeros for the second when `single`), weights paired likewise.
  const auto step = [&](std::size_t j, bool single) KVCACHE_ALWAYS_INLINE {
    // Weights j and j + 1 lie side by side, j at the lower address: one 32-bit load, which the
    // broadcast takes from memory, instead of two 16-bit ones joined by a shift and an or (in
    // cache, medians of six and of eight: 10.2 -> 9.8 and 10.1 -> 9.8 ns a key).
    const auto weight_pair = [&](std::size_t r) KVCACHE_ALWAYS_INLINE {
      std::uint32_t pair = weights[r][j];
      if (!single) std::memcpy(&pair, weights[r] + j, sizeof pair);
      return pair - Pairs{};
    };
    unroll<Dim / kRead>([&](auto c) KVCACHE_ALWAYS_INLINE {
      constexpr std::size_t offset = c * kRead * sizeof(Eigen::bfloat16);
      const Eigen::bfloat16* first = rows + j * stride + c * kRead;
      Pairs b{};
      if (!single) {
        fetch.line(j, offset);
        fetch.line(j + 1, offset);
        b = in_register(load_vector<Pairs>(first + stride));
      }
      const Pairs a = in_register(load_vector<Pairs>(first));
      // Lane l: the even values 2l of both keys, then the odd values 2l + 1.
      const Pairs x[2] = {in_register((a & 0xFFFFU) | (b << 16)), in_register((a >> 16) | (b & 0xFFFF0000U))};
      unroll<2>([&](auto s) KVCACHE_ALWAYS_INLINE {
        unroll<Held>([&](auto r) KVCACHE_ALWAYS_INLINE {
          held[r][2 * c + s] = add_pair_products(held[r][2 * c + s], x[s], weight_pair(r));
        });
        unroll<L>([&](auto r) KVCACHE_ALWAYS_INLINE {
          float* const sum = sums[r] + (2 * c + s) * W;
          store_vector(sum, add_pair_products(load_vector<V>(sum), x[s], weight_pair(Held + r)));
        });
      });
    });
  };
  std::size_t j = 0;
  for (; j + 2 <= count; j += 2) step(j, false);
  if (j < count) step(j, true);
  unroll<Held>([&](auto r) { unroll<Dim / W>([&](auto c) { store_vector(acc[r] + c * W, held[r][c]); }); });
  for (std::size_t r = 0; r < L; ++r) std::copy_n(sums[r], Dim, acc[Held + r]);
}
#else
#define KVCACHE_BF16_PAIRS 0
#endif

/// Whether the passes that read whole rows in order for R query rows ask for each 64-byte line
/// ahead as they read it rather than for a whole row as it begins: under AVX2, where asking for
/// lines at the pace they are used, the K pass of four float query rows over one long stream read
/// 0.86-0.89 of the plain read instead of 0.81-0.83, and the kernel at H_q = 32 float 0.77 -> 0.80
/// (one core) and 0.80 -> 0.87 (two; medians of four interleaved pairs of runs, other cells -0.03
/// to +0.05; 2-core AMD EPYC). At 64 bytes, four 16-bit rows read in order (Intel Xeon, see
/// four_rows_in_order_pay) ask a line at a time too (+0.00 to +0.02 against a row at a time, one
/// run of bench/ab); one row asks as it was tuned, a row at a time (AVX-512 AMD EPYC).
template <std::size_t R, std::size_t B = kVectorBytes>
inline constexpr bool kFetchLines = B == 32 || R > 1;

/// out[r][j] = q[r] . rows[j] for R query rows and `count` rows `stride` apart, read one whole
/// row after another, so that every load moves by one row stride from key to key. The queries
/// (Dim values each, in lane_of order) are copied into an array of the function's own first,
/// of which the compiler keeps what the registers hold and reads the rest from L1 (read from q
/// at every step instead, two and four query rows read one long stream of K rows at 0.60-0.66
/// of the plain read, against 0.74-0.93 in float; 2-core AMD EPYC, AVX2). A key's products
/// stay a vector per query row, lanes not yet summed, until W keys are done and transpose_sum
/// adds them up. fetch(j) is called as row j is read, or where kFetchLines, fetch.line(j, offset)
/// as each of its 64-byte lines is.
template <std::size_t R, std::size_t Dim, bool PerUse = false, std::size_t B = kVectorBytes, class T, class Acc,
          class Fetch>
inline void score_in_order(const Acc* const (&q)[R], const T* rows, std::size_t stride, std::size_t count,
                           Acc* const (&out)[R], const Fetch& fetch) noexcept {
  using V = Vector<Acc, B>;
  using Reader = RowReader<T, Acc, B>;
  constexpr std::size_t W = kVector<Acc, B>;
  constexpr std::size_t S = Reader::kSplit;
  static_assert(Dim % (S * W) == 0 && Dim > 0, "score_in_order: Dim must be a whole number of reads.");
  V query[R][Dim / W];
  unroll<R>([&](auto r) { unroll<Dim / W>([&](auto c) { query[r][c] = load_vector<V>(q[r] + c * W); }); });
  for (std::size_t first = 0; first < count; first += W) {
    const std::size_t n = std::min(W, count - first);
    V products[R][W];
    for (std::size_t k = 0; k < n; ++k) {
      const T* row = rows + (first + k) * stride;
      if constexpr (!kFetchLines<R, B>) fetch(first + k);
      V chains[R][2] = {};  // two chains of multiply-adds per query row, so each waits on half as many
      for_each_step<Dim, S * W>(Dim, [&](auto d) KVCACHE_ALWAYS_INLINE {
        if constexpr (kFetchLines<R, B> && d * sizeof(T) % 64 == 0) fetch.line(first + k, d * sizeof(T));
        V x[S];
        read_row<PerUse, B, T, Acc>(row + d, x);
        unroll<S>([&](auto s) KVCACHE_ALWAYS_INLINE {
          const V v = in_register(x[s]);
          unroll<R>([&](auto r) { chains[r][(d / W + s) % 2] += query[r][d / W + s] * v; });
        });
      });
      unroll<R>([&](auto r) { products[r][k] = chains[r][0] + chains[r][1]; });
    }
    unroll<R>([&](auto r) {
      for (std::size_t k = n; k < W; ++k) products[r][k] = V{};
      V ordered[W];
      unroll<W>([&](auto l) { ordered[l] = products[r][reverse_bits(l, W)]; });
      const V sums = transpose_sum<W, W / 2>(ordered);
      if (n == W) {
        store_vector(out[r] + first, sums);  // a memcpy of a size known only at run time is a rep movs
      } else {
        Acc lanes[W];
        store_vector(lanes, sums);
        std::memcpy(out[r] + first, lanes, n * sizeof(Acc));
      }
    });
  }
}

/// acc[r][d, d + C W) += sum_j w[r][j] * rows[j][d, d + C W) for R query rows: each stored row
/// is read and widened once for all R, into R x C accumulators held in registers. fetch(j) is
/// called as row j is read by the block at d = 0, the one that takes the rows from memory.
template <std::size_t R, std::size_t C, bool PerUse = false, std::size_t B = kVectorBytes, class T, class Acc,
          class Fetch>
inline void accumulate_block(Acc* const (&acc)[R], const Acc* const (&w)[R], const T* rows, std::size_t stride,
                             std::size_t count, std::size_t d, const Fetch& fetch) noexcept {
  using V = Vector<Acc, B>;
  using Reader = RowReader<T, Acc, B>;
  constexpr std::size_t W = kVector<Acc, B>;
  constexpr std::size_t S = Reader::kSplit;
  static_assert(C % S == 0, "accumulate_block: C must be a whole number of reads.");
  V a[R][C];
  unroll<R>([&](auto r) { unroll<C>([&](auto c) { a[r][c] = load_vector<V>(acc[r] + d + c * W); }); });
  for (std::size_t j = 0; j < count; ++j) {
    const T* row = rows + j * stride + d;
    if (d == 0) fetch(j);
    V p[R];
    unroll<R>([&](auto r) { p[r] = splat<B>(w[r][j]); });
    unroll<C / S>([&](auto c) {
      V x[S];
      read_row<PerUse, B, T, Acc>(row + c * S * W, x);
      unroll<S>([&](auto s) {
        const V v = in_register(x[s]);
        unroll<R>([&](auto r) { a[r][c * S + s] += p[r] * v; });
      });
    });
  }
  unroll<R>([&](auto r) { unroll<C>([&](auto c) { store_vector(acc[r] + d + c * W, a[r][c]); }); });
}

#if defined(__clang__)
// Clang 14 keeps the held sums on the stack when two 16-bit keys a step leave it no registers
// (AVX-512, two rows held): one key a step there ran 20.2-20.4 -> 16.8-17.8 ns a key with K and
// V in cache (bf16, four query rows per kv head, one core), where GCC 12 went 15.2 -> 19.0.
inline constexpr bool kTwoKeysWithHeldRows = false;
#else
inline constexpr bool kTwoKeysWithHeldRows = true;
#endif

/// acc[r] += sum_j w[r][j] * rows[j] for R query rows over whole rows of Dim values in one pass
/// over whole rows in order (the one from memory): the first Held rows' sums in registers, the
/// others' read from and written back to L1, where the registers hold less than all R rows.
/// The stores set the pace unless each is shared: 16-bit rows take two keys a step (P), each
/// sum loaded and stored once for both. Four 16-bit rows one key a step store 16 sums per
/// 64-byte line read (0.30-0.57 of the plain read over one long stream); two rows a key at a
/// time take 15-16 ns a key in cache and two keys a step 9-10 (bf16 at H_q = 16, one core,
/// medians of two sets of three interleaved pairs of runs: 0.76-0.77 -> 0.79-0.81; AVX2). Float
/// rows, twice the bytes a key, take one: two float keys a step ran faster in cache but slower
/// from memory (four rows at H_q = 32, one core: 0.81 -> 0.72 under AVX2; 0.81-0.84 ->
/// 0.79-0.81 under AVX-512 with two rows held).
/// The sums live in an array of the function's own while it runs, which the compiler knows no
/// row or weight shares: summed in acc itself, one long stream of float V rows read 0.73 of the
/// plain read at two query rows and 0.61 at four, against 0.90 at both (scratch program, 2-core
/// AMD EPYC, AVX2). The array is filled and emptied by a loop, not memcpy, and every step is
/// forced inline: else GCC 12 stores every sum twice, to a stack slot of its own and to the
/// array (four float rows over one long stream then read 0.52-0.67 of the plain read, with both
/// 0.72-0.85). fetch.line(j, offset) is called as row j's 64-byte line at byte `offset` is
/// read, so that lines are asked for at the pace they are used: asking for whole rows as each
/// row began, four float rows read 0.62-0.65 of the plain read, four bf16 rows two keys a step
/// 0.58-0.62, against 0.76-0.78 and 0.74-0.77 a line at a time (one long stream, three runs).
template <std::size_t R, std::size_t Dim, std::size_t Held, std::size_t B = kVectorBytes, class T, class Acc,
          class Fetch>
inline void accumulate_whole_rows_in_l1(Acc* const (&acc)[R], const Acc* const (&w)[R], const T* rows,
                                        std::size_t stride, std::size_t count, const Fetch& given_fetch) noexcept {
  // A copy of its own, whose fields the registers keep, as accumulate_pairs_in_l1's: in cache,
  // medians of ten, four float rows 15.0 -> 13.9 and 15.2 -> 14.1 ns a key, bf16 -2%, half -1%.
  const Fetch fetch = given_fetch;
  using V = Vector<Acc, B>;
  using Reader = RowReader<T, Acc, B>;
  constexpr std::size_t W = kVector<Acc, B>;
  constexpr std::size_t S = Reader::kSplit;
  constexpr std::size_t kRead = S * W;  // values a read takes
  constexpr std::size_t P = sizeof(T) < sizeof(Acc) && (Held == 0 || kTwoKeysWithHeldRows) ? 2 : 1;  // keys a step
  constexpr std::size_t L = R - Held;  // rows summed in L1
  static_assert(Dim % kRead == 0, "accumulate_whole_rows_in_l1: Dim must be a whole number of reads.");
  static_assert(Held < R, "accumulate_whole_rows_in_l1: at least one row is summed in L1.");
  V held[std::max<std::size_t>(Held, 1)][Dim / W];
  alignas(64) Acc sums[L][Dim];
  unroll<Held>([&](auto r) { unroll<Dim / W>([&](auto c) { held[r][c] = load_vector<V>(acc[r] + c * W); }); });
  for (std::size_t r = 0; r < L; ++r) std::copy_n(acc[Held + r], Dim, sums[r]);
  // The keys' reads x[k] at (c, s), times each row's weights p[r][k], added to the sums of every row.
  const auto add = [&](auto c, auto s, const auto& x, const auto& p) KVCACHE_ALWAYS_INLINE {
    constexpr std::size_t keys = std::extent_v<std::remove_cvref_t<decltype(x)>>;
    unroll<Held>([&](auto r) KVCACHE_ALWAYS_INLINE {
      unroll<keys>([&](auto k) KVCACHE_ALWAYS_INLINE { held[r][c * S + s] += p[r][k] * in_register(x[k][s]); });
    });
    unroll<L>([&](auto r) KVCACHE_ALWAYS_INLINE {
      Acc* const sum = sums[r] + (c * S + s) * W;
      V total = load_vector<V>(sum);
      unroll<keys>([&](auto k) KVCACHE_ALWAYS_INLINE { total += p[Held + r][k] * in_register(x[k][s]); });
      store_vector(sum, total);
    });
  };
  // Reads K keys from `first` (their lines asked for ahead when `fetching`) and adds them in.
  const auto step = [&]<std::size_t K>(std::integral_constant<std::size_t, K>, std::size_t first,
                                       bool fetching) KVCACHE_ALWAYS_INLINE {
    V p[R][K];
    unroll<R>([&](auto r) KVCACHE_ALWAYS_INLINE { unroll<K>([&](auto k) { p[r][k] = splat<B>(w[r][first + k]); }); });
    unroll<Dim / kRead>([&](auto c) KVCACHE_ALWAYS_INLINE {
      V x[K][S];
      unroll<K>([&](auto k) KVCACHE_ALWAYS_INLINE {
        if constexpr (c * kRead * sizeof(T) % 64 == 0) {
          if (fetching) fetch.line(first + k, c * kRead * sizeof(T));
        }
        Reader::load(rows + (first + k) * stride + c * kRead, x[k]);
      });
      unroll<S>([&](auto s) KVCACHE_ALWAYS_INLINE { add(c, s, x, p); });
    });
  };
  std::size_t j = 0;
  for (; j + P <= count; j += P) step(std::integral_constant<std::size_t, P>{}, j, true);
  for (; j < count; ++j) step(std::integral_constant<std::size_t, 1>{}, j, false);  // fewer than P left
  unroll<Held>([&](auto r) { unroll<Dim / W>([&](auto c) { store_vector(acc[r] + c * W, held[r][c]); }); });
  for (std::size_t r = 0; r < L; ++r) std::copy_n(sums[r], Dim, acc[Held + r]);
}

/// acc[r][d, dim) += sum_j w[r][j] * rows[j][d, dim) for R query rows (accumulators in lane_of
/// order): blocks of C registers per row while they fit, then half as many, down to one read,
/// then scalars for the tail. fetch(j) is called as in accumulate_block.
template <std::size_t R, std::size_t C, bool PerUse = false, std::size_t B = kVectorBytes, class T, class Acc,
          class Fetch>
inline void accumulate_rows(Acc* const (&acc)[R], const Acc* const (&w)[R], const T* rows, std::size_t stride,
                            std::size_t count, std::size_t dim, const Fetch& fetch, std::size_t d = 0) noexcept {
  constexpr std::size_t W = kVector<Acc, B>;
  constexpr std::size_t S = RowReader<T, Acc, B>::kSplit;
  for (; d + C * W <= dim; d += C * W) accumulate_block<R, C, PerUse, B>(acc, w, rows, stride, count, d, fetch);
  if constexpr (C > S) {
    accumulate_rows<R, C / 2, PerUse, B>(acc, w, rows, stride, count, dim, fetch, d);
  } else {
    for (std::size_t r = 0; r < R; ++r) {
      for (std::size_t i = d; i < dim; ++i) {
        Acc sum = acc[r][i];
        for (std::size_t j = 0; j < count; ++j) sum += w[r][j] * load_as<Acc>(rows, j * stride + i);
        acc[r][i] = sum;
      }
    }
  }
}

/// The registers of accumulators per row that R rows may hold at once: a power of two, and a
/// whole number of reads of T. One row under AVX2 takes all 16 registers, a whole row at D = 128,
/// its operands read from memory: read in two halves, the second from cache, one float query row
/// per kv head read 0.43-0.52 of the plain read from memory, a whole row 0.82-0.91 (2-core AMD
/// EPYC, with the K rows read in order too, see score_fixed).
template <std::size_t R, class T, class Acc, std::size_t B = kVectorBytes>
inline constexpr std::size_t kBlockRegisters = std::max<std::size_t>(
    std::bit_floor((R == 1 && B == 32 ? kRegisters : kAccumulators) / R), RowReader<T, Acc, B>::kSplit);

/// v with the two halves of every block of 2H lanes swapped.
template <std::size_t H, class V, std::size_t... L>
inline V swap_halves(const V& v, std::index_sequence<L...>) noexcept {
  if constexpr (std::is_class_v<V>) {
    V out;
    for (std::size_t l = 0; l < sizeof...(L); ++l) out[l] = v[l % (2 * H) < H ? l + H : l - H];
    return out;
  } else {
#if KVCACHE_VECTOR_EXTENSIONS
    return __builtin_shufflevector(v, v, static_cast<int>(L % (2 * H) < H ? L + H : L - H)...);
#endif
  }
}

/// The larger of a and b, lane by lane (b where either is NaN, like the scalar a > b ? a : b).
template <class V>
inline V lane_max(V a, const V& b) noexcept {
  if constexpr (std::is_class_v<V>) {
    for (std::size_t l = 0; l < sizeof(V) / sizeof(a[0]); ++l) a[l] = a[l] > b[l] ? a[l] : b[l];
    return a;
  } else {
    return a > b ? a : b;
  }
}

/// Folds the W lanes of v by halves with op, in registers; lane 0 of the result holds the total.
template <std::size_t H, class V, class Op>
inline V fold_halves(const V& v, const Op& op) noexcept {
  if constexpr (H == 0) {
    return v;
  } else {
    constexpr std::size_t W = sizeof(V) / sizeof(v[0]);
    return fold_halves<H / 2>(op(v, swap_halves<H>(v, std::make_index_sequence<W>{})), op);
  }
}

/// The largest of n values (-inf for none): a register of running maxima, folded at the end.
template <class Acc>
inline Acc max_of(const Acc* x, std::size_t n) noexcept {
  using V = Vector<Acc>;
  constexpr std::size_t W = kVector<Acc>;
  V lanes = splat(-std::numeric_limits<Acc>::infinity());
  std::size_t i = 0;
  for (; i + W <= n; i += W) lanes = lane_max(lanes, load_vector<V>(x + i));
  Acc max = fold_halves<W / 2>(lanes, [](const V& a, const V& b) { return lane_max(a, b); })[0];
  for (; i < n; ++i) max = max > x[i] ? max : x[i];
  return max;
}

/// The sum of n values: a register of running sums, folded at the end.
template <class Acc>
inline Acc sum_of(const Acc* x, std::size_t n) noexcept {
  using V = Vector<Acc>;
  constexpr std::size_t W = kVector<Acc>;
  V lanes = splat(Acc{0});
  std::size_t i = 0;
  for (; i + W <= n; i += W) lanes += load_vector<V>(x + i);
  Acc sum = fold_halves<W / 2>(lanes, [](const V& a, const V& b) { return a + b; })[0];
  for (; i < n; ++i) sum += x[i];
  return sum;
}

/// The unsigned integers of the same size as F (a float, or a register of floats).
template <class F>
struct BitsOf {
  using type = Vector<std::uint32_t, sizeof(F)>;
};
template <>
struct BitsOf<float> {
  using type = std::uint32_t;
};

/// e^x for x <= 0, with e^x = 0 below -87 (and for -inf, a masked score), on a float or lane by
/// lane on a register of floats. Within 1 ulp; no call or float-to-int conversion. The scalar
/// form is not vectorized by GCC 12 (its selects stay a branch per value), so loops over a tile
/// of scores call the register form: in a decode at four query rows per kv head the scalar loop
/// had taken a fifth of the time with the history in cache (bf16, AVX2 AMD EPYC).
template <class F>
inline F exp_nonpositive_steps(const F& x) noexcept {
  using Bits = typename BitsOf<F>::type;
  const F floor = F{} - 87.0F;  // F{} - c: c, or c in every lane
  const F xc = x < floor ? floor : x;
  // x = i ln2 + f with |f| <= ln2 / 2: adding 1.5 * 2^23 rounds x / ln2 to the integer i,
  // which lands in the low bits of the sum's mantissa.
  const F shifted = xc * 1.44269504088896341F + 12582912.0F;
  const F r = shifted - 12582912.0F;
  const F f = (xc - r * 0.693359375F) + r * 2.12194440e-4F;
  F p = F{} + 1.9875691500e-4F;
  p = p * f + 1.3981999507e-3F;
  p = p * f + 8.3334519073e-3F;
  p = p * f + 4.1665795894e-2F;
  p = p * f + 1.6666665459e-1F;
  p = p * f + 5.0000001201e-1F;
  const F e = p * f * f + f + 1.0F;
  // 2^i from the sum's bits: (i + 127) << 23, i in [-126, 0].
  const F two_i = std::bit_cast<F>((std::bit_cast<Bits>(shifted) + (127U - 0x400000U)) << 23);
  const F keep = x < floor ? F{} : F{} + 1.0F;
  return e * two_i * keep;
}

inline float exp_nonpositive(float x) noexcept {
#if defined(__FAST_MATH__)
  // The rounding trick of exp_nonpositive_steps is exactly what -ffast-math may rewrite away.
  return x < -87.0F ? 0.0F : std::exp(x);
#else
  return exp_nonpositive_steps(x);
#endif
}

inline double exp_nonpositive(double x) noexcept { return x == -HUGE_VAL ? 0.0 : std::exp(x); }

#if KVCACHE_VECTOR_EXTENSIONS && !defined(__FAST_MATH__)
#define KVCACHE_VECTOR_EXP 1
/// Lane by lane, on a register of floats of any width.
template <class V>
requires std::is_same_v<V, Vector<float, sizeof(V)>>
inline V exp_nonpositive(const V& x) noexcept { return exp_nonpositive_steps(x); }
#else
#define KVCACHE_VECTOR_EXP 0
#endif

#if KVCACHE_BF16_PAIRS
/// Rounds n weights (finite, >= 0) to bfloat16, to nearest even, into `rounded`, and returns the
/// sum of the rounded values, so that the weights the V pass applies are the ones it divides by.
inline float round_weights(const float* weights, std::size_t n, std::uint16_t* rounded) noexcept {
  using V = Vector<float>;
  using Bits = Vector<std::uint32_t>;
  using Halves = std::uint16_t __attribute__((vector_size(kVectorBytes / 2)));
  constexpr std::size_t W = kVector<float>;
  const auto round = [](auto bits) { return (bits + 0x7FFFU + ((bits >> 16) & 1U)) >> 16; };  // a float's top half
  V lanes = splat(0.0F);
  std::size_t j = 0;
  for (; j + W <= n; j += W) {
    const Bits top = round(load_vector<Bits>(weights + j));
    store_vector(rounded + j, __builtin_convertvector(top, Halves));
    lanes += std::bit_cast<V>(top << 16);
  }
  float sum = fold_halves<W / 2>(lanes, [](const V& a, const V& b) { return a + b; })[0];
  for (; j < n; ++j) {
    const std::uint32_t top = round(std::bit_cast<std::uint32_t>(weights[j]));
    rounded[j] = static_cast<std::uint16_t>(top);
    sum += std::bit_cast<float>(top << 16);
  }
  return sum;
}
#endif

}  // namespace kvcache::detail
