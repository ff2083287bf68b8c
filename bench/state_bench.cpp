// SPDX-License-Identifier: Apache-2.0
// Saving and loading a cache's state against the disk and the memory it goes through. A
// KvCache<bfloat16> of Qwen3-0.6B's shape (28 layers, 8 kv heads x 128) holds N tokens (32,768:
// 3.5 GiB), and each iteration times, in turn, on one file in $KVCACHE_STATE_BENCH_DIR (else the
// system's temporary directory):
//
// - save: save_state to an ofstream of the file (into the page cache); save_sync: save_state to
//   the path (a temporary file, fsync, rename, fsync of the directory: to the disk); write_sync:
//   the same bytes written from the cache's rows with a plain ofstream, then fsync: the disk's rate;
// - load_cold: load_state into the cache reset to no tokens, the file evicted from the page cache
//   first (from the disk); read_cold: a plain read of the file evicted the same way;
// - load: load_state into the cache reset to no tokens, from the page cache (one pass);
//   load_verify: into the cache holding its tokens (verified, then read: two passes);
// - memcpy: a copy of the cache's rows into a 256 MiB buffer, round and round: memory's rate.
//
// Counters are GiB/s (the file's bytes over each median time) and the ratios
// save_sync_vs_write_sync, load_cold_vs_read_cold, save_vs_memcpy, load_vs_memcpy.
//
//   build/release/bench/state_bench --benchmark_filter=StateSaveLoad
//
// The 3.5 GiB case needs that much memory for the cache and twice that on disk (the state file
// and the plain one), and takes a few minutes.

#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "kvcache/kvcache.hpp"
#include "kvcache/state_file.hpp"

namespace {

using kvcache::bench::median;
using kvcache::bench::smoke_mode;
using kvcache::bench::time_call;

constexpr std::size_t kHeads = 8, kDim = 128;

std::filesystem::path bench_dir() {
  const char* dir = std::getenv("KVCACHE_STATE_BENCH_DIR");
  return dir != nullptr && *dir != '\0' ? std::filesystem::path(dir) : std::filesystem::temp_directory_path();
}

/// Writes a file's dirty pages to the disk, then asks the kernel to drop it from the page cache
/// (it may keep some: only a hint).
void sync_and_evict(const std::filesystem::path& path, bool evict) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::runtime_error("state_bench: cannot open " + path.string());
  ::fsync(fd);
  if (evict) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

/// A cache of `layers` layers holding `tokens` tokens of seeded bfloat16 values.
kvcache::KvCache<Eigen::bfloat16> filled_cache(std::size_t layers, std::size_t tokens) {
  kvcache::KvCache<Eigen::bfloat16> cache({.layers = layers, .kv_heads = kHeads, .head_dim = kDim, .capacity = tokens});
  constexpr std::size_t kChunk = 2048;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::vector<Eigen::bfloat16> k(kHeads * kChunk * kDim), v(k.size());
  for (auto* x : {&k, &v}) {
    for (auto& e : *x) e = Eigen::bfloat16(normal(rng));
  }
  for (std::size_t first = 0; first < tokens; first += kChunk) {
    const std::size_t n = std::min(kChunk, tokens - first);
    const kvcache::Strides strides{kHeads * kChunk * kDim, kChunk * kDim, kDim};
    const auto positions = kvcache::next_positions(first, n);
    for (std::size_t l = 0; l < layers; ++l) {
      cache.update(l, kvcache::TensorView<const Eigen::bfloat16>(k.data(), {1, kHeads, n, kDim}, strides),
                   kvcache::TensorView<const Eigen::bfloat16>(v.data(), {1, kHeads, n, kDim}, strides), positions);
    }
  }
  return cache;
}

/// Calls f(bytes, count) on each contiguous run of the cache's stored keys and values.
template <class F>
void for_each_row_run(kvcache::KvCache<Eigen::bfloat16>& cache, const F& f) {
  for (std::size_t l = 0; l < cache.layers(); ++l) {
    for (const auto& s : cache.history(l).segments) {
      for (const auto* view : {&s.keys, &s.values}) {
        for (std::size_t h = 0; h < view->heads(); ++h) {
          f(reinterpret_cast<const char*>(view->row(0, h, 0)), s.tokens() * kDim * sizeof(Eigen::bfloat16));
        }
      }
    }
  }
}

/// Args: layers, tokens.
void BM_StateSaveLoad(benchmark::State& state) {
  const auto layers = static_cast<std::size_t>(state.range(0));
  const auto tokens = static_cast<std::size_t>(state.range(1));
  auto cache = filled_cache(layers, tokens);
  const std::filesystem::path dir = bench_dir();
  const std::filesystem::path file = dir / "kvcache_state_bench.kvstate";
  const std::filesystem::path plain = dir / "kvcache_state_bench.plain";
  std::vector<char> buffer(smoke_mode() ? std::size_t{1} << 20 : std::size_t{256} << 20);

  std::vector<double> save, save_sync, write_sync, load_cold, read_cold, load, load_verify, copy;
  for (auto _ : state) {
    save.push_back(time_call([&] {
      std::ofstream out(file, std::ios::binary | std::ios::trunc);
      kvcache::save_state(cache, out);
    }));
    save_sync.push_back(time_call([&] { kvcache::save_state(cache, file); }));
    write_sync.push_back(time_call([&] {
      std::ofstream out(plain, std::ios::binary | std::ios::trunc);
      for_each_row_run(cache,
                       [&](const char* data, std::size_t n) { out.write(data, static_cast<std::streamsize>(n)); });
      out.close();
      sync_and_evict(plain, false);
    }));

    sync_and_evict(file, true);
    load_cold.push_back(time_call([&] {
      cache.reset();
      kvcache::load_state(cache, file);
    }));
    sync_and_evict(plain, true);
    read_cold.push_back(time_call([&] {
      std::ifstream in(plain, std::ios::binary);
      while (in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()))) {
      }
      benchmark::DoNotOptimize(buffer.data());
    }));

