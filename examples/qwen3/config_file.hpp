// SPDX-License-Identifier: Apache-2.0
#pragma once

// A Hugging Face config.json for a Qwen3 decoder, read into a Config and written from one. No
// Eigen here: kvcache-bench reads a model's shape with it.
//
//   qwen3::Config c = qwen3::parse_config(text, "Qwen3-0.6B/config.json");

#include <array>
#include <charconv>
#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>

#include "qwen3/config.hpp"
#include "qwen3/json.hpp"
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

}  // namespace qwen3
