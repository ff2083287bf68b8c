// SPDX-License-Identifier: Apache-2.0
// The one list of formats: with_format finds each by its name and refuses others naming them
// all; a list is visited by index; the tests' list is storage_formats with Eigen's 16-bit types.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kvcache/formats.hpp"
#include "support/formats.hpp"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;

TEST(Formats, WithFormatCallsTheFormatOfThatNameAndReturnsWhatItReturns) {
  std::size_t index = 0;
  for_each_format([&]<class T>() {
    const std::size_t found = with_format(format_name<T>(), [&]<class U>() -> std::size_t {
      EXPECT_TRUE((std::is_same_v<U, T>)) << format_name<T>() << " called " << format_name<U>();
      return index;
    });
    EXPECT_EQ(found, index++);
  });
  EXPECT_EQ(index, storage_formats::size);
  with_format<formats>("half", []<class T>() { EXPECT_TRUE((std::is_same_v<T, Eigen::half>)); });
  with_format<formats>("bfloat16", []<class T>() { EXPECT_TRUE((std::is_same_v<T, Eigen::bfloat16>)); });
}

TEST(Formats, WithFormatRefusesAnUnknownNameNamingEveryFormat) {
  int calls = 0;
  try {
    with_format("int8", [&]<class T>() { ++calls; });
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("given 'int8'"));
    for_each_format([&]<class T>() { EXPECT_THAT(e.what(), HasSubstr(format_name<T>())); });
  }
  EXPECT_THROW(with_format("", [&]<class T>() { ++calls; }), std::invalid_argument);
  EXPECT_EQ(calls, 0);
}

TEST(Formats, VisitCallsTheTypeAtAnIndexAndRefusesOnePastTheEnd) {
  using List = type_list<int, double, char>;
  EXPECT_EQ(List::visit(1, []<class T>() { return sizeof(T); }), sizeof(double));
  EXPECT_EQ(List::visit(2, []<class T>() { return sizeof(T); }), sizeof(char));
  try {
    List::visit(3, []<class T>() { return sizeof(T); });
    ADD_FAILURE() << "no exception";
  } catch (const std::out_of_range& e) {
    EXPECT_THAT(e.what(), HasSubstr("expected below 3, given 3"));
  }
}

TEST(Formats, TheTestsListIsStorageFormatsInOrderWithEigens16BitTypes) {
  static_assert(formats::size == storage_formats::size);
  static_assert(std::is_same_v<formats::at<2>, Eigen::half> && std::is_same_v<formats::at<3>, Eigen::bfloat16>);
  std::size_t i = 0;
  for_each_format([&]<class T>() {
    EXPECT_STREQ(formats::visit(i++, []<class U>() { return format_name<U>(); }), format_name<T>());
  });
  // Quantized: every format but the four an engine computes in.
  static_assert(quantized_formats::size == storage_formats::size - 4);
  static_assert(std::is_same_v<quantized_formats::at<0>, fp8_e4m3>);
}

}  // namespace
}  // namespace kvcache::testing
