// SPDX-License-Identifier: Apache-2.0
// Saving and loading cache state: a bit-exact round trip for every variant and format, every
// corruption refused with the cache unchanged, the data read straight into the cache's storage,
// and the reference model continuing after a load exactly as without it.

#include "kvcache/state_file.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <streambuf>
#include <string>
#include <vector>

#include "cache_test_support.hpp"
#include "kvcache/detail/crc32c.hpp"
#include "qwen3/model.hpp"

namespace kvcache::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// ---- CRC-32C ----------------------------------------------------------------------------------

std::vector<unsigned char> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> bytes(n);
  for (unsigned char& b : bytes) b = static_cast<unsigned char>(rng());
  return bytes;
}

TEST(Crc32c, MatchesTheStandardCheckValues) {
  // The check value of the catalogue of CRCs, and RFC 3720's (iSCSI) test patterns.
  const std::string digits = "123456789";
  const std::vector<unsigned char> zeros(32, 0x00), ones(32, 0xFF);
  std::vector<unsigned char> ascending(32);
  for (std::size_t i = 0; i < ascending.size(); ++i) ascending[i] = static_cast<unsigned char>(i);
  for (const auto crc : {&detail::crc32c_portable, &detail::crc32c}) {
    EXPECT_EQ(crc(0, digits.data(), digits.size()), 0xE3069283U);
    EXPECT_EQ(crc(0, zeros.data(), zeros.size()), 0x8A9136AAU);
    EXPECT_EQ(crc(0, ones.data(), ones.size()), 0x62A8AB43U);
    EXPECT_EQ(crc(0, ascending.data(), ascending.size()), 0x46DD794EU);
    EXPECT_EQ(crc(0, nullptr, 0), 0U);
  }
}

TEST(Crc32c, EveryFormAgreesAtEveryLengthAndAlignmentAndContinues) {
  const auto bytes = random_bytes(3 * 3 * 8192 + 77, 1);
  std::vector<std::size_t> lengths;
  for (std::size_t n = 0; n < 40; ++n) lengths.push_back(n);
  for (const std::size_t n : {24575U, 24576U, 24577U, 24585U, 49165U}) lengths.push_back(n);  // around 3 lanes
  for (const std::size_t n : lengths) {
    for (const std::size_t offset : {0U, 1U, 3U, 7U}) {
      const unsigned char* p = bytes.data() + offset;
      const std::uint32_t expected = detail::crc32c_portable(0, p, n);
      EXPECT_EQ(detail::crc32c(0, p, n), expected) << n << " bytes at offset " << offset;
#if defined(KVCACHE_CRC32C_X86)
      if (detail::has_sse42()) {
        EXPECT_EQ(detail::crc32c_sse42(0, p, n), expected) << n << " bytes";
      }
#endif
      const std::size_t half = n / 3;
      EXPECT_EQ(detail::crc32c(detail::crc32c(0, p, half), p + half, n - half), expected) << n << " bytes in two";
      EXPECT_EQ(detail::crc32c_combine(detail::crc32c(0, p, half), detail::crc32c(0, p + half, n - half), n - half),
                expected)
          << n << " bytes combined";
    }
  }
}

TEST(Crc32c, SeesEveryFlippedBit) {
  auto bytes = random_bytes(4096, 2);
  const std::uint32_t clean = detail::crc32c(0, bytes.data(), bytes.size());
  for (std::size_t bit = 0; bit < bytes.size() * 8; bit += 61) {
    bytes[bit / 8] ^= static_cast<unsigned char>(1U << (bit % 8));
    EXPECT_NE(detail::crc32c(0, bytes.data(), bytes.size()), clean) << "bit " << bit;
    bytes[bit / 8] ^= static_cast<unsigned char>(1U << (bit % 8));
  }
}

// ---- the file's framing, parsed here independently of the loader --------------------------

struct Section {
  std::string name;    // "ROWS[2]", "HEAD"
  std::size_t begin;   // its header's first byte
  std::size_t header;  // 16 bytes
  std::size_t payload;
  std::size_t end;  // after its checksum
};

/// The sections of a state file as docs/state.md describes them, each checksum verified.
std::vector<Section> parse_sections(const std::string& file) {
  std::vector<Section> sections;
  EXPECT_EQ(file.substr(0, 8), std::string("\x89KVC\r\n\x1a\n", 8));
  std::uint32_t version = 0;
  std::memcpy(&version, file.data() + 8, 4);
  EXPECT_EQ(version, 2U);
  for (std::size_t at = 12; at < file.size();) {
    Section s;
    s.begin = at;
    std::uint32_t index = 0;
    std::uint64_t bytes = 0;
    std::memcpy(&index, file.data() + at + 4, 4);
    std::memcpy(&bytes, file.data() + at + 8, 8);
    s.name = file.substr(at, 4) + (index == 0xFFFFFFFFU ? "" : "[" + std::to_string(index) + "]");
    s.header = 16;
    s.payload = static_cast<std::size_t>(bytes);
    s.end = at + 16 + s.payload + 4;
    EXPECT_LE(s.end, file.size()) << s.name;
    if (s.end > file.size()) break;
    std::uint32_t stored = 0;
    std::memcpy(&stored, file.data() + s.end - 4, 4);
    EXPECT_EQ(detail::crc32c_portable(0, file.data() + at, 16 + s.payload), stored) << s.name;
    sections.push_back(s);
    at = s.end;
  }
  return sections;
}

/// A file with one byte changed, and where, for messages.
struct Corrupted {
  std::string what;
  std::string bytes;
};

/// `file` with one byte flipped in each section's tag, length, first, middle and last payload
/// bytes and checksum, one at a time.
std::vector<Corrupted> corruptions(const std::string& file) {
  std::vector<Corrupted> out;
  for (const Section& s : parse_sections(file)) {
    std::vector<std::size_t> at = {s.begin, s.begin + 9, s.end - 1};
    if (s.payload != 0) {
      for (const std::size_t p : {std::size_t{0}, s.payload / 2, s.payload - 1}) at.push_back(s.begin + 16 + p);
    }
    for (const std::size_t byte : at) {
      std::string bad = file;
      bad[byte] = static_cast<char>(bad[byte] ^ 0x04);
      out.push_back({s.name + " byte " + std::to_string(byte - s.begin), std::move(bad)});
    }
  }
  return out;
}

/// A stream over bytes that records where every read of `min_bytes` or more went, and may refuse
/// to seek (a pipe) or change a byte once it has been read from the start again.
class RecordingBuf : public std::streambuf {
 public:
  struct Read {
    const char* to;
    std::size_t bytes;
  };

  RecordingBuf(std::string bytes, bool seekable) : bytes_(std::move(bytes)), seekable_(seekable) {
    char* p = bytes_.data();
    setg(p, p, p + bytes_.size());
  }
  std::vector<Read> reads;
  std::size_t min_bytes = 64;
  /// Flip this byte once the reader seeks backwards (the file changed under it).
  std::size_t flip_on_seek_back = std::string::npos;

 protected:
  std::streamsize xsgetn(char* s, std::streamsize n) override {
    const auto got = std::min<std::streamsize>(n, egptr() - gptr());
    std::memcpy(s, gptr(), static_cast<std::size_t>(got));
    gbump(static_cast<int>(got));
    if (static_cast<std::size_t>(got) >= min_bytes) reads.push_back({s, static_cast<std::size_t>(got)});
    return got;
  }
  pos_type seekoff(off_type off, std::ios_base::seekdir dir, std::ios_base::openmode which) override {
    if (!seekable_) return pos_type(off_type(-1));
    const off_type base = dir == std::ios_base::beg   ? 0
                          : dir == std::ios_base::cur ? gptr() - eback()
                                                      : egptr() - eback();
    return seekpos(pos_type(base + off), which);
  }
  pos_type seekpos(pos_type pos, std::ios_base::openmode) override {
    const auto at = static_cast<off_type>(pos);
    if (!seekable_ || at < 0 || at > egptr() - eback()) return pos_type(off_type(-1));
    if (at < gptr() - eback() && flip_on_seek_back < bytes_.size()) {
      bytes_[flip_on_seek_back] = static_cast<char>(bytes_[flip_on_seek_back] ^ 0x10);
      flip_on_seek_back = std::string::npos;
    }
    setg(eback(), eback() + at, egptr());
    return pos;
  }

 private:
  std::string bytes_;
  bool seekable_;
};

// ---- the typed suite over every variant and format -----------------------------------------

using StateCaches = gtest_types<every<formats, KvCache, ConcatKvCache, RingKvCache>>;

/// What every cache shows beside its rows: bytes, clipped count and head scales.
struct Totals {
  std::size_t bytes = 0;
  std::size_t clipped = 0;
  std::vector<float> key_scales, value_scales;
  friend bool operator==(const Totals&, const Totals&) = default;
};

template <class Cache>
Totals totals_of(const Cache& cache) {
  return {cache.bytes(), cache.clipped(), cache.key_head_scales(), cache.value_head_scales()};
}

/// Everything a cache shows: each layer's history by position, its lengths and totals.
struct Snapshot {
  std::vector<std::map<std::int64_t, Row>> layers;
  std::vector<std::size_t> lengths;
  Totals totals;
  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};

template <class Cache>
Snapshot snapshot(Cache& cache) {
  Snapshot s;
  for (std::size_t l = 0; l < cache.layers(); ++l) {
    s.layers.push_back(flatten(cache.history(l)));
    s.lengths.push_back(cache.length(l));
  }
  s.totals = totals_of(cache);
  return s;
}

template <class Cache>
std::string saved(const Cache& cache, std::string_view metadata = {}) {
  std::ostringstream out(std::ios::binary);
  save_state(cache, out, metadata);
  return std::move(out).str();
}

template <class Cache>
std::string load_from(Cache& cache, const std::string& file) {
  std::istringstream in(file);
  return load_state(cache, in);
}

StateInfo info_of(const std::string& file) {
  std::istringstream in(file);
  return read_state_info(in);
}

template <class Cache>
class StateFile : public ::testing::Test {
 protected:
  using T = typename Cache::value_type;
  using In = input_t<T>;
  static constexpr std::size_t layers = 3, batch = 2, kv_heads = 2, head_dim = 40, capacity = 24;

  // head_dim 40: int4 rows end in a short group. The ring wraps (window 6) and keeps a long last
  // chunk staged. fp8_e4m3_heads' given scales cover the first chunk's values, and later, larger
  // values beyond them are clipped and counted: both are state to restore.
  static KvCacheConfig config() {
    KvCacheConfig c{.layers = layers, .batch = batch, .kv_heads = kv_heads, .head_dim = head_dim, .capacity = capacity};
    if constexpr (is_ring<Cache>) {
      c.window = 6;
      c.sinks = 2;
      c.slack = 2;
    }
    return test_config<T>(c);
  }
  static Cache make() { return Cache(config()); }

