// SPDX-License-Identifier: Apache-2.0
// kvcache_error_budget: the chapter's experiment on the random reference model. Fixed token
// ids, teacher-forced in two feeds (a prompt then one token a step; every token alone); every
// format against the float and the bfloat16 cache. Prints markdown tables (docs/quantization.md
// holds one run of each).
//
//   kvcache_error_budget                          # every shape, both feeds, 64 + 1000 tokens
//   kvcache_error_budget --shape qwen3 --window 256
//   kvcache_error_budget --table saturation       # what fp8_e4m3_heads' calibration costs
//   kvcache_error_budget --table bytes            # bytes a row of every format, head sizes 16-256

#include <Eigen/Core>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include "kvcache/calibration.hpp"
#include "kvcache/formats.hpp"
#include "kvcache/quantized.hpp"
#include "kvcache/size.hpp"
#include "qwen3/error_budget.hpp"
#include "qwen3/model.hpp"

namespace {

constexpr const char* usage = R"(usage: kvcache_error_budget [options]

  --table T     budget (default): every format against float and bfloat16, per shape and feed;
                saturation: fp8_e4m3_heads with scales calibrated several ways (--shape's first);
                bytes: bytes a row of every format at head sizes 16 to 256;
                sizes: Qwen3-0.6B's cache at 32k tokens in every format
  --shape S     tiny, d48, d64, qwen3 or all (default all)
  --feed F      prompt (the prompt in one update, then a token a step), token (every token
                alone) or both (default both)
  --prompt P    tokens before the first step compared (default 64)
  --steps N     teacher-forced steps compared, one token each (default 1000)
  --window W    also through a RingKvCache of this window (default 0: KvCache alone)
  --outliers F  scale a few K and V channels by F (the outsized channels trained models have)
)";

struct Options {
  std::string table = "budget";
  std::string shape = "all";
  std::string feed = "both";
  std::size_t prompt = 64;
  std::size_t steps = 1000;
  std::size_t window = 0;
  float outliers = 0.0F;
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
    if (flag == "--table") {
      o.table = value;
    } else if (flag == "--shape") {
      o.shape = value;
    } else if (flag == "--feed") {
      o.feed = value;
    } else if (flag == "--prompt") {
      o.prompt = static_cast<std::size_t>(number());
    } else if (flag == "--steps") {
      o.steps = static_cast<std::size_t>(number());
    } else if (flag == "--window") {
      o.window = static_cast<std::size_t>(number());
    } else if (flag == "--outliers") {
      o.outliers = static_cast<float>(number());
    } else {
      usage_error("unknown option '" + flag + "'");
    }
  }
  if (o.table != "budget" && o.table != "saturation" && o.table != "bytes" && o.table != "sizes")
    usage_error("--table: expected budget, saturation, bytes or sizes, given " + o.table);
  if (o.shape != "all") (void)qwen3::budget_shape(o.shape);  // throws for another name
  if (o.feed != "prompt" && o.feed != "token" && o.feed != "both")
    usage_error("--feed: expected prompt, token or both, given " + o.feed);
  if (o.prompt == 0 || o.steps == 0) usage_error("--prompt and --steps: expected at least 1");
  return o;
}

