// SPDX-License-Identifier: Apache-2.0
// kvcache-bench: how a model's KV cache performs on this machine, as llama-bench is for a
// model. For each storage format, cache variant and context length it fills a cache to the
// context, then runs decode steps (an update of every layer, then attention of every layer, as
// an engine does) and prints per token: the update time, the decode attention time and what
// fraction of the machine's plain read of as many bytes it reaches, the bytes a token takes and
// the cache's bytes in all, and its time against ConcatKvCache's (the torch.cat pattern). It runs
// the caches through the C API (kvcache.h): the library's kernels compiled once, no Eigen.
//
//   kvcache-bench --config Qwen3-0.6B/config.json --formats bfloat16,fp8_e4m3 --context 1024,8192
//   kvcache-bench --layers 28 --q-heads 16 --kv-heads 8 --head-dim 128 --variants all --json

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvcache.h"
#include "qwen3/config_file.hpp"
#include "timing.hpp"

namespace {

using kvcache::bench::Clock;
using kvcache::bench::median;
using kvcache::bench::seconds_since;

constexpr const char* kUsage =
    R"(usage: kvcache-bench (--config config.json | --layers N --q-heads N --kv-heads N --head-dim N)
                     [--formats F,...|all] [--variants V,...|all] [--context N,...] [--decode N]
                     [--chunk N] [--window N] [--threads N] [--no-concat] [--json] [--quiet] [--help]

  --config PATH    a Hugging Face config.json of a Qwen3 model: its layers and heads
  --layers, --q-heads, --kv-heads, --head-dim   the model's shape, instead of --config
  --formats        storage formats (default bfloat16; all: every one the library has)
  --variants       kv, concat, ring, slot, paged or all (default kv)
  --context        context lengths a cache is filled to before decoding (default 1024,4096)
  --decode         decode steps timed at each context (default 16)
  --chunk          tokens an update writes while filling (default 512)
  --window         the ring's window (default: the whole context, as the others hold it)
  --threads        threads of attention and of the plain read (default 1; 0: automatic)
  --no-concat      skip the ConcatKvCache baseline (its column is then empty)
  --json           one JSON object per line on standard output instead of the table
  --quiet          no progress line on standard error
)";

/// A model's attention shape.
struct Model {
  std::size_t layers = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
};

struct Options {
  Model model;
  std::vector<kvcache_format> formats{KVCACHE_FORMAT_BFLOAT16};
  std::vector<kvcache_variant> variants{KVCACHE_VARIANT_KV};
  std::vector<std::size_t> contexts{1024, 4096};
  std::size_t decode = 16, chunk = 512, window = 0, threads = 1;
  bool concat = true, json = false, progress = true;
};

/// What one (format, variant, context) measured: seconds per token and bytes.
struct Result {
  kvcache_format format;
  kvcache_variant variant;
  std::size_t context = 0;
  double update = 0, attention = 0, read = 0;
  std::size_t bytes_per_token = 0, bytes = 0;
  double concat = 0;  // ConcatKvCache's update + attention time per token, 0 if not measured
};

[[noreturn]] void usage_error(const std::string& message) { throw std::invalid_argument(message); }

std::vector<std::string> split(std::string_view list) {
  std::vector<std::string> items;
  for (std::size_t at = 0; at <= list.size();) {
    const std::size_t comma = std::min(list.find(',', at), list.size());
    items.emplace_back(list.substr(at, comma - at));
    at = comma + 1;
  }
  return items;
}

