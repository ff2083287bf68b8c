// SPDX-License-Identifier: Apache-2.0
#pragma once

// Every storage format kvcache defines, in one list: what the C API, kvcache-bench, the tests'
// matrices and the format checks are generated from. A new format is its codec and one entry
// here (and one line in kvcache.h's KVCACHE_FORMATS, which the C API checks against this list).
//
//   kvcache::for_each_format([]<class T>() { std::puts(kvcache::format_name<T>()); });
//   kvcache::with_format("int8_rows", []<class T>() { run<kvcache::KvCache<T>>(); });  // by name

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

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
  /// The list of F<T> for each T, in order.
  template <template <class> class F>
  using transform = type_list<F<Ts>...>;

  /// Calls f.template operator()<T>() for the index-th type T and returns what it returns;
  /// throws std::out_of_range unless index < size.
  template <class F>
  static decltype(auto) visit(std::size_t index, F&& f) {
    using Result = decltype(f.template operator()<at<0>>());
    using Call = Result (*)(std::remove_reference_t<F>&);
    static constexpr Call calls[] = {
        [](std::remove_reference_t<F>& g) -> Result { return g.template operator()<Ts>(); }...};
    if (index >= size)
      throw std::out_of_range("type_list::visit: index: expected below " + std::to_string(size) + ", given " +
                              std::to_string(index));
    return calls[index](f);
  }
};

/// Every storage format kvcache defines, in the order of kvcache.h's KVCACHE_FORMATS.
using storage_formats = type_list<float, double, half, bfloat16, fp8_e4m3, int8_rows, int4_groups, fp8_e4m3_heads,
                                  int4_rotated, int8_heads>;

/// Calls f.template operator()<T>() for every format T of storage_formats, in order.
template <class F>
constexpr void for_each_format(F&& f) {
  [&]<class... Ts>(type_list<Ts...>) { (f.template operator()<Ts>(), ...); }(storage_formats{});
}

/// Calls f.template operator()<T>() for the format T of Formats whose format_name<T>() is `name`
/// and returns what it returns; throws std::invalid_argument naming the known formats otherwise.
template <class Formats = storage_formats, class F>
decltype(auto) with_format(std::string_view name, F&& f) {
  std::size_t index = 0;
  std::string known;
  [&]<class... Ts>(type_list<Ts...>) {
    const bool found = ((name == format_name<Ts>() || (++index, false)) || ...);
    if (!found) ((known += (known.empty() ? "" : ", ") + std::string(format_name<Ts>())), ...);
  }(Formats{});
  if (!known.empty())
    throw std::invalid_argument("with_format: name: expected one of " + known + ", given '" + std::string(name) + "'");
  return Formats::visit(index, std::forward<F>(f));
}

}  // namespace KVCACHE_ABI
}  // namespace kvcache
