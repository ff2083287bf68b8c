// SPDX-License-Identifier: Apache-2.0
// Block stores (docs/store.md), each side timed in turn inside one iteration:
//
// - PrefixReuse/<backend>: a 1,024-token prompt prefix of a Qwen3-0.6B-shaped model (28 layers,
//   8 kv heads x 128, bfloat16 blocks of 16 tokens: 64 blocks of 1.75 MiB) that another process
//   saved, reused from the store (reuse_prefix, then the prompt's last token fed for its logits),
//   against recomputing it: the reference model's prefill of the whole prompt, at that shape.
//   Both into one long-lived pool whose blocks were all taken by other tokens in between. `reuse_vs_recompute` is the
//   reuse's median time over the prefill's; `save_vs_recompute` the time of save_prefix writing the 64 blocks to a
//   store that holds none of them (the write-through an engine pays once per new prefix).
// - StoreFetch/<backend>: the same 64 records read by the backend's get(), and fetched by
//   reuse_prefix (get, verification, copy into the pool's blocks), against a plain read of the
//   same bytes: read(2) of the same files (file; `cold`: each file evicted from the page cache
//   first), a pipelined GET of the same keys through hiredis (redis). Counters are GiB/s and the
//   ratios get_vs_plain and reuse_vs_plain.
//
// The file backend writes under $KVCACHE_STORE_BENCH_DIR (else the system's temporary
// directory); the Redis backend uses the server at 127.0.0.1:$KVCACHE_REDIS_PORT (bench/run.sh
// starts one) and deletes its keys afterwards.
//
//   build/release/bench/store_bench --benchmark_filter=PrefixReuse
//   KVCACHE_REDIS_PORT=6379 build/release/bench/store_bench --benchmark_filter=StoreFetch

#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include "bench_support.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

// GCC 12 with -march=native reports Eigen's AVX-512 matrix-product packing as maybe-uninitialized
// (_mm512_undefined_ps is uninitialized on purpose); see model_bench.cpp.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <Eigen/Core>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include "kvcache/file_block_store.hpp"
#include "kvcache/kvcache.hpp"
#include "qwen3/model.hpp"
#if defined(KVCACHE_BENCH_REDIS)
#include "kvcache/redis_block_store.hpp"
#endif

