// SPDX-License-Identifier: Apache-2.0
#pragma once

// Saving a cache's state to a file or a stream and loading it back, for every variant and
// storage format: an engine saves a prompt's cache once and skips its prefill afterwards.
//
//   kvcache::save_state(cache, "prompt.kvstate", fingerprint);          // the model's, say
//   kvcache::KvCache<kvcache::bfloat16> restored(kvcache::read_state_info("prompt.kvstate").config);
//   std::string metadata = kvcache::load_state(restored, "prompt.kvstate");
//
// The file: an 8-byte magic, a version, then sections, each a tag, an index (the layer), its
// length, its bytes and their CRC-32C. HEAD says which variant, storage format, shape and config
// wrote it; META is the caller's metadata string; BASE the tokens of each layer (and the head
// scales of formats that keep them); then each variant's own sections (the rows of every layer,
// a ring's row positions and staged chunk, a slot cache's slots, a paged sequence's token ids).
// A PagedKvCache saves one sequence, not its pool, and loads into an empty sequence of a pool of
// the same geometry, taking fresh blocks. docs/state.md describes every field, what a load
// checks, and how a new variant joins.
//
// A load reads a file written for the same variant, format and shape (the capacity may differ:
// the file's tokens must fit) and throws, naming what it expected and what it found, for any
// other; for a bad magic or version, a checksum that does not match, a truncated file or
// inconsistent values. The cache is then left as it was. It reads the data straight into the
// cache's own storage: no second copy of it is made, but for a non-seekable stream loaded into
// a cache that holds tokens (docs/state.md has each path's memory).

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <istream>
#include <limits>
#include <numeric>
#include <ostream>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvcache/codec.hpp"
#include "kvcache/config.hpp"
#include "kvcache/detail/assert.hpp"
#include "kvcache/detail/atomic_file.hpp"
#include "kvcache/detail/cache_base.hpp"
#include "kvcache/detail/crc32c.hpp"
#include "kvcache/detail/row_store.hpp"
#include "kvcache/version.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// What a state file says of itself, read by read_state_info() without its data.
struct StateInfo {
  std::string variant;  // the cache's name: "KvCache", "RingKvCache", "SlotKvCache", "PagedKvCache", ...
  std::string format;   // the storage format's name: "float", "bfloat16", "fp8_e4m3", ... (a file written
                        // while fp8_e4m3 kept a scale per head says "fp8_e4m3_heads": it loads there)
  /// The counts of the config the saved cache was built with, enough to build a cache that
  /// loads the file; a format with head scales (fp8_e4m3_heads) needs them too:
  /// `info.config.key_scales = info.key_scales; info.config.value_scales = info.value_scales;`.
  KvCacheConfig config;
  std::vector<std::size_t> lengths;  // tokens held by each layer (0 for SlotKvCache: its rows' are its own)
  std::string metadata;              // the caller's string given to save_state
  /// The K and V scales of every (layer, kv head) the file's rows were encoded with, layer-major,
  /// for a format with head scales; empty for other formats.
  std::vector<float> key_scales, value_scales;
};

namespace detail {

/// The first bytes of every state file: a non-ASCII byte, the name, and the line endings and
/// end-of-file byte that a text-mode copy would change (as PNG's).
inline constexpr std::array<char, 8> kStateMagic = {'\x89', 'K', 'V', 'C', '\r', '\n', '\x1a', '\n'};
inline constexpr std::uint32_t kStateVersion = 1;
/// Bytes read or written, and checksummed, at a time: large enough for the disk's speed, small
/// enough to be checksummed while still in the processor's cache.
inline constexpr std::size_t kStateChunk = std::size_t{4} << 20;
/// The index of a section that belongs to no layer.
inline constexpr std::uint32_t kWholeCache = 0xFFFFFFFFU;
inline constexpr std::size_t kMaxHeadBytes = 4096;
inline constexpr std::size_t kMaxMetadataBytes = std::size_t{1} << 30;

inline std::string file_error(const std::string& what, const std::string& expected, const std::string& found) {
  return "kvcache state file: " + what + ": expected " + expected + ", found " + found;
}

inline std::string hex32(std::uint32_t value) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s = "0x";
  for (int shift = 28; shift >= 0; shift -= 4) s += kDigits[(value >> shift) & 0xFU];
  return s;
}

/// "ROWS[3]" (a layer's section) or "HEAD".
inline std::string section_name(std::string_view tag, std::size_t index) {
  return std::string(tag) + (index == kWholeCache ? std::string() : "[" + std::to_string(index) + "]");
}

/// State files are little-endian; refuses other hosts, where this code would misread them.
inline void check_little_endian(const char* call) {
  if constexpr (std::endian::native != std::endian::little) {
    throw std::runtime_error(std::string(call) + ": state files are little-endian; this host is not");
  }
}

/// Where a section's header sits: its tag, index and payload length, checksummed with it.
struct SectionHeader {
  std::array<char, 4> tag{};
  std::uint32_t index = 0;
  std::uint64_t bytes = 0;
};
static_assert(sizeof(SectionHeader) == 16, "a section header is 16 bytes, without padding");

inline SectionHeader section_header(std::string_view tag, std::size_t index, std::uint64_t bytes) {
  KVCACHE_ASSERT(tag.size() == 4, "a section tag is 4 characters");
  KVCACHE_ASSERT(index <= kWholeCache, "a section index fits in 32 bits");
  SectionHeader h;
  std::copy(tag.begin(), tag.end(), h.tag.begin());
  h.index = static_cast<std::uint32_t>(index);
  h.bytes = bytes;
  return h;
}

