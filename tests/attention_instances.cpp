// SPDX-License-Identifier: Apache-2.0
// The kernels attention_instances.hpp declares, compiled once for every test program.
#include "attention_instances.hpp"

KVCACHE_INSTANTIATE_ATTENTION(float);
KVCACHE_INSTANTIATE_ATTENTION(double);
KVCACHE_INSTANTIATE_ATTENTION(kvcache::half);
KVCACHE_INSTANTIATE_ATTENTION(kvcache::bfloat16);
KVCACHE_INSTANTIATE_ATTENTION(Eigen::half);
KVCACHE_INSTANTIATE_ATTENTION(Eigen::bfloat16);
KVCACHE_INSTANTIATE_ATTENTION(kvcache::fp8_e4m3);
KVCACHE_INSTANTIATE_ATTENTION(kvcache::fp8_e4m3_heads);
KVCACHE_INSTANTIATE_ATTENTION(kvcache::int8_rows);
KVCACHE_INSTANTIATE_ATTENTION(kvcache::int4_groups);
KVCACHE_INSTANTIATE_ATTENTION(kvcache::int4_rotated);
KVCACHE_INSTANTIATE_ATTENTION(kvcache::int8_heads);
