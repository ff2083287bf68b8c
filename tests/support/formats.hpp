// SPDX-License-Identifier: Apache-2.0
#pragma once

// The formats the tests, the fuzz harnesses and the tools run over, generated from
// kvcache::storage_formats, and the type-list pieces that cut it into subsets. A new format in
// storage_formats joins every matrix built from these.

#include <Eigen/Core>
#include <type_traits>

#include "kvcache/formats.hpp"

namespace kvcache::testing {

/// T, or Eigen's type of the same bits for kvcache's 16-bit types: the suites store and compute
/// 16-bit values as Eigen's types, as an engine that uses Eigen passes them.
template <class T>
struct eigen_equivalent {
  using type = T;
};
template <>
struct eigen_equivalent<half> {
  using type = Eigen::half;
};
template <>
struct eigen_equivalent<bfloat16> {
  using type = Eigen::bfloat16;
};
template <class T>
using eigen_equivalent_t = typename eigen_equivalent<T>::type;

/// Every storage format, in storage_formats' order (the fuzz corpora's format indices).
using formats = storage_formats::transform<eigen_equivalent_t>;

template <class... Lists>
struct concat_lists;
template <>
struct concat_lists<> {
  using type = type_list<>;
};
template <class... A, class... B, class... Rest>
struct concat_lists<type_list<A...>, type_list<B...>, Rest...> : concat_lists<type_list<A..., B...>, Rest...> {};
template <class... A>
struct concat_lists<type_list<A...>> {
  using type = type_list<A...>;
};
/// The types of every list, in order.
template <class... Lists>
using concat = typename concat_lists<Lists...>::type;

template <template <class> class Keep, class List>
struct filter_list;
template <template <class> class Keep, class... Ts>
struct filter_list<Keep, type_list<Ts...>> {
  using type = concat<std::conditional_t<Keep<Ts>::value, type_list<Ts>, type_list<>>...>;
};
/// The types T of List with Keep<T>::value, in order.
template <template <class> class Keep, class List>
using filter = typename filter_list<Keep, List>::type;

/// Whether format T is stored quantized: it is no type an engine computes in.
template <class T>
struct is_quantized : std::bool_constant<!compute_type<T>> {};

/// The quantized formats.
using quantized_formats = filter<is_quantized, formats>;

}  // namespace kvcache::testing
