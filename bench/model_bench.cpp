// SPDX-License-Identifier: Apache-2.0
//
// End to end: the reference decoder generating N tokens through a KvCache, next to the same
// decoder recomputing the whole sequence for every token with no cache, in one benchmark.
//
// Both sides start from the same fixed prompt and pick each next token greedily, so they
// produce the same tokens. The cached side runs the prompt once, then one token per step; the
// uncached side runs the whole sequence so far for every new token. Its step at length L costs
// about a + bL + cL^2 (projections grow with L, attention with L^2), so past a budget the full
// uncached loop is not run: its total is derived from three measured steps (first, middle,
// last) by Simpson's rule, which is exact for a cost quadratic in L. Counters say which.
//
// Each side's figure is its fastest iteration (each step: the fastest of three), not the mean:
// the machine these run on is shared, and one burst of other work during a single long loop
// would otherwise be the whole figure.
//
// KVCACHE_BENCH_SMOKE=1 registers only tiny cases.

#include <benchmark/benchmark.h>

#include "bench_support.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// GCC 12 with -march=native reports Eigen's AVX-512 matrix-product packing as maybe-uninitialized
// (_mm512_undefined_ps is uninitialized on purpose); the warning is about the compiler's
// intrinsics header, not this code, and -Werror would stop the build on it.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <Eigen/Core>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include "kvcache/kvcache.hpp"
#include "qwen3/model.hpp"

namespace {

using kvcache::bench::Clock;
using kvcache::bench::seconds_since;
using kvcache::bench::smoke_mode;

/// A fixed prompt of byte tokens (the default model's vocabulary is bytes).
std::vector<qwen3::TokenId> prompt() {
  const std::string_view text = "The cache keeps what was computed.";
  return {text.begin(), text.end()};
}

qwen3::TokenId argmax(const qwen3::Matrix& logits) {
  Eigen::Index best = 0;
  logits.row(logits.rows() - 1).maxCoeff(&best);
  return static_cast<qwen3::TokenId>(best);
}

/// Seconds to generate `steps` tokens after the prompt through a fresh KvCache.
double cached_generation(qwen3::Model& model, std::size_t steps) {
  const qwen3::Config& c = model.config();
  std::vector<qwen3::TokenId> tokens = prompt();
  kvcache::KvCache<float> cache(
      {.layers = c.layers, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .capacity = tokens.size() + steps});
  const auto start = Clock::now();
  qwen3::TokenId next = argmax(model.forward(tokens, cache, qwen3::Logits::last));
  for (std::size_t i = 1; i < steps; ++i) {
    const qwen3::TokenId one[] = {next};
    next = argmax(model.forward(one, cache, qwen3::Logits::last));
  }
  benchmark::DoNotOptimize(next);
  return seconds_since(start);
}

/// Seconds to generate `steps` tokens after the prompt, recomputing the sequence every time.
double uncached_generation(qwen3::Model& model, std::size_t steps) {
  std::vector<qwen3::TokenId> tokens = prompt();
  const auto start = Clock::now();
  for (std::size_t i = 0; i < steps; ++i) {
    tokens.push_back(argmax(model.forward_uncached(tokens, {}, qwen3::Logits::last)));
  }
  benchmark::DoNotOptimize(tokens.data());
  return seconds_since(start);
}

/// Seconds of one uncached step over `length` tokens (the prompt, then fixed filler tokens):
/// the fastest of three.
double uncached_step(qwen3::Model& model, std::size_t length) {
  std::vector<qwen3::TokenId> tokens = prompt();
  for (std::size_t i = tokens.size(); i < length; ++i) tokens.push_back(static_cast<qwen3::TokenId>(32 + i % 90));
  tokens.resize(length);
  double best = std::numeric_limits<double>::infinity();
  for (int repeat = 0; repeat < 3; ++repeat) {
    const auto start = Clock::now();
    auto logits = model.forward_uncached(tokens, {}, qwen3::Logits::last);
    best = std::min(best, seconds_since(start));
    benchmark::DoNotOptimize(logits.data());
  }
  return best;
}

void generate(benchmark::State& state, std::size_t steps, bool full_uncached) {
  qwen3::Model model(qwen3::random_weights(qwen3::Config{}));
  const std::size_t p = prompt().size();
  // Lengths the uncached side runs over: p (the first token) to p + steps - 1 (the last).
  const std::size_t first = p;
  const std::size_t middle = p + (steps - 1) / 2;
  const std::size_t last = p + steps - 1;
  // Fastest iteration of each side.
  double cached = std::numeric_limits<double>::infinity();
  double uncached = std::numeric_limits<double>::infinity();
  double simpson = std::numeric_limits<double>::infinity();
  for (auto _ : state) {
    const double c = cached_generation(model, steps);
    const double u = full_uncached ? uncached_generation(model, steps) : 0;
    const double f0 = uncached_step(model, first);
    const double fm = uncached_step(model, middle);
    const double f1 = uncached_step(model, last);
    const double derived = static_cast<double>(steps) * (f0 + 4 * fm + f1) / 6;
    cached = std::min(cached, c);
    uncached = std::min(uncached, u);
    simpson = std::min(simpson, derived);
    state.SetIterationTime(c + u + f0 + fm + f1);
  }
  const auto n = static_cast<double>(steps);
  const double cached_total = cached;
  const double derived_total = simpson;
  const double uncached_total = full_uncached ? uncached : derived_total;
  const qwen3::Config& c = model.config();
  state.counters["N"] = n;
  state.counters["P"] = static_cast<double>(p);
  state.counters["layers"] = static_cast<double>(c.layers);
  state.counters["hidden"] = static_cast<double>(c.hidden);
  state.counters["uncached_full_loop"] = full_uncached ? 1 : 0;  // 0: uncached totals are derived
  state.counters["cached_tokens_per_s"] = n / cached_total;
  state.counters["uncached_tokens_per_s"] = n / uncached_total;
  state.counters["cached_total_ms"] = cached_total * 1e3;
  state.counters["uncached_total_ms"] = uncached_total * 1e3;
  state.counters["uncached_total_ms_derived"] = derived_total * 1e3;
  state.counters["cached_over_uncached"] = uncached_total / cached_total;  // speedup in tokens/s
}

}  // namespace