/// The payload of a small section being written: fixed-width little-endian fields.
class PayloadWriter {
 public:
  void u8(bool flag) { bytes_.push_back(static_cast<char>(flag ? 1 : 0)); }
  void u64(std::size_t value) { raw(static_cast<std::uint64_t>(value)); }
  void i64s(std::span<const std::int64_t> values) { append(values.data(), values.size_bytes()); }
  void f32s(std::span<const float> values) { append(values.data(), values.size_bytes()); }
  /// A u32 length, then the characters.
  void str(std::string_view s) {
    raw(static_cast<std::uint32_t>(s.size()));
    append(s.data(), s.size());
  }
  /// The characters alone (a section that is one string).
  void text(std::string_view s) { append(s.data(), s.size()); }
  [[nodiscard]] const std::string& bytes() const noexcept { return bytes_; }

 private:
  template <class V>
  void raw(V value) {
    append(&value, sizeof value);
  }
  void append(const void* data, std::size_t n) {
    if (n != 0) bytes_.append(static_cast<const char*>(data), n);  // an empty span's data may be null
  }
  std::string bytes_;
};

/// The payload of a small section being read, its checksum already verified: each field is
/// checked to lie inside it.
class PayloadReader {
 public:
  PayloadReader(std::string name, std::string bytes) : name_(std::move(name)), bytes_(std::move(bytes)) {}

  [[nodiscard]] bool u8(const char* field) {
    const auto value = static_cast<unsigned char>(take(field, 1)[0]);
    if (value > 1) throw std::runtime_error(file_error(where(field), "0 or 1", std::to_string(value)));
    return value == 1;
  }
  [[nodiscard]] std::size_t u64(const char* field) {
    const auto value = raw<std::uint64_t>(field);
    if (!std::in_range<std::size_t>(value)) {
      throw std::runtime_error(file_error(where(field), "a count that fits in std::size_t", std::to_string(value)));
    }
    return static_cast<std::size_t>(value);
  }
  [[nodiscard]] std::vector<std::int64_t> i64s(const char* field, std::size_t count) {
    return values<std::int64_t>(field, count);
  }
  [[nodiscard]] std::vector<float> f32s(const char* field, std::size_t count) { return values<float>(field, count); }
  [[nodiscard]] std::string str(const char* field) {
    const auto size = raw<std::uint32_t>(field);
    return std::string(take(field, size), size);
  }
  /// The rest of the payload as one string.
  [[nodiscard]] std::string text() {
    const std::size_t size = bytes_.size() - at_;
    return std::string(take("text", size), size);
  }

  /// Checks that every byte was read: a longer payload is not this version's.
  void finish() const {
    if (at_ != bytes_.size()) {
      throw std::runtime_error(file_error("section " + name_ + ": payload bytes", std::to_string(at_) + " (its fields)",
                                          std::to_string(bytes_.size())));
    }
  }
  /// Throws std::runtime_error naming the field, what was expected and what was found unless `ok`:
  /// for values a variant checks once their section is read.
  void require(bool ok, const char* field, const std::string& expected, const std::string& found) const {
    if (!ok) throw std::runtime_error(file_error(where(field), expected, found));
  }
  /// The payload's bytes, read or not.
  [[nodiscard]] std::size_t size() const noexcept { return bytes_.size(); }
  /// "section RING[3]: stored_end" for messages.
  [[nodiscard]] std::string where(const char* field) const { return "section " + name_ + ": " + field; }

 private:
  const char* take(const char* field, std::size_t n) {
    if (n > bytes_.size() - at_) {
      throw std::runtime_error(
          file_error(where(field), std::to_string(n) + " more payload bytes", std::to_string(bytes_.size() - at_)));
    }
    const char* p = bytes_.data() + at_;
    at_ += n;
    return p;
  }
  template <class V>
  V raw(const char* field) {
    V value;
    std::memcpy(&value, take(field, sizeof value), sizeof value);
    return value;
  }
  template <class V>
  std::vector<V> values(const char* field, std::size_t count) {
    if (count > (bytes_.size() - at_) / sizeof(V)) {
      throw std::runtime_error(file_error(where(field), std::to_string(count) + " values",
                                          std::to_string((bytes_.size() - at_) / sizeof(V)) + " left in the payload"));
    }
    std::vector<V> out(count);
    if (count != 0) std::memcpy(out.data(), take(field, count * sizeof(V)), count * sizeof(V));
    return out;
  }

  std::string name_;
  std::string bytes_;
  std::size_t at_ = 0;
};

/// Appends to `runs` the stored bytes of tokens [first, first + count) of every stored row,
/// joined where they abut.
template <class Byte, class Store>
void append_runs(std::vector<std::span<Byte>>& runs, Store& rows, std::size_t first, std::size_t count) {
  std::remove_const_t<Store>::for_each_run(rows, first, count, [&](auto* data, std::size_t n) {
    auto* bytes = reinterpret_cast<Byte*>(data);
    if (!runs.empty() && runs.back().data() + runs.back().size() == bytes) {
      runs.back() = {runs.back().data(), runs.back().size() + n};
    } else {
      runs.emplace_back(bytes, n);
    }
  });
}

