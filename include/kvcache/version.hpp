// SPDX-License-Identifier: Apache-2.0
#pragma once

// kvcache's version, for an engine to test across API changes (C and C++ alike: this header
// holds only macros, and kvcache.h includes it):
//
//   #if KVCACHE_VERSION >= KVCACHE_MAKE_VERSION(0, 3, 0)
//   const std::size_t tokens = slots.row_length(row);  // 0.2: slots.length(row)
//   #endif
//
// Everything of the C++ library lives in the inline namespace kvcache::KVCACHE_ABI (v0_3 for
// 0.3.x), which changes with the API: two libraries of different APIs linked into one program
// do not mix their types, and a mismatch is a link error, not a crash. CMakeLists.txt reads the
// package's version from here.

#define KVCACHE_VERSION_MAJOR 0
#define KVCACHE_VERSION_MINOR 3
#define KVCACHE_VERSION_PATCH 0

/// A version as one comparable number: major x 10000 + minor x 100 + patch.
#define KVCACHE_MAKE_VERSION(major, minor, patch) ((major)*10000 + (minor)*100 + (patch))
#define KVCACHE_VERSION KVCACHE_MAKE_VERSION(KVCACHE_VERSION_MAJOR, KVCACHE_VERSION_MINOR, KVCACHE_VERSION_PATCH)

// The inline namespace: v<major>_<minor> (before 1.0 a minor version may change the API, after
// it only a major one will).
#define KVCACHE_DETAIL_ABI_NAME(major, minor) v##major##_##minor
#define KVCACHE_DETAIL_ABI(major, minor) KVCACHE_DETAIL_ABI_NAME(major, minor)
#define KVCACHE_ABI KVCACHE_DETAIL_ABI(KVCACHE_VERSION_MAJOR, KVCACHE_VERSION_MINOR)
