// SPDX-License-Identifier: Apache-2.0
// The attention kernel for every storage format, compiled once (a file per format, which
// kvcache_attention_instances in cmake/KvcacheTargetDefaults.cmake writes from its list) and
// linked into every test, benchmark and example program, instead of once in each
// (KVCACHE_EXTERN_ATTENTION, as an engine does): the kernel is most of what such a file costs to
// compile. CMake includes this file ahead of each of their files; the release build's native copy
// of the attention suite compiles its own kernel.
#pragma once

#include <Eigen/Core>

#include "kvcache/attention.hpp"
#include "kvcache/quantized.hpp"

KVCACHE_EXTERN_ATTENTION(float);
KVCACHE_EXTERN_ATTENTION(double);
KVCACHE_EXTERN_ATTENTION(kvcache::half);
KVCACHE_EXTERN_ATTENTION(kvcache::bfloat16);
KVCACHE_EXTERN_ATTENTION(Eigen::half);
KVCACHE_EXTERN_ATTENTION(Eigen::bfloat16);
KVCACHE_EXTERN_ATTENTION(kvcache::fp8_e4m3);
KVCACHE_EXTERN_ATTENTION(kvcache::fp8_e4m3_heads);
KVCACHE_EXTERN_ATTENTION(kvcache::int8_rows);
KVCACHE_EXTERN_ATTENTION(kvcache::int4_groups);
KVCACHE_EXTERN_ATTENTION(kvcache::int4_rotated);
KVCACHE_EXTERN_ATTENTION(kvcache::int8_heads);