/// The stored bytes of tokens [first, first + count) of `rows` (a RowStore, const or not) as runs
/// of bytes, those that abut in memory joined: a layer whose tokens are all held is one run of
/// keys and one of values, read or written by one call each.
template <class Byte, class Store>
std::vector<std::span<Byte>> joined_runs(Store& rows, std::size_t first, std::size_t count) {
  std::vector<std::span<Byte>> runs;
  append_runs(runs, rows, first, count);
  return runs;
}

/// The stored bytes of a paged sequence's first `tokens` tokens: `block_tokens` a block, block
/// j at tokens [blocks[j] x block_tokens, ...) of `rows`, each block's runs as joined_runs gives
/// them, in order.
template <class Byte, class Store>
std::vector<std::span<Byte>> block_runs(Store& rows, std::span<const std::size_t> blocks, std::size_t block_tokens,
                                        std::size_t tokens) {
  std::vector<std::span<Byte>> runs;
  for (std::size_t j = 0; j * block_tokens < tokens; ++j) {
    append_runs(runs, rows, blocks[j] * block_tokens, std::min(block_tokens, tokens - j * block_tokens));
  }
  return runs;
}

/// Writes a state file's framing: the magic and version, then sections, each checksummed.
class StateWriter {
 public:
  explicit StateWriter(std::ostream& out) : out_(out) {}

  void begin() {
    write(kStateMagic.data(), kStateMagic.size());
    write(&kStateVersion, sizeof kStateVersion);
  }

  /// A small section: fill(PayloadWriter&) gives its fields.
  template <class Fill>
  void section(std::string_view tag, std::size_t index, const Fill& fill) {
    PayloadWriter payload;
    fill(payload);
    const std::string& bytes = payload.bytes();
    std::uint32_t crc = start(tag, index, bytes.size());
    crc = crc32c(crc, bytes.data(), bytes.size());
    write(bytes.data(), bytes.size());
    write(&crc, sizeof crc);
  }

  /// A small section of the whole cache.
  template <class Fill>
  void section(std::string_view tag, const Fill& fill) {
    section(tag, kWholeCache, fill);
  }

  /// A data section: the stored bytes of tokens [first, first + count) of `rows`, written from
  /// the cache's storage itself.
  template <class T>
  void rows(std::string_view tag, std::size_t index, const RowStore<T>& rows, std::size_t first, std::size_t count) {
    write_runs(tag, index, joined_runs<const char>(rows, first, count));
  }
  /// A data section: a paged sequence's first `tokens` tokens, in `block_tokens`-token blocks
  /// held in the stored rows `blocks` of `rows`.
  template <class T>
  void blocks(std::string_view tag, std::size_t index, const RowStore<T>& rows, std::span<const std::size_t> blocks,
              std::size_t block_tokens, std::size_t tokens) {
    write_runs(tag, index, block_runs<const char>(rows, blocks, block_tokens, tokens));
  }

 private:
  void write_runs(std::string_view tag, std::size_t index, const std::vector<std::span<const char>>& runs) {
    std::uint64_t bytes = 0;
    for (const auto run : runs) bytes += run.size();
    std::uint32_t crc = start(tag, index, bytes);
    for (const auto run : runs) {
      for (std::size_t done = 0; done < run.size(); done += kStateChunk) {
        const std::size_t size = std::min(kStateChunk, run.size() - done);
        crc = crc32c(crc, run.data() + done, size);
        write(run.data() + done, size);
      }
    }
    write(&crc, sizeof crc);
  }

  /// Writes a section's header; returns the checksum so far.
  std::uint32_t start(std::string_view tag, std::size_t index, std::uint64_t bytes) {
    const SectionHeader header = section_header(tag, index, bytes);
    write(&header, sizeof header);
    return crc32c(0, &header, sizeof header);
  }
  void write(const void* data, std::size_t n) {
    out_.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
    if (!out_) throw std::runtime_error("kvcache::save_state: the stream refused a write (disk full, or closed?)");
  }

  std::ostream& out_;
};

/// Reads a state file's framing, verifying each section's checksum before anything it holds
/// is used. Data sections go straight into their destinations (direct), or are verified now
/// and read into them by finish(): again from a seekable stream, or from a copy held meanwhile.
class StateReader {
 public:
  enum class Data { direct, verify_then_read, hold };

  explicit StateReader(std::istream& in) : in_(in) {}

  void begin() {
    std::array<char, kStateMagic.size()> magic{};
    const std::size_t got = read_some(magic.data(), magic.size());
    if (got != magic.size() || magic != kStateMagic) {
      throw std::runtime_error(file_error("magic",
                                          printable(kStateMagic.data(), kStateMagic.size()) + " (a state file)",
                                          printable(magic.data(), got)));
    }
    std::uint32_t version = 0;
    read_exact(&version, sizeof version, "the version");
    if (version != kStateVersion) {
      throw std::runtime_error(
          file_error("version", std::to_string(kStateVersion) + " (what this kvcache reads)", std::to_string(version)));
    }
  }