  /// Feeds chunks of these sizes to every layer, from `seed`, each chunk's keys larger.
  static void feed(Cache& cache, std::initializer_list<std::size_t> chunks, std::uint64_t seed) {
    float gain = 1.0F;
    for (const std::size_t tokens : chunks) {
      const auto positions = arange(cache.length(), tokens);
      for (std::size_t l = 0; l < layers; ++l) {
        Block<In> k({batch, kv_heads, tokens, head_dim}, seed++);
        Block<In> v({batch, kv_heads, tokens, head_dim}, seed++);
        for (auto& x : k.data) x = static_cast<In>(static_cast<float>(x) * gain);
        cache.update(l, k.view(), v.view(), positions);
      }
      gain += 0.25F;
    }
  }
  /// A cache through a prompt, a decode, and a last chunk the ring stages.
  static Cache filled(std::uint64_t seed = 1) {
    Cache cache = make();
    feed(cache, {5, 1, 1, 4, 5}, seed);
    return cache;
  }
  /// A cache that holds other tokens: loads into it verify before they overwrite.
  static Cache holding_others() {
    Cache cache = make();
    feed(cache, {3, 2}, 1000);
    return cache;
  }
};

TYPED_TEST_SUITE(StateFile, StateCaches, CacheName);

/// The cases that check the framing, a variant's config or a load's input rather than rows:
/// one format per variant (the formats differ in their rows alone, which StateFile covers).
template <class Cache>
class StateFileOneFormat : public StateFile<Cache> {};
using StateVariants = ::testing::Types<KvCache<float>, ConcatKvCache<float>, RingKvCache<float>>;
TYPED_TEST_SUITE(StateFileOneFormat, StateVariants, CacheName);

TYPED_TEST(StateFile, RoundTripIsBitExactAndContinuesTheSame) {
  TypeParam original = this->filled();
  if constexpr (detail::has_head_scales<typename TypeParam::value_type>) {
    ASSERT_GT(original.clipped(), 0U);  // later values beyond the given scales
  }
  if constexpr (is_ring<TypeParam>) {
    // The last chunk (5 tokens, more than slack + 1) is staged: its own segment.
    ASSERT_EQ(original.history(0).segments.size(), 4U);
  }
  const std::string file = saved(original, "model fingerprint; tokens 1 2 3");
  TypeParam loaded = this->make();
  EXPECT_EQ(load_from(loaded, file), "model fingerprint; tokens 1 2 3");
  EXPECT_EQ(snapshot(loaded), snapshot(original));
  EXPECT_EQ(saved(loaded, "model fingerprint; tokens 1 2 3"), file);  // every byte of the state

  // Both continue alike: the ring folds its staged chunk, fp8_e4m3_heads keeps its scales.
  this->feed(original, {1, 3, 1}, 77);
  this->feed(loaded, {1, 3, 1}, 77);
  EXPECT_EQ(snapshot(loaded), snapshot(original));
  loaded.truncate(loaded.length() - 1);
  original.truncate(original.length() - 1);
  EXPECT_EQ(snapshot(loaded), snapshot(original));
}

TYPED_TEST(StateFile, LoadsIntoACacheHoldingTokensFromEveryKindOfInput) {
  const TypeParam original = this->filled();
  const std::string file = saved(original);
  TypeParam expected = this->filled();
  const Snapshot want = snapshot(expected);
  for (const bool seekable : {true, false}) {
    TypeParam cache = this->holding_others();
    RecordingBuf buf(file, seekable);
    std::istream in(&buf);
    EXPECT_EQ(load_state(cache, in), "");
    EXPECT_EQ(snapshot(cache), want) << (seekable ? "seekable" : "non-seekable");
    EXPECT_EQ(in.tellg(),
              seekable ? std::istream::pos_type(static_cast<std::streamoff>(file.size())) : std::istream::pos_type(-1));
  }
  const auto path = std::filesystem::temp_directory_path() / ("kvcache_state_test_" + CacheName::GetName<TypeParam>(0));
  save_state(original, path, "from a file");
  for (const auto& entry : std::filesystem::directory_iterator(path.parent_path())) {  // no temporary file left
    EXPECT_NE(entry.path().filename().string().rfind(path.filename().string() + ".tmp.", 0), 0U) << entry.path();
  }
  TypeParam cache = this->holding_others();
  EXPECT_EQ(load_state(cache, path), "from a file");
  EXPECT_EQ(snapshot(cache), want);
  std::filesystem::remove(path);
}

TYPED_TEST(StateFile, ResetAndEmptyCachesRoundTrip) {
  TypeParam cache = this->filled();
  cache.reset();
  TypeParam loaded = this->holding_others();
  load_from(loaded, saved(cache));
  // A loaded ConcatKvCache allocates its tokens' buffers only: none here.
  const auto comparable = [](Snapshot s) {
    if constexpr (std::is_same_v<TypeParam, ConcatKvCache<typename TypeParam::value_type>>) s.totals.bytes = 0;
    return s;
  };
  EXPECT_EQ(comparable(snapshot(loaded)), comparable(snapshot(cache)));
  EXPECT_EQ(loaded.length(), 0U);
  this->feed(cache, {2}, 5);
  this->feed(loaded, {2}, 5);
  EXPECT_EQ(snapshot(loaded), snapshot(cache));
}

TYPED_TEST(StateFile, PartWayPassRoundTrips) {
  TypeParam cache = this->filled();
  Block<typename TestFixture::In> k({this->batch, this->kv_heads, 1, this->head_dim}, 9);
  cache.update(0, k.view(), k.view(), arange(cache.length(0), 1));  // the pass stops after layer 0
  TypeParam loaded = this->make();
  load_from(loaded, saved(cache));
  EXPECT_EQ(snapshot(loaded), snapshot(cache));
  EXPECT_EQ(loaded.length(0), loaded.length(1) + 1);
}

/// Expects `load` to throw E naming both sides, and the cache it loads into to be unchanged.
template <class E, class Cache, class Load>
void expect_refused(Cache& cache, const Load& load, const std::string& what) {
  const Snapshot before = snapshot(cache);
  try {
    load(cache);
    ADD_FAILURE() << what << ": loaded";
  } catch (const E& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("expected"), HasSubstr("found"))) << what;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": threw another exception: " << e.what();
  }
  EXPECT_EQ(snapshot(cache), before) << what;
}

TYPED_TEST(StateFile, AFlippedByteInAnySectionIsRefusedAndTheCacheUnchanged) {
  const std::string file = saved(this->filled(), "metadata");
  const auto sections = parse_sections(file);
  std::vector<std::string> names;
  for (const Section& s : sections) names.push_back(s.name.substr(0, 4));
  EXPECT_EQ(names.front(), "HEAD");
  EXPECT_EQ(names[1], "META");
  EXPECT_EQ(names[2], "BASE");
  EXPECT_EQ(std::count(names.begin(), names.end(), "ROWS"), static_cast<std::ptrdiff_t>(this->layers));
  TypeParam holding = this->holding_others();
  TypeParam empty = this->make();
  for (const Corrupted& corrupted : corruptions(file)) {
    const std::string& what = corrupted.what;
    const std::string& bad = corrupted.bytes;
    for (TypeParam* cache : {&holding, &empty}) {
      for (const bool seekable : {true, false}) {
        expect_refused<std::runtime_error>(
            *cache,
            [&](TypeParam& c) {
              RecordingBuf buf(bad, seekable);
              std::istream in(&buf);
              load_state(c, in);
            },
            what);
      }
    }
  }
  // Both still load the file itself.
  load_from(holding, file);
  TypeParam expected = this->filled();
  EXPECT_EQ(snapshot(holding), snapshot(expected));
}

TYPED_TEST(StateFile, ATruncatedFileIsRefusedAndTheCacheUnchanged) {
  const std::string file = saved(this->filled());
  std::vector<std::size_t> cuts = {0, 3, 8, 10, 12, file.size() - 1};
  for (const Section& s : parse_sections(file)) {
    for (const std::size_t at : {s.begin, s.begin + 7, s.begin + 16 + s.payload / 2, s.end - 2}) cuts.push_back(at);
  }
  TypeParam holding = this->holding_others();
  TypeParam empty = this->make();
  for (const std::size_t cut : cuts) {
    for (TypeParam* cache : {&holding, &empty}) {
      expect_refused<std::runtime_error>(
          *cache, [&](TypeParam& c) { load_from(c, file.substr(0, cut)); }, "cut at " + std::to_string(cut));
    }
  }
}

TYPED_TEST(StateFileOneFormat, AWrongMagicOrVersionIsRefusedNamingBoth) {
  const std::string file = saved(this->filled());
  TypeParam cache = this->holding_others();
  std::string other_magic = file;
  other_magic[1] = 'X';
  expect_refused<std::runtime_error>(
      cache, [&](TypeParam& c) { load_from(c, other_magic); }, "magic");
  try {
    load_from(cache, other_magic);
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("magic"), HasSubstr("\\x89KVC"), HasSubstr("\\x89XVC")));
  }
  std::string newer = file;
  const std::uint32_t three = 3;
  std::memcpy(newer.data() + 8, &three, 4);
  try {
    load_from(cache, newer);
    ADD_FAILURE() << "a version 3 file loaded";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("version: expected 1 to 2"), HasSubstr("found 3")));
  }
  expect_refused<std::runtime_error>(
      cache, [&](TypeParam& c) { load_from(c, "not a state file at all"); }, "text");
}

TYPED_TEST(StateFileOneFormat, AnotherShapeIsRefusedNamingTheField) {
  const KvCacheConfig base = this->config();
  struct Other {
    std::string field;
    std::size_t own;
    KvCacheConfig config;
  };
  std::vector<Other> others = {{"layers", base.layers, base},
                               {"batch", base.batch, base},
                               {"kv_heads", base.kv_heads, base},
                               {"head_dim", base.head_dim, base}};
  others[0].config.layers = base.layers + 1;
  others[1].config.batch = base.batch + 1;
  others[2].config.kv_heads = base.kv_heads + 1;
  others[3].config.head_dim = base.head_dim + 2;
  if constexpr (is_ring<TypeParam>) {
    others.push_back({"window", base.window, base});
    others.back().config.window = base.window + 1;
    others.push_back({"sinks", base.sinks, base});
    others.back().config.sinks = base.sinks + 1;
    others.push_back({"slack", base.slack, base});
    others.back().config.slack = base.slack + 1;
  }
  TypeParam cache = this->holding_others();
  for (const Other& other : others) {
    const std::string file = saved(TypeParam(other.config));
    expect_refused<std::invalid_argument>(
        cache, [&](TypeParam& c) { load_from(c, file); }, other.field);
    try {
      load_from(cache, file);
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr("the file's " + other.field + ": expected " + std::to_string(other.own)));
    }
  }
}

