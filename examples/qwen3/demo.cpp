// SPDX-License-Identifier: Apache-2.0
// kvcache_demo: greedy generation with the tiny Qwen3 model, once recomputing the whole
// sequence for every token and once through each cache variant. Prints what each costs, that
// every cache gives the uncached logits, and how the costs grow with the number of new tokens.
//
//   kvcache_demo                               # defaults: random tiny model, ~10 s
//   kvcache_demo --prompt "Hello" -n 64 --type bf16 --window 16 --scaling none
//   kvcache_demo --save /tmp/tiny && kvcache_demo --weights /tmp/tiny
//   kvcache_demo --traffic                     # decode-step bytes: KV cache vs weights
//   kvcache_demo --cache fp8                   # logit error of an fp8 cache vs float and bf16

#include <unistd.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kvcache/concat_kv_cache.hpp"
#include "kvcache/formats.hpp"
#include "kvcache/kv_cache.hpp"
#include "kvcache/quantized.hpp"
#include "kvcache/ring_kv_cache.hpp"
#include "qwen3/checkpoint.hpp"
#include "qwen3/error_budget.hpp"
#include "qwen3/model.hpp"
#include "qwen3/safetensors.hpp"
#include "qwen3/traffic.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using qwen3::Matrix;
using qwen3::TokenId;

constexpr const char* usage = R"(usage: kvcache_demo [options]

