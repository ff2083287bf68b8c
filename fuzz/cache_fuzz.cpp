// SPDX-License-Identifier: Apache-2.0
#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  (void)data;
  (void)size;
  return 0;
}
