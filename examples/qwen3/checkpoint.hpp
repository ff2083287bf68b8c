// SPDX-License-Identifier: Apache-2.0
#pragma once

// A Hugging Face style checkpoint directory: config.json plus one or more .safetensors files
// with names such as model.layers.0.self_attn.q_proj.weight (F32, F16 or BF16), and when
// sharded model.safetensors.index.json saying which file holds which tensor.
//
//   qwen3::Model model(qwen3::load_checkpoint("path/to/Qwen3-0.6B"));
//   qwen3::save_checkpoint("tiny", qwen3::random_weights(qwen3::Config{}), qwen3::safetensors::Dtype::bf16);

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "qwen3/config.hpp"
#include "qwen3/config_file.hpp"
#include "qwen3/json.hpp"
#include "qwen3/model.hpp"
#include "qwen3/safetensors.hpp"

namespace qwen3 {

namespace detail {

inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw safetensors::Error(path.string() + ": cannot open the file");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// `dir` without "." or ".." or a trailing separator: messages name a directory by its
/// filename(), which is empty for "ckpt/" and "." for "ckpt/.". Canonical, so that ".." after
/// a symbolic link goes where the system would take it.
inline std::filesystem::path directory(const std::filesystem::path& dir) {
  const std::filesystem::path given = dir.empty() ? "." : dir;
  std::error_code ec;
  std::filesystem::path p = std::filesystem::weakly_canonical(given, ec);
  if (ec) p = given.lexically_normal();  // then opening the files reports the problem
  if (!p.has_filename() && p.has_relative_path()) p = p.parent_path();
  return p;
}

/// The index of a sharded checkpoint, beside its shards.
inline constexpr const char* index_name = "model.safetensors.index.json";

/// The weight_map of the index at `path`: tensor name -> shard file name. safetensors::Error
/// naming the index for malformed JSON or a shard that is not a file name beside it.
inline std::map<std::string, std::string> read_index(const std::filesystem::path& path) {
  const auto fail = [&](const std::string& message) { config_error(path.filename().string(), message); };
  json::Value root;
  try {
    root = json::parse(read_text(path));
  } catch (const json::Error& e) {
    fail(std::string("not valid JSON: ") + e.what());
  }
  if (!root.is_object()) fail(std::string("expected a JSON object, given ") + root.kind());
  const json::Value* map = root.find("weight_map");
  if (map == nullptr) fail("weight_map: missing");
  if (!map->is_object()) fail(std::string("weight_map: expected an object, given ") + map->kind());
  std::map<std::string, std::string> shards;
  for (const auto& [tensor, shard] : map->as_object()) {
    // A path with a directory in it would read outside the checkpoint; shards sit beside the index.
    const std::string where = "weight_map['" + tensor + "']: expected a file name in the same directory, given ";
    if (!shard.is_string()) fail(where + shard.describe());
    const std::filesystem::path name(shard.as_string());
    if (name.empty() || name != name.filename() || name == "." || name == "..") fail(where + shard.describe());
    shards.emplace(tensor, shard.as_string());
  }
  return shards;
}

}  // namespace detail

/// The Config in `dir`/config.json.
[[nodiscard]] inline Config load_config(const std::filesystem::path& dir) {
  const std::filesystem::path path = detail::directory(dir) / "config.json";
  return parse_config(detail::read_text(path), path.filename().string());
}

/// Every tensor of the model described by `dir`/config.json, from the .safetensors files that
/// `dir`/model.safetensors.index.json names (Hugging Face's sharded layout: each tensor read
/// from the shard its weight_map gives), or without an index from every .safetensors file in
/// `dir`. safetensors::Error, naming the file and the tensor, for a malformed file, a shard
/// missing, a tensor missing, found twice, elsewhere than the index says, not part of the
/// model, or of the wrong shape.
[[nodiscard]] inline Weights load_checkpoint(const std::filesystem::path& dir) {
  const std::filesystem::path folder = detail::directory(dir);
  const Config config = load_config(folder);
  std::error_code ec;
  const std::filesystem::path index_path = folder / detail::index_name;
  const bool indexed = std::filesystem::exists(index_path, ec);
  std::map<std::string, std::string> index;  // tensor -> shard; empty without an index
  if (indexed) index = detail::read_index(index_path);
  std::vector<std::filesystem::path> paths;
  if (indexed) {
    std::map<std::string, std::size_t> shards;  // file name -> tensors the index places there
    for (const auto& [tensor, shard] : index) ++shards[shard];
    for (const auto& [shard, tensors] : shards) {
      paths.push_back(folder / shard);
      if (!std::filesystem::exists(paths.back(), ec)) {
        throw safetensors::Error("shard " + shard + " named by " + detail::index_name + ": not found in " +
                                 folder.string() + " (the index places " + std::to_string(tensors) + " tensors there)");
      }
    }
  } else {
    for (const auto& entry : std::filesystem::directory_iterator(folder, ec)) {
      if (entry.path().extension() == ".safetensors") paths.push_back(entry.path());
    }
    if (ec) throw safetensors::Error(folder.string() + ": cannot list the directory (" + ec.message() + ")");
  }
  if (paths.empty()) throw safetensors::Error(folder.string() + ": no .safetensors files");
  std::sort(paths.begin(), paths.end());

  std::vector<safetensors::File> files;
  std::map<std::string, std::pair<std::size_t, const safetensors::TensorInfo*>> where;
  files.reserve(paths.size());  // `where` points into the files' tensor lists
  for (const auto& path : paths) files.push_back(safetensors::File::open(path));
  for (std::size_t f = 0; f < files.size(); ++f) {
    const std::string file = files[f].path().filename().string();
    for (const auto& info : files[f].tensors()) {
      if (indexed) {
        // The index was written from the shards: disagreeing, one of them is stale or damaged.
        const auto named = index.find(info.name);
        if (named == index.end()) {
          throw safetensors::Error(file + ": tensor '" + info.name + "': not in the weight_map of " +
                                   detail::index_name);
        }
        if (named->second != file) {
          throw safetensors::Error(file + ": tensor '" + info.name + "': " + detail::index_name + " places it in " +
                                   named->second);
        }
      }
      const auto [it, inserted] = where.emplace(info.name, std::make_pair(f, &info));
      if (!inserted) {
        throw safetensors::Error(file + ": tensor '" + info.name + "': also in " +
                                 files[it->second.first].path().filename().string());
      }
    }
  }
  for (const auto& [tensor, shard] : index) {
    if (!where.contains(tensor)) {
      throw safetensors::Error(std::string(detail::index_name) + ": tensor '" + tensor + "': not found in " + shard +
                               ", the shard the index places it in");
    }
  }

  // Every tensor config.json names must be in the files, in its shape, before anything is
  // allocated for it: sizes that no file backs are refused, not allocated. A config with more
  // layers than the files hold tensors misses one within the first where.size() + 1 layers.
  const Weights names{
      config, {}, std::vector<LayerWeights>(std::min<std::size_t>(config.layers, where.size() + 1)), {}, {}};
  for_each_tensor(names, [&](const std::string& name, const auto&, const std::vector<std::size_t>& expected) {
    const auto it = where.find(name);
    if (it == where.end()) {
      if (indexed) {
        throw safetensors::Error(std::string(detail::index_name) + ": tensor '" + name +
                                 "' not found in the weight_map");
      }
      std::string list;
      for (const auto& p : paths) {
        if (!list.empty()) list += ", ";
        list += p.filename().string();
      }
      throw safetensors::Error(folder.filename().string() + ": tensor '" + name + "' not found in " + list);
    }
    auto& [f, info] = it->second;
    const std::vector<std::uint64_t> want(expected.begin(), expected.end());
    if (info->shape != want) {
      throw safetensors::Error(files[f].path().filename().string() + ": tensor '" + name + "': shape " +
                               safetensors::shape_str(info->shape) + ", expected " + safetensors::shape_str(want) +
                               " from config.json");
    }
  });
  Weights w = Weights::zeros(config);
  for_each_tensor(w, [&](const std::string& name, auto& tensor, const std::vector<std::size_t>&) {
    const auto it = where.find(name);
    auto& [f, info] = it->second;
    files[f].read(*info, std::span<float>(tensor.data(), static_cast<std::size_t>(tensor.size())));
    where.erase(it);
  });
  // Tied checkpoints sometimes still carry lm_head.weight: tying means it is not read.
  if (config.tied) where.erase("lm_head.weight");
  if (!where.empty()) {
    const auto& [name, place] = *where.begin();
    throw safetensors::Error(files[place.first].path().filename().string() + ": tensor '" + name +
                             "': not part of a Qwen3 model with this config.json (" + std::to_string(where.size()) +
                             " such tensors)");
  }
  return w;
}

/// Writes `w` as `dir`/config.json plus safetensors in `dtype`, split over `shards` files
/// (model-00001-of-0000N.safetensors, or model.safetensors for one). Creates `dir`.
inline void save_checkpoint(const std::filesystem::path& dir, const Weights& w,
                            safetensors::Dtype dtype = safetensors::Dtype::f32, std::size_t shards = 1) {
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir / "config.json", std::ios::binary | std::ios::trunc);
    out << config_json(w.config);
    if (!out.flush()) throw safetensors::Error((dir / "config.json").string() + ": writing failed");
  }
  std::vector<safetensors::TensorToWrite> all;
  for_each_tensor(w, [&](const std::string& name, const auto& tensor, const std::vector<std::size_t>& shape) {
    all.push_back({name, dtype, std::vector<std::uint64_t>(shape.begin(), shape.end()),
                   std::span<const float>(tensor.data(), static_cast<std::size_t>(tensor.size()))});
  });
  shards = std::clamp<std::size_t>(shards, 1, all.size());
  for (std::size_t s = 0; s < shards; ++s) {
    const std::vector<safetensors::TensorToWrite> part(
        all.begin() + static_cast<std::ptrdiff_t>(s * all.size() / shards),
        all.begin() + static_cast<std::ptrdiff_t>((s + 1) * all.size() / shards));
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards);
    safetensors::write(dir / (shards == 1 ? std::string("model.safetensors") : std::string(name)), part,
                       {{"format", "pt"}});
  }
}

}  // namespace qwen3
