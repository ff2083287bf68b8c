// SPDX-License-Identifier: Apache-2.0
#pragma once

// A paged block as a store keeps it: a self-describing record in the state file's section
// framing (detail/state_container.hpp: a tag, an index, a length, the payload and its CRC-32C),
// under a magic of its own. Written from the pool's rows; verified whole, in memory, before a
// byte of it reaches a block (docs/store.md lists every field):
//
//   magic "\x89KVB\r\n\x1a\n", version u32 (1)
//   NSPC  the namespace: model, format, its row layout, block_tokens, layers, kv_heads, head_dim,
//         the record version, and for formats with head scales the pool's K and V scales
//   BLCK  the block's key, its parent's key, its token ids (u64 count, then i64 each)
//   ROWS[l] for each layer: the block's stored bytes (keys, values, row scales), as a state file's
//
// From the state container it takes the framing alone: SectionHeader, section_header,
// section_name, kWholeCache, PayloadWriter, hex32 and check_little_endian.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kvcache/block_store.hpp"
#include "kvcache/codec.hpp"
#include "kvcache/detail/crc32c.hpp"
#include "kvcache/detail/row_store.hpp"
#include "kvcache/detail/sha256.hpp"
#include "kvcache/detail/state_container.hpp"
#include "kvcache/version.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

inline constexpr std::array<char, 8> kBlockMagic = {'\x89', 'K', 'V', 'B', '\r', '\n', '\x1a', '\n'};
inline constexpr std::uint32_t kBlockRecordVersion = 1;

/// A pool's namespace in a store: NSPC's payload, and its SHA-256, from which every key hashes.
struct BlockSpace {
  std::string payload;
  NamespaceDigest digest{};
};

/// The namespace of blocks of format T stored by a pool of this shape for `model`.
/// `key_scales` and `value_scales` are the pool's head scales (layers x kv_heads; empty for
/// formats without them).
template <class T>
BlockSpace block_space(std::string_view model, std::size_t block_tokens, std::size_t layers, std::size_t kv_heads,
                       std::size_t head_dim, std::span<const float> key_scales, std::span<const float> value_scales) {
  check_little_endian("kvcache block store");
  PayloadWriter p;
  p.str(model);
  p.str(format_name<T>());
  p.u64(sizeof(typename storage_codec<T>::unit));
  p.u64(storage_codec<T>::units(head_dim));
  p.u8(has_row_scales<T>);
  p.u8(has_head_scales<T>);
  for (const std::size_t n : {block_tokens, layers, kv_heads, head_dim, std::size_t{kBlockRecordVersion}}) p.u64(n);
  p.f32s(key_scales);
  p.f32s(value_scales);
  BlockSpace space{p.bytes(), {}};
  Sha256 hash;
  hash.update(space.payload.data(), space.payload.size());
  space.digest = hash.digest();
  return space;
}

/// The keys of a prompt's first `blocks` blocks of `block_tokens` ids each, in `space`.
inline std::vector<BlockKey> prompt_keys(const BlockSpace& space, std::span<const std::int32_t> ids,
                                         std::size_t block_tokens, std::size_t blocks) {
  std::vector<BlockKey> keys;
  keys.reserve(blocks);
  BlockKey parent;
  for (std::size_t j = 0; j < blocks; ++j) {
    parent = block_key(space.digest, parent, ids.subspan(j * block_tokens, block_tokens));
    keys.push_back(parent);
  }
  return keys;
}

/// Bytes of a layer's ROWS payload for one block: its keys, values and row scales.
template <class T>
std::size_t block_row_bytes(const RowStore<T>& rows, std::size_t first, std::size_t block_tokens) noexcept {
  std::size_t bytes = 0;
  RowStore<T>::for_each_run(rows, first, block_tokens, [&](const auto*, std::size_t n) { bytes += n; });
  return bytes;
}