namespace {

using kvcache::bench::median;
using kvcache::bench::normal_floats;
using kvcache::bench::smoke_mode;
using kvcache::bench::time_call;
using T = Eigen::bfloat16;

constexpr std::size_t kBlock = 16;

/// The model's shape: Qwen3-0.6B's, or the tiny default in the smoke run.
qwen3::Config shape() { return smoke_mode() ? qwen3::Config{} : qwen3::Config::qwen3_0_6b(); }
std::size_t prompt_tokens() { return smoke_mode() ? 64 : 1024; }

std::vector<kvcache::TokenId> fixed_prompt(std::size_t n, std::size_t vocab) {
  std::vector<kvcache::TokenId> ids(n);
  qwen3::SplitMix64 rng(56);
  for (auto& id : ids) id = static_cast<kvcache::TokenId>(rng.next() % vocab);
  return ids;
}

kvcache::BlockPoolConfig pool_config(const qwen3::Config& c, std::size_t tokens) {
  return {.layers = c.layers,
          .kv_heads = c.kv_heads,
          .head_dim = c.head_dim,
          .block_tokens = kBlock,
          .blocks = tokens / kBlock + 1};
}

/// Fills every block of `pool` with tokens whose ids no one gave, which keys none: its blocks are
/// then free and unkeyed, as in a long-running engine whose other prompts have evicted a prefix.
void forget_prefixes(kvcache::BlockPool<T>& pool) {
  const std::size_t tokens = pool.blocks() * pool.block_tokens();
  const std::vector<float> zeros(pool.kv_heads() * tokens * pool.head_dim(), 0.0F);
  const kvcache::TensorView<const float> view(zeros.data(), {1, pool.kv_heads(), tokens, pool.head_dim()});
  kvcache::PagedKvCache<T> filler(pool);
  for (std::size_t l = 0; l < pool.layers(); ++l)
    (void)filler.update(l, view, view, kvcache::next_positions(0, tokens));
}

std::filesystem::path bench_dir() {
  const char* dir = std::getenv("KVCACHE_STORE_BENCH_DIR");
  return (dir != nullptr && *dir != '\0' ? std::filesystem::path(dir) : std::filesystem::temp_directory_path()) /
         ("kvcache_store_bench." + std::to_string(::getpid()));
}

/// A backend: stores of a model id, where they keep records, and the plain read they are
/// measured against.
struct Files {
  std::filesystem::path dir = bench_dir();
  bool cold = false;
  Files() { std::filesystem::create_directories(dir); }
  Files(const Files&) = delete;
  Files& operator=(const Files&) = delete;
  ~Files() {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
  [[nodiscard]] std::unique_ptr<kvcache::FileBlockStore> store(const std::string& model) const {
    return std::make_unique<kvcache::FileBlockStore>(kvcache::FileBlockStoreConfig{dir, model});
  }
  /// Every record file: their keys from their names.
  [[nodiscard]] std::vector<std::filesystem::path> records() const {
    std::vector<std::filesystem::path> paths;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
      if (entry.is_regular_file() && entry.path().extension() == ".kvblock") paths.push_back(entry.path());
    }
    return paths;
  }
  /// Syncs the records and, for a cold read, drops them from the page cache (a hint).
  void before_read() const {
    for (const auto& path : records()) {
      const int fd = ::open(path.c_str(), O_RDONLY);
      ::fsync(fd);
      if (cold) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
    }
  }
  /// read(2) of every record file into `buffer`; the bytes read.
  std::size_t plain_read(std::vector<char>& buffer) const {
    std::size_t total = 0;
    for (const auto& path : records()) {
      const int fd = ::open(path.c_str(), O_RDONLY);
      for (ssize_t n; (n = ::read(fd, buffer.data(), buffer.size())) > 0;) total += static_cast<std::size_t>(n);
      ::close(fd);
    }
    benchmark::DoNotOptimize(buffer.data());
    return total;
  }
  [[nodiscard]] std::vector<kvcache::BlockKey> keys() const {
    std::vector<kvcache::BlockKey> keys;
    for (const auto& path : records()) keys.push_back(key_of_hex(path.stem().string()));
    return keys;
  }
  static kvcache::BlockKey key_of_hex(const std::string& hex) {
    kvcache::BlockKey key;
    for (std::size_t i = 0; i < key.bytes.size(); ++i)
      key.bytes[i] = static_cast<std::uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
    return key;
  }
  [[nodiscard]] std::string missing() const { return {}; }
};

#if defined(KVCACHE_BENCH_REDIS)
struct Redis {
  int port = [] {
    const char* p = std::getenv("KVCACHE_REDIS_PORT");
    return p != nullptr ? std::atoi(p) : 0;
  }();
  std::string prefix = "kvcache-bench:" + std::to_string(::getpid()) + ":";
  bool cold = false;
  Redis() = default;
  Redis(const Redis&) = delete;
  Redis& operator=(const Redis&) = delete;
  ~Redis() {
    if (port == 0) return;
    const std::vector<std::string> names = scan();
    redisContext* c = redisConnect("127.0.0.1", port);
    for (const std::string& name : names) freeReplyObject(redisCommand(c, "DEL %b", name.data(), name.size()));
    redisFree(c);
  }
  [[nodiscard]] std::unique_ptr<kvcache::RedisBlockStore> store(const std::string& model) const {
    return std::make_unique<kvcache::RedisBlockStore>(
        kvcache::RedisBlockStoreConfig{.port = port, .model = model, .key_prefix = prefix});
  }
  [[nodiscard]] std::vector<std::string> scan() const {
    std::vector<std::string> names;
    redisContext* c = redisConnect("127.0.0.1", port);
    std::string cursor = "0";
    do {
      auto* r =
          static_cast<redisReply*>(redisCommand(c, "SCAN %s MATCH %s* COUNT 1000", cursor.c_str(), prefix.c_str()));
      cursor.assign(r->element[0]->str, static_cast<std::size_t>(r->element[0]->len));
      for (std::size_t i = 0; i < r->element[1]->elements; ++i)
        names.emplace_back(r->element[1]->element[i]->str, static_cast<std::size_t>(r->element[1]->element[i]->len));
      freeReplyObject(r);
    } while (cursor != "0");
    redisFree(c);
    return names;
  }
  void before_read() const {}
  /// A pipelined GET of every record through hiredis, the replies dropped; the bytes read.
  std::size_t plain_read(std::vector<char>&) const {
    const std::vector<std::string> names = scan();
    redisContext* c = redisConnect("127.0.0.1", port);
    for (const std::string& name : names) redisAppendCommand(c, "GET %b", name.data(), name.size());
    std::size_t total = 0;
    for (std::size_t i = 0; i < names.size(); ++i) {
      void* reply = nullptr;
      if (redisGetReply(c, &reply) != REDIS_OK) break;
      total += static_cast<std::size_t>(static_cast<redisReply*>(reply)->len);
      freeReplyObject(reply);
    }
    redisFree(c);
    return total;
  }
  [[nodiscard]] std::vector<kvcache::BlockKey> keys() const {
    std::vector<kvcache::BlockKey> keys;
    for (const std::string& name : scan()) keys.push_back(Files::key_of_hex(name.substr(prefix.size())));
    return keys;
  }
  [[nodiscard]] std::string missing() const {
    return port == 0 ? "KVCACHE_REDIS_PORT is not set (bench/run.sh starts a server)" : std::string();
  }
};
#endif

/// Args: none (the shape is Qwen3-0.6B's).
template <class Backend>
void BM_PrefixReuse(benchmark::State& state) {
  Backend backend;
  if (const std::string why = backend.missing(); !why.empty()) return state.SkipWithError(why.c_str());
  const qwen3::Config c = shape();
  qwen3::Model model(qwen3::random_weights(c));
  const std::size_t tokens = prompt_tokens();
  const std::vector<kvcache::TokenId> prompt = fixed_prompt(tokens, c.vocab);
  auto store = backend.store("qwen3-bench");
  {  // another process's prefill, saved
    kvcache::BlockPool<T> pool(pool_config(c, tokens));
    kvcache::PagedKvCache<T> seq(pool);
    (void)seq.reuse_prefix(prompt);
    (void)model.forward(prompt, seq, qwen3::Logits::last);
    if (!seq.save_prefix(*store).error.empty()) return state.SkipWithError("the first save failed");
  }
  std::vector<double> recompute, reuse, fetch, save;
  int round = 0;
  kvcache::BlockPool<T> pool(pool_config(c, tokens));  // long-lived, as an engine's
  for (auto _ : state) {
    forget_prefixes(pool);
    {
      kvcache::PagedKvCache<T> seq(pool);
      recompute.push_back(time_call([&] {
        (void)seq.reuse_prefix(prompt);
        benchmark::DoNotOptimize(model.forward(prompt, seq, qwen3::Logits::last).data());
      }));
      auto fresh = backend.store("qwen3-bench-" + std::to_string(round++));  // holds none of the blocks
      kvcache::PrefixSave saved;
      save.push_back(time_call([&] { saved = seq.save_prefix(*fresh); }));
      if (saved.written != tokens / kBlock) return state.SkipWithError(("save: " + saved.error).c_str());
    }
    forget_prefixes(pool);
    backend.before_read();
    kvcache::PagedKvCache<T> seq(pool);
    kvcache::PrefixReuse hit;
    reuse.push_back(time_call([&] {
      fetch.push_back(time_call([&] { hit = seq.reuse_prefix(prompt, *store); }));
      benchmark::DoNotOptimize(model.forward(std::span(prompt).subspan(hit.tokens), seq, qwen3::Logits::last).data());
    }));
    if (hit.store_blocks != tokens / kBlock) return state.SkipWithError(("reuse: " + hit.error).c_str());
    state.SetIterationTime(reuse.back());
  }
  state.counters["recompute_s"] = median(recompute);
  state.counters["reuse_s"] = median(reuse);
  state.counters["fetch_s"] = median(fetch);
  state.counters["save_s"] = median(save);
  state.counters["reuse_vs_recompute"] = median(reuse) / median(recompute);
  state.counters["save_vs_recompute"] = median(save) / median(recompute);
}

/// Args: cold (1: records evicted from the page cache before each read; the file backend).
template <class Backend>
void BM_StoreFetch(benchmark::State& state) {
  Backend backend;
  backend.cold = state.range(0) != 0;
  if (const std::string why = backend.missing(); !why.empty()) return state.SkipWithError(why.c_str());
  const qwen3::Config c = shape();
  const std::size_t tokens = prompt_tokens();
  const std::vector<kvcache::TokenId> prompt = fixed_prompt(tokens, c.vocab);
  auto store = backend.store("qwen3-bench");
  {  // rows of seeded values (the bytes, not their meaning, are what is timed)
    kvcache::BlockPool<T> pool(pool_config(c, tokens));
    kvcache::PagedKvCache<T> seq(pool);
    (void)seq.reuse_prefix(prompt);
    const std::vector<float> k = normal_floats(c.kv_heads * tokens * c.head_dim, 1);
    const kvcache::TensorView<const float> view(k.data(), {1, c.kv_heads, tokens, c.head_dim});
    for (std::size_t l = 0; l < c.layers; ++l) (void)seq.update(l, view, view, kvcache::next_positions(0, tokens));
    if (!seq.save_prefix(*store).error.empty()) return state.SkipWithError("the save failed");
  }
  const std::vector<kvcache::BlockKey> keys = backend.keys();
  (void)store->contains(keys);  // connected, for a server
  std::vector<std::string> records(keys.size());
  std::vector<char> buffer(std::size_t{4} << 20);
  std::vector<double> get, reuse, plain;
  std::size_t bytes = 0;
  kvcache::BlockPool<T> pool(pool_config(c, tokens));  // long-lived, as an engine's
  for (auto _ : state) {
    backend.before_read();
    get.push_back(time_call([&] { benchmark::DoNotOptimize(store->get(keys, records)); }));
    backend.before_read();
    plain.push_back(time_call([&] { bytes = backend.plain_read(buffer); }));
    forget_prefixes(pool);
    backend.before_read();
    kvcache::PagedKvCache<T> seq(pool);
    kvcache::PrefixReuse hit;
    reuse.push_back(time_call([&] { hit = seq.reuse_prefix(prompt, *store); }));
    if (hit.store_blocks != tokens / kBlock) return state.SkipWithError(("reuse: " + hit.error).c_str());
    state.SetIterationTime(get.back());
  }
  const double gib = static_cast<double>(bytes) / static_cast<double>(1U << 30);
  const auto rate = [&](std::vector<double>& seconds) { return gib / median(seconds); };
  state.counters["GiB"] = gib;
  state.counters["get_GiBps"] = rate(get);
  state.counters["reuse_GiBps"] = rate(reuse);
  state.counters["plain_GiBps"] = rate(plain);
  state.counters["get_vs_plain"] = rate(get) / rate(plain);
  state.counters["reuse_vs_plain"] = rate(reuse) / rate(plain);
}

}  // namespace

int main(int argc, char** argv) {
  return kvcache::bench::run_benchmarks(argc, argv, [] {
    const auto reuse = [](const char* name, auto* f) {
      benchmark::RegisterBenchmark(name, f)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(smoke_mode() ? 1 : 3);
    };
    const auto fetch = [](const char* name, auto* f, std::vector<long> cold) {
      auto* b =
          benchmark::RegisterBenchmark(name, f)->ArgNames({"cold"})->UseManualTime()->Unit(benchmark::kMillisecond);
      b->Iterations(smoke_mode() ? 1 : 11);
      for (const long c : cold) b->Arg(c);
    };
    reuse("PrefixReuse/file", BM_PrefixReuse<Files>);
    fetch("StoreFetch/file", BM_StoreFetch<Files>, {0, 1});
#if defined(KVCACHE_BENCH_REDIS)
    reuse("PrefixReuse/redis", BM_PrefixReuse<Redis>);
    fetch("StoreFetch/redis", BM_StoreFetch<Redis>, {0});
#endif
  });
}