  /// A small section of at most `max_bytes`, its checksum verified.
  PayloadReader section(std::string_view tag, std::size_t index, std::size_t max_bytes) {
    const std::string name = section_name(tag, index);
    const SectionHeader header = read_header(tag, index);
    if (header.bytes > max_bytes) {
      throw std::runtime_error(file_error("section " + name + ": payload bytes", "at most " + std::to_string(max_bytes),
                                          std::to_string(header.bytes)));
    }
    std::string payload;
    // Grown as the bytes arrive, so that a length no file backs allocates nothing large.
    while (payload.size() < header.bytes) {
      const std::size_t size = std::min<std::size_t>(kStateChunk, header.bytes - payload.size());
      const std::size_t at = payload.size();
      payload.resize(at + size);
      read_exact(payload.data() + at, size, "the payload of section " + name);
    }
    std::uint32_t crc = crc32c(0, &header, sizeof header);
    check_crc(name, crc32c(crc, payload.data(), payload.size()));
    return {name, std::move(payload)};
  }

  /// A small section of the whole cache.
  PayloadReader section(std::string_view tag, std::size_t max_bytes) { return section(tag, kWholeCache, max_bytes); }

  /// A data section holding the stored bytes of tokens [first, first + count) of `rows`, read
  /// into them as the data mode says.
  template <class T>
  void rows(std::string_view tag, std::size_t index, RowStore<T>& rows, std::size_t first, std::size_t count) {
    read_runs_into(tag, index, joined_runs<char>(rows, first, count));
  }
  /// A data section holding a paged sequence's first `tokens` tokens, read into the stored rows
  /// `blocks` of `rows`, `block_tokens` a block, as the data mode says.
  template <class T>
  void blocks(std::string_view tag, std::size_t index, RowStore<T>& rows, std::span<const std::size_t> blocks,
              std::size_t block_tokens, std::size_t tokens) {
    read_runs_into(tag, index, block_runs<char>(rows, blocks, block_tokens, tokens));
  }

  /// A data section read into these runs of bytes, as the data mode says.
  void read_runs_into(std::string_view tag, std::size_t index, std::vector<std::span<char>> runs) {
    Pending pending{section_name(tag, index), std::move(runs), 0, 0, 0, {}};
    std::uint64_t expected = 0;
    for (const auto run : pending.runs) expected += run.size();
    const SectionHeader header = read_header(tag, index);
    if (header.bytes != expected) {
      throw std::runtime_error(file_error("section " + pending.name + ": payload bytes",
                                          std::to_string(expected) + " (its rows)", std::to_string(header.bytes)));
    }
    const std::uint32_t start = crc32c(0, &header, sizeof header);
    if (data_ == Data::direct) {
      check_crc(pending.name, read_runs(pending.runs, start, pending.name));
      return;
    }
    if (data_ == Data::hold) {
      pending.held.resize(expected);
      check_crc(pending.name, read_runs({std::span<char>(pending.held)}, start, pending.name));
    } else {
      pending.offset = in_.tellg();
      pending.at = offset_;
      std::uint32_t crc = start;
      scratch_.resize(std::min<std::size_t>(kStateChunk, expected));
      for (std::uint64_t done = 0; done < expected;) {
        const std::size_t size = std::min<std::size_t>(scratch_.size(), expected - done);
        read_exact(scratch_.data(), size, "the payload of section " + pending.name);
        crc = crc32c(crc, scratch_.data(), size);
        done += size;
      }
      pending.start_crc = start;
      check_crc(pending.name, crc);
    }
    pending_.push_back(std::move(pending));
  }

  /// How data sections are read from here on.
  void set_data(Data data) noexcept { data_ = data; }
  /// Data sections from here on are verified before they reach their destinations: for a
  /// variant whose rows something reads though BASE's lengths are 0 (it keeps its own).
  void verify_first() {
    if (data_ == Data::direct) data_ = seekable(in_) ? Data::verify_then_read : Data::hold;
  }
  /// The tokens each layer of the file holds, from BASE (checked against the cache's capacity).
  void set_lengths(std::span<const std::size_t> lengths) noexcept { lengths_ = lengths; }
  [[nodiscard]] std::span<const std::size_t> lengths() const noexcept { return lengths_; }
  /// The K and V head scales BASE holds (layers x kv_heads each, for formats with head scales).
  void set_head_scales(std::span<const float> keys, std::span<const float> values) noexcept {
    key_scales_ = keys;
    value_scales_ = values;
  }
  [[nodiscard]] std::span<const float> head_scales(bool values) const noexcept {
    return values ? value_scales_ : key_scales_;
  }
  [[nodiscard]] static bool seekable(std::istream& in) { return in.tellg() != std::istream::pos_type(-1); }

  /// Reads the data sections that were verified or held into their destinations; the stream
  /// is left after the state. From a seekable stream they are read and checksummed again: a
  /// file that changed since it was verified throws here, its sections part-read.
  void finish() {
    const auto end = in_.tellg();
    for (Pending& p : pending_) {
      if (data_ == Data::hold) {
        const char* from = p.held.data();
        for (const auto run : p.runs) {
          std::memcpy(run.data(), from, run.size());
          from += run.size();
        }
        continue;
      }
      in_.seekg(p.offset);
      offset_ = p.at;
      if (!in_) throw std::runtime_error("kvcache state file: section " + p.name + ": cannot seek back to read it");
      const std::uint32_t crc = read_runs(p.runs, p.start_crc, p.name);
      std::uint32_t stored = 0;
      read_exact(&stored, sizeof stored, "the checksum of section " + p.name);
      if (crc != stored) {
        throw std::runtime_error(file_error("section " + p.name + " read after verifying it: checksum",
                                            hex32(stored) + " (as verified)", hex32(crc)));
      }
    }
    pending_.clear();
    if (data_ == Data::verify_then_read) in_.seekg(end);
  }

