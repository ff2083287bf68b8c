// SPDX-License-Identifier: Apache-2.0
#pragma once

// Threads kept between attention calls. Starting a helper thread and joining it had cost a
// decode call 0.19-0.32 ms on the 2-vCPU AMD EPYC VM measured (clone 0.09-0.14 ms; the join's
// wake-up 0.05-0.16 ms more where the helper finished last): 12-20% of a call over 64 MiB of K
// and V on two cores. Kept threads wait blocked, so an idle pool costs no CPU time.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace kvcache::detail {

/// A job for the pool: call(context, i) for the worker with index i.
struct PoolJob {
  void (*call)(const void* context, std::size_t worker) = nullptr;
  const void* context = nullptr;
  std::size_t helpers = 0;  // pool threads that take part, as workers 1 .. helpers
};

/// Helper threads shared by the process, started as calls first ask for them and kept; one
/// caller's job at a time.
class WorkerPool {
 public:
  WorkerPool() = default;
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  /// The process's pool, started empty; threads are added as calls ask for them. Never
  /// destroyed: its threads wait until the process ends, so a call made while static objects
  /// are destroyed still finds it, and a forked child, which has none of its threads, never
  /// joins them.
  static WorkerPool& shared() {
    static auto* const pool = new WorkerPool;
    return *pool;
  }

  /// Runs job.call(context, i) for i in [0, job.helpers], 0 on the calling thread and the rest
  /// on kept threads, and returns once all have returned. Returns false, having run nothing,
  /// when the pool cannot take the job: another thread's job is running, this is a process
  /// forked from the one that started the threads, or no thread could be started. Never throws.
  bool try_run(PoolJob job) noexcept {
    const std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || !same_process()) return false;
    try {
      threads_.reserve(job.helpers);
      while (threads_.size() < job.helpers) {
        threads_.emplace_back([this, index = threads_.size() + 1] { serve(index); });
      }
    } catch (...) {  // std::system_error from a thread, std::bad_alloc from the vector: fewer helpers
    }
    job.helpers = std::min(job.helpers, threads_.size());
    if (job.helpers == 0) return false;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      job_ = job;
      pending_.store(job.helpers, std::memory_order_relaxed);
      ++generation_;
    }
    wake_.notify_all();
    job.call(job.context, 0);
    // Spun, not slept: a caller that blocks here is woken 0.05-0.16 ms after the last helper
    // is done (2-vCPU VM), while what is left to wait for is at most one helper's last item.
    while (pending_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
    return true;
  }

 private:
  [[noreturn]] void serve(std::size_t index) {
    std::uint64_t seen = 0;
    for (;;) {
      PoolJob job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        job = job_;
      }
      if (index > job.helpers) continue;  // a job for fewer threads than the pool has
      job.call(job.context, index);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  /// Whether this is the process that started the threads (a forked child has none of them).
  bool same_process() noexcept {
#if defined(__unix__) || defined(__APPLE__)
    if (threads_.empty()) owner_ = getpid();
    return owner_ == getpid();
#else
    return true;
#endif
  }

  std::mutex busy_;   // held by the caller whose job runs
  std::mutex mutex_;  // guards job_ and generation_
  std::condition_variable wake_;
  PoolJob job_;
  std::uint64_t generation_ = 0;
  std::atomic<std::size_t> pending_{0};
  std::vector<std::thread> threads_;
#if defined(__unix__) || defined(__APPLE__)
  pid_t owner_ = 0;
#endif
};

/// Runs `work(worker)` on `workers` threads, the caller's included; `work` takes items until
/// none are left. The others are the shared pool's kept threads where it is free, else threads
/// started for the call. If a thread cannot be started, the ones running (and the caller) do
/// its share.
template <class Work>
void run_workers(std::size_t workers, const Work& work) {
  if (workers <= 1) return work(0);
  const PoolJob job{[](const void* context, std::size_t worker) { (*static_cast<const Work*>(context))(worker); },
                    &work, workers - 1};
  if (WorkerPool::shared().try_run(job)) return;
  std::vector<std::thread> threads;
  threads.reserve(workers - 1);
  for (std::size_t i = 1; i < workers; ++i) {
    try {
      threads.emplace_back([&work, i] { work(i); });
    } catch (const std::system_error&) {
      break;
    }
  }
  work(0);
  for (std::thread& t : threads) t.join();
}

}  // namespace kvcache::detail
