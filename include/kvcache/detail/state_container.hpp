// SPDX-License-Identifier: Apache-2.0
#pragma once

// A state file's container, which knows no variant: an 8-byte magic, a version, then sections,
// each a tag, an index (the layer, or kWholeCache), its length, its bytes and their CRC-32C.
// Small sections are fixed-width little-endian fields (PayloadWriter, PayloadReader); data
// sections are a cache's stored rows, written from its storage and read straight into it, or
// verified first (StateReader::Data). state_file.hpp says which sections a state holds;
// block_record.hpp frames a store's blocks the same way.

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <istream>
#include <ostream>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvcache/detail/assert.hpp"
#include "kvcache/detail/crc32c.hpp"
#include "kvcache/detail/row_store.hpp"
#include "kvcache/version.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

/// The first bytes of every state file: a non-ASCII byte, the name, and the line endings and
/// end-of-file byte that a text-mode copy would change (as PNG's).
inline constexpr std::array<char, 8> kStateMagic = {'\x89', 'K', 'V', 'C', '\r', '\n', '\x1a', '\n'};
/// The layout written; begin() reads this one and every earlier one from kOldestStateVersion (1:
/// HEAD's config a fixed list of eight counts; 2: the shape, then the variant's own settings).
inline constexpr std::uint32_t kStateVersion = 2;
inline constexpr std::uint32_t kOldestStateVersion = 1;
/// Bytes read or written, and checksummed, at a time: large enough for the disk's speed, small
/// enough to be checksummed while still in the processor's cache.
inline constexpr std::size_t kStateChunk = std::size_t{4} << 20;
/// The index of a section that belongs to no layer.
inline constexpr std::uint32_t kWholeCache = 0xFFFFFFFFU;

inline std::string file_error(const std::string& what, const std::string& expected, const std::string& found) {
  return "kvcache state file: " + what + ": expected " + expected + ", found " + found;
}

inline std::string hex32(std::uint32_t value) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s = "0x";
  for (int shift = 28; shift >= 0; shift -= 4) s += kDigits[(value >> shift) & 0xFU];
  return s;
}

/// Bytes read from a file as quoted text for a message, non-printable ones as \xNN: a name a
/// file gives may hold any byte, a NUL included.
inline std::string printable(std::string_view bytes) {
  std::string s = "\"";
  for (const char byte : bytes) {
    const auto c = static_cast<unsigned char>(byte);
    if (c >= 0x20 && c < 0x7F && c != '"' && c != '\\') {
      s += byte;
    } else {
      s += "\\x" + hex32(c).substr(8);
    }
  }
  return s + "\"";
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
      throw std::runtime_error(
          file_error("magic", printable(std::string_view(kStateMagic.data(), kStateMagic.size())) + " (a state file)",
                     printable(std::string_view(magic.data(), got))));
    }
    std::uint32_t version = 0;
    read_exact(&version, sizeof version, "the version");
    if (version < kOldestStateVersion || version > kStateVersion) {
      throw std::runtime_error(file_error(
          "version",
          std::to_string(kOldestStateVersion) + " to " + std::to_string(kStateVersion) + " (what this kvcache reads)",
          std::to_string(version)));
    }
    version_ = version;
  }
  /// The file's version, which begin() read: what an earlier version's sections hold differs.
  [[nodiscard]] std::uint32_t version() const noexcept { return version_; }

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
  [[nodiscard]] std::span<const float> key_head_scales() const noexcept { return key_scales_; }
  [[nodiscard]] std::span<const float> value_head_scales() const noexcept { return value_scales_; }
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
    if (found != name) throw std::runtime_error(file_error("section", name, printable(found)));
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

  std::istream& in_;
  std::uint64_t offset_ = 0;  // bytes read so far, for messages
  std::uint32_t version_ = 0;
  Data data_ = Data::direct;
  std::span<const std::size_t> lengths_;
  std::span<const float> key_scales_, value_scales_;
  std::vector<Pending> pending_;
  std::vector<char> scratch_;
};

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