TYPED_TEST(StateFileOneFormat, AnotherCapacityLoadsWhileTheTokensFit) {
  TypeParam original = this->filled();  // 16 tokens
  const std::string file = saved(original);
  KvCacheConfig roomy = this->config();
  roomy.capacity = 40;
  TypeParam larger(roomy);
  load_from(larger, file);
  for (std::size_t l = 0; l < this->layers; ++l) {
    EXPECT_EQ(flatten(larger.history(l)), flatten(original.history(l))) << "layer " << l;
  }
  KvCacheConfig tight = this->config();
  tight.capacity = 10;
  TypeParam smaller(tight);
  expect_refused<std::invalid_argument>(
      smaller, [&](TypeParam& c) { load_from(c, file); }, "capacity");
}

TYPED_TEST(StateFileOneFormat, InfoDescribesTheFileAndBuildsACacheThatLoadsIt) {
  TypeParam original = this->filled();
  std::istringstream in(saved(original, "fingerprint"));
  const StateInfo info = read_state_info(in);
  EXPECT_EQ(info.format, storage_codec<typename TypeParam::value_type>::name);
  EXPECT_EQ(info.variant, variant_name<TypeParam>);
  EXPECT_EQ(info.metadata, "fingerprint");
  EXPECT_EQ(info.lengths, std::vector<std::size_t>(this->layers, 16));
  EXPECT_EQ(std::size_t{info.config.capacity}, this->capacity);
  EXPECT_EQ(std::size_t{info.config.window}, std::size_t{this->config().window});
  TypeParam built(info.config);
  in.seekg(0);
  load_state(built, in);
  EXPECT_EQ(snapshot(built), snapshot(original));
}

TYPED_TEST(StateFileOneFormat, AFileChangedBetweenVerifyingAndReadingResetsTheCacheAndSaysSo) {
  const std::string file = saved(this->filled());
  const auto sections = parse_sections(file);
  const auto rows =
      std::find_if(sections.begin(), sections.end(), [](const Section& s) { return s.name == "ROWS[1]"; });
  ASSERT_NE(rows, sections.end());
  TypeParam cache = this->holding_others();
  RecordingBuf buf(file, true);
  buf.flip_on_seek_back = rows->begin + 16 + rows->payload / 2;
  std::istream in(&buf);
  try {
    load_state(cache, in);
    ADD_FAILURE() << "loaded a file that changed";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("ROWS[1]"), HasSubstr("changed"), HasSubstr("reset")));
  }
  EXPECT_EQ(cache.length(), 0U);
}

/// Sets the u64 at `at` bytes into the payload of `file`'s section `name` to `value`, its
/// checksum recomputed as a crafted file's would be; returns the value it replaced.
std::uint64_t patch_u64(std::string& file, const std::string& name, std::size_t at, std::uint64_t value) {
  const auto sections = parse_sections(file);
  const auto s = std::find_if(sections.begin(), sections.end(), [&](const Section& x) { return x.name == name; });
  EXPECT_NE(s, sections.end()) << name;
  if (s == sections.end()) return 0;
  std::uint64_t old = 0;
  std::memcpy(&old, file.data() + s->begin + 16 + at, 8);
  std::memcpy(file.data() + s->begin + 16 + at, &value, 8);
  const std::uint32_t crc = detail::crc32c_portable(0, file.data() + s->begin, 16 + s->payload);
  std::memcpy(file.data() + s->end - 4, &crc, 4);
  return old;
}

TEST(StateFileCrafted, HeadsLayersBeyondBasesPayloadAreRefusedBeforeAnythingIsSized) {
  // Found by fuzz/state_fuzz: read_state_info sized BASE's per-layer lists from HEAD's layers
  // before checking that BASE holds them, so a crafted HEAD (checksums recomputed) asked for
  // 2^44 lengths.
  KvCache<float> cache({.layers = 2, .kv_heads = 1, .head_dim = 4, .capacity = 4});
  std::string file = saved(cache);
  // HEAD: variant and format (u32 length + characters each), unit bytes, units, two flags, layers.
  ASSERT_EQ(patch_u64(file, "HEAD", 4 + 7 + 4 + 5 + 8 + 8 + 1 + 1, std::uint64_t{1} << 44), 2U);
  try {
    (void)info_of(file);
    ADD_FAILURE() << "read a BASE too short for HEAD's layers";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("section BASE: payload bytes: expected 281474976710657 (for HEAD's "
                                          "17592186044416 layers)"),
                                HasSubstr("found 33")));
  }
  const Snapshot before = snapshot(cache);
  EXPECT_THROW(load_from(cache, file), std::invalid_argument);  // HEAD's layers are not the cache's
  EXPECT_EQ(snapshot(cache), before);
}

TEST(StateFileCrafted, ARingsStagingAreaBeyondItsCapacityIsRefusedBeforeItIsAllocated) {
  // Found by fuzz/state_fuzz: a ring allocated the staging area a crafted RING section asked for
  // (2^40 tokens here), which no chunk within the capacity can need.
  const KvCacheConfig config{.layers = 1, .kv_heads = 1, .head_dim = 4, .capacity = 12, .window = 3, .sinks = 1};
  RingKvCache<float> saved_ring(config);
  Block<float> k({1, 1, 5, 4}, 1);
  saved_ring.update(0, k.view(), k.view(), arange(0, 5));  // a chunk the ring stages
  std::string file = saved(saved_ring);
  ASSERT_EQ(patch_u64(file, "RING[0]", 16, std::uint64_t{1} << 40), 5U);  // after stored_end and oldest
  RingKvCache<float> cache(config);
  Block<float> other({1, 1, 2, 4}, 2);
  cache.update(0, other.view(), other.view(), arange(0, 2));
  const Snapshot before = snapshot(cache);
  try {
    load_from(cache, file);
    ADD_FAILURE() << "loaded a staging area of 2^40 tokens";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("section RING[0]: staging tokens: expected <= the capacity 12"),
                                HasSubstr("found 1099511627776")));
  }
  EXPECT_EQ(snapshot(cache), before);
}

TEST(StateFileCrafted, ARingSlotHoldingAnotherPositionThanTheHistoryReadsIsRefused) {
  // Found by fuzz/state_fuzz in CI: a slot the history reads said position 6 (its slot's, but
  // past the layer's length of 4), and the loaded history held it.
  const KvCacheConfig config{.layers = 1, .kv_heads = 1, .head_dim = 4, .capacity = 32, .window = 4, .sinks = 1};
  RingKvCache<float> saved_ring(config);
  for (std::size_t t = 0; t < 4; ++t) {
    Block<float> k({1, 1, 1, 4}, t);
    saved_ring.update(0, k.view(), k.view(), arange(t, 1));
  }
  std::string file = saved(saved_ring);
  ASSERT_EQ(patch_u64(file, "RING[0]", 24 + 2 * 8, 6), 2U);  // slot 2 of stored_end, oldest, staging, slots
  RingKvCache<float> cache(config);
  const Snapshot before = snapshot(cache);
  try {
    load_from(cache, file);
    ADD_FAILURE() << "loaded a slot holding position 6 into a layer of 4 tokens";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(),
                AllOf(HasSubstr("section RING[0]: row positions: expected 2 in row 2"), HasSubstr("found 6")));
  }
  EXPECT_EQ(snapshot(cache), before);
}

TEST(StateFileCrafted, ARingWithoutCapacityAllocatesOnlyTheStagedTokensAFileHolds) {
  // Without a capacity nothing bounds a saved staging area: the loaded ring allocates the staged
  // tokens the file holds, and a later larger chunk grows it as it would have.
  const KvCacheConfig config{.layers = 1, .kv_heads = 1, .head_dim = 4, .window = 3, .sinks = 1};
  RingKvCache<float> saved_ring(config);
  Block<float> k({1, 1, 5, 4}, 1);
  saved_ring.update(0, k.view(), k.view(), arange(0, 5));  // a chunk the ring stages
  std::string file = saved(saved_ring);
  ASSERT_EQ(patch_u64(file, "RING[0]", 16, std::uint64_t{1} << 40), 5U);
  RingKvCache<float> cache(config);
  load_from(cache, file);
  EXPECT_EQ(cache.bytes(), saved_ring.bytes());  // five staged tokens, not 2^40
  EXPECT_EQ(flatten(cache.history(0)), flatten(saved_ring.history(0)));
  Block<float> more({1, 1, 7, 4}, 3);
  cache.update(0, more.view(), more.view(), arange(5, 7));
  saved_ring.update(0, more.view(), more.view(), arange(5, 7));
  EXPECT_EQ(flatten(cache.history(0)), flatten(saved_ring.history(0)));
}

// ---- SlotKvCache: rows of their own lengths, some slots free ------------------------------

/// Everything a slot cache shows: which slots are acquired, each (layer, slot)'s tokens and
/// history, bytes, clipped count and head scales.
struct SlotSnapshot {
  std::vector<bool> acquired;
  std::vector<std::size_t> lengths;                 // [layer, slot]
  std::vector<std::map<std::int64_t, Row>> layers;  // [layer, slot]
  Totals totals;
  friend bool operator==(const SlotSnapshot&, const SlotSnapshot&) = default;
};

template <class T>
SlotSnapshot snapshot(SlotKvCache<T>& cache) {
  SlotSnapshot s;
  for (std::size_t row = 0; row < cache.slots(); ++row) s.acquired.push_back(cache.acquired(row));
  for (std::size_t l = 0; l < cache.layers(); ++l) {
    for (std::size_t row = 0; row < cache.slots(); ++row) {
      s.lengths.push_back(cache.row_length(row, l));
      s.layers.push_back(flatten(cache.history(l, Rows(row))));
    }
  }
  s.totals = totals_of(cache);
  return s;
}

template <class T>
class SlotStateFile : public ::testing::Test {
 protected:
  using Cache = SlotKvCache<T>;
  using In = input_t<T>;
  static constexpr std::size_t layers = 3, slots = 3, kv_heads = 2, head_dim = 40, capacity = 24;

