// SPDX-License-Identifier: Apache-2.0
// State files fed arbitrary bytes: read_state_info and load_state into a cache of every variant
// and format. A load either throws a standard exception naming what it expected, leaving the
// cache (and a paged sequence's pool) exactly as it was, or succeeds and the cache holds what
// the file says: its lengths, a readable history, the same bytes when saved again, and updates
// that continue it.
//
// Input: a flags byte, a target byte (variant x format of the fixed target), then the file.
// Flags: repair the checksums first (so mutations reach the checks behind them), load into a
// cache that holds other tokens, read through a stream that cannot seek, build the target
// from what read_state_info reports (when small enough) instead of the fixed one, or patch a
// seed's file (the rest of the input is then patches, not a file; see patched_state).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <istream>
#include <new>
#include <optional>
#include <sstream>
#include <streambuf>
#include <string>
#include <string_view>

#include "kvcache/detail/crc32c.hpp"
#include "kvcache/state_file.hpp"
#include "state_fuzz_support.hpp"

namespace {

using namespace state_fuzz;

constexpr std::uint8_t kRepair = 1, kHolds = 2, kPipe = 4, kFromInfo = 8, kPatch = 16;

/// Recomputes every whole section's checksum, as a writer of crafted files would.
void repair(std::string& file) {
  std::size_t at = 12;
  while (at <= file.size() && file.size() - at >= 16) {
    std::uint64_t bytes = 0;
    std::memcpy(&bytes, file.data() + at + 8, 8);
    const std::size_t rest = file.size() - at - 16;
    if (bytes > rest || rest - bytes < 4) return;
    const auto payload = static_cast<std::size_t>(bytes);
    const std::uint32_t crc = detail::crc32c(0, file.data() + at, 16 + payload);
    std::memcpy(file.data() + at + 16 + payload, &crc, 4);
    at += 16 + payload + 4;
  }
}

/// Where each section starts, by its tag, and where HEAD ends.
struct Layout {
  std::size_t head_end = 0;
  std::size_t base_end = 0;
  std::size_t page = 0;  // PAGE's start, 0 if none
  std::string format;    // the format HEAD names
};
Layout layout(const std::string& file) {
  Layout out;
  for (std::size_t at = 12; at <= file.size() && file.size() - at >= 16;) {
    std::uint64_t bytes = 0;
    std::memcpy(&bytes, file.data() + at + 8, 8);
    const std::size_t rest = file.size() - at - 16;
    if (bytes > rest || rest - bytes < 4) break;
    const std::size_t end = at + 16 + static_cast<std::size_t>(bytes) + 4;
    if (file.compare(at, 4, "HEAD") == 0) {
      out.head_end = end;
      // The variant and the format, each a u32 length and its characters.
      std::uint32_t variant = 0, format = 0;
      if (bytes >= 8) std::memcpy(&variant, file.data() + at + 16, 4);
      if (bytes >= 8 + std::uint64_t{variant}) std::memcpy(&format, file.data() + at + 20 + variant, 4);
      if (bytes >= 8 + std::uint64_t{variant} + format) out.format = file.substr(at + 24 + variant, format);
    }
    if (file.compare(at, 4, "BASE") == 0) out.base_end = end;
    if (file.compare(at, 4, "PAGE") == 0) out.page = at;
    at = end;
  }
  return out;
}

/// The seed file of the target's variant and format with `patches` applied past HEAD, each three
/// bytes (a little-endian offset into what follows HEAD, a byte XORed there), checksums
/// repaired. Arbitrary files mostly stop at the parser; these keep their sections and sizes, so
/// their loads reach the checks of the lengths, positions and scales they hold, and succeed.
template <class T>
std::string patched_state(Variant v, std::string_view patches) {
  std::string file = saved_state<T>(v);
  const std::size_t from = layout(file).head_end;
  if (from == 0 || from >= file.size()) return file;
  for (std::size_t i = 0; i + 3 <= patches.size(); i += 3) {
    const std::size_t offset = static_cast<std::uint8_t>(patches[i]) |
                               static_cast<std::size_t>(static_cast<std::uint8_t>(patches[i + 1])) << 8;
    file[from + offset % (file.size() - from)] ^= patches[i + 2];
  }
  repair(file);
  return file;
}

/// A stream over the bytes that cannot seek, as a pipe.
class PipeBuf : public std::streambuf {
 public:
  explicit PipeBuf(std::string& bytes) { setg(bytes.data(), bytes.data(), bytes.data() + bytes.size()); }
};

/// A refusal must be a standard exception naming what was expected; std::bad_alloc means a file
/// made the loader allocate what it does not back.
void check_refusal(const std::exception& e, const char* call) {
  require(dynamic_cast<const std::bad_alloc*>(&e) == nullptr, std::string(call) + ": std::bad_alloc");
  require(std::string_view(e.what()).find("expected") != std::string_view::npos,
          std::string(call) + ": a message that names what it expected: " + e.what());
}

/// Whether a config read from a file is small enough to build a target from.
bool small(const KvCacheConfig& c) {
  const std::size_t counts[] = {c.layers, c.batch, c.kv_heads, c.head_dim};
  for (const std::size_t n : counts) {
    if (n == 0 || n > 64) return false;
  }
  const std::size_t ring = c.window + c.sinks + c.slack;
  if (c.capacity > 4096 || c.window > 4096 || c.sinks > 4096 || c.slack > 4096) return false;
  return c.layers * c.batch * c.kv_heads * c.head_dim * std::max<std::size_t>({c.capacity, ring, 1}) <= (1U << 18);
}

/// One token (then a chunk of three) more in every layer that has room: a loaded state continues.
template <Variant V, class Cache>
void continue_updates(Cache& cache) {
  for (const std::size_t tokens : {std::size_t{1}, std::size_t{3}}) {
    if constexpr (V == Variant::slot) {
      for (std::size_t row = 0; row < cache.slots(); ++row) {
        if (!cache.acquired(row)) continue;
        for (std::size_t l = 0; l < cache.layers(); ++l) {
          if (cache.row_length(row, l) + tokens <= cache.capacity()) feed(cache, tokens, 7, 3.0F, l + 1, row);
        }
      }
    } else {
      for (std::size_t l = 0; l < cache.layers(); ++l) {
        if (cache.length(l) + tokens > cache.capacity()) continue;
        using In = input_t<typename Cache::value_type>;
        Block<In> k({cache.batch(), cache.kv_heads(), tokens, cache.head_dim()}, 5, 3.0F);
        try {
          cache.update(l, k.view(), k.view(), arange(cache.length(l), tokens));
        } catch (const std::length_error& e) {
          // A paged sequence whose pool has no free block left: the one refusal allowed here.
          require(V == Variant::paged, std::string("an update after a load: ") + e.what());
        }
      }
    }
  }
}

template <Variant V, class T, class Config>
void run(const Config& config, std::uint8_t flags, std::string& file, const std::optional<StateInfo>& info) {
  std::optional<Target<V, T>> target;
  try {
    target.emplace(config);
    if ((flags & kHolds) != 0) hold_others(*target);
  } catch (const std::exception&) {
    return;  // a config from the file that builds no cache (or too small to hold others)
  }
  auto& cache = target->cache;
  const Snapshot before = snapshot(cache);
  std::optional<Snapshot> holder;
  std::size_t free_blocks = 0, keyed_blocks = 0;
  if constexpr (V == Variant::paged) {
    holder = snapshot(*target->holder);
    free_blocks = target->pool->free_blocks();
    keyed_blocks = target->pool->keyed_blocks();
  }

  std::string metadata;
  bool loaded = false;
  try {
    if ((flags & kPipe) != 0) {
      PipeBuf buf(file);
      std::istream in(&buf);
      metadata = load_state(cache, in);
    } else {
      std::istringstream in(file);
      metadata = load_state(cache, in);
    }
    loaded = true;
  } catch (const std::exception& e) {
    check_refusal(e, "load_state");
  }
  if constexpr (V == Variant::paged) target->pool->check_invariants();

  if (!loaded) {
    require(snapshot(cache) == before, "a refused load changed the cache");
    if constexpr (V == Variant::paged) {
      require(snapshot(*target->holder) == *holder, "a refused load changed another sequence of the pool");
      require(target->pool->free_blocks() == free_blocks && target->pool->keyed_blocks() == keyed_blocks,
              "a refused load changed the pool's free or keyed blocks");
    }
    return;
  }

  // Loaded: what read_state_info said of the same bytes is what the cache now holds.
  require(info.has_value(), "load_state loaded a file that read_state_info refuses");
  require(metadata == info->metadata, "load_state and read_state_info give other metadata");
  require(info->variant == kVariantNames[static_cast<std::size_t>(V)], "a file of another variant loaded");
  require(info->lengths.size() == cache.layers(), "read_state_info's layers");
  const Snapshot after = snapshot(cache);
  for (std::size_t l = 0; l < cache.layers(); ++l) {
    if constexpr (V == Variant::slot) {
      require(info->lengths[l] == 0, "a slot cache's file with layer lengths");
      for (std::size_t row = 0; row < cache.slots(); ++row) {
        const std::size_t n = cache.row_length(row, l);
        require(n <= cache.capacity() && (n == 0 || cache.acquired(row)), "a loaded slot's tokens");
        const auto& h = after.histories[l * cache.slots() + row];
        require(h.size() == n && (n == 0 || (h.begin()->first == 0 && h.rbegin()->first + 1 == std::int64_t(n))),
                "a loaded slot's history holds positions 0..length-1");
      }
    } else {
      const std::size_t n = cache.length(l);
      require(n == info->lengths[l] && n <= cache.capacity(), "a loaded layer's tokens are the file's");
      const auto& h = after.histories[l];
      require(h.empty() || (h.begin()->first >= 0 && h.rbegin()->first < std::int64_t(n)),
              "a loaded history's positions lie below its length");
      if constexpr (V != Variant::ring) {
        require(h.size() == n, "a loaded history holds every token");
      }
    }
  }

  // Saved again, it is the file (HEAD aside: the capacity is the cache's own; a paged
  // sequence's BASE aside: its scales and clipped count are its pool's; and the BASE of a file
  // written while fp8_e4m3 kept head scales, which may say they were not given).
  std::ostringstream out;
  save_state(cache, out, metadata);
  const std::string again = std::move(out).str();
  const Layout from = layout(file), to = layout(again);
  const bool renamed = from.format != to.format;
  const std::size_t from_at = V == Variant::paged ? from.page : renamed ? from.base_end : from.head_end;
  const std::size_t to_at = V == Variant::paged ? to.page : renamed ? to.base_end : to.head_end;
  require(to_at != 0 && from_at != 0 && to_at <= again.size(), "the sections of a loaded file");
  const std::size_t n = again.size() - to_at;
  require(file.size() - from_at >= n && file.compare(from_at, n, again, to_at, n) == 0,
          "a loaded cache saved again differs from its file");

  try {
    continue_updates<V>(cache);
  } catch (const std::exception& e) {
    fail(std::string("an update after a load threw: ") + e.what());
  }
  if constexpr (V == Variant::paged) target->pool->check_invariants();
  (void)snapshot(cache);
}

template <class T>
void run_variant(Variant v, const KvCacheConfig& config, std::uint8_t flags, std::string& file,
                 const std::optional<StateInfo>& info) {
  switch (v) {
    case Variant::dense:
      return run<Variant::dense, T>(config, flags, file, info);
    case Variant::concat:
      return run<Variant::concat, T>(config, flags, file, info);
    case Variant::ring:
      return run<Variant::ring, T>(config, flags, file, info);
    case Variant::slot:
      return run<Variant::slot, T>(config, flags, file, info);
    case Variant::paged: {
      const std::size_t blocks = (config.capacity + kBlockTokens - 1) / kBlockTokens + kBlocks;
      return run<Variant::paged, T>(pool_config(config, blocks), flags, file, info);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const std::uint8_t flags = data[0];
  std::size_t variant = data[1] / kFormats % kVariants, format = data[1] % kFormats;
  std::string file(reinterpret_cast<const char*>(data + 2), size - 2);
  if ((flags & kPatch) != 0) {
    file = with_format_at(format, [&]<class T>() { return patched_state<T>(Variant(variant), file); });
  } else if ((flags & kRepair) != 0) {
    repair(file);
  }

  std::optional<StateInfo> info;
  try {
    std::istringstream in(file);
    info = read_state_info(in);
  } catch (const std::exception& e) {
    check_refusal(e, "read_state_info");
  }

  KvCacheConfig config = fixed_config(static_cast<Variant>(variant));
  if ((flags & kFromInfo) != 0 && info && small(info->config)) {
    for (std::size_t v = 0; v < kVariants; ++v) {
      if (info->variant == kVariantNames[v]) variant = v;
    }
    if (const std::size_t f = format_index(info->format); f < kFormats) format = f;
    config = info->config;
    config.key_scales = info->key_scales;  // as the file's rows were encoded (formats with head scales)
    config.value_scales = info->value_scales;
  }
  with_format_at(format, [&]<class T>() { run_variant<T>(Variant(variant), config, flags, file, info); });
  return 0;
}
