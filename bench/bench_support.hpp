// SPDX-License-Identifier: Apache-2.0
#pragma once

// What every benchmark program shares: its clock and the CI smoke switch.

#include <chrono>
#include <cstdlib>
#include <string_view>

namespace kvcache::bench {

using Clock = std::chrono::steady_clock;

/// Seconds from `start` to now.
inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// KVCACHE_BENCH_SMOKE set (and not "0"): register only tiny cases, so CI runs every path in seconds.
inline bool smoke_mode() {
  const char* value = std::getenv("KVCACHE_BENCH_SMOKE");
  return value != nullptr && *value != '\0' && std::string_view(value) != "0";
}

}  // namespace kvcache::bench