  static KvCacheConfig config(std::size_t cap = capacity) {
    return test_config<T>(
        {.layers = layers, .batch = slots, .kv_heads = kv_heads, .head_dim = head_dim, .capacity = cap});
  }
  /// Feeds `tokens` to `row` in layers [0, until), from `seed`, scaled by `gain`.
  static void feed(Cache& cache, std::size_t row, std::size_t tokens, std::uint64_t seed, float gain = 1.0F,
                   std::size_t until = layers) {
    const auto positions = arange(cache.row_length(row, 0), tokens);
    for (std::size_t l = 0; l < until; ++l) {
      Block<In> k({1, kv_heads, tokens, head_dim}, seed + 2 * l);
      Block<In> v({1, kv_heads, tokens, head_dim}, seed + 2 * l + 1);
      for (auto& x : k.data) x = static_cast<In>(static_cast<float>(x) * gain);
      cache.update(l, k.view(), v.view(), positions, Rows(row));
    }
  }
  /// Slot 0 holds a prompt and a decoded token, slot 1 was released, slot 2 stopped part-way
  /// (one more token in layer 0); fp8_e4m3_heads' later, larger values are clipped.
  static Cache filled(std::size_t cap = capacity) {
    Cache cache(config(cap));
    for (std::size_t row = 0; row < slots; ++row) EXPECT_EQ(cache.acquire(), row);
    feed(cache, 0, 7, 1);
    feed(cache, 1, 2, 20);
    feed(cache, 2, 4, 40);
    cache.release(1);
    feed(cache, 0, 1, 60, 2.0F);
    feed(cache, 2, 1, 80, 1.5F, 1);
    return cache;
  }
  /// A cache whose slots hold other tokens: loads into it verify before they overwrite.
  static Cache holding_others() {
    Cache cache(config());
    (void)cache.acquire();
    (void)cache.acquire();
    feed(cache, 1, 9, 1000);
    return cache;
  }
};

using SlotFormats = gtest_types<formats>;
TYPED_TEST_SUITE(SlotStateFile, SlotFormats);

TYPED_TEST(SlotStateFile, RoundTripIsBitExactAndContinuesTheSame) {
  SlotKvCache<TypeParam> original = this->filled();
  if constexpr (detail::has_head_scales<TypeParam>) {
    ASSERT_GT(original.clipped(), 0U);
  }
  ASSERT_EQ(original.row_length(2, 0), original.row_length(2, 1) + 1);
  const std::string file = saved(original, "slots");
  EXPECT_EQ(info_of(file).variant, "SlotKvCache");
  StateInfo info = info_of(file);
  info.config.key_scales = info.key_scales;
  info.config.value_scales = info.value_scales;
  SlotKvCache<TypeParam> loaded(info.config);
  EXPECT_EQ(load_from(loaded, file), "slots");
  EXPECT_EQ(snapshot(loaded), snapshot(original));
  EXPECT_FALSE(loaded.acquired(1));
  EXPECT_EQ(saved(loaded, "slots"), file);

  // Both continue alike: slot 2 repaired, slot 1 admitted again, slot 0 decoding.
  for (SlotKvCache<TypeParam>* cache : {&original, &loaded}) {
    cache->truncate(2, cache->row_length(2, 1));
    EXPECT_EQ(cache->acquire(), 1U);
    this->feed(*cache, 1, 3, 500);
    this->feed(*cache, 0, 2, 600);
    this->feed(*cache, 2, 1, 700);
  }
  EXPECT_EQ(snapshot(loaded), snapshot(original));
}

TYPED_TEST(SlotStateFile, AFlippedByteInAnySectionIsRefusedAndTheCacheUnchanged) {
  const std::string file = saved(this->filled(), "metadata");
  const auto sections = parse_sections(file);
  ASSERT_TRUE(std::any_of(sections.begin(), sections.end(), [](const Section& s) { return s.name == "SLOT"; }));
  SlotKvCache<TypeParam> holding = this->holding_others();
  SlotKvCache<TypeParam> empty(this->config());
  for (const Corrupted& corrupted : corruptions(file)) {
    const std::string& what = corrupted.what;
    const std::string& bad = corrupted.bytes;
    for (SlotKvCache<TypeParam>* cache : {&holding, &empty}) {
      for (const bool seekable : {true, false}) {
        const SlotSnapshot before = snapshot(*cache);
        RecordingBuf buf(bad, seekable);
        std::istream in(&buf);
        EXPECT_THROW(load_state(*cache, in), std::runtime_error) << what;
        EXPECT_EQ(snapshot(*cache), before) << what;
      }
    }
  }
  load_from(holding, file);
  SlotKvCache<TypeParam> expected = this->filled();
  EXPECT_EQ(snapshot(holding), snapshot(expected));
}

using SlotFloatState = SlotStateFile<float>;

TEST_F(SlotFloatState, LoadsIntoSlotsHoldingTokensAndRefusesWhatDoesNotFit) {
  const Cache original = filled();
  const std::string file = saved(original);
  Cache expected = filled();
  for (const bool seekable : {true, false}) {
    Cache cache = holding_others();
    RecordingBuf buf(file, seekable);
    std::istream in(&buf);
    load_state(cache, in);
    EXPECT_EQ(snapshot(cache), snapshot(expected)) << "seekable " << seekable;
  }
  // A file changed between verifying and reading: slots that held tokens are read first.
  const auto sections = parse_sections(file);
  const auto rows =
      std::find_if(sections.begin(), sections.end(), [](const Section& s) { return s.name == "ROWS[1]"; });
  ASSERT_NE(rows, sections.end());
  Cache changed = holding_others();
  RecordingBuf buf(file, true);
  buf.flip_on_seek_back = rows->begin + 16 + rows->payload / 2;
  std::istream in(&buf);
  EXPECT_THROW(load_state(changed, in), std::runtime_error);
  EXPECT_EQ(changed.free_slots(), slots);

  Cache larger(config(40));
  load_from(larger, file);
  for (std::size_t l = 0; l < layers; ++l) {
    for (std::size_t row = 0; row < slots; ++row) {
      EXPECT_EQ(flatten(larger.history(l, Rows(row))), flatten(expected.history(l, Rows(row))));
    }
  }
  Cache smaller(config(7));  // slot 0 holds 8 tokens
  const SlotSnapshot before = snapshot(smaller);
  try {
    load_from(smaller, file);
    ADD_FAILURE() << "8 tokens loaded into a capacity of 7";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("slot 0 tokens: expected <= 7"), HasSubstr("found 8")));
  }
  EXPECT_EQ(snapshot(smaller), before);
  KvCacheConfig more_slots = config();
  more_slots.batch = slots + 1;
  Cache other(more_slots);
  EXPECT_THROW(load_from(other, file), std::invalid_argument);
}

TEST_F(SlotFloatState, AFreeSlotWithTokensIsRefused) {
  // A crafted file: slot 1 free but holding tokens, its checksum recomputed.
  std::string file = saved(filled());
  const auto sections = parse_sections(file);
  const auto slot = std::find_if(sections.begin(), sections.end(), [](const Section& s) { return s.name == "SLOT"; });
  ASSERT_NE(slot, sections.end());
  const std::size_t length_1 = slot->begin + 16 + slots + 8 * 1;  // layer 0, slot 1
  file[length_1] = 3;
  const std::uint32_t crc = detail::crc32c_portable(0, file.data() + slot->begin, 16 + slot->payload);
  std::memcpy(file.data() + slot->end - 4, &crc, 4);
  Cache cache = holding_others();
  const SlotSnapshot before = snapshot(cache);
  try {
    load_from(cache, file);
    ADD_FAILURE() << "loaded a free slot with tokens";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("layer 0 slot 1 tokens"), HasSubstr("free"), HasSubstr("found 3")));
  }
  EXPECT_EQ(snapshot(cache), before);
}

TEST_F(SlotFloatState, BaseLayerLengthsOtherThanZeroAreRefused) {
  // Found by fuzz/state_fuzz: a slot cache's file whose BASE gave layer 1 tokens (its slots
  // keep their own in SLOT) loaded, and the cache took BASE's lengths as its own.
  std::string file = saved(filled());
  ASSERT_EQ(patch_u64(file, "BASE", 8, 5), 0U);  // layer 1's length, after layer 0's
  Cache cache = holding_others();
  const SlotSnapshot before = snapshot(cache);
  try {
    load_from(cache, file);
    ADD_FAILURE() << "loaded a slot cache's file whose BASE gives layer 1 five tokens";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("section SLOT: BASE's layer 1 tokens: expected 0"), HasSubstr("found 5")));
  }
  EXPECT_EQ(snapshot(cache), before);
}

// ---- PagedKvCache: one sequence of a pool, loaded into fresh blocks of another -----------

/// What a paged sequence shows: each layer's history and tokens, its blocks' count, its
/// totals (the pool's clipped count and head scales).
struct PagedSnapshot {
  std::vector<std::map<std::int64_t, Row>> layers;
  std::vector<std::size_t> lengths;
  std::size_t blocks = 0;
  Totals totals;
  friend bool operator==(const PagedSnapshot&, const PagedSnapshot&) = default;
};

template <class T>
PagedSnapshot snapshot(PagedKvCache<T>& seq) {
  PagedSnapshot s;
  for (std::size_t l = 0; l < seq.layers(); ++l) {
    s.layers.push_back(flatten(seq.history(l)));
    s.lengths.push_back(seq.length(l));
  }
  s.blocks = seq.block_table().size();
  s.totals = totals_of(seq);
  return s;
}

template <class T>
class PagedStateFile : public ::testing::Test {
 protected:
  using Seq = PagedKvCache<T>;
  using Pool = BlockPool<T>;
  using In = input_t<T>;
  static constexpr std::size_t layers = 3, kv_heads = 2, head_dim = 40, block_tokens = 4;

