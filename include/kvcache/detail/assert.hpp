// SPDX-License-Identifier: Apache-2.0
#pragma once

// Internal invariants: checked in debug and sanitizer builds, free in release builds.
// Public preconditions are never checked with this; they throw (see detail/checks.hpp).

#include <cstdio>
#include <cstdlib>

#if !defined(KVCACHE_ENABLE_ASSERTS) && !defined(NDEBUG)
#define KVCACHE_ENABLE_ASSERTS 1
#endif

#if defined(KVCACHE_ENABLE_ASSERTS) && KVCACHE_ENABLE_ASSERTS
#define KVCACHE_ASSERT(condition, message) \
  ((condition)                             \
       ? static_cast<void>(0)              \
       : (std::fprintf(stderr, "%s:%d: kvcache assertion failed: %s\n", __FILE__, __LINE__, message), std::abort()))
#else
#define KVCACHE_ASSERT(condition, message) static_cast<void>(0)
#endif