std::size_t count(const std::string& flag, const std::string& text, bool zero_allowed = false) {
  std::size_t used = 0;
  unsigned long long value = 0;
  try {
    value = std::stoull(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty() || text[0] == '-' || (value == 0 && !zero_allowed)) {
    usage_error(flag + ": expected " + (zero_allowed ? "a count >= 0" : "a count > 0") + ", given \"" + text + "\"");
  }
  return static_cast<std::size_t>(value);
}

kvcache_variant variant_named(const std::string& name) {
  static constexpr std::pair<const char*, kvcache_variant> kNames[] = {{"kv", KVCACHE_VARIANT_KV},
                                                                       {"concat", KVCACHE_VARIANT_CONCAT},
                                                                       {"ring", KVCACHE_VARIANT_RING},
                                                                       {"slot", KVCACHE_VARIANT_SLOT},
                                                                       {"paged", KVCACHE_VARIANT_PAGED}};
  for (const auto& [flag, variant] : kNames)
    if (name == flag) return variant;
  usage_error("--variants: expected kv, concat, ring, slot, paged or all, given \"" + name + "\"");
}

Options parse(int argc, char** argv) {
  Options o;
  std::string config;
  bool shape_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(flag + ": expected a value after it");
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (flag == "--config") {
      config = value();
    } else if (flag == "--layers") {
      o.model.layers = count(flag, value()), shape_given = true;
    } else if (flag == "--q-heads") {
      o.model.q_heads = count(flag, value()), shape_given = true;
    } else if (flag == "--kv-heads") {
      o.model.kv_heads = count(flag, value()), shape_given = true;
    } else if (flag == "--head-dim") {
      o.model.head_dim = count(flag, value()), shape_given = true;
    } else if (flag == "--formats") {
      const std::string list = value();
      o.formats.clear();
      for (const std::string& name : split(list)) {
        if (name == "all") {
          for (int f = 0; f < KVCACHE_FORMAT_COUNT; ++f) o.formats.push_back(static_cast<kvcache_format>(f));
          continue;
        }
        kvcache_format format{};
        if (kvcache_format_from_name(name.c_str(), &format) != KVCACHE_OK)
          usage_error(std::string("--formats: ") + kvcache_last_error());
        o.formats.push_back(format);
      }
    } else if (flag == "--variants") {
      const std::string list = value();
      o.variants.clear();
      for (const std::string& name : split(list)) {
        if (name == "all") {
          for (int v = 0; v < KVCACHE_VARIANT_COUNT; ++v)
            if (v != KVCACHE_VARIANT_CONCAT) o.variants.push_back(static_cast<kvcache_variant>(v));
          continue;
        }
        o.variants.push_back(variant_named(name));
      }
    } else if (flag == "--context") {
      const std::string list = value();
      o.contexts.clear();
      for (const std::string& n : split(list)) o.contexts.push_back(count(flag, n));
    } else if (flag == "--decode") {
      o.decode = count(flag, value());
    } else if (flag == "--chunk") {
      o.chunk = count(flag, value());
    } else if (flag == "--window") {
      o.window = count(flag, value());
    } else if (flag == "--threads") {
      o.threads = count(flag, value(), true);
    } else if (flag == "--no-concat") {
      o.concat = false;
    } else if (flag == "--json") {
      o.json = true;
    } else if (flag == "--quiet") {
      o.progress = false;
    } else {
      usage_error("unknown flag \"" + flag + "\"");
    }
  }
  if (!config.empty() && shape_given) usage_error("--config and --layers/--q-heads/--kv-heads/--head-dim: give one");
  if (!config.empty()) {
    std::ifstream in(config, std::ios::binary);
    if (!in) throw std::runtime_error("--config: cannot open " + config);
    std::stringstream text;
    text << in.rdbuf();
    const qwen3::Config c = qwen3::parse_config(text.str(), config);
    o.model = {c.layers, c.q_heads, c.kv_heads, c.head_dim};
  } else {
    const Model& m = o.model;
    if (m.layers == 0 || m.q_heads == 0 || m.kv_heads == 0 || m.head_dim == 0) {
      usage_error("the model's shape: expected --config, or all of --layers, --q-heads, --kv-heads and --head-dim");
    }
  }
  if (o.model.q_heads % o.model.kv_heads != 0) {
    usage_error("--q-heads: expected a multiple of --kv-heads " + std::to_string(o.model.kv_heads) + ", given " +
                std::to_string(o.model.q_heads));
  }
  return o;
}

/// Throws std::runtime_error with the C API's message unless `status` is KVCACHE_OK.
void check(kvcache_status status, const char* call) {
  if (status != KVCACHE_OK) throw std::runtime_error(std::string(call) + ": " + kvcache_last_error());
}

/// A line on standard error rewritten in place while a case runs (when it is a terminal).
class Progress {
 public:
  explicit Progress(bool on) : on_(on && ::isatty(STDERR_FILENO) != 0) {}
  void show(const std::string& line) {
    if (!on_) return;
    std::fprintf(stderr, "\r%-100s", line.c_str());
    std::fflush(stderr);
  }
  void clear() {
    if (on_) std::fprintf(stderr, "\r%100s\r", "");
  }