  /// fp8_e4m3_heads' scales: pools that hold other sequences agree with the file's.
  static BlockPoolConfig config(std::size_t blocks = 16, std::size_t tokens = block_tokens) {
    BlockPoolConfig c{
        .layers = layers, .kv_heads = kv_heads, .head_dim = head_dim, .block_tokens = tokens, .blocks = blocks};
    if constexpr (detail::has_head_scales<T>) {
      c.key_scales = scales();
      c.value_scales = scales();
    }
    return c;
  }
  static std::span<const float> scales() {
    static const std::vector<float> given(layers * kv_heads, 0.01F);
    return given;
  }
  static std::vector<TokenId> ids(std::size_t n, TokenId first) {
    std::vector<TokenId> v(n);
    std::iota(v.begin(), v.end(), first);
    return v;
  }
  /// Feeds `tokens` to layers [0, until) of `seq`, from `seed`.
  static void feed(Seq& seq, std::size_t tokens, std::uint64_t seed, std::size_t until = layers) {
    const auto positions = arange(seq.length(0), tokens);
    for (std::size_t l = 0; l < until; ++l) {
      Block<In> k({1, kv_heads, tokens, head_dim}, seed + 2 * l);
      Block<In> v({1, kv_heads, tokens, head_dim}, seed + 2 * l + 1);
      seq.update(l, k.view(), v.view(), positions);
    }
  }
  /// A prompt of 10 known ids fed in chunks to 11 tokens, then one more in layer 0 only (a
  /// pass stopped part-way): its first two blocks are keyed.
  static void fill(Seq& seq) {
    EXPECT_EQ(seq.reuse_prefix(ids(10, 100)), 0U);
    feed(seq, 5, 1);
    feed(seq, 1, 10);
    feed(seq, 5, 20);
    feed(seq, 1, 30, 1);
  }
};

using PagedFormats = gtest_types<formats>;
TYPED_TEST_SUITE(PagedStateFile, PagedFormats);

TYPED_TEST(PagedStateFile, RoundTripIsBitExactContinuesTheSameAndIsReused) {
  BlockPool<TypeParam> pool(this->config());
  PagedKvCache<TypeParam> original(pool);
  this->fill(original);
  ASSERT_EQ(pool.keyed_blocks(), 2U);
  const std::string file = saved(original, "paged");
  EXPECT_EQ(info_of(file).variant, "PagedKvCache");

  BlockPool<TypeParam> other(this->config());
  PagedKvCache<TypeParam> holder(other);  // holds the pool's first blocks: the load takes others
  this->feed(holder, 6, 900);
  PagedKvCache<TypeParam> loaded(other);
  EXPECT_EQ(load_from(loaded, file), "paged");
  EXPECT_EQ(snapshot(loaded), snapshot(original));
  EXPECT_EQ(saved(loaded, "paged"), file);
  for (const std::size_t b : loaded.block_table()) {
    EXPECT_EQ(std::count(holder.block_table().begin(), holder.block_table().end(), b), 0) << "block " << b;
  }
  EXPECT_EQ(other.keyed_blocks(), 2U);
  other.check_invariants();

  // A new sequence with the prompt takes the loaded blocks.
  PagedKvCache<TypeParam> reuser(other);
  EXPECT_EQ(reuser.reuse_prefix(this->ids(10, 100)), 8U);
  EXPECT_TRUE(std::equal(reuser.block_table().begin(), reuser.block_table().end(), loaded.block_table().begin()));

  // Both continue alike: the part-way pass repaired back to the tokens whose ids are known,
  // then decoding with each token's id given before it.
  for (PagedKvCache<TypeParam>* seq : {&original, &loaded}) {
    seq->truncate(10);
    seq->add_token_ids(this->ids(4, 110));
    this->feed(*seq, 3, 500);
    this->feed(*seq, 2, 600);
  }
  EXPECT_EQ(snapshot(loaded), snapshot(original));
  EXPECT_EQ(pool.keyed_blocks(), 3U);
  EXPECT_EQ(other.keyed_blocks(), 3U);
  other.check_invariants();
}

TYPED_TEST(PagedStateFile, AFlippedByteInAnySectionIsRefusedAndNothingChanged) {
  BlockPool<TypeParam> pool(this->config());
  PagedKvCache<TypeParam> original(pool);
  this->fill(original);
  const std::string file = saved(original, "metadata");
  const auto sections = parse_sections(file);
  ASSERT_TRUE(std::any_of(sections.begin(), sections.end(), [](const Section& s) { return s.name == "PAGE"; }));

  // The pool's free blocks: two never used, then three of a released prompt, still keyed,
  // which the load's three blocks reach: their rows must survive every refused load.
  BlockPool<TypeParam> other(this->config(16));
  PagedKvCache<TypeParam> holder(other);
  this->feed(holder, 44, 900);
  PagedKvCache<TypeParam> keeper(other);
  (void)keeper.reuse_prefix(this->ids(12, 7));
  this->feed(keeper, 12, 800);
  const PagedSnapshot kept = snapshot(keeper);
  keeper.reset();
  ASSERT_EQ(other.free_blocks(), 5U);
  ASSERT_EQ(other.keyed_blocks(), 3U);
  const PagedSnapshot held = snapshot(holder);
  PagedKvCache<TypeParam> target(other);
  for (const Corrupted& corrupted : corruptions(file)) {
    const std::string& what = corrupted.what;
    const std::string& bad = corrupted.bytes;
    for (const bool seekable : {true, false}) {
      RecordingBuf buf(bad, seekable);
      std::istream in(&buf);
      EXPECT_THROW(load_state(target, in), std::runtime_error) << what;
      EXPECT_EQ(target.length(), 0U) << what;
      EXPECT_TRUE(target.block_table().empty()) << what;
      EXPECT_EQ(other.free_blocks(), 5U) << what;
      EXPECT_EQ(other.keyed_blocks(), 3U) << what;
    }
  }
  other.check_invariants();
  EXPECT_EQ(snapshot(holder), held);
  PagedKvCache<TypeParam> reuser(other);
  EXPECT_EQ(reuser.reuse_prefix(this->ids(13, 7)), 12U);  // the prompt's 13th token is fed
  EXPECT_EQ(snapshot(reuser), kept);
  reuser.reset();
  load_from(target, file);
  EXPECT_EQ(snapshot(target), snapshot(original));
  other.check_invariants();
}

using PagedFloatState = PagedStateFile<float>;

TEST_F(PagedFloatState, RefusesASequenceHoldingTokensAPoolWithoutRoomAndAnotherBlockSize) {
  Pool pool(config());
  Seq original(pool);
  fill(original);
  const std::string file = saved(original);

  Pool other(config());
  Seq busy(other);
  feed(busy, 2, 5);
  const PagedSnapshot before = snapshot(busy);
  try {
    load_from(busy, file);
    ADD_FAILURE() << "loaded into a sequence holding tokens";
  } catch (const std::logic_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("an empty sequence"), HasSubstr("2 tokens")));
  }
  EXPECT_EQ(snapshot(busy), before);
  busy.reset();
  load_from(busy, file);
  EXPECT_EQ(snapshot(busy), snapshot(original));

  Pool full(config(4));
  Seq filler(full);
  feed(filler, 8, 5);  // 2 of 4 blocks; the file needs 3
  Seq target(full);
  try {
    load_from(target, file);
    ADD_FAILURE() << "loaded into a pool without room";
  } catch (const std::length_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("at most the 2 free"), HasSubstr("3 needed")));
  }
  EXPECT_EQ(full.free_blocks(), 2U);
  EXPECT_TRUE(target.block_table().empty());
  full.check_invariants();

  Pool wide(config(16, 8));
  Seq other_size(wide);
  try {
    load_from(other_size, file);
    ADD_FAILURE() << "loaded blocks of another size";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("block_tokens: expected 8"), HasSubstr("found 4")));
  }
  EXPECT_EQ(wide.free_blocks(), 16U);
}

TEST(PagedStateFileScales, AFileWithOtherScalesThanThePoolsIsRefused) {
  const std::vector<float> scales{0.01F, 0.01F}, others{0.01F, 0.02F};
  const BlockPoolConfig config{.layers = 2,
                               .kv_heads = 1,
                               .head_dim = 8,
                               .block_tokens = 4,
                               .blocks = 8,
                               .key_scales = scales,
                               .value_scales = scales};
  BlockPoolConfig other_config = config;
  other_config.key_scales = others;
  BlockPool<fp8_e4m3_heads> pool(config), other(other_config);
  PagedKvCache<fp8_e4m3_heads> original(pool), busy(other), target(other);
  const Block<float> k({1, 1, 3, 8}, 1);
  for (std::size_t l = 0; l < 2; ++l) {
    original.update(l, k.view(), k.view(), arange(0, 3));
    busy.update(l, k.view(), k.view(), arange(0, 3));
  }
  const std::string file = saved(original);
  try {
    load_from(target, file);
    ADD_FAILURE() << "loaded rows encoded with other scales";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("K scale of layer 1 kv head 0"), HasSubstr("the pool's")));
  }
  EXPECT_TRUE(target.block_table().empty());
  EXPECT_EQ(other.free_blocks(), 7U);
}

// ---- across variants and formats --------------------------------------------------------------

template <class From, class To>
void expect_refused_across(const std::string& expected, const std::string& found) {
  KvCacheConfig config{.layers = 2, .kv_heads = 2, .head_dim = 8, .capacity = 8};
  KvCacheConfig ring = config;
  ring.window = 4;
  From from(test_config<typename From::value_type>(is_ring<From> ? ring : config));
  To to(test_config<typename To::value_type>(is_ring<To> ? ring : config));
  const std::string file = saved(from);
  expect_refused<std::invalid_argument>(
      to, [&](To& c) { load_from(c, file); }, expected + " from " + found);
  try {
    load_from(to, file);
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(),
                AllOf(HasSubstr("expected " + expected + " (the cache loaded into)"), HasSubstr("found " + found)));
  }
}

// ---- windows: a slot cache's rings and a paged sequence's blocks given back ----------------

/// Feeds `tokens` to slot `row` of every layer in chunks of at most `chunk`, from `seed`.
void feed_slot(SlotKvCache<float>& cache, std::size_t row, std::size_t tokens, std::size_t chunk, std::uint64_t seed) {
  for (std::size_t done = 0; done < tokens;) {
    const std::size_t n = std::min(chunk, tokens - done);
    const auto positions = arange(cache.row_length(row, 0), n);
    for (std::size_t l = 0; l < cache.layers(); ++l) {
      const Block<float> k({1, cache.kv_heads(), n, cache.head_dim()}, seed++);
      const Block<float> v({1, cache.kv_heads(), n, cache.head_dim()}, seed++);
      cache.update(l, k.view(), v.view(), positions, Rows(row));
    }
    done += n;
  }
}

