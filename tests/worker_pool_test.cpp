// SPDX-License-Identifier: Apache-2.0
// The threads causal_attention runs on: every worker index runs once per call, worker 0 on the
// caller's thread, the others on threads kept between calls; callers that find the pool busy,
// and forked children, which have none of its threads, still get every worker run.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <thread>
#include <vector>

#include "kvcache/detail/worker_pool.hpp"

namespace {

using kvcache::detail::run_workers;

/// How many workers ran each index in one run_workers call, and whether 0 ran on the caller.
struct Census {
  std::vector<std::atomic<int>> runs;
  bool zero_on_caller = false;

  explicit Census(std::size_t workers) : runs(workers) {}

  [[nodiscard]] bool each_once() const {
    return std::ranges::all_of(runs, [](const std::atomic<int>& r) { return r.load() == 1; });
  }
};

Census take_census(std::size_t workers) {
  Census census(workers);
  const std::thread::id caller = std::this_thread::get_id();
  run_workers(workers, [&](std::size_t worker) {
    census.runs[worker].fetch_add(1);
    if (worker == 0) census.zero_on_caller = std::this_thread::get_id() == caller;
  });
  return census;
}

TEST(WorkerPool, EveryWorkerRunsOnceAndZeroOnTheCaller) {
  for (const std::size_t workers : {1U, 2U, 3U, 5U, 2U, 1U, 4U}) {
    const Census census = take_census(workers);
    EXPECT_TRUE(census.each_once()) << workers << " workers";
    EXPECT_TRUE(census.zero_on_caller) << workers << " workers";
  }
}

// A thread started for a call would begin with its thread_local count at zero.
thread_local int calls_served = 0;

TEST(WorkerPool, KeepsItsThreadsBetweenCalls) {
  std::vector<int> served(2, -1);
  for (std::size_t call = 0; call < 2; ++call) {
    run_workers(2, [&](std::size_t worker) {
      if (worker == 1) served[call] = calls_served++;
    });
  }
  EXPECT_EQ(served[1], served[0] + 1) << "worker 1 of the second call ran on a thread that did not serve the first";
}

TEST(WorkerPool, ConcurrentCallersAllFinish) {
  // One caller at a time has the pool; the other starts threads of its own for the call.
  std::atomic<int> bad{0};
  const auto caller = [&] {
    for (int i = 0; i < 200; ++i) {
      const Census census = take_census(3);
      if (!census.each_once() || !census.zero_on_caller) bad.fetch_add(1);
    }
  };
  std::thread a(caller);
  std::thread b(caller);
  a.join();
  b.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST(WorkerPoolDeathTest, ForkedChildRunsEveryWorker) {
  take_census(3);  // the parent's pool now has threads, which a forked child does not
  EXPECT_EXIT(std::exit(take_census(3).each_once() ? 0 : 1), ::testing::ExitedWithCode(0), "");
}

}  // namespace
