// SPDX-License-Identifier: Apache-2.0
// The kernels attention_instances.hpp declares, compiled once for every test program.
#include "attention_instances.hpp"

template KVCACHE_ATTENTION_KERNEL(float);
template KVCACHE_ATTENTION_KERNEL(double);
template KVCACHE_ATTENTION_KERNEL(Eigen::half);
template KVCACHE_ATTENTION_KERNEL(Eigen::bfloat16);
template KVCACHE_ATTENTION_KERNEL(kvcache::fp8_e4m3);
template KVCACHE_ATTENTION_KERNEL(kvcache::fp8_e4m3_heads);
template KVCACHE_ATTENTION_KERNEL(kvcache::int8_rows);
template KVCACHE_ATTENTION_KERNEL(kvcache::int4_groups);
template KVCACHE_ATTENTION_KERNEL(kvcache::int4_rotated);
