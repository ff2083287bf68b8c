// SPDX-License-Identifier: Apache-2.0
// The threads causal_attention runs on: every worker index runs once per call, worker 0 on the
// caller's thread, the others on threads kept between calls, never more threads than the
// hardware runs; a call wakes only the threads it uses; callers that find the pool busy still
// get every index run; and a forked child, whatever its pid, runs on threads of its own.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "kvcache/attention.hpp"
#include "kvcache/detail/worker_pool.hpp"
#include "kvcache/kv_cache.hpp"

#if defined(__linux__)
#include <sched.h>

#include "child_process.hpp"
#endif

namespace kvcache {
namespace {

using detail::hardware_threads;
using detail::PoolJob;
using detail::run_workers;
using detail::WorkerPool;

/// What one call did: how often each index ran, whether 0 ran on the caller, on how many threads.
struct Census {
  std::vector<std::atomic<int>> runs;
  bool zero_on_caller = false;
  std::mutex mutex;
  std::set<std::thread::id> threads;

  explicit Census(std::size_t workers) : runs(workers) {}

  void record(std::size_t worker, std::thread::id caller) {
    runs[worker].fetch_add(1);
    if (worker == 0) zero_on_caller = std::this_thread::get_id() == caller;
    const std::lock_guard<std::mutex> lock(mutex);
    threads.insert(std::this_thread::get_id());
  }
  [[nodiscard]] bool each_once() const {
    return std::ranges::all_of(runs, [](const std::atomic<int>& r) { return r.load() == 1; });
  }
};

/// run_workers(workers), recorded.
void take_census(Census& census) {
  const std::thread::id caller = std::this_thread::get_id();
  run_workers(census.runs.size(), [&](std::size_t worker) { census.record(worker, caller); });
}

/// pool.try_run of `census.runs.size()` workers, recorded; returns what try_run returned.
std::size_t take_census(WorkerPool& pool, Census& census) {
  const std::thread::id caller = std::this_thread::get_id();
  const auto work = [&](std::size_t worker) { census.record(worker, caller); };
  return pool.try_run(
      {[](const void* context, std::size_t worker) { (*static_cast<const decltype(work)*>(context))(worker); }, &work,
       census.runs.size()});
}

TEST(WorkerPool, EveryWorkerRunsOnceAndZeroOnTheCaller) {
  for (const std::size_t workers : {1U, 2U, 3U, 5U, 2U, 1U, 4U, 64U}) {
    Census census(workers);
    take_census(census);
    EXPECT_TRUE(census.each_once()) << workers << " workers";
    EXPECT_TRUE(census.zero_on_caller) << workers << " workers";
    EXPECT_LE(census.threads.size(), std::min(workers, hardware_threads())) << workers << " workers";
  }
}

// A thread started for a call would begin with its thread_local count at zero.
thread_local int calls_served = 0;

TEST(WorkerPool, KeepsItsThreadsBetweenCalls) {
  if (hardware_threads() < 2) GTEST_SKIP() << "one hardware thread: the pool keeps none";
  std::vector<int> served(2, -1);
  for (std::size_t call = 0; call < 2; ++call) {
    // Worker 0 (on the caller) waits for worker 1 to start, so that a helper, not the caller
    // after its own index, runs worker 1.
    std::atomic<bool> started{false};
    run_workers(2, [&](std::size_t worker) {
      if (worker == 0) {
        while (!started.load()) std::this_thread::yield();
      } else {
        started.store(true);
        served[call] = calls_served++;
      }
    });
  }
  EXPECT_EQ(served[1], served[0] + 1) << "worker 1 of the second call ran on a thread that did not serve the first";
}

TEST(WorkerPool, KeepsNoMoreThreadsThanTheHardware) {
  Census wide(64);
  take_census(wide);
  EXPECT_TRUE(wide.each_once());
  ASSERT_NE(WorkerPool::shared(), nullptr);
  EXPECT_LE(WorkerPool::shared()->threads(), hardware_threads() - 1);

  // A pool limited to three threads runs a ten-worker job on four: every index, once.
  WorkerPool pool(3);
  Census census(10);
  EXPECT_EQ(take_census(pool, census), 4U);
  EXPECT_TRUE(census.each_once());
  EXPECT_TRUE(census.zero_on_caller);
  EXPECT_LE(census.threads.size(), 4U);
  EXPECT_EQ(pool.threads(), 3U);
}

TEST(WorkerPool, WakesOnlyTheThreadsACallUses) {
  // After a job on eight threads, two-worker jobs leave the six threads they do not use asleep,
  // whatever the hardware; waking every kept thread would wake six for nothing per call. The
  // allowance is for the rare spurious wake-ups of a condition variable.
  constexpr std::size_t kCalls = 20;
  constexpr std::uint64_t kSpurious = 2;
  WorkerPool pool(7);
  Census wide(8);
  ASSERT_EQ(take_census(pool, wide), 8U);
  ASSERT_TRUE(wide.each_once());
  const std::uint64_t before = pool.idle_wakes();
  for (std::size_t call = 0; call < kCalls; ++call) {
    Census census(2);
    ASSERT_EQ(take_census(pool, census), 2U);
    ASSERT_TRUE(census.each_once());
  }
  EXPECT_LE(pool.idle_wakes() - before, kSpurious);
  EXPECT_EQ(pool.threads(), 7U);

  // The shared pool, after a call that asked for 64 threads.
  Census widest(64);
  take_census(widest);
  ASSERT_NE(WorkerPool::shared(), nullptr);
  const std::uint64_t shared_before = WorkerPool::shared()->idle_wakes();
  for (std::size_t call = 0; call < kCalls; ++call) {
    Census census(2);
    take_census(census);
  }
  EXPECT_LE(WorkerPool::shared()->idle_wakes() - shared_before, kSpurious);
}

TEST(WorkerPool, ConcurrentCallersAllFinish) {
  // One caller at a time has the pool; the other starts threads of its own for the call.
  std::atomic<int> bad{0};
  const auto caller = [&] {
    for (int i = 0; i < 200; ++i) {
      Census census(3);
      take_census(census);
      if (!census.each_once() || !census.zero_on_caller) bad.fetch_add(1);
    }
  };
  std::thread a(caller);
  std::thread b(caller);
  a.join();
  b.join();
  EXPECT_EQ(bad.load(), 0);
}

#if defined(__linux__)

/// A fixed query's attention over a fixed 40-token history of two kv heads, on `threads`
/// threads: every thread count gives the same bits (each head is one item, never split).
std::vector<float> attention_result(std::size_t threads) {
  constexpr std::size_t kTokens = 40;
  const Shape kv_shape{1, 2, kTokens, 32};
  const Shape q_shape{1, 4, 3, 32};
  std::vector<float> kv(kv_shape.size());
  for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<float>(i % 23) / 23.0F - 0.5F;
  std::vector<float> q(q_shape.size());
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i % 17) / 17.0F - 0.5F;
  std::vector<float> out(q.size());
  KvCache<float> cache({.layers = 1, .kv_heads = 2, .head_dim = 32, .capacity = kTokens});
  const TensorView<const float> keys(kv.data(), kv_shape);
  const History<float> history = cache.update(0, keys, keys, next_positions(0, kTokens));
  causal_attention(TensorView<const float>(q.data(), q_shape), next_positions(kTokens - 3, 3), history,
                   TensorView<float>(out.data(), q_shape), {.threads = threads});
  return out;
}

using testing::kHung;
using testing::kSanitizerAllocator;
using testing::kSkip;
using testing::run_in_child;

TEST(WorkerPoolFork, ChildRunsAttentionOnAPoolOfItsOwn) {
  const std::vector<float> expected = attention_result(1);
  ASSERT_EQ(attention_result(2), expected);  // the parent's pool now has threads
  const WorkerPool* parents = WorkerPool::shared();
  ASSERT_NE(parents, nullptr);
  const int code = run_in_child(
      [&] {
        if (WorkerPool::shared() == parents) return 2;
        return attention_result(2) == expected ? 0 : 1;
      },
      std::chrono::seconds(60));
  EXPECT_EQ(code, 0) << "1: a wrong result; 2: the child took its parent's pool; " << kHung << ": it hung";
}

TEST(WorkerPoolFork, ChildForkedWhileTheParentsPoolIsBusy) {
  // The parent's pool may be mid-job, its locks held by threads the child does not have.
  const std::vector<float> expected = attention_result(1);
  std::atomic<bool> stop{false};
  std::atomic<bool> started{false};
  std::thread busy([&] {
    while (!stop.load()) {
      run_workers(2, [](std::size_t) { std::this_thread::yield(); });
      started.store(true);
    }
  });
  // The first call, which starts the pool and allocates, is the next test's case.
  while (!started.load()) std::this_thread::yield();
  std::vector<int> codes;
  for (int i = 0; i < 5; ++i) {
    codes.push_back(run_in_child([&] { return attention_result(2) == expected ? 0 : 1; }, std::chrono::seconds(60)));
  }
  stop.store(true);
  busy.join();
  EXPECT_EQ(codes, std::vector<int>(5, 0)) << "1: a wrong result; " << kHung << ": it hung";
}

TEST(WorkerPoolFork, ChildForkedWhileAnotherThreadMakesTheFirstPoolCall) {
  // The process's first call registers the fork handler and starts the pool; a child forked in
  // that moment once waited for good on a guard the calling thread held. Each round is a fresh
  // process A whose pool is untouched (ctest runs each test alone and this one starts none): a
  // thread of A makes A's first calls while A forks B at once, and B then runs attention.
  if (kSanitizerAllocator) {
    GTEST_SKIP() << "A's first calls allocate while A forks, which the sanitizer's allocator does not survive";
  }
  const std::vector<float> expected = attention_result(1);
  std::vector<int> codes;
  constexpr int kRounds = 40;
  for (int round = 0; round < kRounds; ++round) {
    codes.push_back(run_in_child(
        [&] {
          std::atomic<bool> stop{false};
          std::thread first([&] {
            while (!stop.load()) run_workers(2, [](std::size_t) {});
          });
          const int code =
              run_in_child([&] { return attention_result(2) == expected ? 0 : 1; }, std::chrono::seconds(20));
          stop.store(true);
          first.join();
          return code;
        },
        std::chrono::seconds(30)));
  }
  EXPECT_EQ(codes, std::vector<int>(kRounds, 0)) << "1: a wrong result; " << kHung << ": it hung";
}

TEST(WorkerPoolFork, ChildWithItsParentsPidRunsAttention) {
  // A PID-1 engine in a container forking into a new PID namespace: parent and child both have
  // pid 1. Built from two nested PID namespaces (in a user namespace, so no privilege is
  // needed): B is pid 1 of the first, starts its pool, and forks C, pid 1 of the second. A pool
  // that told processes apart by pid gave C its parent's threads, and C waited for them for
  // good. (The test process must not start its pool first: ctest runs each test alone.)
  const std::vector<float> expected = attention_result(1);
  const int code = run_in_child(
      [&] {
        if (unshare(CLONE_NEWUSER | CLONE_NEWPID) != 0) return kSkip;
        return run_in_child(
            [&] {
              if (getpid() != 1 || attention_result(2) != expected) return 1;  // starts B's pool
              if (unshare(CLONE_NEWPID) != 0) return kSkip;
              return run_in_child([&] { return getpid() != 1                     ? kSkip
                                               : attention_result(2) == expected ? 0
                                                                                 : 1; },
                                  std::chrono::seconds(30));
            },
            std::chrono::seconds(45));
      },
      std::chrono::seconds(60));
  if (code == kSkip) GTEST_SKIP() << "no user and PID namespaces here";
  EXPECT_EQ(code, 0) << "1: a wrong result; " << kHung << ": the child hung";
}

#endif

}  // namespace
}  // namespace kvcache