 private:
  struct Pending {
    std::string name;
    std::vector<std::span<char>> runs;
    std::istream::pos_type offset;  // of the payload, in the stream
    std::uint64_t at;               // the same, in bytes from the state's start, for messages
    std::uint32_t start_crc;
    std::vector<char> held;
  };

  SectionHeader read_header(std::string_view tag, std::size_t index) {
    const std::string name = section_name(tag, index);
    SectionHeader header;
    read_exact(&header, sizeof header, "the header of section " + name);
    const std::string found = section_name(std::string_view(header.tag.data(), header.tag.size()), header.index);
    if (found != name) throw std::runtime_error(file_error("section", name, printable(found.data(), found.size())));
    return header;
  }

  /// Reads the runs' bytes in chunks, checksumming each while it is in the processor's cache;
  /// returns `crc` continued over them.
  std::uint32_t read_runs(const std::vector<std::span<char>>& runs, std::uint32_t crc, const std::string& name) {
    for (const auto run : runs) {
      for (std::size_t done = 0; done < run.size(); done += kStateChunk) {
        const std::size_t size = std::min(kStateChunk, run.size() - done);
        read_exact(run.data() + done, size, "the payload of section " + name);
        crc = crc32c(crc, run.data() + done, size);
      }
    }
    return crc;
  }

  void check_crc(const std::string& name, std::uint32_t computed) {
    std::uint32_t stored = 0;
    read_exact(&stored, sizeof stored, "the checksum of section " + name);
    if (computed != stored) {
      throw std::runtime_error(file_error("section " + name + ": checksum", hex32(stored) + " (stored in the file)",
                                          hex32(computed) + " (computed from its bytes)"));
    }
  }

  std::size_t read_some(void* data, std::size_t n) {
    in_.read(static_cast<char*>(data), static_cast<std::streamsize>(n));
    const auto got = static_cast<std::size_t>(in_.gcount());
    offset_ += got;
    return got;
  }
  void read_exact(void* data, std::size_t n, const std::string& what) {
    const std::uint64_t at = offset_;
    const std::size_t got = read_some(data, n);
    if (got != n) {
      throw std::runtime_error(file_error(what + " at byte " + std::to_string(at), std::to_string(n) + " bytes",
                                          std::to_string(got) + " (the input ends there: a truncated file?)"));
    }
  }

  /// Bytes as text for a message, non-printable ones as \xNN.
  static std::string printable(const char* data, std::size_t n) {
    std::string s = "\"";
    for (std::size_t i = 0; i < n; ++i) {
      const auto c = static_cast<unsigned char>(data[i]);
      if (c >= 0x20 && c < 0x7F && c != '"' && c != '\\') {
        s += static_cast<char>(c);
      } else {
        s += "\\x" + hex32(c).substr(8);
      }
    }
    return s + "\"";
  }

  std::istream& in_;
  std::uint64_t offset_ = 0;  // bytes read so far, for messages
  Data data_ = Data::direct;
  std::span<const std::size_t> lengths_;
  std::span<const float> key_scales_, value_scales_;
  std::vector<Pending> pending_;
  std::vector<char> scratch_;
};

/// What HEAD holds.
struct StateHead {
  std::string variant;
  std::string format;
  std::size_t unit_bytes = 0;
  std::size_t units = 0;     // units a stored row of head_dim values takes
  bool row_scales = false;   // a scale kept per stored row
  bool head_scales = false;  // a scale kept per (layer, kv head)
  bool legacy_fp8 = false;   // written while fp8_e4m3 kept head scales (read as fp8_e4m3_heads)
  KvCacheConfig config;
};

/// What BASE holds: the layer lengths, head scales and clipped counts.
struct StateBase {
  std::vector<std::size_t> lengths;
  std::vector<std::size_t> clipped;  // per layer
  bool scales_given = false;
  std::vector<float> key_scales, value_scales;  // layers x kv_heads each, for head-scale formats
};

inline StateHead read_head(StateReader& in) {
  PayloadReader p = in.section("HEAD", kWholeCache, kMaxHeadBytes);
  StateHead h;
  h.variant = p.str("variant");
  h.format = p.str("format");
  h.unit_bytes = p.u64("unit bytes");
  h.units = p.u64("units per row");
  h.row_scales = p.u8("row scales");
  h.head_scales = p.u8("head scales");
  h.config.layers = p.u64("layers");
  h.config.batch = p.u64("batch");
  h.config.kv_heads = p.u64("kv_heads");
  h.config.head_dim = p.u64("head_dim");
  h.config.capacity = p.u64("capacity");
  h.config.window = p.u64("window");
  h.config.sinks = p.u64("sinks");
  h.config.slack = p.u64("slack");
  p.finish();
  // Files written while fp8_e4m3 kept a scale per (layer, kv head) hold fp8_e4m3_heads' rows under
  // that name (fp8_e4m3 now keeps a scale per row): they load into a cache of fp8_e4m3_heads.
  if (h.format == "fp8_e4m3" && h.head_scales && !h.row_scales) {
    h.format = "fp8_e4m3_heads";
    h.legacy_fp8 = true;
  }
  return h;
}

