// SPDX-License-Identifier: Apache-2.0
#pragma once

// How far logits through a cache of each storage format may stray, one row a format, keyed by
// its name, and each lossy format's error budget over long decodes. A format without a row fails to compile where its
// tolerance is asked for, and the check below fails for any format of storage_formats without one.

#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>

#include "kvcache/formats.hpp"

namespace kvcache::testing {

/// The bounds on the tiny Qwen3 model's |cached - uncached| logits for a cache storing a format.
struct LogitTolerance {
  std::string_view format;  // format_name<T>()
  /// The uncached side exact in float. float and double hold the model's float K and V exactly.
  /// The 16-bit types round them (half to an 11-bit significand, bfloat16 to 8 bits): measured at
  /// most 2.8e-3 (half) and 2.3e-2 (bfloat16), ~3x headroom. The quantized formats measured 0.35
  /// (fp8_e4m3), 0.076 (int8_rows) and 1.17 (int4_groups: one group of 32 a row here);
  /// docs/quantization.md has their budget over long decodes.
  double vs_float;
  /// The uncached side rounding K and V to the format too: only the float rounding of K and V
  /// before the cast differs (a chunk and a single token project it in a different order), so a
  /// 16-bit value now and then lands one step apart: measured 3.4e-4 (half) and 1.3e-3
  /// (bfloat16). A quantized code one step apart moves more (a step is 1/8 of the value in fp8,
  /// 1/15 of the group's range in int4): measured 1.1e-2 (fp8_e4m3), 1.8e-3 (int8_rows), 3.7e-2
  /// (int4_groups).
  double vs_rounded;
};

inline constexpr LogitTolerance kLogitTolerances[] = {
    {"float", 1e-5, 1e-5},       {"double", 1e-5, 1e-5},     {"half", 1e-2, 1.5e-3},     {"bfloat16", 6e-2, 5e-3},
    {"fp8_e4m3", 1.0, 3e-2},     {"int8_rows", 0.25, 6e-3},  {"int4_groups", 3.5, 0.12}, {"fp8_e4m3_heads", 1.0, 3e-2},
    {"int4_rotated", 3.5, 0.12}, {"int8_heads", 0.25, 6e-3},
};

/// The row of format T (constant-evaluated: no row, no build).
template <class T>
constexpr LogitTolerance logit_tolerance() {
  for (const LogitTolerance& row : kLogitTolerances) {
    if (row.format == format_name<T>()) return row;
  }
  throw std::logic_error("tests/support/tolerances.hpp: no tolerance row for this format");
}

static_assert(
    [] {
      bool every = true;
      for_each_format([&]<class T>() { every = every && logit_tolerance<T>().vs_float > 0.0; });
      return every;
    }(),
    "every format of kvcache::storage_formats needs a row in kLogitTolerances");

/// What a format may drift from the float and the bfloat16 caches on one shape, in either feed.
struct Budget {
  double max_abs;  // largest |dlogit|
  double mean_kl;  // mean KL divergence, nats
  double top1;     // least top-1 agreement
};

/// The measured worst over both feeds and both references (bfloat16: against float alone) of
/// each format that rounds K and V on each shape of quantized_budget_test: largest |dlogit|, mean
/// KL and top-1, by "format/shape".
inline const std::map<std::string, Budget, std::less<>> kMeasuredBudgets = {
    {"bfloat16/tiny", {0.0307, 5.30e-6, 0.997}},       {"fp8_e4m3/tiny", {0.276, 9.55e-4, 0.931}},
    {"fp8_e4m3_heads/tiny", {0.336, 1.69e-3, 0.922}},  {"int8_rows/tiny", {0.0767, 6.03e-5, 0.984}},
    {"int4_groups/tiny", {0.920, 8.95e-3, 0.781}},     {"int4_rotated/tiny", {0.756, 6.91e-3, 0.825}},
    {"bfloat16/d48", {0.0165, 3.69e-6, 0.993}},        {"fp8_e4m3/d48", {0.229, 8.10e-4, 0.933}},
    {"fp8_e4m3_heads/d48", {0.271, 1.18e-3, 0.926}},   {"int8_rows/d48", {0.0593, 4.50e-5, 0.980}},
    {"int4_groups/d48", {0.762, 7.66e-3, 0.820}},      {"int4_rotated/d48", {0.534, 4.84e-3, 0.843}},
    {"bfloat16/qwen3", {0.0195, 4.17e-6, 0.993}},      {"fp8_e4m3/qwen3", {0.255, 1.11e-3, 0.916}},
    {"fp8_e4m3_heads/qwen3", {0.262, 1.14e-3, 0.924}}, {"int8_rows/qwen3", {0.0718, 6.57e-5, 0.980}},
    {"int4_groups/qwen3", {0.797, 9.78e-3, 0.784}},    {"int4_rotated/qwen3", {0.671, 6.47e-3, 0.830}},
    {"half/tiny", {0.0304, 5.36e-6, 0.997}},           {"half/d48", {0.0167, 3.74e-6, 0.993}},
    {"half/qwen3", {0.0192, 4.26e-6, 0.993}},          {"int8_heads/tiny", {0.172, 2.69e-4, 0.963}},
    {"int8_heads/d48", {0.123, 1.97e-4, 0.960}},       {"int8_heads/qwen3", {0.132, 2.58e-4, 0.955}},
};

}  // namespace kvcache::testing
