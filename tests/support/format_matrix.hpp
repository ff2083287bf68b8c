// SPDX-License-Identifier: Apache-2.0
#pragma once

// GoogleTest's typed suites over generated lists: every cache variant over every format, or a
// subset, from kvcache::storage_formats (support/formats.hpp), never from a list kept by hand.

#include <gtest/gtest.h>

#include <string>

#include "kvcache/codec.hpp"
#include "support/formats.hpp"

namespace kvcache::testing {

template <class List>
struct gtest_types_of;
template <class... Ts>
struct gtest_types_of<type_list<Ts...>> {
  using type = ::testing::Types<Ts...>;
};
/// List's types as ::testing::Types, for TYPED_TEST_SUITE.
template <class List>
using gtest_types = typename gtest_types_of<List>::type;

/// Variant<T> for every variant template and every format T of Formats, variant by variant.
template <class Formats, template <class> class... Variants>
using every = concat<typename Formats::template transform<Variants>...>;

/// Each format's name, for typed suites over formats.
struct FormatName {
  template <class T>
  static std::string GetName(int /*index*/) {
    return format_name<T>();
  }
};

}  // namespace kvcache::testing