TEST(StateFileWindows, AWindowedSlotCacheRoundTripsAndContinuesTheSame) {
  const KvCacheConfig config{
      .layers = 2, .batch = 3, .kv_heads = 2, .head_dim = 8, .window = 5, .sinks = 1, .slack = 3};
  // Slot 0 wrapped its ring several times, slot 1 was cut back after wrapping (rows with no
  // position), slot 2 holds a few tokens.
  const auto filled = [&] {
    SlotKvCache<float> cache(config);
    for (std::size_t row = 0; row < 3; ++row) EXPECT_EQ(cache.acquire(), row);
    feed_slot(cache, 0, 23, 4, 1);
    feed_slot(cache, 1, 14, 3, 100);
    cache.truncate(1, 12);
    feed_slot(cache, 2, 3, 3, 200);
    return cache;
  };
  SlotKvCache<float> original = filled();
  const std::string file = saved(original, "rings");
  const auto sections = parse_sections(file);
  EXPECT_TRUE(std::any_of(sections.begin(), sections.end(), [](const Section& s) { return s.name == "SWIN[1]"; }));
  EXPECT_EQ(info_of(file).config.window, 5U);
  EXPECT_EQ(info_of(file).config.capacity, 0U) << "no bound on a windowed slot's tokens";
  SlotKvCache<float> loaded(info_of(file).config);
  EXPECT_EQ(load_from(loaded, file), "rings");
  EXPECT_EQ(snapshot(loaded), snapshot(original));
  EXPECT_EQ(saved(loaded, "rings"), file);
  for (SlotKvCache<float>* cache : {&original, &loaded}) {
    feed_slot(*cache, 1, 6, 2, 300);
    feed_slot(*cache, 2, 9, 4, 400);
  }
  EXPECT_EQ(snapshot(loaded), snapshot(original));

  // A cache without the window, or with another, refuses it; so does one given a corrupt file.
  KvCacheConfig plain = config;
  plain.window = 0;
  plain.sinks = 0;
  plain.slack = 0;
  plain.capacity = 64;
  SlotKvCache<float> other(plain);
  expect_throw_naming([&] { load_from(other, file); }, Throws::invalid_argument, {"window", "expected 0", "found 5"});
  SlotKvCache<float> empty(config);
  for (const Corrupted& corrupted : corruptions(file)) {
    const SlotSnapshot before = snapshot(empty);
    EXPECT_THROW(load_from(empty, corrupted.bytes), std::runtime_error) << corrupted.what;
    EXPECT_EQ(snapshot(empty), before) << corrupted.what;
  }
  // A crafted file: slot 0's row 1 said to hold another position than the history reads there.
  std::string crafted = file;
  const std::uint64_t held = patch_u64(crafted, "SWIN[0]", 8 * 3 + 8 * 1, 7);
  EXPECT_NE(held, 7U);
  try {
    load_from(empty, crafted);
    ADD_FAILURE() << "loaded a ring row holding a position the history does not read there";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("SWIN[0]"), HasSubstr("slot 0 positions")));
  }
}

TEST(StateFileWindows, AWindowedPagedSequenceSavesTheBlocksItHoldsAndContinuesTheSame) {
  const BlockPoolConfig config{
      .layers = 2, .kv_heads = 2, .head_dim = 8, .block_tokens = 4, .blocks = 24, .window = 6, .sinks = 2, .slack = 1};
  BlockPool<float> pool(config);
  PagedKvCache<float> original(pool);
  std::vector<TokenId> ids(40);
  std::iota(ids.begin(), ids.end(), 7);
  original.add_token_ids(std::span(ids).first(30));
  for (std::size_t done = 0; done < 30; done += 3) {
    for (std::size_t l = 0; l < 2; ++l) {
      const Block<float> k({1, 2, 3, 8}, 10 * done + l), v({1, 2, 3, 8}, 10 * done + l + 5);
      original.update(l, k.view(), v.view(), arange(done, 3));
    }
  }
  const auto released = [](const PagedKvCache<float>& s) {
    return std::count(s.block_table().begin(), s.block_table().end(), PagedKvCache<float>::kReleased);
  };
  ASSERT_GT(released(original), 3);
  const std::string file = saved(original, "window");
  const auto sections = parse_sections(file);
  EXPECT_TRUE(std::any_of(sections.begin(), sections.end(), [](const Section& s) { return s.name == "PWIN"; }));

  BlockPool<float> other(config);
  PagedKvCache<float> holder(other);
  for (std::size_t l = 0; l < 2; ++l) {
    const Block<float> k({1, 2, 5, 8}, 900 + l);
    holder.update(l, k.view(), k.view(), arange(0, 5));
  }
  PagedKvCache<float> loaded(other);
  EXPECT_EQ(load_from(loaded, file), "window");
  EXPECT_EQ(snapshot(loaded), snapshot(original));
  const auto released_at_load = released(loaded);
  EXPECT_EQ(released_at_load, released(original));
  EXPECT_EQ(loaded.bytes(), original.bytes());
  EXPECT_EQ(saved(loaded, "window"), file);
  ASSERT_NO_THROW(other.check_invariants());

  // Both go on alike, keying the blocks they fill by the chain of every id before them.
  for (PagedKvCache<float>* seq : {&original, &loaded}) {
    seq->add_token_ids(std::span(ids).subspan(30));
    for (std::size_t l = 0; l < 2; ++l) {
      const Block<float> k({1, 2, 10, 8}, 77 + l);
      seq->update(l, k.view(), k.view(), arange(30, 10));
    }
  }
  EXPECT_EQ(snapshot(loaded), snapshot(original));
  // Every block the loaded sequence took or filled is full and keyed (the chain through those it
  // gave back before the save from the ids it knows), the ones it gave back since waiting keyed in
  // the free list; check_invariants checks each key against those ids.
  EXPECT_GT(released(loaded), released_at_load);
  EXPECT_EQ(other.keyed_blocks(), loaded.block_table().size() - static_cast<std::size_t>(released_at_load));
  ASSERT_NO_THROW(other.check_invariants());
  ASSERT_NO_THROW(pool.check_invariants());

  // A pool without the window refuses the file; corrupt files change nothing.
  BlockPoolConfig plain = config;
  plain.window = 0;
  plain.sinks = 0;
  plain.slack = 0;
  BlockPool<float> unwindowed(plain);
  PagedKvCache<float> target(unwindowed);
  expect_throw_naming([&] { load_from(target, file); }, Throws::invalid_argument, {"window", "expected 0", "found 6"});
  BlockPool<float> third(config);
  PagedKvCache<float> empty(third);
  for (const Corrupted& corrupted : corruptions(file)) {
    EXPECT_THROW(load_from(empty, corrupted.bytes), std::runtime_error) << corrupted.what;
    EXPECT_EQ(empty.block_table().size(), 0U) << corrupted.what;
    EXPECT_EQ(third.free_blocks(), 24U) << corrupted.what;
  }
  // A crafted PWIN giving back blocks a layer still reads.
  std::string crafted = file;
  const std::uint64_t given = patch_u64(crafted, "PWIN", 0, 6);
  EXPECT_LT(given, 6U);
  try {
    load_from(empty, crafted);
    ADD_FAILURE() << "loaded a sequence said to have given back blocks its layers read";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("PWIN"), HasSubstr("blocks given back")));
  }
  EXPECT_EQ(third.free_blocks(), 24U);
}

TEST(StateFileAcross, AnotherVariantIsRefusedNamingBoth) {
  expect_refused_across<KvCache<float>, RingKvCache<float>>("RingKvCache", "KvCache");
  expect_refused_across<KvCache<float>, ConcatKvCache<float>>("ConcatKvCache", "KvCache");
  expect_refused_across<RingKvCache<float>, KvCache<float>>("KvCache", "RingKvCache");
  expect_refused_across<ConcatKvCache<float>, RingKvCache<float>>("RingKvCache", "ConcatKvCache");
}

TEST(StateFileAcross, AnotherFormatIsRefusedNamingBoth) {
  expect_refused_across<KvCache<float>, KvCache<Eigen::half>>("half", "float");
  expect_refused_across<KvCache<Eigen::bfloat16>, KvCache<Eigen::half>>("half", "bfloat16");
  expect_refused_across<KvCache<int8_rows>, KvCache<fp8_e4m3>>("fp8_e4m3", "int8_rows");
  expect_refused_across<KvCache<fp8_e4m3_heads>, KvCache<fp8_e4m3>>("fp8_e4m3", "fp8_e4m3_heads");
  expect_refused_across<KvCache<int4_groups>, KvCache<int4_rotated>>("int4_rotated", "int4_groups");
  expect_refused_across<RingKvCache<int4_groups>, RingKvCache<double>>("double", "int4_groups");
}

TEST(StateFileAcross, TheFilesHeadScalesReplaceTheConfigsAndStayThroughAReset) {
  // The file's rows were encoded with its scales: the cache reads them, and later rows, with those.
  const std::vector<float> keys = {0.5F, 0.25F, 2.0F, 4.0F}, values = {1.0F, 3.0F, 0.125F, 8.0F};
  const std::vector<float> others(4, 1.0F);
  KvCache<fp8_e4m3_heads> given(
      {.layers = 2, .kv_heads = 2, .head_dim = 8, .capacity = 8, .key_scales = keys, .value_scales = values});
  KvCache<fp8_e4m3_heads> loaded(
      {.layers = 2, .kv_heads = 2, .head_dim = 8, .capacity = 8, .key_scales = others, .value_scales = others});
  const std::string file = saved(given);
  EXPECT_EQ(info_of(file).key_scales, keys);
  EXPECT_EQ(info_of(file).value_scales, values);
  EXPECT_TRUE(
      info_of(saved(KvCache<fp8_e4m3>({.layers = 2, .kv_heads = 2, .head_dim = 8, .capacity = 8}))).key_scales.empty());
  load_from(loaded, file);
  EXPECT_EQ(loaded.key_head_scales(), keys);
  loaded.reset();
  EXPECT_EQ(loaded.key_head_scales(), keys);
  EXPECT_EQ(loaded.value_head_scales(), values);
}

/// `file` (of a cache of `layers` layers) with its HEAD's format name replaced and BASE's "scales
/// given" flag set to `given`, both checksums recomputed: the file an earlier version wrote.
std::string as_written_before(std::string file, std::size_t layers, const std::string& format, bool given) {
  const auto sections = parse_sections(file);
  const auto head = std::find_if(sections.begin(), sections.end(), [](const Section& x) { return x.name == "HEAD"; });
  EXPECT_NE(head, sections.end());
  if (head == sections.end()) return file;
  // HEAD: the variant, then the format, each a u32 length and its characters.
  std::string payload = file.substr(head->begin + 16, head->payload);
  std::uint32_t variant = 0, old_format = 0;
  std::memcpy(&variant, payload.data(), 4);
  std::memcpy(&old_format, payload.data() + 4 + variant, 4);
  const auto length = static_cast<std::uint32_t>(format.size());
  payload.replace(4 + variant, 4 + old_format, std::string(reinterpret_cast<const char*>(&length), 4) + format);
  std::string section = file.substr(head->begin, 8);
  const std::uint64_t bytes = payload.size();
  section.append(reinterpret_cast<const char*>(&bytes), 8);
  section += payload;
  const std::uint32_t crc = detail::crc32c_portable(0, section.data(), section.size());
  section.append(reinterpret_cast<const char*>(&crc), 4);
  file.replace(head->begin, head->end - head->begin, section);
  // BASE: a u64 length and a u64 clipped count per layer, then the flag.
  const auto base_sections = parse_sections(file);
  const auto base =
      std::find_if(base_sections.begin(), base_sections.end(), [](const Section& x) { return x.name == "BASE"; });
  EXPECT_NE(base, base_sections.end());
  if (base == base_sections.end()) return file;
  file[base->begin + 16 + 16 * layers] = given ? 1 : 0;
  const std::uint32_t base_crc = detail::crc32c_portable(0, file.data() + base->begin, 16 + base->payload);
  std::memcpy(file.data() + base->end - 4, &base_crc, 4);
  return file;
}