std::string cell(double v, const char* format) {
  char buf[32];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

std::string drift_cells(const qwen3::Drift& d) {
  return cell(d.max_abs, "%.3g") + " | " + cell(d.mean_kl, "%.2e") + " | " + cell(100 * d.top1, "%.1f%%");
}

std::vector<const qwen3::BudgetShape*> shapes_of(const Options& o) {
  std::vector<const qwen3::BudgetShape*> shapes;
  for (const qwen3::BudgetShape& s : qwen3::budget_shapes()) {
    if (o.shape == "all" || o.shape == s.name) shapes.push_back(&s);
  }
  return shapes;
}

std::vector<qwen3::Feed> feeds_of(const Options& o) {
  std::vector<qwen3::Feed> feeds;
  if (o.feed != "token") feeds.push_back(qwen3::Feed::prompt_then_decode);
  if (o.feed != "prompt") feeds.push_back(qwen3::Feed::token_by_token);
  return feeds;
}

/// Calls f.template operator()<T>() for bfloat16, then every quantized format (one an engine
/// does not compute in): the rows of every table.
template <class F>
void for_each_row(F&& f) {
  f.template operator()<Eigen::bfloat16>();
  kvcache::for_each_format([&]<class T>() {
    if constexpr (!kvcache::compute_type<T>) f.template operator()<T>();
  });
}

/// One budget row: format T against float and bfloat16 (none against itself for bfloat16).
template <class T>
void budget_row(qwen3::Model& model, const std::vector<qwen3::TokenId>& tokens, const qwen3::Forcing& how,
                const qwen3::Decode& as_float, const qwen3::Decode& as_bf16) {
  const std::string name = kvcache::format_name<T>();
  const qwen3::Config& c = model.config();
  const qwen3::Decode d = std::is_same_v<T, Eigen::bfloat16> ? as_bf16 : qwen3::teacher_forced<T>(model, tokens, how);
  const std::string vs_bf16 =
      std::is_same_v<T, Eigen::bfloat16> ? "- | - | -" : drift_cells(qwen3::drift(as_bf16.logits, d.logits));
  std::string cache = how.window.size == 0 ? "" : ", ring w" + std::to_string(how.window.size);
  std::printf("| %s%s | %s | %zu | %s | %s | %zu |\n", name.c_str(), cache.c_str(), qwen3::feed_name(how.feed),
              kvcache::kv_bytes_per_token<T>(c.layers, c.kv_heads, c.head_dim),
              drift_cells(qwen3::drift(as_float.logits, d.logits)).c_str(), vs_bf16.c_str(), d.clipped);
  std::fflush(stdout);
}

void budget(const Options& o) {
  for (const qwen3::BudgetShape* shape : shapes_of(o)) {
    qwen3::Model model(qwen3::budget_weights(shape->config, o.outliers));
    const qwen3::Config& c = model.config();
    const auto tokens = qwen3::budget_tokens(c, o.prompt + o.steps);
    // Head scales from another text of the same length, with the default margin.
    const auto calibration = qwen3::budget_tokens(c, o.prompt + o.steps, 8);
    std::printf("\n%s: %s, vocab %zu%s; %zu-token prompt, %zu teacher-forced steps compared\n\n", shape->name,
                shape->description, c.vocab,
                o.outliers > 0 ? (", outlier channels x" + cell(o.outliers, "%g")).c_str() : "", o.prompt, o.steps);
    std::printf(
        "| format | feed | bytes/token | vs float: max \\|dlogit\\| | mean KL | top-1 | vs bf16: max \\|dlogit\\| | "
        "mean KL | top-1 | clipped |\n");
    std::printf("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|\n");
    std::vector<qwen3::Window> windows = {{}};
    if (o.window != 0) windows.push_back({o.window, 0});
    for (const qwen3::Window window : windows) {
      for (const qwen3::Feed feed : feeds_of(o)) {
        qwen3::Forcing how{.prompt = o.prompt, .feed = feed, .window = window};
        const qwen3::Decode as_float = qwen3::teacher_forced<float>(model, tokens, how);
        const qwen3::Decode as_bf16 = qwen3::teacher_forced<Eigen::bfloat16>(model, tokens, how);
        for_each_row([&]<class T>() {
          qwen3::Forcing with = how;
          if constexpr (kvcache::detail::has_head_scales<T>)
            with.scales = qwen3::calibrated_scales<T>(model, calibration);
          budget_row<T>(model, tokens, with, as_float, as_bf16);
        });
      }
    }
  }
  std::printf(
      "\nKL(reference || format) of the softmax over the vocabulary, in nats, averaged over the steps; "
      "fp8_e4m3_heads' scales calibrated on another %zu-token text (margin %.2f).\n",
      o.prompt + o.steps, static_cast<double>(kvcache::kDefaultCalibrationMargin));
}

/// fp8_e4m3_heads with its scales calibrated on several texts and margins, against float: what a
/// scale that does not cover later values costs, next to fp8_e4m3's own row scales.
void saturation(const Options& o) {
  const qwen3::BudgetShape& shape = *shapes_of(o).front();
  qwen3::Model model(qwen3::budget_weights(shape.config, o.outliers));
  const qwen3::Config& c = model.config();
  const auto tokens = qwen3::budget_tokens(c, o.prompt + o.steps);
  const auto other = qwen3::budget_tokens(c, o.prompt + o.steps, 8);
  const std::span<const qwen3::TokenId> run(tokens);
  std::printf("\n%s: %s; %zu-token prompt, %zu steps; fp8_e4m3_heads against float\n\n", shape.name, shape.description,
              o.prompt, o.steps);
  std::printf("| scales | max \\|dlogit\\| | mean KL | top-1 | values clipped |\n|---|--:|--:|--:|--:|\n");
  struct Calibration {
    std::string what;
    std::span<const qwen3::TokenId> text;
    float margin;
  };
  const std::vector<Calibration> calibrations = {
      {"the run itself, margin 1 (an oracle)", run, 1.0F},
      {"another " + std::to_string(other.size()) + "-token text, margin 1.25 (the default)", other, 1.25F},
      {"another " + std::to_string(other.size()) + "-token text, margin 1", other, 1.0F},
      {"the " + std::to_string(o.prompt) + "-token prompt, margin 2", run.first(o.prompt), 2.0F},
      {"the " + std::to_string(o.prompt) + "-token prompt, margin 1", run.first(o.prompt), 1.0F},
      {"the first token, margin 1 (a first update's, fed token by token)", run.first(1), 1.0F},
      {"another text's first token, margin 1 (another request's first update)", std::span(other).first(1), 1.0F},
  };
  // Static scales do not depend on the feed: the first feed asked for stands for both.
  const qwen3::Forcing exact{.prompt = o.prompt, .feed = feeds_of(o).front()};
  const qwen3::Decode as_float = qwen3::teacher_forced<float>(model, tokens, exact);
  const qwen3::Decode rows = qwen3::teacher_forced<kvcache::fp8_e4m3>(model, tokens, exact);
  std::printf("| fp8_e4m3: a scale per row | %s | 0 |\n",
              drift_cells(qwen3::drift(as_float.logits, rows.logits)).c_str());
  for (const Calibration& k : calibrations) {
    qwen3::Forcing how = exact;
    how.scales = qwen3::calibrated_scales<kvcache::fp8_e4m3_heads>(model, k.text, k.margin);
    const qwen3::Decode d = qwen3::teacher_forced<kvcache::fp8_e4m3_heads>(model, tokens, how);
    std::printf("| %s | %s | %s |\n", k.what.c_str(), drift_cells(qwen3::drift(as_float.logits, d.logits)).c_str(),
                cell(100.0 * static_cast<double>(d.clipped) / static_cast<double>(d.values), "%.3f%%").c_str());
    std::fflush(stdout);
  }
}

/// Bytes of one stored row (K or V of one kv head and token) of format T at head size d, its
/// row scale included.
template <class T>
std::size_t row_bytes(std::size_t d) {
  return kvcache::kv_bytes_per_token<T>(1, 1, d) / 2;
}

template <class T>
void bytes_row(const char* name, const std::vector<std::size_t>& dims) {
  std::printf("| %s |", name);
  for (const std::size_t d : dims) {
    std::printf(" %zu (%.2f) |", row_bytes<T>(d), 8.0 * static_cast<double>(row_bytes<T>(d)) / static_cast<double>(d));
  }
  std::printf("\n");
}

void bytes() {
  const std::vector<std::size_t> dims = {16, 32, 48, 64, 80, 96, 128, 160, 192, 256};
  std::printf(
      "\nBytes a row (K or V of one kv head and token, its scales included) and, in brackets, bits a value:\n\n");
  std::printf("| format |");
  for (const std::size_t d : dims) std::printf(" D = %zu |", d);
  std::printf("\n|---|");
  for (std::size_t i = 0; i < dims.size(); ++i) std::printf("--:|");
  std::printf("\n");
  for_each_row([&]<class T>() { bytes_row<T>(kvcache::format_name<T>(), dims); });
  std::printf("\nfp8_e4m3_heads adds two floats per (layer, kv head) once, not per row.\n");
}

/// One format's bytes for Qwen3-0.6B's cache at 32k tokens (the chapter's formula).
template <class T>
void size_row(const char* name) {
  const qwen3::Config c = qwen3::Config::qwen3_0_6b();
  constexpr std::size_t tokens = 32768;
  const std::size_t per_token = kvcache::kv_bytes_per_token<T>(c.layers, c.kv_heads, c.head_dim);
  // Scales kept per (layer, kv head) rather than per token: K and V, a float each.
  const std::size_t head_scales = kvcache::detail::has_head_scales<T> ? 2 * c.layers * c.kv_heads * sizeof(float) : 0;
  const std::size_t total = per_token * tokens + head_scales;
  const std::size_t bf16 = kvcache::kv_bytes_per_token<Eigen::bfloat16>(c.layers, c.kv_heads, c.head_dim) * tokens;
  std::printf("| %s | %zu | %zu | %zu | %.3f GiB | %.3f |\n", name, row_bytes<T>(c.head_dim), per_token, head_scales,
              static_cast<double>(total) / static_cast<double>(1ULL << 30),
              static_cast<double>(total) / static_cast<double>(bf16));
}

void sizes() {
  std::printf("\nQwen3-0.6B (28 layers, 8 kv heads x 128) at 32,768 tokens, batch 1:\n\n");
  std::printf("| format | bytes/row | bytes/token (K+V, all layers) | head scales | at 32k | vs bf16 |\n");
  std::printf("|---|--:|--:|--:|--:|--:|\n");
  size_row<float>("float");
  for_each_row([]<class T>() { size_row<T>(kvcache::format_name<T>()); });
}

int run(const Options& o) {
  if (o.table == "budget") budget(o);
  if (o.table == "saturation") saturation(o);
  if (o.table == "bytes") bytes();
  if (o.table == "sizes") sizes();
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
