// SPDX-License-Identifier: Apache-2.0
// The reference model's loader fed arbitrary bytes: config.json text, a safetensors file, the
// model.safetensors.index.json index, and a whole checkpoint directory (config.json beside a
// model.safetensors). Each either throws a clear error (safetensors::Error, json::Error,
// std::invalid_argument) or returns what is consistent: tensors inside the file whose shapes
// match their bytes, weights of the config's shapes. No crash, no undefined behaviour, and no
// allocation that the bytes given do not back (std::bad_alloc fails the run).
//
// Input: a mode byte (its value modulo 4), then the bytes. Mode 3: a 2-byte little-endian length
// of config.json, its text, then model.safetensors.

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "qwen3/checkpoint.hpp"
#include "qwen3/config.hpp"
#include "qwen3/json.hpp"
#include "qwen3/safetensors.hpp"

namespace {

namespace fs = std::filesystem;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "checkpoint_fuzz: %s\n", what.c_str());
  std::abort();
}
void require(bool ok, const std::string& what) {
  if (!ok) fail(what);
}

/// A directory of this process's own, removed at exit: the loader reads files, not memory.
const fs::path& scratch() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("kvcache_checkpoint_fuzz." + std::to_string(::getpid()));
    fs::create_directories(d);
    std::atexit([] {
      std::error_code ignored;
      fs::remove_all(scratch(), ignored);
    });
    return d;
  }();
  return dir;
}

void write_file(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  require(static_cast<bool>(out.flush()), "cannot write " + path.string());
}

/// The loader's documented errors; anything else (std::bad_alloc, std::length_error from a
/// container, an out_of_range from a lookup) is not a clear refusal of the bytes.
template <class Call>
bool refused(const Call& call, const char* what) {
  try {
    call();
    return false;
  } catch (const qwen3::safetensors::Error& e) {
    require(e.what()[0] != '\0', std::string(what) + ": an empty message");
  } catch (const qwen3::json::Error& e) {
    require(e.what()[0] != '\0', std::string(what) + ": an empty message");
  } catch (const std::invalid_argument& e) {
    require(e.what()[0] != '\0', std::string(what) + ": an empty message");
  } catch (const std::exception& e) {
    fail(std::string(what) + ": an unclear exception: " + e.what());
  }
  return true;
}

void config_text(std::string_view text) {
  qwen3::Config c;
  if (refused([&] { c = qwen3::parse_config(text); }, "parse_config")) return;
  try {
    c.validate();
  } catch (const std::exception& e) {
    fail(std::string("parse_config returned a config that does not validate: ") + e.what());
  }
  // Written back and read again, it is the same decoder.
  const qwen3::Config again = qwen3::parse_config(qwen3::config_json(c));
  require(again.vocab == c.vocab && again.hidden == c.hidden && again.layers == c.layers &&
              again.q_heads == c.q_heads && again.kv_heads == c.kv_heads && again.head_dim == c.head_dim &&
              again.mlp == c.mlp && again.tied == c.tied && again.rms_eps == c.rms_eps &&
              again.rope_theta == c.rope_theta,
          "config_json(parse_config(text)) reads back as another config");
}

void safetensors_file(std::string_view bytes) {
  const fs::path path = scratch() / "fuzz.safetensors";
  write_file(path, bytes);
  std::optional<qwen3::safetensors::File> file;
  if (refused([&] { file.emplace(qwen3::safetensors::File::open(path)); }, "safetensors::File::open")) return;
  // Every tensor lies inside the data section, its bytes what its shape and dtype need, and the
  // tensors tile the section; so every read below is backed by the file.
  std::uint64_t covered = 0;
  for (const auto& t : file->tensors()) {
    require(t.begin <= t.end && t.end <= bytes.size(), "a tensor's offsets outside the file");
    require(t.end - t.begin == t.elements() * qwen3::safetensors::dtype_size(t.dtype), "a tensor's bytes");
    covered += t.end - t.begin;
    require(file->find(t.name) == &t, "find() gives another tensor of the same name");
  }
  require(covered <= bytes.size(), "tensors cover more than the file");
  for (const auto& t : file->tensors()) {
    std::vector<float> values(static_cast<std::size_t>(t.elements()));
    file->read(t, values);
    std::vector<float> short_buffer(values.size() + 1);
    require(refused([&] { file->read(t, short_buffer); }, "read into a buffer of another size"),
            "read() accepted a buffer of another size");
  }
}

void index_file(std::string_view bytes) {
  const fs::path path = scratch() / qwen3::detail::index_name;
  write_file(path, bytes);
  std::map<std::string, std::string> shards;
  if (refused([&] { shards = qwen3::detail::read_index(path); }, "read_index")) return;
  for (const auto& [tensor, shard] : shards) {
    const fs::path name(shard);
    require(!shard.empty() && name == name.filename() && name != "." && name != "..",
            "the index names a shard outside its directory: " + shard);
  }
}

void checkpoint_dir(std::string_view bytes) {
  if (bytes.size() < 2) return;
  const std::size_t config_bytes =
      std::min<std::size_t>(bytes.size() - 2, static_cast<unsigned char>(bytes[0]) |
                                                  static_cast<std::size_t>(static_cast<unsigned char>(bytes[1])) << 8);
  const fs::path dir = scratch() / "checkpoint";
  fs::create_directories(dir);
  write_file(dir / "config.json", bytes.substr(2, config_bytes));
  write_file(dir / "model.safetensors", bytes.substr(2 + config_bytes));
  qwen3::Weights w;
  if (refused([&] { w = qwen3::load_checkpoint(dir); }, "load_checkpoint")) return;
  qwen3::for_each_tensor(w, [&](const std::string& name, const auto& tensor, const std::vector<std::size_t>& shape) {
    require(qwen3::shape_of(tensor) == shape, "tensor " + name + " loaded in another shape than the config's");
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] % 4) {
    case 0:
      config_text(bytes);
      break;
    case 1:
      safetensors_file(bytes);
      break;
    case 2:
      index_file(bytes);
      break;
    default:
      checkpoint_dir(bytes);
      break;
  }
  return 0;
}