TEST(StateFileAcross, AFileOfFp8E4M3WithHeadScalesLoadsAsFp8E4M3Heads) {
  // Before fp8_e4m3 scaled each row, its files held a scale per (layer, kv head) under that
  // name, set by each layer's first update: those rows are fp8_e4m3_heads'.
  const std::vector<float> scales(2 * 2, 1.0F / 448);
  const KvCacheConfig config{
      .layers = 2, .kv_heads = 2, .head_dim = 8, .capacity = 8, .key_scales = scales, .value_scales = scales};
  KvCache<fp8_e4m3_heads> original(config);
  const Block<float> k({1, 2, 3, 8}, 1), v({1, 2, 3, 8}, 2);
  for (std::size_t l = 0; l < 2; ++l) original.update(l, k.view(), v.view(), arange(0, 3));
  const std::string file = as_written_before(saved(original), 2, "fp8_e4m3", false);
  EXPECT_EQ(info_of(file).format, "fp8_e4m3_heads");
  KvCache<fp8_e4m3_heads> loaded(config);
  load_from(loaded, file);
  EXPECT_EQ(snapshot(loaded), snapshot(original));
  KvCache<fp8_e4m3> rows({.layers = 2, .kv_heads = 2, .head_dim = 8, .capacity = 8});
  expect_throw_naming([&] { load_from(rows, file); }, Throws::invalid_argument,
                      {"storage format: expected fp8_e4m3 (the cache loaded into), found fp8_e4m3_heads"});
  EXPECT_EQ(rows.length(), 0U);
}

TEST(StateFileCrafted, AScalesGivenFlagOtherThanTheFormatsIsRefusedAndTheCacheUnchanged) {
  // Found by fuzz/state_fuzz: BASE said head scales were given for a format without them; the
  // load took the file, and saving it again wrote another byte.
  const Block<float> k({1, 2, 3, 8}, 1), v({1, 2, 3, 8}, 2);
  KvCache<float> plain({.layers = 2, .kv_heads = 2, .head_dim = 8, .capacity = 8});
  plain.update(0, k.view(), v.view(), arange(0, 3));
  const Snapshot plain_before = snapshot(plain);
  const auto expect_refused = [](const auto& load, const std::string& message) {
    try {
      load();
      ADD_FAILURE() << "loaded a file whose BASE says " << message;
    } catch (const std::runtime_error& e) {
      EXPECT_THAT(e.what(), HasSubstr(message));
    }
  };
  const std::string plain_file = as_written_before(saved(plain), 2, "float", true);
  expect_refused([&] { load_from(plain, plain_file); },
                 "section BASE: scales given: expected 0 (for format float), found 1");
  EXPECT_EQ(snapshot(plain), plain_before);

  const std::vector<float> scales(2 * 2, 1.0F / 448);
  KvCache<fp8_e4m3_heads> heads(
      {.layers = 2, .kv_heads = 2, .head_dim = 8, .capacity = 8, .key_scales = scales, .value_scales = scales});
  heads.update(1, k.view(), v.view(), arange(0, 3));
  const Snapshot heads_before = snapshot(heads);
  const std::string file = as_written_before(saved(heads), 2, "fp8_e4m3_heads", false);
  expect_refused([&] { load_from(heads, file); },
                 "section BASE: scales given: expected 1 (for format fp8_e4m3_heads), found 0");
  EXPECT_EQ(snapshot(heads), heads_before);
}

TEST(StateFileAcross, ASaveThatCannotWriteThrowsAndLeavesNoFile) {
  const KvCache<float> cache({.layers = 1, .kv_heads = 1, .head_dim = 4, .capacity = 4});
  const auto path = std::filesystem::temp_directory_path() / "kvcache_no_such_directory" / "state";
  EXPECT_THROW(save_state(cache, path), std::runtime_error);
  EXPECT_FALSE(std::filesystem::exists(path.parent_path()));
  KvCache<float> target({.layers = 1, .kv_heads = 1, .head_dim = 4, .capacity = 4});
  EXPECT_THROW(load_state(target, path), std::runtime_error);
}

// ---- no second copy ----------------------------------------------------------------------------

/// The address ranges a layer's stored keys, values and row scales occupy.
template <class T>
std::vector<std::pair<const char*, const char*>> storage_of(const History<T>& history) {
  std::vector<std::pair<const char*, const char*>> ranges;
  for (const Segment<T>& s : history.segments) {
    if (s.tokens() == 0) continue;
    const std::size_t b = s.keys.batch() - 1, h = s.keys.heads() - 1, t = s.tokens() - 1;
    for (const auto* view : {&s.keys, &s.values}) {
      ranges.emplace_back(reinterpret_cast<const char*>(view->data()),
                          reinterpret_cast<const char*>(view->row(b, h, t) + view->head_dim()));
    }
  }
  return ranges;
}

TEST(StateFileMemory, DataGoesStraightIntoTheCacheStorage) {
  // A bfloat16 cache of the reference shape's heads: every data byte must be read into the
  // cache's own rows, from a file or from a stream of either kind, when it holds no tokens; and
  // when it does, from a seekable one (verified first through a buffer of one chunk at most).
  const KvCacheConfig config{.layers = 3, .kv_heads = 8, .head_dim = 128, .capacity = 600};
  KvCache<Eigen::bfloat16> original(config);
  std::vector<float> k(8 * 512 * 128);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-1.0F, 1.0F);
  for (float& x : k) x = dist(rng);
  for (std::size_t l = 0; l < 3; ++l) {
    const TensorView<const float> view(k.data(), {1, 8, 512, 128});
    original.update(l, view, view, arange(0, 512));
  }
  const std::string file = saved(original);
  std::size_t data_bytes = 0;
  for (const Section& s : parse_sections(file)) {
    if (s.name.starts_with("ROWS")) data_bytes += s.payload;
  }
  ASSERT_EQ(data_bytes, 3U * 2 * 8 * 512 * 128 * 2);
  for (const bool holding : {false, true}) {
    for (const bool seekable : {true, false}) {
      if (holding && !seekable) continue;  // held in memory until verified: docs/state.md
      KvCache<Eigen::bfloat16> cache(config);
      if (holding) {
        const TensorView<const float> view(k.data(), {1, 8, 1, 128});
        for (std::size_t l = 0; l < 3; ++l) cache.update(l, view, view, arange(0, 1));
      }
      RecordingBuf buf(file, seekable);
      std::istream in(&buf);
      load_state(cache, in);
      std::vector<std::pair<const char*, const char*>> storage;
      for (std::size_t l = 0; l < 3; ++l) {
        const auto ranges = storage_of(cache.history(l));
        storage.insert(storage.end(), ranges.begin(), ranges.end());
      }
      std::size_t into_cache = 0, elsewhere_largest = 0;
      for (const auto& read : buf.reads) {
        const bool inside = std::any_of(storage.begin(), storage.end(), [&](const auto& r) {
          return read.to >= r.first && read.to + read.bytes <= r.second;
        });
        if (inside) {
          into_cache += read.bytes;
        } else {
          elsewhere_largest = std::max(elsewhere_largest, read.bytes);
        }
      }
      EXPECT_EQ(into_cache, data_bytes) << "holding " << holding << ", seekable " << seekable;
      EXPECT_LE(elsewhere_largest, detail::kStateChunk) << "holding " << holding << ", seekable " << seekable;
    }
  }
}

// ---- the reference model continues after a load as without it ----------------------------

qwen3::Model& tiny_model() {
  static qwen3::Model model(qwen3::random_weights(qwen3::Config{}));
  return model;
}

std::vector<qwen3::TokenId> fixed_tokens(std::size_t n, std::uint64_t seed) {
  qwen3::SplitMix64 rng(seed);
  std::vector<qwen3::TokenId> tokens(n);
  for (auto& t : tokens) t = static_cast<qwen3::TokenId>(rng.next() % 256);
  return tokens;
}

bool same_bits(const qwen3::Matrix& a, const qwen3::Matrix& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.size()) * sizeof(float)) == 0;
}

/// Runs the reference model over 20 tokens, saves, loads into a new cache and continues both.
template <class TypeParam>
void expect_model_continues_after_load() {
  const qwen3::Config& c = tiny_model().config();
  KvCacheConfig config{.layers = c.layers, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .capacity = 64};
  if constexpr (is_ring<TypeParam>) {
    config.window = 8;  // wrapped by the prompt; the 6-token chunk is staged when saved
    config.sinks = 1;
    config.slack = 1;
  }
  const auto tokens = fixed_tokens(40, 11);
  const auto span = [&](std::size_t first, std::size_t count) {
    return std::span<const qwen3::TokenId>(tokens).subspan(first, count);
  };
  using T = typename TypeParam::value_type;
  config = test_config<T>(config);
  TypeParam straight(config);
  tiny_model().forward(span(0, 14), straight);
  tiny_model().forward(span(14, 6), straight);
  const std::string file = saved(straight, "tiny qwen3, tokens 0-19");
  StateInfo info = info_of(file);
  info.config.key_scales = info.key_scales;
  info.config.value_scales = info.value_scales;
  TypeParam restored(info.config);
  load_from(restored, file);
  for (const auto& [first, count] : {std::pair<std::size_t, std::size_t>{20, 1}, {21, 1}, {22, 5}, {27, 1}, {28, 12}}) {
    const qwen3::Matrix want = tiny_model().forward(span(first, count), straight);
    const qwen3::Matrix got = tiny_model().forward(span(first, count), restored);
    EXPECT_TRUE(same_bits(got, want)) << "tokens " << first << "-" << first + count - 1;
    if (first == 20) {
      // The comparison has teeth: without the first 20 tokens the logits differ.
      TypeParam unprimed(config);
      EXPECT_FALSE(same_bits(tiny_model().forward(span(first, count), unprimed), want));
    }
  }
}

