// SPDX-License-Identifier: Apache-2.0
// kvcache_error_budget: the chapter's experiment on the random reference model. Fixed token
// ids, teacher-forced: a prompt, then one token a step; every quantized format against the
// bfloat16 and the float cache, with and without a sliding window. Prints a markdown table
// (docs/quantization.md holds one run of it).
//
//   kvcache_error_budget                        # tiny model, 64-token prompt, 1000 steps, window 256
//   kvcache_error_budget --model d128 --steps 1000 --window 256

#include <Eigen/Core>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include "kvcache/quantized.hpp"
#include "kvcache/size.hpp"
#include "qwen3/error_budget.hpp"
#include "qwen3/model.hpp"

namespace {

constexpr const char* usage = R"(usage: kvcache_error_budget [options]

  --model M     tiny (the tests' model: head_dim 32) or d128 (head_dim 128, 2 kv heads, hidden 256)
  --prompt P    prompt tokens, fed in one pass (default 64)
  --steps N     decode steps, one token each (default 1000)
  --window W    RingKvCache window for the second half of the table (default 256; 0 leaves it out)
  --seed S      seed of the weights (default 2024); the token ids come from seed 7
)";

struct Options {
  std::string model = "tiny";
  std::size_t prompt = 64;
  std::size_t steps = 1000;
  std::size_t window = 256;
  std::uint64_t seed = 2024;
};

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "kvcache_error_budget: %s\n\n%s", message.c_str(), usage);
  std::exit(2);
}

Options parse_options(int argc, char** argv) {
  Options o;
  const std::vector<std::string> args(argv + 1, argv + argc);
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& flag = args[i];
    if (flag == "-h" || flag == "--help") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    if (i + 1 >= args.size()) usage_error(flag + ": expected a value");
    const std::string& value = args[++i];
    const auto number = [&] {
      char* end = nullptr;
      const unsigned long long v = std::strtoull(value.c_str(), &end, 10);
      if (value.empty() || value[0] == '-' || *end != '\0') usage_error(flag + ": expected a number, given " + value);
      return v;
    };
    if (flag == "--model") {
      o.model = value;
    } else if (flag == "--prompt") {
      o.prompt = static_cast<std::size_t>(number());
    } else if (flag == "--steps") {
      o.steps = static_cast<std::size_t>(number());
    } else if (flag == "--window") {
      o.window = static_cast<std::size_t>(number());
    } else if (flag == "--seed") {
      o.seed = number();
    } else {
      usage_error("unknown option '" + flag + "'");
    }
  }
  if (o.model != "tiny" && o.model != "d128") usage_error("--model: expected tiny or d128, given " + o.model);
  if (o.prompt == 0 || o.steps == 0) usage_error("--prompt and --steps: expected at least 1");
  return o;
}

