// SPDX-License-Identifier: Apache-2.0
#pragma once

// Every storage format kvcache defines, in one list: what the C API, kvcache-bench and the
// format checks are generated from. A new format is its codec and one entry here (and one line
// in kvcache.h's KVCACHE_FORMATS, which the C API checks against this list).
//
//   kvcache::for_each_format([]<class T>() { std::puts(kvcache::format_name<T>()); });

#include <cstddef>
#include <tuple>

#include "kvcache/codec.hpp"
#include "kvcache/quantized.hpp"
#include "kvcache/version.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// A list of types.
template <class... Ts>
struct type_list {
  static constexpr std::size_t size = sizeof...(Ts);
  /// The I-th type.
  template <std::size_t I>
  using at = std::tuple_element_t<I, std::tuple<Ts...>>;
};

/// Every storage format kvcache defines, in the order of kvcache.h's KVCACHE_FORMATS.
using storage_formats =
    type_list<float, double, half, bfloat16, fp8_e4m3, int8_rows, int4_groups, fp8_e4m3_heads, int4_rotated>;

/// Calls f.template operator()<T>() for every format T of storage_formats, in order.
template <class F>
constexpr void for_each_format(F&& f) {
  [&]<class... Ts>(type_list<Ts...>) { (f.template operator()<Ts>(), ...); }(storage_formats{});
}

}  // namespace KVCACHE_ABI
}  // namespace kvcache