Greedy generation with a tiny Qwen3 model, uncached and through each kvcache variant.

  --prompt TEXT         prompt, one token per byte (default "The cache changes nothing but speed.")
  --ids 1,2,3           token ids instead of a text prompt (for checkpoints with a real vocabulary)
  -n, --new-tokens N    tokens to generate (default 128)
  --window W            RingKvCache window (default 32; 0 leaves the ring out)
  --sinks S             RingKvCache sink positions (default 4)
  --type T              cache element type: float, double, half, bf16 (default float)
  --cache Q             also store K and V quantized: any quantized format by name (fp8_e4m3,
                        int8_rows, ...; a format with head scales has them calibrated on the
                        prompt), or fp8, fp8_heads, int8, int4; prints the logit error against
                        the float and bfloat16 caches, and the bytes of each
  --weights DIR         load DIR/config.json and DIR/*.safetensors instead of the random tiny model
  --seed S              seed of the random tiny model (default 2024)
  --scaling LIST        N values of the scaling table, comma-separated, or none (default 64,256,1024)
  --uncached-budget S   uncached scaling runs predicted to take longer are estimated, not run (default 5)
  --save DIR            write the tiny model to DIR as config.json + model.safetensors, then exit
  --save-dtype T        f32, bf16 or f16 for --save (default f32)
  --traffic             print one decode step's memory reads, KV cache vs weights, then exit
                        (the --weights config, or Qwen3-0.6B in BF16)
  --contexts LIST       contexts for --traffic (default 2048,8192,32768)
  --bytes-per-value B   value size for --traffic (default 2, BF16)
  -h, --help            this text
)";

struct Options {
  std::string prompt = "The cache changes nothing but speed.";
  std::vector<TokenId> ids;
  std::size_t new_tokens = 128;
  std::size_t window = 32;
  std::size_t sinks = 4;
  std::string type = "float";
  std::string cache;  // quantized format for the error report; empty: none
  std::string weights;
  std::uint64_t seed = 2024;
  std::vector<std::size_t> scaling = {64, 256, 1024};
  double uncached_budget = 5.0;
  std::string save;
  std::string save_dtype = "f32";
  bool traffic = false;
  std::vector<std::size_t> contexts = {2048, 8192, 32768};
  std::size_t bytes_per_value = 2;
};

/// The format --cache names: a format's own name, or one of the short names the demo always took.
std::string cache_format(const std::string& name) {
  if (name == "fp8") return "fp8_e4m3";
  if (name == "fp8_heads") return "fp8_e4m3_heads";
  if (name == "int8") return "int8_rows";
  if (name == "int4") return "int4_groups";
  return name;
}

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "kvcache_demo: %s\n\n%s", message.c_str(), usage);
  std::exit(2);
}

std::uint64_t parse_uint(const std::string& flag, const std::string& text) {
  std::size_t used = 0;
  unsigned long long v = 0;
  try {
    v = std::stoull(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty() || text[0] == '-')
    usage_error(flag + ": expected a number, given '" + text + "'");
  return v;
}

std::vector<std::size_t> parse_list(const std::string& flag, const std::string& text) {
  std::vector<std::size_t> out;
  if (text == "none") return out;
  std::size_t from = 0;
  while (from <= text.size()) {
    const std::size_t comma = std::min(text.find(',', from), text.size());
    out.push_back(static_cast<std::size_t>(parse_uint(flag, text.substr(from, comma - from))));
    from = comma + 1;
  }
  return out;
}

Options parse_options(int argc, char** argv) {
  Options o;
  const std::vector<std::string> args(argv + 1, argv + argc);
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i];
    std::optional<std::string> inline_value;
    if (const auto eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    }
    const auto value = [&]() -> std::string {
      if (inline_value) return *inline_value;
      if (i + 1 >= args.size()) usage_error(flag + ": expected a value");
      return args[++i];
    };
    if (flag == "-h" || flag == "--help") {
      std::fputs(usage, stdout);
      std::exit(0);
    } else if (flag == "--prompt") {
      o.prompt = value();
    } else if (flag == "--ids") {
      for (const std::size_t id : parse_list(flag, value())) o.ids.push_back(static_cast<TokenId>(id));
    } else if (flag == "-n" || flag == "--new-tokens") {
      o.new_tokens = static_cast<std::size_t>(parse_uint(flag, value()));
    } else if (flag == "--window") {
      o.window = static_cast<std::size_t>(parse_uint(flag, value()));
    } else if (flag == "--sinks") {
      o.sinks = static_cast<std::size_t>(parse_uint(flag, value()));
    } else if (flag == "--type") {
      o.type = value();
    } else if (flag == "--cache") {
      o.cache = value();
    } else if (flag == "--weights") {
      o.weights = value();
    } else if (flag == "--seed") {
      o.seed = parse_uint(flag, value());
    } else if (flag == "--scaling") {
      o.scaling = parse_list(flag, value());
    } else if (flag == "--uncached-budget") {
      o.uncached_budget = static_cast<double>(parse_uint(flag, value()));
    } else if (flag == "--save") {
      o.save = value();
    } else if (flag == "--save-dtype") {
      o.save_dtype = value();
    } else if (flag == "--traffic") {
      o.traffic = true;
    } else if (flag == "--contexts") {
      o.contexts = parse_list(flag, value());
    } else if (flag == "--bytes-per-value") {
      o.bytes_per_value = static_cast<std::size_t>(parse_uint(flag, value()));
    } else {
      usage_error("unknown option '" + args[i] + "'");
    }
  }
  if (o.new_tokens == 0) usage_error("--new-tokens: expected at least 1");
  if (o.save_dtype != "f32" && o.save_dtype != "bf16" && o.save_dtype != "f16") {
    usage_error("--save-dtype: expected f32, bf16 or f16, given '" + o.save_dtype + "'");
  }
  if (o.type != "float" && o.type != "double" && o.type != "half" && o.type != "bf16") {
    usage_error("--type: expected float, double, half or bf16, given '" + o.type + "'");
  }
  if (!o.cache.empty()) {
    bool quantized = false;
    try {
      quantized = kvcache::with_format(cache_format(o.cache), []<class T>() { return !kvcache::compute_type<T>; });
    } catch (const std::invalid_argument&) {
    }
    if (!quantized) usage_error("--cache: expected a quantized format's name, given '" + o.cache + "'");
  }
  return o;
}

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

std::string format_seconds(double s) {
  char buf[32];
  if (s < 1.0) {
    std::snprintf(buf, sizeof buf, "%.1f ms", s * 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f s", s);
  }
  return buf;
}

/// One status line on stderr for work that runs longer than a couple of seconds: rewritten in
/// place on a terminal, a line every few seconds otherwise.
class Progress {
 public:
  Progress(std::string label, std::size_t total) : label_(std::move(label)), total_(total) {}
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  ~Progress() {
    if (shown_ && tty_) std::fprintf(stderr, "\r\033[K");
  }

  void update(std::size_t done) {
    const double elapsed = seconds_since(start_);
    if (elapsed < 2.0 || elapsed - last_ < (tty_ ? 0.25 : 5.0)) return;
    last_ = elapsed;
    shown_ = true;
    std::fflush(stdout);  // keep the tables and the progress lines in order when both go to one file
    std::fprintf(stderr, tty_ ? "\r\033[K  %s: %zu/%zu tokens, %.1f s" : "  %s: %zu/%zu tokens, %.1f s\n",
                 label_.c_str(), done, total_, elapsed);
    std::fflush(stderr);
  }

 private:
  std::string label_;
  std::size_t total_;
  Clock::time_point start_ = Clock::now();
  double last_ = 0.0;
  bool shown_ = false;
  bool tty_ = ::isatty(::fileno(stderr)) != 0;
};

TokenId argmax(const Matrix& logits) {
  Eigen::Index best = 0;
  logits.row(logits.rows() - 1).maxCoeff(&best);
  return static_cast<TokenId>(best);
}

/// One generation: the tokens chosen, each step's logits, and what it cost.
struct Generation {
  std::string variant;
  std::vector<TokenId> tokens;
  std::vector<Matrix> logits;  // [1, vocab] per step, kept only when asked
  double seconds = 0.0;
  std::uint64_t positions = 0;  // token positions pushed through the layers
  std::size_t cache_bytes = 0;
};

/// Greedy decoding, recomputing the whole sequence (under `window`) for every new token.
template <class T>
Generation generate_uncached(qwen3::Model& model, const std::vector<TokenId>& prompt, std::size_t n,
                             qwen3::Window window, bool keep_logits, const std::string& name) {
  Generation g{name, {}, {}, 0.0, 0, 0};
  std::vector<TokenId> sequence = prompt;
  Progress progress(name, n);
  const auto start = Clock::now();
  for (std::size_t i = 0; i < n; ++i) {
    Matrix logits = model.forward_uncached<T>(sequence, window, qwen3::Logits::last);
    g.positions += sequence.size();
    const TokenId next = argmax(logits);
    g.tokens.push_back(next);
    if (keep_logits) g.logits.push_back(std::move(logits));
    sequence.push_back(next);
    progress.update(i + 1);
  }
  g.seconds = seconds_since(start);
  return g;
}

/// Greedy decoding through `cache`: the prompt once, then one token per step. The last
/// token chosen is not fed back: nothing would read its logits.
template <class Cache>
Generation generate_cached(qwen3::Model& model, Cache& cache, const std::vector<TokenId>& prompt, std::size_t n,
                           bool keep_logits, const std::string& name) {
  Generation g{name, {}, {}, 0.0, 0, 0};
  Progress progress(name, n);
  const auto start = Clock::now();
  Matrix logits = model.forward(prompt, cache, qwen3::Logits::last);
  g.positions += prompt.size();
  for (std::size_t i = 0; i < n; ++i) {
    const TokenId next = argmax(logits);
    g.tokens.push_back(next);
    if (keep_logits) g.logits.push_back(logits);
    if (i + 1 < n) {
      const TokenId one[] = {next};
      logits = model.forward(one, cache, qwen3::Logits::last);
      g.positions += 1;
    }
    progress.update(i + 1);
  }
  g.seconds = seconds_since(start);
  g.cache_bytes = cache.bytes();
  return g;
}

/// Compares `g` with `reference` step by step while both have fed the same tokens: once a
/// token differs, later logits belong to different inputs and comparing them means nothing.
struct Comparison {
  double max_diff = 0.0;
  std::size_t same_tokens = 0;  // leading tokens equal
};

Comparison compare(const Generation& g, const Generation& reference) {
  Comparison c;
  for (std::size_t i = 0; i < g.tokens.size() && i < reference.tokens.size(); ++i) {
    c.max_diff = std::max(c.max_diff, static_cast<double>((g.logits[i] - reference.logits[i]).cwiseAbs().maxCoeff()));
    if (g.tokens[i] != reference.tokens[i]) break;
    c.same_tokens = i + 1;
  }
  return c;
}

template <class T>
const char* type_name() {
  if constexpr (std::is_same_v<T, float>) return "float";
  if constexpr (std::is_same_v<T, double>) return "double";
  if constexpr (std::is_same_v<T, Eigen::half>) return "half";
  if constexpr (std::is_same_v<T, Eigen::bfloat16>) return "bf16";
}

/// How far cached logits may stray from the uncached ones (which round K and V to T too),
/// per unit of the largest |logit|: float rounding error scales with the values summed.
template <class T>
double tolerance() {
  if constexpr (std::is_same_v<T, Eigen::half>) return 2e-3;
  if constexpr (std::is_same_v<T, Eigen::bfloat16>) return 1e-2;
  return 1e-5;
}

kvcache::KvCacheConfig dense_config(const qwen3::Config& c, std::size_t capacity) {
  return {.layers = c.layers, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .capacity = capacity};
}

kvcache::KvCacheConfig ring_config(const qwen3::Config& c, const Options& o) {
  return {.layers = c.layers, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .window = o.window, .sinks = o.sinks};
}

std::string printable(const std::vector<TokenId>& tokens, std::size_t vocab) {
  std::string s;
  for (const TokenId t : tokens) {
    if (vocab != 256) {
      s += (s.empty() ? "" : " ") + std::to_string(t);
    } else if (t >= 0x20 && t < 0x7f && t != '\\') {
      s += static_cast<char>(t);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(t));
      s += buf;
    }
  }
  return s;
}

/// The main table: every variant generating the same N tokens; returns false if a cache
/// strayed from the uncached logits.
template <class T>
bool run_table(qwen3::Model& model, const std::vector<TokenId>& prompt, const Options& o) {
  const qwen3::Config& c = model.config();
  const std::size_t p = prompt.size();
  const std::size_t n = o.new_tokens;
  const std::string t = type_name<T>();
  const bool rounded = !std::is_same_v<T, float>;
  const std::string suffix = rounded ? " (K,V as " + t + ")" : "";
  const qwen3::Window window{o.window, o.sinks};
  const std::string window_text = "window " + std::to_string(o.window) + ", " + std::to_string(o.sinks) + " sinks";

  std::printf("\nGreedy generation: %zu prompt tokens, %zu new tokens, cache element type %s\n", p, n, t.c_str());
  // One untimed pass first, so that no row pays for first-touch page faults and cold caches.
  (void)model.forward_uncached<T>(prompt, {}, qwen3::Logits::last);
  std::vector<Generation> runs;
  std::vector<std::size_t> reference_of;

  runs.push_back(generate_uncached<T>(model, prompt, n, {}, true, "uncached" + suffix));
  reference_of.push_back(0);
  {
    kvcache::KvCache<T> cache(dense_config(c, p + n));
    runs.push_back(generate_cached(model, cache, prompt, n, true, "KvCache<" + t + ">"));
    reference_of.push_back(0);
  }
  {
    kvcache::ConcatKvCache<T> cache(dense_config(c, p + n));
    runs.push_back(generate_cached(model, cache, prompt, n, true, "ConcatKvCache<" + t + ">"));
    reference_of.push_back(0);
  }
  if (o.window != 0) {
    const std::size_t windowed = runs.size();
    runs.push_back(generate_uncached<T>(model, prompt, n, window, true, "uncached, " + window_text + suffix));
    reference_of.push_back(windowed);
    kvcache::RingKvCache<T> cache(ring_config(c, o));
    runs.push_back(generate_cached(model, cache, prompt, n, true, "RingKvCache<" + t + ">, " + window_text));
    reference_of.push_back(windowed);
  }

  std::printf("\n%-46s %6s %10s %10s %9s %13s %7s %11s\n", "variant", "new", "wall time", "positions", "speedup",
              "max |dlogit|", "same", "cache");
  std::printf("%-46s %6s %10s %10s %9s %13s %7s %11s\n", "", "tokens", "", "projected", "", "vs uncached", "tokens",
              "bytes");
  double largest = 1.0;  // the bound scales with the logits once they pass 1
  for (const Matrix& l : runs[0].logits) largest = std::max(largest, static_cast<double>(l.cwiseAbs().maxCoeff()));
  const double bound = tolerance<T>() * largest;
  bool ok = true;
  double worst = 0.0;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const Generation& g = runs[i];
    const Generation& ref = runs[reference_of[i]];
    char diff[32] = "reference";
    char same[32] = "";
    if (reference_of[i] != i) {
      const Comparison cmp = compare(g, ref);
      std::snprintf(diff, sizeof diff, "%.2e", cmp.max_diff);
      std::snprintf(same, sizeof same, "%zu/%zu", cmp.same_tokens, g.tokens.size());
      worst = std::max(worst, cmp.max_diff);
      ok = ok && cmp.max_diff <= bound;
    }
    const std::string bytes = g.cache_bytes == 0 ? "-" : qwen3::format_bytes(g.cache_bytes);
    std::printf("%-46s %6zu %10s %10llu %8.1fx %13s %7s %11s\n", g.variant.c_str(), g.tokens.size(),
                format_seconds(g.seconds).c_str(), static_cast<unsigned long long>(g.positions),
                ref.seconds / g.seconds, diff, same, bytes.c_str());
  }
  std::printf(
      "\npositions projected: uncached P + (P+1) + ... + (P+N-1) = %zu, cached P + N - 1 = %zu (P = %zu, N = %zu)\n",
      n * p + n * (n - 1) / 2, p + n - 1, p, n);
  const std::size_t shown = std::min<std::size_t>(runs[1].tokens.size(), 64);
  std::printf("generated (KvCache, first %zu tokens): \"%s\"\n", shown,
              printable({runs[1].tokens.begin(), runs[1].tokens.begin() + static_cast<std::ptrdiff_t>(shown)}, c.vocab)
                  .c_str());
  char rule[64];
  std::snprintf(rule, sizeof rule, "%.0e x max(1, largest |logit| %.2f)", tolerance<T>(), largest);
  if (ok) {
    std::printf("equivalence: OK: every cache variant matched its uncached reference, max |dlogit| %.2e <= %.2e = %s\n",
                worst, bound, rule);
  } else {
    std::printf("equivalence: FAILED: max |dlogit| %.2e > %.2e = %s\n", worst, bound, rule);
  }
  return ok;
}

/// Seconds of one uncached forward pass over `length` tokens (the best of two).
template <class T>
double uncached_pass(qwen3::Model& model, const std::vector<TokenId>& prompt, std::size_t length) {
  std::vector<TokenId> tokens = prompt;
  for (std::size_t i = tokens.size(); i < length; ++i) tokens.push_back(prompt[i % prompt.size()]);
  tokens.resize(length);
  double best = INFINITY;
  for (int repeat = 0; repeat < 2; ++repeat) {  // the faster of two: a one-off stall would skew the estimate
    const auto start = Clock::now();
    const Matrix logits = model.forward_uncached<T>(tokens, {}, qwen3::Logits::last);
    best = std::min(best, seconds_since(start));
    if (!std::isfinite(logits(0, 0))) std::fprintf(stderr, "non-finite logits\n");
  }
  return best;
}

/// The scaling table: how uncached and cached generation times grow with N.
template <class T>
void run_scaling(qwen3::Model& model, const std::vector<TokenId>& prompt, const Options& o) {
  if (o.scaling.empty()) return;
  const qwen3::Config& c = model.config();
  const std::size_t p = prompt.size();
  const std::string t = type_name<T>();
  std::printf(
      "\nScaling with N new tokens (P = %zu, %s): uncached projects N*P + N(N-1)/2 positions, cached P + N - 1\n", p,
      t.c_str());
  const Options ring = o.window == 0 ? Options{} : o;  // the ring left out of the table still scales here
  const std::string ring_name = "Ring w" + std::to_string(ring.window) + " s" + std::to_string(ring.sinks);
  std::printf("%7s  %18s %7s  %12s %7s  %14s %7s  %12s %7s\n", "N", "uncached", "growth", "KvCache", "growth",
              "ConcatKvCache", "growth", ring_name.c_str(), "growth");
  std::vector<double> previous(4, 0.0);
  bool estimated_any = false;
  for (const std::size_t n : o.scaling) {
    if (n == 0) continue;
    // The uncached loop's passes cost a + bL + cL^2 for L = P .. P+N-1: Simpson's rule on the
    // first, middle and last pass predicts the total exactly for such a cost.
    const double predicted =
        static_cast<double>(n) *
        (uncached_pass<T>(model, prompt, p) + 4 * uncached_pass<T>(model, prompt, p + (n - 1) / 2) +
         uncached_pass<T>(model, prompt, p + n - 1)) /
        6;
    double times[4];
    bool estimated = predicted > o.uncached_budget;
    times[0] = estimated ? predicted
                         : generate_uncached<T>(model, prompt, n, {}, false, "uncached N=" + std::to_string(n)).seconds;
    estimated_any = estimated_any || estimated;
    {
      kvcache::KvCache<T> cache(dense_config(c, p + n));
      times[1] = generate_cached(model, cache, prompt, n, false, "KvCache N=" + std::to_string(n)).seconds;
    }
    {
      kvcache::ConcatKvCache<T> cache(dense_config(c, p + n));
      times[2] = generate_cached(model, cache, prompt, n, false, "ConcatKvCache N=" + std::to_string(n)).seconds;
    }
    {
      kvcache::RingKvCache<T> cache(ring_config(c, ring));
      times[3] = generate_cached(model, cache, prompt, n, false, "RingKvCache N=" + std::to_string(n)).seconds;
    }
    char cells[4][2][32];
    for (int k = 0; k < 4; ++k) {
      std::snprintf(cells[k][0], sizeof cells[k][0], "%s%s%s", k == 0 && estimated ? "~" : "",
                    format_seconds(times[k]).c_str(), k == 0 && estimated ? " (est.)" : "");
      if (previous[static_cast<std::size_t>(k)] > 0) {
        std::snprintf(cells[k][1], sizeof cells[k][1], "x%.1f", times[k] / previous[static_cast<std::size_t>(k)]);
      } else {
        std::snprintf(cells[k][1], sizeof cells[k][1], "-");
      }
      previous[static_cast<std::size_t>(k)] = times[k];
    }
    std::printf("%7zu  %18s %7s  %12s %7s  %14s %7s  %12s %7s\n", n, cells[0][0], cells[0][1], cells[1][0], cells[1][1],
                cells[2][0], cells[2][1], cells[3][0], cells[3][1]);
  }
  if (estimated_any) {
    std::printf(
        "(est.: predicted from three timed uncached passes, as running it would exceed --uncached-budget %.0f s)\n",
        o.uncached_budget);
  }
  std::printf(
      "N x4: linear grows x4, quadratic x16. Uncached passes also attend over all L positions (L^2 each), so its "
      "total\n"
      "heads toward N^3; cached steps attend over the history (a + bL each), a little over linear until the ring's\n"
      "window caps L.\n");
}

/// The logit error of a quantized cache: the float KvCache's greedy tokens fed again,
/// teacher-forced, through float, bfloat16 and format Q caches (and rings, for a window).
template <class Q>
void run_quantized(qwen3::Model& model, const std::vector<TokenId>& prompt, const Options& o) {
  const qwen3::Config& c = model.config();
  const std::size_t p = prompt.size();
  std::vector<TokenId> tokens = prompt;
  {
    kvcache::KvCache<float> cache(dense_config(c, p + o.new_tokens));
    const Generation g = generate_cached(model, cache, prompt, o.new_tokens, false, "KvCache<float> for --cache");
    tokens.insert(tokens.end(), g.tokens.begin(), g.tokens.end());
  }
  const std::string q = kvcache::storage_codec<Q>::name;
  std::printf(
      "\nQuantized cache (--cache %s): the float KvCache's %zu tokens fed again through each cache, "
      "teacher-forced\n",
      o.cache.c_str(), tokens.size() - p);
  std::printf("%-44s %11s  %13s %9s %7s  %13s %9s %7s %8s\n", "cache", "bytes", "max |dlogit|", "mean KL", "top-1",
              "max |dlogit|", "mean KL", "top-1", "clipped");
  std::printf("%-44s %11s  %31s  %31s\n", "", "", "--------- vs float ---------", "--------- vs bf16 ----------");
  std::vector<qwen3::Window> windows = {{}};
  if (o.window != 0) windows.push_back({o.window, o.sinks});
  for (const qwen3::Window window : windows) {
    const std::string layout = window.size == 0 ? "KvCache<" : "RingKvCache<";
    const std::string suffix = window.size == 0 ? ">"
                                                : ">, " + std::string("window ") + std::to_string(window.size) + ", " +
                                                      std::to_string(window.sinks) + " sinks";
    qwen3::Forcing how{.prompt = p, .window = window};
    const qwen3::Decode as_float = qwen3::teacher_forced<float>(model, tokens, how);
    const qwen3::Decode as_bf16 = qwen3::teacher_forced<Eigen::bfloat16>(model, tokens, how);
    if constexpr (kvcache::detail::has_head_scales<Q>) {
      how.scales = qwen3::calibrated_scales<Q>(model, std::span<const TokenId>(tokens).first(p));
    }
    const qwen3::Decode quantized = qwen3::teacher_forced<Q>(model, tokens, how);
    const auto line = [&](const std::string& name, const qwen3::Decode& d, bool vs_float, bool vs_bf16) {
      const auto cells = [&](bool show, const qwen3::Decode& ref) {
        char buf[64] = "";
        if (show) {
          const qwen3::Drift dr = qwen3::drift(ref.logits, d.logits);
          std::snprintf(buf, sizeof buf, "%13.3g %9.2e %6.1f%%", dr.max_abs, dr.mean_kl, 100 * dr.top1);
        } else {
          std::snprintf(buf, sizeof buf, "%13s %9s %7s", "-", "-", "-");
        }
        return std::string(buf);
      };
      std::printf("%-44s %11s  %s  %s %8zu\n", name.c_str(), qwen3::format_bytes(d.bytes).c_str(),
                  cells(vs_float, as_float).c_str(), cells(vs_bf16, as_bf16).c_str(), d.clipped);
    };
    line(layout + "float" + suffix, as_float, false, true);
    line(layout + "bf16" + suffix, as_bf16, true, false);
    line(layout + q + suffix, quantized, true, true);
  }
  std::printf(
      "KL(reference || cache) of the softmax, nats, averaged over the steps; fp8_e4m3_heads' scales are the "
      "prompt's largest values (a float run) x 1.25.\n");
}

template <class T>
bool run(qwen3::Model& model, const std::vector<TokenId>& prompt, const Options& o) {
  const bool ok = run_table<T>(model, prompt, o);
  run_scaling<T>(model, prompt, o);
  return ok;
}

int demo(const Options& o) {
  if (o.traffic) {
    const qwen3::Config c = o.weights.empty() ? qwen3::Config::qwen3_0_6b() : qwen3::load_config(o.weights);
    std::fputs(qwen3::traffic_report(c, o.contexts, o.bytes_per_value).c_str(), stdout);
    return 0;
  }
  if (!o.save.empty()) {
    const auto dtype = o.save_dtype == "bf16"  ? qwen3::safetensors::Dtype::bf16
                       : o.save_dtype == "f16" ? qwen3::safetensors::Dtype::f16
                                               : qwen3::safetensors::Dtype::f32;
    qwen3::save_checkpoint(o.save, qwen3::random_weights(qwen3::Config{}, o.seed), dtype);
    std::printf("wrote %s/config.json and %s/model.safetensors (%s)\n", o.save.c_str(), o.save.c_str(),
                qwen3::safetensors::dtype_name(dtype));
    return 0;
  }
  const auto load_start = Clock::now();
  qwen3::Model model(o.weights.empty() ? qwen3::random_weights(qwen3::Config{}, o.seed)
                                       : qwen3::load_checkpoint(o.weights));
  const qwen3::Config& c = model.config();
  std::vector<TokenId> prompt = o.ids;
  if (prompt.empty()) {
    for (const char ch : o.prompt) prompt.push_back(static_cast<unsigned char>(ch));  // one token per byte
  }
  if (prompt.empty()) usage_error("the prompt is empty");
  std::printf(
      "kvcache demo: Qwen3-style decoder, %zu layers, hidden %zu, %zu q heads / %zu kv heads x %zu, MLP %zu, "
      "vocab %zu\n",
      c.layers, c.hidden, c.q_heads, c.kv_heads, c.head_dim, c.mlp, c.vocab);
  if (o.weights.empty()) {
    std::printf("weights: random (seed %llu; the text is noise, the point is that every variant agrees)\n",
                static_cast<unsigned long long>(o.seed));
  } else {
    std::printf("weights: %s (loaded in %s)\n", o.weights.c_str(), format_seconds(seconds_since(load_start)).c_str());
    if (o.ids.empty() && c.vocab != 256) {
      std::printf("note: no tokenizer here; the prompt's bytes are used as token ids (pass --ids for real ones)\n");
    }
  }
  std::printf("prompt: \"%s\"\n", printable(prompt, c.vocab).c_str());
  bool ok = false;
  if (o.type == "double") {
    ok = run<double>(model, prompt, o);
  } else if (o.type == "half") {
    ok = run<Eigen::half>(model, prompt, o);
  } else if (o.type == "bf16") {
    ok = run<Eigen::bfloat16>(model, prompt, o);
  } else {
    ok = run<float>(model, prompt, o);
  }
  if (!o.cache.empty()) {
    kvcache::with_format(cache_format(o.cache), [&]<class T>() {
      if constexpr (!kvcache::compute_type<T>) run_quantized<T>(model, prompt, o);
    });
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return demo(parse_options(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvcache_demo: %s\n", e.what());
    return 1;
  }
}
