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
#include "qwen3/json.hpp"
#include "qwen3/model.hpp"
#include "qwen3/safetensors.hpp"

namespace qwen3 {

namespace detail {

[[noreturn]] inline void config_error(const std::string& source, const std::string& message) {
  throw safetensors::Error(source + ": " + message);
}

/// `x` as the shortest decimal that reads back the same, without an exponent ("1000000").
inline std::string plain_number(double x) {
  std::array<char, 400> text{};  // fixed notation of the largest double has 309 digits
  const auto [end, ec] = std::to_chars(text.data(), text.data() + text.size(), x, std::chars_format::fixed);
  return ec == std::errc() ? std::string(text.data(), end) : std::to_string(x);
}

/// The rotary base of a config.json object: top-level "rope_theta" (Hugging Face before v5) or
/// "rope_parameters": {"rope_type": "default", "rope_theta": ...} (v5 on). Required, since a
/// default here would silently differ from the model's; std::invalid_argument if both are
/// given and disagree, safetensors::Error naming `source` for anything else.
inline double rope_theta(const json::Value& root, const std::string& source) {
  const auto fail = [&](const std::string& message) { config_error(source, message); };
  const auto number = [&](const json::Value* v, const char* key) -> const json::Value* {
    if (v != nullptr && !v->is_number()) fail(std::string(key) + ": expected a number, given " + v->describe());
    return v;
  };
  const json::Value* top = number(root.find("rope_theta"), "rope_theta");
  const json::Value* nested = nullptr;
  if (const json::Value* params = root.find("rope_parameters"); params != nullptr && !params->is_null()) {
    if (!params->is_object()) fail("rope_parameters: expected an object, given " + params->describe());
    if (const json::Value* type = params->find("rope_type");
        type != nullptr && (!type->is_string() || type->as_string() != "default")) {
      fail("rope_parameters.rope_type: expected \"default\" (scaled rotary embeddings are not implemented), given " +
           type->describe());
    }
    nested = number(params->find("rope_theta"), "rope_parameters.rope_theta");
    if (nested == nullptr) fail("rope_parameters.rope_theta: missing");
  }
  if (top == nullptr && nested == nullptr) {
    fail("rope_theta: missing (expected a top-level rope_theta or rope_parameters.rope_theta)");
  }
  if (top != nullptr && nested != nullptr && top->as_double() != nested->as_double()) {
    throw std::invalid_argument(source + ": rope_theta " + plain_number(top->as_double()) +
                                " and rope_parameters.rope_theta " + plain_number(nested->as_double()) +
                                " disagree: expected one rotary base");
  }
  return (top != nullptr ? top : nested)->as_double();
}

}  // namespace detail

/// Reads the decoder's shape from config.json text; safetensors::Error naming `source` and the
/// field for a missing, mistyped or unsupported one, std::invalid_argument for two rotary bases
/// that disagree (rope_theta and rope_parameters.rope_theta).
[[nodiscard]] inline Config parse_config(std::string_view text, const std::string& source = "config.json") {
  const auto fail = [&](const std::string& message) { detail::config_error(source, message); };
  json::Value root;
  try {
    root = json::parse(text);
  } catch (const json::Error& e) {
    fail(std::string("not valid JSON: ") + e.what());
  }
  if (!root.is_object()) fail(std::string("expected a JSON object, given ") + root.kind());
  const auto count = [&](const char* key) -> std::size_t {
    const json::Value* v = root.find(key);
    if (v == nullptr) fail(std::string(key) + ": missing");
    if (!v->is_uint() || v->as_uint() == 0)
      fail(std::string(key) + ": expected a positive integer, given " + v->describe());
    return static_cast<std::size_t>(v->as_uint());
  };
  const auto number = [&](const char* key, double fallback) -> double {
    const json::Value* v = root.find(key);
    if (v == nullptr) return fallback;
    if (!v->is_number()) fail(std::string(key) + ": expected a number, given " + v->describe());
    return v->as_double();
  };
  const auto flag = [&](const char* key, bool fallback) -> bool {
    const json::Value* v = root.find(key);
    if (v == nullptr || v->is_null()) return fallback;
    if (!v->is_bool()) fail(std::string(key) + ": expected true or false, given " + v->describe());
    return v->as_bool();
  };
  const auto require_string = [&](const char* key, const char* expected) {
    const json::Value* v = root.find(key);
    if (v != nullptr && (!v->is_string() || v->as_string() != expected)) {
      fail(std::string(key) + ": expected \"" + expected + "\" (this is a Qwen3 decoder), given " + v->describe());
    }
  };
  require_string("model_type", "qwen3");
  require_string("hidden_act", "silu");
  if (flag("attention_bias", false))
    fail("attention_bias: expected false (Qwen3 projections have no bias), given true");
  if (const json::Value* v = root.find("rope_scaling"); v != nullptr && !v->is_null()) {
    fail("rope_scaling: expected null (scaled rotary embeddings are not implemented), given " + std::string(v->kind()));
  }
  if (flag("use_sliding_window", false)) {
    fail("use_sliding_window: expected false (per-layer windows are not implemented; a window is a cache choice here)");
  }
  Config c;
  c.vocab = count("vocab_size");
  c.hidden = count("hidden_size");
  c.layers = count("num_hidden_layers");
  c.q_heads = count("num_attention_heads");
  // As Hugging Face's Qwen3Config reads them: null kv heads means one per query head (no
  // grouping), and an absent head_dim is its default 128, not hidden / heads as in Llama.
  const json::Value* kv_heads = root.find("num_key_value_heads");
  c.kv_heads = kv_heads != nullptr && !kv_heads->is_null() ? count("num_key_value_heads") : c.q_heads;
  c.head_dim = root.find("head_dim") != nullptr ? count("head_dim") : 128;
  c.mlp = count("intermediate_size");
  c.rms_eps = static_cast<float>(number("rms_norm_eps", 1e-6));
  c.rope_theta = detail::rope_theta(root, source);
  c.tied = flag("tie_word_embeddings", false);  // the Qwen3 configuration's default
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
  return c;
}

/// config.json text for `c`, with every field parse_config reads.
[[nodiscard]] inline std::string config_json(const Config& c) {
  std::ostringstream s;
  s.precision(17);
  s << "{\n  \"architectures\": [\"Qwen3ForCausalLM\"],\n  \"model_type\": \"qwen3\",\n  \"hidden_act\": \"silu\",\n"
    << "  \"attention_bias\": false,\n  \"vocab_size\": " << c.vocab << ",\n  \"hidden_size\": " << c.hidden
    << ",\n  \"num_hidden_layers\": " << c.layers << ",\n  \"num_attention_heads\": " << c.q_heads
    << ",\n  \"num_key_value_heads\": " << c.kv_heads << ",\n  \"head_dim\": " << c.head_dim
    << ",\n  \"intermediate_size\": " << c.mlp << ",\n  \"rms_norm_eps\": " << static_cast<double>(c.rms_eps)
    << ",\n  \"rope_theta\": " << c.rope_theta
    << ",\n  \"rope_scaling\": null,\n  \"tie_word_embeddings\": " << (c.tied ? "true" : "false") << "\n}\n";
  return s.str();
}

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
