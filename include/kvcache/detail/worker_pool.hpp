// SPDX-License-Identifier: Apache-2.0
#pragma once

// Threads kept between attention calls: starting and joining a helper thread for every call
// costs a decode step a share of its time worth saving (docs/threads.md). Kept threads wait
// blocked, each on a condition of its own, so an idle pool costs no CPU time and a call wakes
// only the threads it uses.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>

#include "kvcache/version.hpp"
#endif

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

/// Threads the hardware runs at once (at least 1). Cached in a constant-initialized atomic, not a
/// function-local static: a child forked while another thread held such a static's guard would
/// wait on that guard for good.
inline std::size_t hardware_threads() noexcept {
  static constinit std::atomic<std::size_t> cached{0};
  std::size_t threads = cached.load(std::memory_order_relaxed);
  if (threads == 0) {
    threads = std::max<std::size_t>(std::thread::hardware_concurrency(), 1);
    cached.store(threads, std::memory_order_relaxed);
  }
  return threads;
}

/// A job: call(context, w) once for every worker index w < workers, 0 on the caller's thread;
/// the threads that take part share the other indices.
struct PoolJob {
  void (*call)(const void* context, std::size_t worker) = nullptr;
  const void* context = nullptr;
  std::size_t workers = 1;
};

/// Runs the worker indices `next` hands out until none below job.workers is left.
inline void take_workers(const PoolJob& job, std::atomic<std::size_t>& next) noexcept {
  for (std::size_t w = next.fetch_add(1, std::memory_order_relaxed); w < job.workers;
       w = next.fetch_add(1, std::memory_order_relaxed)) {
    job.call(job.context, w);
  }
}

