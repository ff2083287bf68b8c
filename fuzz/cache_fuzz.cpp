// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness for every cache variant and storage format. The input's first bytes choose
// a variant, a format and a small geometry; the rest is a sequence of operations, which the
// variant's harness runs (contiguous_fuzz.cpp, slot_fuzz.cpp, paged_fuzz.cpp over harness.hpp):
// updates of any layer and chunk size, bad calls, truncate, reset, and each variant's own. After
// each one every layer's history is compared, position by position, with the reference model
// (tests/support/reference_model.hpp); a bad call must throw the documented type and change
// nothing; and attention over a history now and then must match the model's uncached
// attention. Any difference prints what differed and traps, so that libFuzzer keeps the input.

#include <cstddef>
#include <cstdint>

#include "harness.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvcache;
  fuzz::Bytes in(data, size);
  // 0-2: KvCache, ConcatKvCache, RingKvCache; 3: SlotKvCache; 4: PagedKvCache.
  const std::size_t variant = in.byte() % 5;
  // The format byte indexes storage_formats, in its order: what the corpus' files were written for.
  const std::size_t format = in.byte() % testing::formats::size;
  const fuzz::Setup setup = fuzz::read_setup(in);
  if (variant < 3) {
    fuzz::run_contiguous(variant, format, setup, in);
  } else if (variant == 3) {
    fuzz::run_slot(format, setup, in);
  } else {
    fuzz::run_paged(format, setup, in);
  }
  return 0;
}
