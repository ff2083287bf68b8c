// SPDX-License-Identifier: Apache-2.0
// Writes the seed corpora of state_fuzz and checkpoint_fuzz: a state file saved from every
// variant x format (fuzz/state_fuzz_support.hpp's small caches), and config.json texts, small
// safetensors files, an index and a tiny checkpoint. Built on request (target fuzz_make_seeds):
//
//   cmake --build build/fuzz --target fuzz_make_seeds
//   build/fuzz/fuzz/fuzz_make_seeds fuzz/corpus

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "qwen3/checkpoint.hpp"
#include "qwen3/safetensors.hpp"
#include "state_fuzz_support.hpp"

namespace {

namespace fs = std::filesystem;
using namespace state_fuzz;

void write(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
std::string read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Qwen3-0.6B's config.json as Hugging Face publishes it.
constexpr const char* kQwen3Config = R"({
  "architectures": [
    "Qwen3ForCausalLM"
  ],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "initializer_range": 0.02,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}
)";

// The Hugging Face v5 form: the rotary base inside rope_parameters, kv heads null.
constexpr const char* kRopeParametersConfig =
    R"({"model_type":"qwen3","vocab_size":32,"hidden_size":16,"num_hidden_layers":2,"num_attention_heads":4,)"
    R"("num_key_value_heads":null,"head_dim":4,"intermediate_size":24,"rms_norm_eps":1e-5,)"
    R"("rope_parameters":{"rope_type":"default","rope_theta":10000.0},"tie_word_embeddings":false,)"
    R"("name":"\u00e9\ud83d\ude00\n","list":[1,-2.5e3,true,false,null,{}]})";

constexpr const char* kIndex = R"({"metadata":{"total_size":1234},"weight_map":{)"
                               R"("model.embed_tokens.weight":"model-00001-of-00002.safetensors",)"
                               R"("model.norm.weight":"model-00002-of-00002.safetensors"}})";

/// The tiny model a checkpoint seed holds: every tensor a few values.
qwen3::Config tiny() {
  return {.vocab = 8, .hidden = 4, .layers = 1, .q_heads = 2, .kv_heads = 1, .head_dim = 2, .mlp = 4};
}

}  // namespace

int main(int argc, char** argv) {
  const fs::path root = argc > 1 ? argv[1] : "fuzz/corpus";
  const fs::path state = root / "state_fuzz", checkpoint = root / "checkpoint_fuzz";
  fs::create_directories(state);
  fs::create_directories(checkpoint);

  // State seeds: the flags byte cycles through every mode; the target byte names the variant
  // and format the file was saved from, so that each loads into the fixed target.
  std::size_t i = 0;
  for (std::size_t v = 0; v < kVariants; ++v) {
    for (std::size_t f = 0; f < kFormats; ++f, ++i) {
      const std::string file = with_format_at(f, [&]<class T>() { return saved_state<T>(Variant(v)); });
      const std::string name = with_format_at(f, []<class T>() { return std::string(format_name<T>()); });
      std::string input;
      input += static_cast<char>(i % 16);
      input += static_cast<char>(v * kFormats + f);
      write(state / (std::string(kVariantNames[v]) + "_" + name), input + file);
    }
  }

  // Patch seeds: a seed file of each variant with three bytes changed past HEAD (flag 16).
  for (std::size_t v = 0; v < kVariants; ++v) {
    std::string input;
    input += '\x10';
    input += static_cast<char>(v * kFormats + v % kFormats);
    for (const std::size_t offset : {8 * v + 3, 64 * v + 40, 512 * v + 200}) {
      input += static_cast<char>(offset & 0xFF);
      input += static_cast<char>(offset >> 8);
      input += '\x01';
    }
    write(state / (std::string("patched_") + kVariantNames[v]), input);
  }

  // Checkpoint seeds: a mode byte, then the bytes.
  write(checkpoint / "config_qwen3_0_6b", std::string(1, '\0') + kQwen3Config);
  write(checkpoint / "config_tiny", std::string(1, '\0') + qwen3::config_json(tiny()));
  write(checkpoint / "config_rope_parameters", std::string(1, '\0') + kRopeParametersConfig);
  write(checkpoint / "index", std::string(1, '\2') + kIndex);

  const fs::path scratch = fs::temp_directory_path() / "kvcache_make_seeds";
  fs::create_directories(scratch);
  const std::vector<float> values = {1.0F, -2.5F, 0.125F, 3.0e-5F, 65504.0F, -0.0F};
  qwen3::safetensors::write(scratch / "a.safetensors",
                            {{"f32", qwen3::safetensors::Dtype::f32, {2, 3}, values},
                             {"f16", qwen3::safetensors::Dtype::f16, {3, 2}, values},
                             {"bf16", qwen3::safetensors::Dtype::bf16, {6}, values},
                             {"empty", qwen3::safetensors::Dtype::f32, {0, 4}, std::span<const float>()}},
                            {{"format", "pt"}});
  write(checkpoint / "safetensors_three_dtypes", std::string(1, '\1') + read(scratch / "a.safetensors"));
  qwen3::safetensors::write(scratch / "b.safetensors",
                            {{"scalar", qwen3::safetensors::Dtype::bf16, {}, std::span<const float>(values).first(1)}});
  write(checkpoint / "safetensors_scalar", std::string(1, '\1') + read(scratch / "b.safetensors"));

  qwen3::save_checkpoint(scratch / "tiny", qwen3::random_weights(tiny()), qwen3::safetensors::Dtype::f16);
  const std::string config = read(scratch / "tiny" / "config.json");
  std::string input(1, '\3');
  input += static_cast<char>(config.size() & 0xFF);
  input += static_cast<char>(config.size() >> 8);
  write(checkpoint / "checkpoint_tiny", input + config + read(scratch / "tiny" / "model.safetensors"));
  fs::remove_all(scratch);
  return 0;
}