/// Helper threads started as calls first ask for them and kept, up to a limit; one caller's job
/// at a time.
class WorkerPool {
 public:
  /// A pool that keeps at most `max_threads` threads besides its callers'.
  explicit WorkerPool(std::size_t max_threads) noexcept : max_threads_(max_threads) {}
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;
  /// Stops and joins the kept threads; no job may be running.
  ~WorkerPool() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    for (const auto& helper : helpers_) helper->wake.notify_one();
    for (const auto& helper : helpers_) helper->thread.join();
  }

  /// This process's pool, started empty, keeping one thread fewer than the hardware runs (the
  /// caller is the other). A forked child, which has none of its parent's threads, gets a pool
  /// of its own, whatever its pid. Never destroyed, so that a call made while static objects
  /// are destroyed still finds it. Null, for this call only, while another thread registers the
  /// fork handler or when the pool cannot be allocated: the caller then uses threads of its own.
  static WorkerPool* shared() noexcept {
    WorkerPool* pool = current_.load(std::memory_order_acquire);
    return pool != nullptr ? pool : start_shared();
  }

  /// Runs every worker index of `job`, 0 first, on the calling thread and up to
  /// job.workers - 1 kept threads, starting threads up to the limit, and returns once all
  /// indices have returned: how many threads took part. Returns 0, having run nothing, when
  /// another thread's job is running, the job needs no helper, or the pool has no thread.
  std::size_t try_run(const PoolJob& job) noexcept {
    const std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || job.workers < 2) return 0;
    const std::size_t helpers = std::min(job.workers - 1, start(job.workers - 1));
    if (helpers == 0) return 0;
    std::atomic<std::size_t> next{1};
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      task_ = {job, &next, helpers};
      pending_.store(helpers, std::memory_order_relaxed);
      ++generation_;
    }
    for (std::size_t i = 0; i < helpers; ++i) helpers_[i]->wake.notify_one();
    job.call(job.context, 0);
    take_workers(job, next);
    // Spun, not slept: what is left is at most one helper's last index, and a caller that
    // blocked here would be woken later than that takes (docs/threads.md).
    while (pending_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
    return helpers + 1;
  }

  /// Threads the pool keeps now.
  [[nodiscard]] std::size_t threads() {
    const std::lock_guard<std::mutex> lock(busy_);
    return helpers_.size();
  }

  /// Times a kept thread has woken with no job for it. A call wakes only the threads it uses, so
  /// these are the spurious wake-ups a condition variable is allowed, which are rare.
  [[nodiscard]] std::uint64_t idle_wakes() const noexcept { return idle_wakes_.load(std::memory_order_relaxed); }

 private:
  struct Helper {
    std::condition_variable wake;
    std::thread thread;
  };
  /// What the helpers of the running job read: the job, the indices it hands out, and how many
  /// helpers it uses (helper i, from 1, takes part iff i <= helpers).
  struct Task {
    PoolJob job;
    std::atomic<std::size_t>* next = nullptr;
    std::size_t helpers = 0;
  };

  /// Starts threads until the pool keeps min(wanted, max_threads_) of them (fewer if one cannot
  /// be started); returns how many it keeps. Called by the caller holding busy_.
  std::size_t start(std::size_t wanted) noexcept {
    wanted = std::min(wanted, max_threads_);
    try {
      helpers_.reserve(wanted);
      while (helpers_.size() < wanted) {
        auto helper = std::make_unique<Helper>();
        helper->thread = std::thread(
            [this, &self = *helper, index = helpers_.size() + 1, seen = generation_] { serve(self, index, seen); });
        helpers_.push_back(std::move(helper));
      }
    } catch (...) {  // std::system_error from a thread, std::bad_alloc: fewer threads
    }
    return helpers_.size();
  }

  /// Helper `index`'s loop: waits until a job uses it (or the pool stops), takes indices.
  void serve(Helper& self, std::size_t index, std::uint64_t seen) noexcept {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto called = [&] { return stopping_ || (generation_ != seen && index <= task_.helpers); };
    for (;;) {
      while (!called()) {
        self.wake.wait(lock);
        if (!called()) idle_wakes_.fetch_add(1, std::memory_order_relaxed);
      }
      if (stopping_) return;
      seen = generation_;
      const Task task = task_;
      lock.unlock();
      take_workers(task.job, *task.next);
      pending_.fetch_sub(1, std::memory_order_release);
      lock.lock();
    }
  }

  static WorkerPool* start_shared() noexcept {
    const ForkHandler handler = fork_handler();
    if (handler == ForkHandler::registering) return nullptr;
    // Without the handler a forked child could not tell its parent's threads from its own.
    const std::size_t max_threads = handler == ForkHandler::registered ? hardware_threads() - 1 : 0;
    auto* fresh = new (std::nothrow) WorkerPool(max_threads);
    if (fresh == nullptr) return nullptr;
    WorkerPool* first = nullptr;
    if (current_.compare_exchange_strong(first, fresh, std::memory_order_acq_rel)) return fresh;
    delete fresh;  // another thread's came first
    return first;
  }

  enum class ForkHandler : int { unregistered, registering, registered, unavailable };

  /// Registers leave_after_fork once, through an atomic rather than a function-local static or
  /// std::call_once, whose guard a fork could leave held by a thread the child does not have.
  /// `registering` while another thread does it; in a child forked at that moment, for good
  /// unless the handler was in place by then (it then says `registered` itself).
  static ForkHandler fork_handler() noexcept {
    auto state = fork_handler_.load(std::memory_order_acquire);
    if (state != ForkHandler::unregistered ||
        !fork_handler_.compare_exchange_strong(state, ForkHandler::registering, std::memory_order_acq_rel)) {
      return state;
    }
#if defined(__unix__) || defined(__APPLE__)
    state =
        pthread_atfork(nullptr, nullptr, &leave_after_fork) == 0 ? ForkHandler::registered : ForkHandler::unavailable;
#else
    state = ForkHandler::registered;  // no fork()
#endif
    fork_handler_.store(state, std::memory_order_release);
    return state;
  }

  /// In a forked child (one thread, before fork() returns): leaves the parent's pool, whose
  /// threads and lock holders are not in this process, for the next call to replace.
  static void leave_after_fork() noexcept {
    fork_handler_.store(ForkHandler::registered, std::memory_order_relaxed);  // this handler runs
    WorkerPool* parents = current_.exchange(nullptr, std::memory_order_relaxed);
    if (parents == nullptr) return;
    parents->older_ = left_;  // kept reachable, so that leak checkers see no leak
    left_ = parents;
  }

  static inline std::atomic<WorkerPool*> current_{nullptr};                         // this process's shared pool
  static inline std::atomic<ForkHandler> fork_handler_{ForkHandler::unregistered};  // fork_handler()'s state
  static inline WorkerPool* left_ = nullptr;  // pools of ancestor processes, newest first

  std::size_t max_threads_;
  std::mutex busy_;   // held by the caller whose job runs
  std::mutex mutex_;  // guards task_, generation_ and stopping_
  Task task_;
  std::uint64_t generation_ = 0;  // jobs started
  bool stopping_ = false;
  std::atomic<std::size_t> pending_{0};  // helpers of the running job not done yet
  std::atomic<std::uint64_t> idle_wakes_{0};
  std::vector<std::unique_ptr<Helper>> helpers_;  // helper i + 1 at i
  WorkerPool* older_ = nullptr;                   // the next pool in left_
};

/// Runs work(w) once for every w < workers, 0 on the calling thread, on at most as many threads
/// as the hardware runs (the caller's included), which share the indices: work(w) must not wait
/// for another index. The others are the shared pool's kept threads where it is free, else
/// threads started for the call; if a thread cannot be started, the others run its indices.
template <class Work>
void run_workers(std::size_t workers, const Work& work) {
  if (workers <= 1) return work(0);
  const PoolJob job{[](const void* context, std::size_t worker) { (*static_cast<const Work*>(context))(worker); },
                    &work, workers};
  WorkerPool* pool = WorkerPool::shared();
  if (pool != nullptr && pool->try_run(job) != 0) return;
  const std::size_t helpers = std::min(workers, hardware_threads()) - 1;
  std::atomic<std::size_t> next{1};
  std::vector<std::thread> threads;
  threads.reserve(helpers);
  for (std::size_t i = 0; i < helpers; ++i) {
    try {
      threads.emplace_back([&] { take_workers(job, next); });
    } catch (const std::system_error&) {
      break;
    }
  }
  work(0);
  take_workers(job, next);
  for (std::thread& t : threads) t.join();
}

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