/// BASE for the shape HEAD gave: the per-layer lengths, the clipped count and the head scales.
inline StateBase read_base(StateReader& in, const StateHead& head) {
  const std::size_t layers = head.config.layers;
  const std::size_t heads = head.head_scales ? std::size_t{head.config.kv_heads} : 0;
  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max() / 32;  // the bytes below then fit
  if (layers > kMax || (heads != 0 && layers > kMax / heads)) {
    throw std::runtime_error(file_error("section HEAD: layers x kv_heads", "at most " + std::to_string(kMax),
                                        std::to_string(layers) + " x " + std::to_string(head.config.kv_heads)));
  }
  const std::size_t scales = layers * heads;
  const std::size_t bytes = 16 * layers + 1 + 8 * scales;
  PayloadReader p = in.section("BASE", kWholeCache, bytes);
  // HEAD's counts size what follows: a payload too short for them is refused before anything is
  // allocated for them (read_state_info checks them against no cache).
  p.require(p.size() == bytes, "payload bytes",
            std::to_string(bytes) + " (for HEAD's " + std::to_string(layers) + " layers)", std::to_string(p.size()));
  StateBase base;
  base.lengths.resize(layers);
  for (std::size_t& n : base.lengths) n = p.u64("length");
  base.clipped.resize(layers);
  for (std::size_t& n : base.clipped) n = p.u64("clipped");
  // A cache says so exactly when its format keeps head scales (a file of the legacy fp8 name may
  // not: its scales were set by the first update); anything else would not be written back as read.
  base.scales_given = p.u8("scales given");
  p.require(head.legacy_fp8 || base.scales_given == (heads != 0), "scales given",
            std::string(heads != 0 ? "1" : "0") + " (for format " + head.format + ")", base.scales_given ? "1" : "0");
  base.key_scales = p.f32s("key scales", scales);
  base.value_scales = p.f32s("value scales", scales);
  p.finish();
  for (const auto* s : {&base.key_scales, &base.value_scales}) {
    for (std::size_t i = 0; i < s->size(); ++i) {
      const float x = (*s)[i];
      // 0 is a head no update has set yet; a given scale is never 0.
      if (!std::isfinite(x) || x < 0.0F || (base.scales_given && x == 0.0F)) {
        throw std::runtime_error(
            file_error(p.where(s == &base.key_scales ? "key scale" : "value scale") + " " + std::to_string(i),
                       base.scales_given ? "a positive finite scale (given in the config)" : "a finite scale >= 0",
                       std::to_string(x)));
      }
    }
  }
  return base;
}

}  // namespace detail

/// Reads what a state file says of itself (its HEAD, META and BASE sections, each checksummed),
/// not its data: enough to build a cache that loads it, or to check the metadata first.
/// Throws std::runtime_error for a file that is not a state file of this version, or corrupt.
inline StateInfo read_state_info(std::istream& in) {
  detail::check_little_endian("kvcache::read_state_info");
  detail::StateReader reader(in);
  reader.begin();
  StateInfo info;
  detail::StateHead head = detail::read_head(reader);
  info.variant = std::move(head.variant);
  info.format = std::move(head.format);
  info.config = head.config;
  info.metadata = reader.section("META", detail::kWholeCache, detail::kMaxMetadataBytes).text();
  detail::StateBase base = detail::read_base(reader, head);
  info.lengths = std::move(base.lengths);
  info.key_scales = std::move(base.key_scales);
  info.value_scales = std::move(base.value_scales);
  return info;
}

/// read_state_info() of the file at `path`; std::runtime_error if it cannot be opened.
inline StateInfo read_state_info(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("kvcache::read_state_info: cannot open " + path.string());
  return read_state_info(in);
}

namespace detail {

/// Reads and restores the private state of the shared pieces and of every variant that joins state
/// files. A variant joins with three private members and `friend struct detail::StateAccess;`:
///
///   KvCacheConfig state_config() const;        // the counts it was built with
///   template <class Out> void save_sections(Out& out) const;   // its sections, after BASE
///   template <class In> auto load_sections(In& in);            // reads them back: returns a
///                                                              // noexcept callable that commits
///
/// save_sections writes with out.section(tag, layer, fill) and out.rows(tag, layer, rows, first,
/// count); load_sections reads the same sections in the same order with in.section(tag, layer,
/// max_bytes) and in.rows(...), checks what it reads, allocates what it needs, and changes
/// nothing in the cache until the callable it returns is called. in.lengths() are the tokens of
/// each layer the file holds, already checked against capacity().
struct StateAccess {
  template <class Cache>
  static constexpr bool joins = requires(const Cache& c) {
    { c.state_config() } -> std::same_as<KvCacheConfig>;
  };

  template <class Cache>
  static StateHead head(const Cache& cache) {
    using T = typename Cache::value_type;
    const CacheGeometry& base = cache;
    return {std::string(base.name_),
            format_name<T>(),
            sizeof(typename storage_codec<T>::unit),
            storage_codec<T>::units(base.head_dim()),
            has_row_scales<T>,
            has_head_scales<T>,
            false,
            cache.state_config()};
  }

  /// Where a cache's head scales and clipped counts live: a paged sequence's, in its pool.
  template <class Cache>
  static const HeadScales& scale_owner(const Cache& cache) {
    if constexpr (requires { cache.state_scale_owner(); }) {
      return cache.state_scale_owner();
    } else {
      return cache;
    }
  }