 private:
  bool on_;
};

/// A cache (or a paged sequence and its pool) made through the C API, freed with it.
class Cache {
 public:
  Cache(kvcache_variant variant, kvcache_format format, const Model& m, std::size_t tokens, std::size_t window,
        float largest) {
    // A format with static head scales gets the scales that hold every value the run writes.
    if (const float scale = kvcache_head_scale(format, largest); scale > 0.0F) {
      scales_.assign(m.layers * m.kv_heads, scale);
    }
    const float* scales = scales_.empty() ? nullptr : scales_.data();
    if (variant == KVCACHE_VARIANT_PAGED) {
      const kvcache_pool_config config{m.layers, m.kv_heads, m.head_dim, 16, (tokens + 15) / 16 + 1, 0, scales, scales};
      check(kvcache_pool_create(format, &config, &pool_), "kvcache_pool_create");
      check(kvcache_pool_sequence(pool_, &cache_), "kvcache_pool_sequence");
      return;
    }
    kvcache_config config{};
    config.layers = m.layers;
    config.kv_heads = m.kv_heads;
    config.head_dim = m.head_dim;
    config.capacity = tokens;
    config.key_scales = config.value_scales = scales;
    if (variant == KVCACHE_VARIANT_RING) config.window = window == 0 ? tokens : window;
    check(kvcache_create(variant, format, &config, &cache_), "kvcache_create");
    if (variant == KVCACHE_VARIANT_SLOT) check(kvcache_acquire(cache_, &row_), "kvcache_acquire");
  }
  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;
  ~Cache() {
    kvcache_destroy(cache_);
    (void)kvcache_pool_destroy(pool_);
  }

  /// Writes k, v [1, kv_heads, T, head_dim] of `layer` at `positions`.
  void update(std::size_t layer, const kvcache_tensor& k, const kvcache_tensor& v, const std::int64_t* positions) {
    if (kvcache_variant_of(cache_) == KVCACHE_VARIANT_SLOT) {
      check(kvcache_update_rows(cache_, layer, &k, &v, positions, 0, &row_, 1), "kvcache_update_rows");
    } else {
      check(kvcache_update(cache_, layer, &k, &v, positions), "kvcache_update");
    }
  }
  void attention(std::size_t layer, const kvcache_tensor& q, const std::int64_t* positions, float* out,
                 std::size_t threads) {
    const kvcache_attention_options options{0.0F, 0, 0, threads};
    check(kvcache_attention(cache_, layer, &q, positions, 0, out, &options), "kvcache_attention");
  }
  [[nodiscard]] std::size_t bytes() const { return kvcache_bytes(cache_); }

 private:
  std::vector<float> scales_;
  kvcache_pool* pool_ = nullptr;
  kvcache_cache* cache_ = nullptr;
  std::size_t row_ = 0;
};

/// Fills a cache to `context` tokens, then times `decode` steps.
class Run {
 public:
  Run(const Options& o, Progress& progress) : o_(o), progress_(progress) {
    const Model& m = o.model;
    const std::size_t chunk = std::min(o.chunk, *std::max_element(o.contexts.begin(), o.contexts.end()));
    kv_ = kvcache::bench::normal_floats(chunk * m.kv_heads * m.head_dim, 1);
    q_ = kvcache::bench::normal_floats(m.q_heads * m.head_dim, 2);
    out_.resize(q_.size());
    for (const float x : kv_) largest_ = std::max(largest_, std::fabs(x) * 1.25F);
  }

