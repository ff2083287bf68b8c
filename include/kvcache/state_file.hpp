// SPDX-License-Identifier: Apache-2.0
#pragma once

// Saving a cache's state to a file or a stream and loading it back, for every variant and
// storage format: an engine saves a prompt's cache once and skips its prefill afterwards.
//
//   kvcache::save_state(cache, "prompt.kvstate", fingerprint);          // the model's, say
//   kvcache::KvCache<kvcache::bfloat16> restored(kvcache::read_state_info("prompt.kvstate").config);
//   std::string metadata = kvcache::load_state(restored, "prompt.kvstate");
//
// The file (its container: detail/state_container.hpp): an 8-byte magic, a version, then
// sections, each a tag, an index (the layer), its length, its bytes and their CRC-32C. HEAD says
// which variant, storage format and shape wrote it, and the settings the variant lists
// (detail/state_settings.hpp); META is the caller's metadata string; BASE the tokens of each layer (and the head
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
#include "kvcache/detail/state_container.hpp"
#include "kvcache/detail/state_settings.hpp"
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

inline constexpr std::size_t kMaxHeadBytes = 4096;
inline constexpr std::size_t kMaxMetadataBytes = std::size_t{1} << 30;

/// What HEAD holds.
struct StateHead {
  std::string variant;
  std::string format;
  std::size_t unit_bytes = 0;
  std::size_t units = 0;     // units a stored row of head_dim values takes
  bool row_scales = false;   // a scale kept per stored row
  bool head_scales = false;  // a scale kept per (layer, kv head)
  bool legacy_fp8 = false;   // written while fp8_e4m3 kept head scales (read as fp8_e4m3_heads)
  /// The shape (layers, batch, kv_heads, head_dim), and of the settings those that are counts
  /// of a config, for read_state_info().
  KvCacheConfig config;
  std::vector<StateSetting> settings;  // the variant's own, as it named them
};

/// What BASE holds: the layer lengths, head scales and clipped counts.
struct StateBase {
  std::vector<std::size_t> lengths;
  std::vector<std::size_t> clipped;  // per layer
  bool scales_given = false;
  std::vector<float> key_scales, value_scales;  // layers x kv_heads each, for head-scale formats
};

inline void write_head(PayloadWriter& p, const StateHead& h) {
  p.str(h.variant);
  p.str(h.format);
  p.u64(h.unit_bytes);
  p.u64(h.units);
  p.u8(h.row_scales);
  p.u8(h.head_scales);
  for (const std::size_t n :
       std::array<std::size_t, 4>{h.config.layers, h.config.batch, h.config.kv_heads, h.config.head_dim}) {
    p.u64(n);
  }
  write_settings(p, h.settings);
}

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
  h.settings = read_settings(p, in.version());
  p.finish();
  for (const StateSetting& setting : h.settings) (void)set_config_count(h.config, setting.name, setting.value);
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
///   template <class S> void state_settings(S& settings) const; // its settings (state_settings.hpp)
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
  static constexpr bool joins = requires(const Cache& c, StateSettings& settings) {
    c.state_settings(settings);
  };

  template <class Cache>
  static StateHead head(const Cache& cache) {
    using T = typename Cache::value_type;
    const CacheGeometry& base = cache;
    StateSettings settings;
    cache.state_settings(settings);
    return {std::string(base.name_),
            format_name<T>(),
            sizeof(typename storage_codec<T>::unit),
            storage_codec<T>::units(base.head_dim()),
            has_row_scales<T>,
            has_head_scales<T>,
            false,
            {.layers = base.layers(), .batch = base.batch(), .kv_heads = base.kv_heads(), .head_dim = base.head_dim()},
            settings.list()};
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

/// Checks that a file's HEAD describes `cache`'s variant, format, shape and the settings it must
/// match; std::invalid_argument naming the first field that differs otherwise.
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
  check_settings(own.settings, file.settings, own.variant);
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
  writer.section("HEAD", detail::kWholeCache, [&](detail::PayloadWriter& p) { detail::write_head(p, head); });
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
/// head_dim), with the settings the variant must match (a ring's window, sinks and slack) and no
/// layer beyond `cache.capacity()`; its head scales, clipped count and lengths replace the
/// cache's. A load is a mutating call on every layer: earlier histories are invalid after it.
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