  template <class Cache>
  static void save_base(const Cache& cache, StateWriter& out) {
    const HeadScales& scales = scale_owner(cache);
    out.section("BASE", kWholeCache, [&](PayloadWriter& p) {
      for (const std::size_t n : layer_lengths(cache)) p.u64(n);
      for (const std::size_t n : scales.clipped_) p.u64(n);
      p.u8(scales.scales_.empty() ? 0 : 1);  // head scales are given in the config
      for (const auto& l : scales.scales_) p.f32s(l.keys);
      for (const auto& l : scales.scales_) p.f32s(l.values);
    });
  }

  /// The tokens of each layer: 0 for a cache whose rows each have their own (SlotKvCache's
  /// section holds them).
  template <class Cache>
  static std::vector<std::size_t> layer_lengths(const Cache& cache) {
    if constexpr (std::is_base_of_v<LayerLengths, Cache>) {
      return static_cast<const LayerLengths&>(cache).lengths_;
    } else {
      return std::vector<std::size_t>(cache.layers(), 0);
    }
  }

  /// BASE's state as the cache will hold it, allocated before anything changes.
  struct LoadedBase {
    std::vector<std::size_t> lengths;
    std::vector<HeadScales::LayerScales> scales;
    std::vector<std::size_t> clipped;
  };
  /// Takes BASE's lengths, clipped counts and head scales (the file's rows were encoded with
  /// them); a head scale of 0, which a file of an earlier version keeps for a head no update
  /// had set, leaves the cache's own.
  /// A paged sequence's scales and clipped counts stay its pool's.
  template <class Cache>
  static LoadedBase load_base(const Cache& cache, StateBase& base) {
    LoadedBase loaded{std::move(base.lengths), {}, std::move(base.clipped)};
    if constexpr (std::is_base_of_v<HeadScales, Cache>) loaded.scales = static_cast<const HeadScales&>(cache).scales_;
    const std::size_t heads = cache.kv_heads();
    for (std::size_t l = 0; l < loaded.scales.size(); ++l) {
      for (std::size_t h = 0; h < heads; ++h) {
        const float key = base.key_scales[l * heads + h], value = base.value_scales[l * heads + h];
        if (key != 0.0F) loaded.scales[l].keys[h] = key;
        if (value != 0.0F) loaded.scales[l].values[h] = value;
      }
    }
    return loaded;
  }
  template <class Cache>
  static void commit_base(Cache& cache, LoadedBase&& loaded) noexcept {
    if constexpr (std::is_base_of_v<LayerLengths, Cache>)
      static_cast<LayerLengths&>(cache).lengths_ = std::move(loaded.lengths);
    if constexpr (std::is_base_of_v<HeadScales, Cache>) {
      static_cast<HeadScales&>(cache).scales_ = std::move(loaded.scales);
      static_cast<HeadScales&>(cache).clipped_ = std::move(loaded.clipped);
    }
  }
  /// Whether a layer holds tokens (a SlotKvCache's section checks its rows itself).
  template <class Cache>
  [[nodiscard]] static bool holds_tokens(const Cache& cache) noexcept {
    if constexpr (std::is_base_of_v<LayerLengths, Cache>) {
      const auto& lengths = static_cast<const LayerLengths&>(cache).lengths_;
      return std::any_of(lengths.begin(), lengths.end(), [](std::size_t n) { return n != 0; });
    } else {
      return false;
    }
  }
  template <class Cache>
  static void save_sections(const Cache& cache, StateWriter& out) {
    cache.save_sections(out);
  }
  template <class Cache>
  static auto load_sections(Cache& cache, StateReader& in) {
    return cache.load_sections(in);
  }
};

/// Checks that a file's HEAD describes `cache`'s variant, format and shape; std::invalid_argument
/// naming the first field that differs otherwise.
template <class Cache>
void check_head(const Cache& cache, const StateHead& file) {
  const StateHead own = StateAccess::head(cache);
  const auto differs = [&](const char* field, const std::string& expected, const std::string& found) {
    throw std::invalid_argument("kvcache::load_state: the file's " + std::string(field) + ": expected " + expected +
                                " (the cache loaded into), found " + found);
  };
  if (file.variant != own.variant) differs("variant", own.variant, file.variant);
  if (file.format != own.format) differs("storage format", own.format, file.format);
  const auto count = [&](const char* field, std::size_t expected, std::size_t found) {
    if (expected != found) differs(field, std::to_string(expected), std::to_string(found));
  };
  count("layers", own.config.layers, file.config.layers);
  count("batch", own.config.batch, file.config.batch);
  count("kv_heads", own.config.kv_heads, file.config.kv_heads);
  count("head_dim", own.config.head_dim, file.config.head_dim);
  count("window", own.config.window, file.config.window);
  count("sinks", own.config.sinks, file.config.sinks);
  count("slack", own.config.slack, file.config.slack);
  // The same format's rows laid out otherwise (another kvcache's codec): not this version's file.
  count("unit bytes", own.unit_bytes, file.unit_bytes);
  count("units per row", own.units, file.units);
  count("row scales", own.row_scales, file.row_scales);
  count("head scales", own.head_scales, file.head_scales);
}

}  // namespace detail