/// The record of the block whose rows start at token `first` in every layer's `rows`.
template <class T>
std::string encode_block(const BlockSpace& space, const BlockKey& key, const BlockKey& parent,
                         std::span<const std::int32_t> ids, const std::vector<RowStore<T>>& rows, std::size_t first,
                         std::size_t block_tokens) {
  PayloadWriter block;
  block.text(std::string_view(reinterpret_cast<const char*>(key.bytes.data()), key.bytes.size()));
  block.text(std::string_view(reinterpret_cast<const char*>(parent.bytes.data()), parent.bytes.size()));
  block.u64(ids.size());
  block.i64s(std::vector<std::int64_t>(ids.begin(), ids.end()));

  std::size_t total = kBlockMagic.size() + sizeof kBlockRecordVersion + 2 * (sizeof(SectionHeader) + 4) +
                      space.payload.size() + block.bytes().size();
  for (const RowStore<T>& r : rows) total += sizeof(SectionHeader) + 4 + block_row_bytes(r, first, block_tokens);
  std::string out;
  out.reserve(total);
  const auto append = [&](const void* data, std::size_t n) { out.append(static_cast<const char*>(data), n); };
  append(kBlockMagic.data(), kBlockMagic.size());
  append(&kBlockRecordVersion, sizeof kBlockRecordVersion);
  const auto section = [&](std::string_view tag, std::size_t index, std::size_t bytes, const auto& payload) {
    const SectionHeader header = section_header(tag, index, bytes);
    append(&header, sizeof header);
    std::uint32_t crc = crc32c(0, &header, sizeof header);
    payload([&](const void* data, std::size_t n) {
      crc = crc32c(crc, data, n);
      append(data, n);
    });
    append(&crc, sizeof crc);
  };
  for (const auto& small : {std::pair{"NSPC", &space.payload}, std::pair{"BLCK", &block.bytes()}}) {
    const std::string& bytes = *small.second;
    section(small.first, kWholeCache, bytes.size(), [&](const auto& emit) { emit(bytes.data(), bytes.size()); });
  }
  for (std::size_t l = 0; l < rows.size(); ++l) {
    section("ROWS", l, block_row_bytes(rows[l], first, block_tokens), [&](const auto& emit) {
      RowStore<T>::for_each_run(rows[l], first, block_tokens, [&](const auto* data, std::size_t n) { emit(data, n); });
    });
  }
  KVCACHE_ASSERT(out.size() == total, "a block record is as long as its sections");
  return out;
}

/// Reads a record's fields, each checked to lie inside it; messages name the field.
class RecordCursor {
 public:
  explicit RecordCursor(std::string_view bytes) noexcept : bytes_(bytes) {}

  std::string_view take(std::size_t n, const std::string& what) {
    if (n > bytes_.size() - at_) {
      throw std::runtime_error(what + ": expected " + std::to_string(n) + " more bytes, found " +
                               std::to_string(bytes_.size() - at_));
    }
    const std::string_view out = bytes_.substr(at_, n);
    at_ += n;
    return out;
  }
  template <class V>
  V raw(const std::string& what) {
    V value;
    std::memcpy(&value, take(sizeof value, what).data(), sizeof value);
    return value;
  }
  std::string str(const std::string& what) { return std::string(take(raw<std::uint32_t>(what), what)); }
  [[nodiscard]] std::size_t left() const noexcept { return bytes_.size() - at_; }
  [[nodiscard]] std::size_t at() const noexcept { return at_; }

  /// The payload of the next section, which must be `tag`[index], its checksum verified.
  std::string_view section(std::string_view tag, std::size_t index) {
    const std::string name = section_name(tag, index);
    SectionHeader header;
    std::memcpy(&header, take(sizeof header, "the header of section " + name).data(), sizeof header);
    const std::string found = section_name(std::string_view(header.tag.data(), header.tag.size()), header.index);
    if (found != name) throw std::runtime_error("section: expected " + name + ", found \"" + found + "\"");
    if (header.bytes > left()) {
      throw std::runtime_error("section " + name + ": payload bytes: expected at most " + std::to_string(left()) +
                               " (the rest of the record), found " + std::to_string(header.bytes));
    }
    const std::string_view payload = take(static_cast<std::size_t>(header.bytes), "section " + name);
    const std::uint32_t computed = crc32c(crc32c(0, &header, sizeof header), payload.data(), payload.size());
    const auto stored = raw<std::uint32_t>("the checksum of section " + name);
    if (stored != computed) {
      throw std::runtime_error("section " + name + ": checksum: expected " + hex32(stored) +
                               " (stored in the record), found " + hex32(computed) + " (computed from its bytes)");
    }
    return payload;
  }

 private:
  std::string_view bytes_;
  std::size_t at_ = 0;
};

/// Names the first field in which two NSPC payloads differ (`found` may be malformed).
inline std::string namespace_difference(std::string_view expected, std::string_view found) {
  RecordCursor e(expected), f(found);
  const auto differs = [](const char* field, const std::string& want, const std::string& got) {
    return std::string("namespace: ") + field + ": expected " + want + " (the pool's), found " + got;
  };
  try {
    for (const char* field : {"model", "format"}) {
      const std::string want = e.str(field), got = f.str(field);
      if (want != got) return differs(field, "\"" + want + "\"", "\"" + got + "\"");
    }
    for (const char* field : {"unit bytes", "units per row"}) {
      const auto want = e.raw<std::uint64_t>(field), got = f.raw<std::uint64_t>(field);
      if (want != got) return differs(field, std::to_string(want), std::to_string(got));
    }
    for (const char* field : {"row scales", "head scales"}) {
      const auto want = e.raw<std::uint8_t>(field), got = f.raw<std::uint8_t>(field);
      if (want != got) return differs(field, std::to_string(want), std::to_string(got));
    }
    for (const char* field : {"block_tokens", "layers", "kv_heads", "head_dim", "record version"}) {
      const auto want = e.raw<std::uint64_t>(field), got = f.raw<std::uint64_t>(field);
      if (want != got) return differs(field, std::to_string(want), std::to_string(got));
    }
    for (std::size_t i = 0; e.left() != 0; ++i) {
      const auto want = e.raw<float>("head scale"), got = f.raw<float>("head scale");
      if (std::memcmp(&want, &got, sizeof want) != 0) {
        return differs(("head scale " + std::to_string(i)).c_str(), std::to_string(want), std::to_string(got));
      }
    }
    if (f.left() != 0) return differs("bytes", std::to_string(expected.size()), std::to_string(found.size()));
  } catch (const std::runtime_error& error) {
    return std::string("namespace: ") + error.what();
  }
  return "namespace: its bytes differ";
}