    load.push_back(time_call([&] {
      cache.reset();
      kvcache::load_state(cache, file);
    }));
    load_verify.push_back(time_call([&] { kvcache::load_state(cache, file); }));
    copy.push_back(time_call([&] {
      std::size_t at = 0;
      for_each_row_run(cache, [&](const char* data, std::size_t n) {
        for (std::size_t done = 0; done < n;) {
          const std::size_t size = std::min(n - done, buffer.size() - at);
          std::memcpy(buffer.data() + at, data + done, size);
          done += size;
          at = (at + size) % buffer.size();
        }
      });
      benchmark::DoNotOptimize(buffer.data());
    }));
    if (cache.length() != tokens) state.SkipWithError("the loaded cache does not hold the saved tokens");
    state.SetIterationTime(load.back());
  }
  const double gib = static_cast<double>(std::filesystem::file_size(file)) / static_cast<double>(1U << 30);
  const auto rate = [&](std::vector<double>& seconds) { return gib / median(seconds); };
  state.counters["GiB"] = gib;
  state.counters["save_GiBps"] = rate(save);
  state.counters["save_sync_GiBps"] = rate(save_sync);
  state.counters["write_sync_GiBps"] = rate(write_sync);
  state.counters["load_cold_GiBps"] = rate(load_cold);
  state.counters["read_cold_GiBps"] = rate(read_cold);
  state.counters["load_GiBps"] = rate(load);
  state.counters["load_verify_GiBps"] = rate(load_verify);
  state.counters["memcpy_GiBps"] = rate(copy);
  state.counters["save_sync_vs_write_sync"] = rate(save_sync) / rate(write_sync);
  state.counters["load_cold_vs_read_cold"] = rate(load_cold) / rate(read_cold);
  state.counters["save_vs_memcpy"] = rate(save) / rate(copy);
  state.counters["load_vs_memcpy"] = rate(load) / rate(copy);
  std::filesystem::remove(file);
  std::filesystem::remove(plain);
}

}  // namespace

int main(int argc, char** argv) {
  return kvcache::bench::run_benchmarks(argc, argv, [] {
    auto* b = benchmark::RegisterBenchmark("StateSaveLoad<bfloat16>", BM_StateSaveLoad)
                  ->ArgNames({"layers", "tokens"})
                  ->UseManualTime()
                  ->Unit(benchmark::kMillisecond)
                  ->Iterations(smoke_mode() ? 1 : 3);
    if (smoke_mode()) {
      b->Args({2, 64});
    } else {
      b->Args({28, 2048});   // 224 MiB: a prompt
      b->Args({28, 32768});  // 3.5 GiB: the figure
    }
  });
}
