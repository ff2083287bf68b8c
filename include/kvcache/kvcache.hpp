// SPDX-License-Identifier: Apache-2.0
#pragma once

// kvcache: a KV cache for C++ inference engines, and the causal attention that reads it.
// This header brings all of it.

#include "kvcache/attention.hpp"
#include "kvcache/block_store.hpp"
#include "kvcache/calibration.hpp"
#include "kvcache/concat_kv_cache.hpp"
#include "kvcache/concepts.hpp"
#include "kvcache/config.hpp"
#include "kvcache/file_block_store.hpp"
#include "kvcache/float16.hpp"
#include "kvcache/formats.hpp"
#include "kvcache/kv_cache.hpp"
#include "kvcache/paged_batch.hpp"
#include "kvcache/paged_kv_cache.hpp"
#include "kvcache/quantized.hpp"
#include "kvcache/ring_kv_cache.hpp"
#include "kvcache/size.hpp"
#include "kvcache/slot_kv_cache.hpp"
#include "kvcache/state_file.hpp"
#include "kvcache/version.hpp"
#include "kvcache/views.hpp"