  /// Seconds per token of `steps` decode steps after `context` tokens: update, attention, and a
  /// plain read of as many bytes as the attention read (with as many threads).
  Result measure(kvcache_format format, kvcache_variant variant, std::size_t context, std::size_t steps,
                 const std::string& label) {
    const Model& m = o_.model;
    Cache cache(variant, format, m, context + steps, o_.window, largest_);
    fill(cache, variant, context, label);
    Result r{format, variant, context};
    r.bytes_per_token = kvcache_bytes_per_token(format, m.layers, m.kv_heads, m.head_dim);
    std::vector<double> updates, attentions, reads;
    const kvcache_tensor q = kvcache_token_major(q_.data(), KVCACHE_DTYPE_F32, 1, m.q_heads, m.head_dim);
    const kvcache_tensor kv = kvcache_token_major(kv_.data(), KVCACHE_DTYPE_F32, 1, m.kv_heads, m.head_dim);
    for (std::size_t step = 0; step < steps; ++step) {
      progress_.show(label + ": decode step " + std::to_string(step + 1) + "/" + std::to_string(steps));
      const auto position = static_cast<std::int64_t>(context + step);
      double update = 0, attention = 0;
      for (std::size_t layer = 0; layer < m.layers; ++layer) {
        const auto start = Clock::now();
        cache.update(layer, kv, kv, &position);
        const auto written = Clock::now();
        cache.attention(layer, q, &position, out_.data(), o_.threads);
        update += std::chrono::duration<double>(written - start).count();
        attention += seconds_since(written);
      }
      updates.push_back(update);
      attentions.push_back(attention);
      reads.push_back(read(r.bytes_per_token * (context + step + 1)));
    }
    r.update = median(updates);
    r.attention = median(attentions);
    r.read = median(reads);
    r.bytes = cache.bytes();
    return r;
  }

 private:
  /// Writes positions [0, context) of every layer: a chunk at a time, or for ConcatKvCache (which
  /// copies its history on every update) in one update of the chunk's first token repeated.
  void fill(Cache& cache, kvcache_variant variant, std::size_t context, const std::string& label) {
    const Model& m = o_.model;
    const std::size_t chunk = variant == KVCACHE_VARIANT_CONCAT ? context : std::min(o_.chunk, context);
    std::vector<std::int64_t> positions(chunk);
    for (std::size_t done = 0; done < context;) {
      const std::size_t n = std::min(chunk, context - done);
      progress_.show(label + ": filling " + std::to_string(done) + "/" + std::to_string(context) + " tokens");
      std::iota(positions.begin(), positions.begin() + static_cast<std::ptrdiff_t>(n), static_cast<std::int64_t>(done));
      kvcache_tensor kv = kvcache_token_major(kv_.data(), KVCACHE_DTYPE_F32, n, m.kv_heads, m.head_dim);
      if (variant == KVCACHE_VARIANT_CONCAT) kv.token_stride = 0;
      for (std::size_t layer = 0; layer < m.layers; ++layer) cache.update(layer, kv, kv, positions.data());
      done += n;
    }
  }

  /// Seconds of a plain read of `bytes`, from a buffer written once (so that its pages are there)
  /// as large as the largest case needs.
  double read(std::size_t bytes) {
    const std::size_t floats = bytes / sizeof(float);
    if (buffer_.size() < floats) {
      const Model& m = o_.model;
      std::size_t largest = 0;
      for (const kvcache_format f : o_.formats) {
        largest = std::max(largest, kvcache_bytes_per_token(f, m.layers, m.kv_heads, m.head_dim));
      }
      const std::size_t tokens = *std::max_element(o_.contexts.begin(), o_.contexts.end()) + o_.decode;
      buffer_.assign(std::max(floats, largest * tokens / sizeof(float)), 1.0F);
    }
    const std::vector<std::pair<const float*, std::size_t>> all{{buffer_.data(), floats}};
    const std::size_t threads = o_.threads == 0 ? kvcache::detail::hardware_threads() : o_.threads;
    float sink = 0;
    const double seconds = kvcache::bench::time_call([&] { sink = kvcache::bench::read_all(all, threads); });
    sink_ = sink;
    return seconds;
  }

  const Options& o_;
  Progress& progress_;
  std::vector<float> kv_, q_, out_, buffer_;
  float largest_ = 0.0F;     // |K| and |V| the run writes, with a margin
  volatile float sink_ = 0;  // keeps the reads
};

