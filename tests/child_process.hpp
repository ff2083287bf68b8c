// SPDX-License-Identifier: Apache-2.0
#pragma once

// Running part of a test in a forked child process: fork safety, processes sharing a store, a
// writer killed part-way. Linux.

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <thread>

namespace kvcache::testing {

/// Whether a sanitizer's allocator serves malloc here. That of Clang 14 does not hold its locks
/// across fork(), so a child forked while another thread allocates can wait on them for good.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitizerAllocator = true;
#elif defined(__has_feature)
constexpr bool kSanitizerAllocator = __has_feature(address_sanitizer) || __has_feature(thread_sanitizer);
#else
constexpr bool kSanitizerAllocator = false;
#endif

constexpr int kHung = 100;  // what run_in_child returns for a child it had to kill
constexpr int kSkip = 77;   // a child's exit code: this machine cannot set the test up

/// Runs `body` in a forked child and returns its exit code (128 + the signal's number if a signal
/// ended it), or kHung if it had not ended after `timeout` (it is killed then): a child that hangs
/// fails the test instead of blocking it.
template <class Body>
int run_in_child(const Body& body, std::chrono::seconds timeout) {
  const pid_t child = fork();
  if (child < 0) return -1;
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    _exit(body());
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  for (;;) {
    const pid_t ended = waitpid(child, &status, WNOHANG);
    if (ended == child) break;
    if (ended < 0 && errno != EINTR) return -1;
    if (std::chrono::steady_clock::now() > deadline) {
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      return kHung;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace kvcache::testing