/// Writes `cache`'s whole state to `out` with the caller's `metadata` (a model fingerprint and
/// the prompt's token ids, say; at most 1 GiB), the data straight from the cache's storage.
/// Throws std::runtime_error if the stream refuses a write (part of the state may be written),
/// std::length_error for longer metadata.
template <class Cache>
void save_state(const Cache& cache, std::ostream& out, std::string_view metadata = {}) {
  static_assert(detail::StateAccess::joins<Cache>,
                "kvcache::save_state: Cache must be a kvcache cache variant that joins state files (docs/state.md).");
  detail::check_little_endian("kvcache::save_state");
  if (metadata.size() > detail::kMaxMetadataBytes) {
    throw std::length_error(detail::expected_given("kvcache::save_state: metadata bytes",
                                                   "at most " + std::to_string(detail::kMaxMetadataBytes),
                                                   std::to_string(metadata.size())));
  }
  detail::StateWriter writer(out);
  writer.begin();
  const detail::StateHead head = detail::StateAccess::head(cache);
  writer.section("HEAD", detail::kWholeCache, [&](detail::PayloadWriter& p) {
    p.str(head.variant);
    p.str(head.format);
    p.u64(head.unit_bytes);
    p.u64(head.units);
    p.u8(head.row_scales);
    p.u8(head.head_scales);
    const KvCacheConfig& c = head.config;
    for (const std::size_t n : std::array<std::size_t, 8>{c.layers, c.batch, c.kv_heads, c.head_dim, c.capacity,
                                                          c.window, c.sinks, c.slack}) {
      p.u64(n);
    }
  });
  writer.section("META", detail::kWholeCache, [&](detail::PayloadWriter& p) { p.text(metadata); });
  detail::StateAccess::save_base(cache, writer);
  detail::StateAccess::save_sections(cache, writer);
  out.flush();
  if (!out) throw std::runtime_error("kvcache::save_state: the stream refused to flush");
}

/// save_state() to the file at `path`, atomically and durably: written to a temporary file in
/// the same directory, synced, renamed over `path`, and the directory synced. A reader, or a
/// crash at any point, finds the earlier file at `path` or the new one, never a torn one.
/// Throws std::runtime_error naming the file, the step and the system's reason (disk full, ...)
/// for a file it cannot write; `path` is then as it was.
template <class Cache>
void save_state(const Cache& cache, const std::filesystem::path& path, std::string_view metadata = {}) {
  detail::AtomicFile file(path, "kvcache::save_state");
  try {
    save_state(cache, file.stream(), metadata);
  } catch (const std::runtime_error&) {
    file.check();  // the system's reason, when a write failed
    throw;
  }
  file.commit();
}

/// Replaces `cache`'s state with the one saved in `in` and returns the file's metadata. The
/// file must come from the same variant, storage format and shape (layers, batch, kv_heads,
/// head_dim; window, sinks and slack for a ring), with no layer beyond `cache.capacity()`; its
/// head scales, clipped count and lengths replace the cache's. A load is a mutating call on
/// every layer: earlier histories are invalid after it.
///
/// Throws std::invalid_argument for a file of another variant, format or shape, and
/// std::runtime_error for one that is not a state file of this version or is corrupt (checksum,
/// truncation, inconsistent values), naming what was expected and what was found; for a
/// PagedKvCache, std::logic_error unless the sequence is empty and std::length_error if its pool
/// has too few free blocks. The cache (and a paged sequence's pool) is unchanged then. The one exception: a seekable
/// stream whose data changes between the verification and the read that follows it (another process writing the file)
/// leaves the cache reset, and says so.
template <class Cache>
std::string load_state(Cache& cache, std::istream& in) {
  static_assert(detail::StateAccess::joins<Cache>,
                "kvcache::load_state: Cache must be a kvcache cache variant that joins state files (docs/state.md).");
  using Data = detail::StateReader::Data;
  detail::check_little_endian("kvcache::load_state");
  detail::StateReader reader(in);
  reader.begin();
  detail::StateHead head = detail::read_head(reader);
  detail::check_head(cache, head);
  std::string metadata = reader.section("META", detail::kWholeCache, detail::kMaxMetadataBytes).text();
  detail::StateBase base = detail::read_base(reader, head);
  for (std::size_t l = 0; l < base.lengths.size(); ++l) {
    if (base.lengths[l] > cache.capacity()) {
      throw std::invalid_argument("kvcache::load_state: the file's layer " + std::to_string(l) +
                                  " tokens: expected <= " + std::to_string(cache.capacity()) +
                                  " (the capacity of the cache loaded into), found " + std::to_string(base.lengths[l]));
    }
  }
  auto loaded = detail::StateAccess::load_base(cache, base);
  // The rows of a cache that holds no tokens are read by nothing: the data may go straight
  // into them. Otherwise it is verified first (seekable) or held until verified.
  const Data data = !detail::StateAccess::holds_tokens(cache) ? Data::direct
                    : detail::StateReader::seekable(in)       ? Data::verify_then_read
                                                              : Data::hold;
  reader.set_data(data);
  reader.set_lengths(loaded.lengths);
  reader.set_head_scales(base.key_scales, base.value_scales);
  auto commit = detail::StateAccess::load_sections(cache, reader);
  try {
    reader.finish();
  } catch (const std::exception& e) {
    cache.reset();  // part of the data is the file's, part the cache's: neither state
    throw std::runtime_error(std::string(e.what()) + "; the file changed while it was loaded: the cache was reset");
  }
  commit();
  detail::StateAccess::commit_base(cache, std::move(loaded));
  return metadata;
}

/// load_state() from the file at `path`; std::runtime_error if it cannot be opened.
template <class Cache>
std::string load_state(Cache& cache, const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("kvcache::load_state: cannot open " + path.string());
  return load_state(cache, in);
}

}  // namespace KVCACHE_ABI
}  // namespace kvcache