/// Verifies a record against the block a fetch expects (its namespace, key, parent key and token
/// ids, every checksum, each layer's bytes for the pool's rows) and returns each layer's ROWS
/// payload inside it. std::runtime_error naming the first thing that is not as expected.
template <class T>
std::vector<std::string_view> verify_block(std::string_view record, const BlockSpace& space, const BlockKey& key,
                                           const BlockKey& parent, std::span<const std::int32_t> ids,
                                           const std::vector<RowStore<T>>& rows, std::size_t first,
                                           std::size_t block_tokens) {
  RecordCursor in(record);
  const std::string_view magic = in.take(kBlockMagic.size(), "magic");
  if (!std::equal(magic.begin(), magic.end(), kBlockMagic.begin())) {
    throw std::runtime_error("magic: expected \"\\x89KVB\\r\\n\\x1a\\n\" (a block record), found other bytes");
  }
  const auto version = in.raw<std::uint32_t>("version");
  if (version != kBlockRecordVersion) {
    throw std::runtime_error("version: expected " + std::to_string(kBlockRecordVersion) + ", found " +
                             std::to_string(version));
  }
  const std::string_view space_bytes = in.section("NSPC", kWholeCache);
  if (space_bytes != space.payload) throw std::runtime_error(namespace_difference(space.payload, space_bytes));

  RecordCursor block(in.section("BLCK", kWholeCache));
  const auto check_key = [&](const char* what, const BlockKey& expected) {
    BlockKey found;
    std::memcpy(found.bytes.data(), block.take(found.bytes.size(), what).data(), found.bytes.size());
    if (found != expected) {
      throw std::runtime_error(std::string(what) + ": expected " + expected.hex() + ", found " + found.hex());
    }
  };
  check_key("key", key);
  check_key("parent key", parent);
  const auto count = block.raw<std::uint64_t>("token id count");
  if (count != ids.size()) {
    throw std::runtime_error("token ids: expected " + std::to_string(ids.size()) + ", found " + std::to_string(count));
  }
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const auto id = block.raw<std::int64_t>("token id");
    if (id != ids[i]) {
      throw std::runtime_error("token id " + std::to_string(i) + ": expected " + std::to_string(ids[i]) +
                               " (the prompt's), found " + std::to_string(id));
    }
  }
  if (block.left() != 0) {
    throw std::runtime_error("section BLCK: payload bytes: expected " + std::to_string(block.at()) + ", found " +
                             std::to_string(block.at() + block.left()));
  }

  std::vector<std::string_view> layers;
  layers.reserve(rows.size());
  for (std::size_t l = 0; l < rows.size(); ++l) {
    const std::string_view payload = in.section("ROWS", l);
    const std::size_t expected = block_row_bytes(rows[l], first, block_tokens);
    if (payload.size() != expected) {
      throw std::runtime_error(section_name("ROWS", l) + ": payload bytes: expected " + std::to_string(expected) +
                               " (a block of the pool's rows), found " + std::to_string(payload.size()));
    }
    layers.push_back(payload);
  }
  if (in.left() != 0) {
    throw std::runtime_error("record bytes: expected " + std::to_string(in.at()) + " (its sections), found " +
                             std::to_string(record.size()));
  }
  return layers;
}

/// Copies a verified record's rows (verify_block's payloads) into the block at token `first` of every layer.
template <class T>
void copy_block_rows(std::span<const std::string_view> layers, std::vector<RowStore<T>>& rows, std::size_t first,
                     std::size_t block_tokens) noexcept {
  for (std::size_t l = 0; l < rows.size(); ++l) {
    const char* from = layers[l].data();
    RowStore<T>::for_each_run(rows[l], first, block_tokens, [&](auto* data, std::size_t n) {
      std::memcpy(static_cast<void*>(data), from, n);
      from += n;
    });
  }
}

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