int main(int argc, char** argv) {
  return kvcache::bench::run_benchmarks(argc, argv, [] {
    const bool smoke = smoke_mode();
    const std::vector<std::size_t> steps =
        smoke ? std::vector<std::size_t>{4, 8} : std::vector<std::size_t>{64, 256, 1024};
    // The full uncached loop grows as N^3 through attention: a few seconds at N = 256, minutes at 1024.
    const std::size_t full_loop_limit = smoke ? 4 : 256;
    const qwen3::Config c;
    benchmark::AddCustomContext("kvcache_bench_mode", smoke ? "smoke (tiny shapes, not for figures)" : "full");
    benchmark::AddCustomContext(
        "kvcache_model", "qwen3 reference, random weights: layers=" + std::to_string(c.layers) +
                             " hidden=" + std::to_string(c.hidden) + " q_heads=" + std::to_string(c.q_heads) +
                             " kv_heads=" + std::to_string(c.kv_heads) + " head_dim=" + std::to_string(c.head_dim) +
                             " mlp=" + std::to_string(c.mlp) + " vocab=" + std::to_string(c.vocab));
    for (const std::size_t n : steps) {
      auto* b = benchmark::RegisterBenchmark(("model_generate/float/N:" + std::to_string(n)).c_str(), generate, n,
                                             n <= full_loop_limit)
                    ->UseManualTime()
                    ->Unit(benchmark::kMillisecond);
      // At least a few iterations even for the 2-second loop, so that "fastest" has a choice.
      if (!smoke) b->MinTime(4.0);
    }
  });
}