std::string cell(double v, const char* format) {
  char buf[32];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

/// One format's row: its drift against float and bfloat16 (none against itself for bfloat16).
template <class T>
void row(qwen3::Model& model, const std::vector<qwen3::TokenId>& tokens, const Options& o, qwen3::Window window,
         const qwen3::Decode& as_float, const qwen3::Decode& as_bf16, const char* name) {
  const qwen3::Config& c = model.config();
  const qwen3::Decode d =
      std::is_same_v<T, Eigen::bfloat16> ? as_bf16 : qwen3::teacher_forced<T>(model, tokens, o.prompt, window);
  const qwen3::Drift f = qwen3::drift(as_float.logits, d.logits);
  std::string vs_bf16 = "| - | - | -";
  if (!std::is_same_v<T, Eigen::bfloat16>) {
    const qwen3::Drift b = qwen3::drift(as_bf16.logits, d.logits);
    vs_bf16 = "| " + cell(b.max_abs, "%.3g") + " | " + cell(b.mean_kl, "%.2e") + " | " + cell(100 * b.top1, "%.1f%%");
  }
  const std::string cache = window.size == 0 ? "KvCache" : "RingKvCache w" + std::to_string(window.size);
  std::printf("| %s | %s | %zu | %s | %s | %s %s | %zu |\n", name, cache.c_str(),
              kvcache::kv_bytes_per_token<T>(c.layers, c.kv_heads, c.head_dim), cell(f.max_abs, "%.3g").c_str(),
              cell(f.mean_kl, "%.2e").c_str(), cell(100 * f.top1, "%.1f%%").c_str(), vs_bf16.c_str(), d.clipped);
  std::fflush(stdout);
}

/// One format's bytes for Qwen3-0.6B's cache at 32k tokens (the chapter's formula).
template <class T>
void size_row(const char* name) {
  const qwen3::Config c = qwen3::Config::qwen3_0_6b();
  constexpr std::size_t tokens = 32768;
  const std::size_t per_token = kvcache::kv_bytes_per_token<T>(c.layers, c.kv_heads, c.head_dim);
  // Scales kept per (layer, kv head) rather than per token: K and V, a float each.
  const std::size_t head_scales = kvcache::storage_codec<T>::row_scales && kvcache::detail::has_head_scales<T>
                                      ? 2 * c.layers * c.kv_heads * sizeof(float)
                                      : 0;
  const std::size_t total = per_token * tokens + head_scales;
  const std::size_t bf16 = kvcache::kv_bytes_per_token<Eigen::bfloat16>(c.layers, c.kv_heads, c.head_dim) * tokens;
  std::printf("| %s | %zu | %zu | %zu | %.3f GiB | %.3f |\n", name,
              kvcache::kv_bytes_per_token<T>(1, 1, c.head_dim) / 2, per_token, head_scales,
              static_cast<double>(total) / static_cast<double>(1ULL << 30),
              static_cast<double>(total) / static_cast<double>(bf16));
}

void print_sizes() {
  std::printf("\nQwen3-0.6B (28 layers, 8 kv heads x 128) at 32,768 tokens, batch 1:\n\n");
  std::printf("| format | bytes/row | bytes/token (K+V, all layers) | head scales | at 32k | vs bf16 |\n");
  std::printf("|---|--:|--:|--:|--:|--:|\n");
  size_row<float>("float");
  size_row<Eigen::bfloat16>("bfloat16");
  size_row<kvcache::fp8_e4m3>("fp8_e4m3");
  size_row<kvcache::int8_rows>("int8_rows");
  size_row<kvcache::int4_groups>("int4_groups");
}

int run(const Options& o) {
  qwen3::Config config;  // the tiny model the tests use
  if (o.model == "d128") {
    config = {.vocab = 256, .hidden = 256, .layers = 4, .q_heads = 4, .kv_heads = 2, .head_dim = 128, .mlp = 768};
  }
  qwen3::Model model(qwen3::random_weights(config, o.seed));
  qwen3::SplitMix64 rng(7);
  std::vector<qwen3::TokenId> tokens(o.prompt + o.steps);
  for (qwen3::TokenId& t : tokens) t = static_cast<qwen3::TokenId>(rng.next() % config.vocab);

  std::printf(
      "Random Qwen3 (%s: %zu layers, hidden %zu, %zu q / %zu kv heads x %zu, vocab %zu, seed %llu), "
      "%zu-token prompt, %zu teacher-forced decode steps\n\n",
      o.model.c_str(), config.layers, config.hidden, config.q_heads, config.kv_heads, config.head_dim, config.vocab,
      static_cast<unsigned long long>(o.seed), o.prompt, o.steps);
  std::printf(
      "| format | cache | bytes/token | vs float: max \\|dlogit\\| | mean KL | top-1 | vs bf16: max \\|dlogit\\| "
      "| mean KL | top-1 | clipped |\n");
  std::printf("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|\n");
  std::vector<qwen3::Window> windows = {{}};
  if (o.window != 0) windows.push_back({o.window, 0});
  for (const qwen3::Window window : windows) {
    const qwen3::Decode as_float = qwen3::teacher_forced<float>(model, tokens, o.prompt, window);
    const qwen3::Decode as_bf16 = qwen3::teacher_forced<Eigen::bfloat16>(model, tokens, o.prompt, window);
    row<Eigen::bfloat16>(model, tokens, o, window, as_float, as_bf16, "bfloat16");
    row<kvcache::fp8_e4m3>(model, tokens, o, window, as_float, as_bf16, "fp8_e4m3");
    row<kvcache::int8_rows>(model, tokens, o, window, as_float, as_bf16, "int8_rows");
    row<kvcache::int4_groups>(model, tokens, o, window, as_float, as_bf16, "int4_groups");
  }
  std::printf(
      "\nKL(reference || format) of the softmax over the vocabulary, in nats, averaged over the steps; "
      "fp8_e4m3 scales set from the prompt (the first update).\n");
  print_sizes();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_options(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvcache_error_budget: %s\n", e.what());
    return 1;
  }
}