// ---- the variants' settings, and files of the first layout --------------------------------

/// `file` with its HEAD rewritten after `change` (its checksum recomputed).
std::string with_head(const std::string& file, const std::function<void(detail::StateHead&)>& change) {
  std::istringstream in(file);
  detail::StateReader reader(in);
  reader.begin();
  detail::StateHead head = detail::read_head(reader);
  change(head);
  std::ostringstream out(std::ios::binary);
  detail::StateWriter writer(out);
  writer.section("HEAD", detail::kWholeCache, [&](detail::PayloadWriter& p) { detail::write_head(p, head); });
  const auto sections = parse_sections(file);
  return file.substr(0, sections.front().begin) + std::move(out).str() + file.substr(sections.front().end);
}

TEST(StateFileSettings, ARingWritesItsOwnSettingsByName) {
  RingKvCache<float> ring({.layers = 1, .kv_heads = 1, .head_dim = 4, .window = 6, .sinks = 2, .slack = 3});
  std::istringstream in(saved(ring));
  detail::StateReader reader(in);
  reader.begin();
  const detail::StateHead head = detail::read_head(reader);
  std::vector<std::pair<std::string, std::size_t>> settings;
  for (const auto& s : head.settings) settings.emplace_back(s.name, s.value);
  EXPECT_EQ(settings, (std::vector<std::pair<std::string, std::size_t>>{
                          {"capacity", 0}, {"window", 6}, {"sinks", 2}, {"slack", 3}}));
}

TEST(StateFileSettings, ASettingTheCacheDoesNotListLoadsOnlyAtZero) {
  KvCache<float> original({.layers = 2, .kv_heads = 1, .head_dim = 4, .capacity = 8});
  const std::vector<float> k(4 * 3, 0.5F);
  const TensorView<const float> kv(k.data(), {.batch = 1, .heads = 1, .tokens = 3, .head_dim = 4});
  for (std::size_t l = 0; l < 2; ++l) (void)original.update(l, kv, kv, next_positions(0, 3));
  const std::string file = saved(original);
  const auto adding = [&](std::size_t value) {
    return with_head(file, [&](detail::StateHead& h) { h.settings.push_back({"pages", value, true}); });
  };
  KvCache<float> cache({.layers = 2, .kv_heads = 1, .head_dim = 4, .capacity = 8});
  load_from(cache, adding(0));
  EXPECT_EQ(flatten(cache.history(1)), flatten(original.history(1)));
  cache.reset();
  try {
    load_from(cache, adding(3));
    ADD_FAILURE() << "loaded a setting KvCache does not have";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("the file's \"pages\": expected 0 (KvCache has no such setting"));
    EXPECT_THAT(e.what(), HasSubstr("found 3"));
  }
  EXPECT_EQ(cache.length(0), 0U);
}

TEST(StateFileSettings, ANameWithBytesThatAreNotTextIsNamedEscaped) {
  // A name read from a file may hold any byte: the message shows it escaped, so that a NUL does
  // not end the message before what was expected.
  KvCache<float> original({.layers = 1, .kv_heads = 1, .head_dim = 4, .capacity = 8});
  const std::vector<float> k(4 * 3, 0.5F);
  (void)original.update(0, TensorView<const float>(k.data(), {.batch = 1, .heads = 1, .tokens = 3, .head_dim = 4}),
                        TensorView<const float>(k.data(), {.batch = 1, .heads = 1, .tokens = 3, .head_dim = 4}),
                        next_positions(0, 3));
  const std::string file = with_head(saved(original), [](detail::StateHead& h) {
    h.settings.push_back({std::string("cap\0x\n", 6), 5, true});
  });
  KvCache<float> cache({.layers = 1, .kv_heads = 1, .head_dim = 4, .capacity = 8});
  try {
    load_from(cache, file);
    ADD_FAILURE() << "loaded a setting KvCache does not have";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(std::string_view(e.what()),
                AllOf(HasSubstr("the file's \"cap\\x00x\\x0a\": expected 0 (KvCache has no such setting"),
                      HasSubstr("found 5")));
  }
  EXPECT_EQ(cache.length(0), 0U);
}

TEST(StateFileSettings, ASettingTheFileLacksReadsAsZero) {
  const KvCacheConfig config{.layers = 1, .kv_heads = 1, .head_dim = 4, .window = 4, .sinks = 0, .slack = 2};
  const std::string file = with_head(saved(RingKvCache<float>(config)), [](detail::StateHead& h) {
    std::erase_if(h.settings, [](const detail::StateSetting& s) { return s.name == "sinks"; });
  });
  RingKvCache<float> same(config);
  load_from(same, file);
  KvCacheConfig with_sinks = config;
  with_sinks.sinks = 1;
  RingKvCache<float> other(with_sinks);
  expect_refused<std::invalid_argument>(
      other, [&](RingKvCache<float>& c) { load_from(c, file); }, "sinks");
}

TEST(StateFileSettings, ANameGivenTwiceIsRefused) {
  const std::string file = with_head(saved(KvCache<float>({.layers = 1, .kv_heads = 1, .head_dim = 4, .capacity = 2})),
                                     [](detail::StateHead& h) { h.settings.push_back(h.settings.front()); });
  try {
    (void)info_of(file);
    ADD_FAILURE() << "read a setting given twice";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(),
                AllOf(HasSubstr("setting name: expected a name not given before"), HasSubstr("\"capacity\" again")));
  }
}

TEST(StateFileSettings, ASettingNamedAsTheShapeIsRefused) {
  // read_state_info would otherwise take it for the shape that sizes BASE.
  const std::string file = with_head(saved(KvCache<float>({.layers = 1, .kv_heads = 1, .head_dim = 4, .capacity = 2})),
                                     [](detail::StateHead& h) {
                                       h.settings.push_back({"layers", 9, false});
                                     });
  try {
    (void)info_of(file);
    ADD_FAILURE() << "read a setting named as the shape";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("setting name: expected a name other than the shape's"),
                                HasSubstr("found \"layers\"")));
  }
}

std::string version1_file(const std::string& name) {
  std::ifstream in(std::filesystem::path(KVCACHE_TEST_DATA) / "state_v1" / (name + ".kvstate"), std::ios::binary);
  EXPECT_TRUE(in.good()) << name;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// What a file of the first layout says of itself: version 1, the config, the metadata.
void expect_version1_info(const std::string& file, const KvCacheConfig& config, const std::string& variant) {
  ASSERT_GE(file.size(), 12U) << variant;
  std::uint32_t version = 0;
  std::memcpy(&version, file.data() + 8, 4);
  EXPECT_EQ(version, 1U) << variant;
  const StateInfo info = info_of(file);
  EXPECT_EQ(info.variant, variant);
  EXPECT_EQ(info.metadata, variant + " v1");
  EXPECT_EQ(std::vector<std::size_t>({info.config.layers, info.config.batch, info.config.kv_heads, info.config.head_dim,
                                      info.config.capacity, info.config.window, info.config.sinks, info.config.slack}),
            std::vector<std::size_t>({config.layers, config.batch, config.kv_heads, config.head_dim, config.capacity,
                                      config.window, config.sinks, config.slack}))
      << variant;
}

// The files under tests/data/state_v1 were written by the version 1 layout (HEAD's config a fixed
// list of eight counts) from the fixtures' filled() caches: they load into the same caches.
template <class Cache>
struct Version1 : StateFile<Cache> {
  using StateFile<Cache>::config;
  using StateFile<Cache>::filled;
  static void expect_loads(const std::string& name, const std::string& variant) {
    const std::string file = version1_file(name);
    expect_version1_info(file, config(), variant);
    Cache loaded(config());
    EXPECT_EQ(load_from(loaded, file), variant + " v1");
    Cache original = filled();
    EXPECT_EQ(snapshot(loaded), snapshot(original)) << name;
    Cache again(config());
    load_from(again, saved(loaded));  // and saved in today's layout
    EXPECT_EQ(snapshot(again), snapshot(original)) << name;
  }
};

TEST(StateFileVersion1, FilesOfEveryDenseVariantLoad) {
  Version1<KvCache<int8_rows>>::expect_loads("KvCache_int8_rows", "KvCache");
  Version1<RingKvCache<bfloat16>>::expect_loads("RingKvCache_bfloat16", "RingKvCache");
  Version1<ConcatKvCache<fp8_e4m3_heads>>::expect_loads("ConcatKvCache_fp8_e4m3_heads", "ConcatKvCache");
}

struct Version1Slot : SlotStateFile<int4_groups> {
  using SlotStateFile<int4_groups>::config;
  using SlotStateFile<int4_groups>::filled;
};

TEST(StateFileVersion1, AFileOfASlotCacheLoads) {
  const std::string file = version1_file("SlotKvCache_int4_groups");
  expect_version1_info(file, Version1Slot::config(), "SlotKvCache");
  SlotKvCache<int4_groups> loaded(Version1Slot::config());
  load_from(loaded, file);
  SlotKvCache<int4_groups> original = Version1Slot::filled();
  EXPECT_EQ(snapshot(loaded), snapshot(original));
}

struct Version1Paged : PagedStateFile<half> {
  using PagedStateFile<half>::config;
  using PagedStateFile<half>::fill;
};

TEST(StateFileVersion1, AFileOfAPagedSequenceLoads) {
  const std::string file = version1_file("PagedKvCache_half");
  const BlockPoolConfig pooled = Version1Paged::config();  // a sequence's capacity: every block of the pool
  const KvCacheConfig config{
      .layers = 3, .kv_heads = 2, .head_dim = 40, .capacity = pooled.blocks * pooled.block_tokens};
  expect_version1_info(file, config, "PagedKvCache");
  BlockPool<half> pool(Version1Paged::config()), other(Version1Paged::config());
  PagedKvCache<half> original(pool), loaded(other);
  Version1Paged::fill(original);
  load_from(loaded, file);
  EXPECT_EQ(snapshot(loaded), snapshot(original));
  other.check_invariants();
}

TYPED_TEST(StateFile, TheReferenceModelContinuesAfterALoadBitForBit) { expect_model_continues_after_load<TypeParam>(); }

TEST(StateFileModel, TheReferenceModelContinuesAfterALoadOfASlotCache) {
  expect_model_continues_after_load<SlotKvCache<float>>();
}

TEST(StateFileModel, TheReferenceModelContinuesAfterALoadOfAPagedSequence) {
  expect_model_continues_after_load<PooledSequence<float>>();
}

}  // namespace
}  // namespace kvcache::testing