std::string bytes_text(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  std::size_t u = 0;
  while (bytes >= 1024 && u + 1 < std::size(units)) bytes /= 1024, ++u;
  char text[32];
  std::snprintf(text, sizeof text, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return text;
}

void print_table(const Options& o, const std::vector<Result>& results) {
  const Model& m = o.model;
  std::printf("kvcache-bench: %zu layers, %zu query heads, %zu kv heads x %zu; %zu decode steps, %zu thread%s%s\n",
              m.layers, m.q_heads, m.kv_heads, m.head_dim, o.decode, o.threads, o.threads == 1 ? "" : "s",
              o.threads == 0 ? " (automatic)" : "");
  std::printf("%-14s %-14s %8s %14s %17s %7s %10s %11s %10s\n", "format", "variant", "context", "update us/tok",
              "attention us/tok", "vs read", "bytes/tok", "bytes", "vs concat");
  for (const Result& r : results) {
    char vs_concat[32] = "";
    if (r.concat > 0) std::snprintf(vs_concat, sizeof vs_concat, "%.1fx", r.concat / (r.update + r.attention));
    std::printf("%-14s %-14s %8zu %14.2f %17.2f %7.2f %10zu %11s %10s\n", kvcache_format_name(r.format),
                kvcache_variant_name(r.variant), r.context, r.update * 1e6, r.attention * 1e6,
                r.attention > 0 ? r.read / r.attention : 0.0, r.bytes_per_token,
                bytes_text(static_cast<double>(r.bytes)).c_str(), vs_concat);
  }
  std::printf(
      "update and attention: every layer's, per token (median of the steps); vs read: a plain read of as many\n"
      "bytes over the attention's time (1 is the machine's limit); vs concat: ConcatKvCache's update +\n"
      "attention time per token over this cache's\n");
}

void print_json(const Options& o, const std::vector<Result>& results) {
  const Model& m = o.model;
  for (const Result& r : results) {
    std::printf(
        "{\"format\": \"%s\", \"variant\": \"%s\", \"layers\": %zu, \"q_heads\": %zu, \"kv_heads\": %zu, "
        "\"head_dim\": %zu, \"context\": %zu, \"decode_steps\": %zu, \"threads\": %zu, "
        "\"update_seconds_per_token\": %.9g, \"attention_seconds_per_token\": %.9g, "
        "\"read_seconds\": %.9g, \"attention_vs_read\": %.6g, \"bytes_per_token\": %zu, \"bytes\": %zu, "
        "\"concat_seconds_per_token\": %.9g, \"vs_concat\": %.6g}\n",
        kvcache_format_name(r.format), kvcache_variant_name(r.variant), m.layers, m.q_heads, m.kv_heads, m.head_dim,
        r.context, o.decode, o.threads, r.update, r.attention, r.read, r.attention > 0 ? r.read / r.attention : 0.0,
        r.bytes_per_token, r.bytes, r.concat, r.concat > 0 ? r.concat / (r.update + r.attention) : 0.0);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "kvcache-bench: %s\n\n%s", e.what(), kUsage);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvcache-bench: %s\n", e.what());
    return 2;
  }
  try {
    Progress progress(o.progress);
    Run run(o, progress);
    std::vector<Result> results;
    const bool concat_listed =
        std::find(o.variants.begin(), o.variants.end(), KVCACHE_VARIANT_CONCAT) != o.variants.end();
    const std::size_t cases =
        o.formats.size() * o.contexts.size() * (o.variants.size() + (o.concat && !concat_listed ? 1 : 0));
    std::size_t done = 0;
    for (const kvcache_format format : o.formats) {
      for (const std::size_t context : o.contexts) {
        const auto label = [&](kvcache_variant variant) {
          return "[" + std::to_string(++done) + "/" + std::to_string(cases) + "] " + kvcache_format_name(format) + " " +
                 kvcache_variant_name(variant) + " " + std::to_string(context);
        };
        std::unique_ptr<Result> baseline;
        if (o.concat) {
          baseline = std::make_unique<Result>(
              run.measure(format, KVCACHE_VARIANT_CONCAT, context, o.decode, label(KVCACHE_VARIANT_CONCAT)));
        }
        for (const kvcache_variant variant : o.variants) {
          Result r = variant == KVCACHE_VARIANT_CONCAT && baseline
                         ? *baseline
                         : run.measure(format, variant, context, o.decode, label(variant));
          r.concat = baseline ? baseline->update + baseline->attention : 0.0;
          results.push_back(r);
          progress.clear();
          if (o.json) print_json(o, {r});
        }
      }
    }
    progress.clear();
    if (!o.json) print_table(o, results);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\nkvcache-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
