// SPDX-License-Identifier: Apache-2.0
// The attention kernel for every storage format, compiled once (attention_instances.cpp) and
// linked into every test program, instead of once in each: the kernel is most of what a test
// file costs to compile. CMake includes this file ahead of each test file that uses the
// baseline flags; the native copy of the attention suite compiles its own kernel.
#pragma once

#include <Eigen/Core>

#include "kvcache/attention.hpp"
#include "kvcache/quantized.hpp"

// What causal_attention<T, Q> runs for storage format T, whatever the query type Q.
#define KVCACHE_ATTENTION_KERNEL(T)                                                                                 \
  void kvcache::detail::attend_by_width<T>(const QueryRows<acc_type<T>>&, const History<T>&, const VisibilityRule&, \
                                           acc_type<T>, const AttentionOptions&)

extern template KVCACHE_ATTENTION_KERNEL(float);
extern template KVCACHE_ATTENTION_KERNEL(double);
extern template KVCACHE_ATTENTION_KERNEL(Eigen::half);
extern template KVCACHE_ATTENTION_KERNEL(Eigen::bfloat16);
extern template KVCACHE_ATTENTION_KERNEL(kvcache::fp8_e4m3);
extern template KVCACHE_ATTENTION_KERNEL(kvcache::fp8_e4m3_heads);
extern template KVCACHE_ATTENTION_KERNEL(kvcache::int8_rows);
extern template KVCACHE_ATTENTION_KERNEL(kvcache::int4_groups);
extern template KVCACHE_ATTENTION_KERNEL(kvcache::int4_rotated);
