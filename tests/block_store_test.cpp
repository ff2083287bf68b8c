// SPDX-License-Identifier: Apache-2.0
// Block store keys and records (block_store.hpp, detail/block_record.hpp, detail/sha256.hpp):
// SHA-256 against FIPS 180-4's vectors; keys as docs/store.md defines them, pinned to values
// computed apart from this code (Python's hashlib), so that every build and machine finds the
// same records; everything a namespace covers changes the keys; and a record verifies only
// whole: every bit flipped and every length cut short is refused, naming what failed.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/block_store.hpp"
#include "kvcache/detail/block_record.hpp"
#include "kvcache/detail/sha256.hpp"
#include "kvcache/quantized.hpp"

namespace kvcache {
namespace {

using ::testing::HasSubstr;

std::string hex(std::span<const std::uint8_t> bytes) {
  BlockKey k;
  std::string out;
  for (std::size_t i = 0; i < bytes.size(); i += 16) {
    std::copy_n(bytes.begin() + static_cast<std::ptrdiff_t>(i), 16, k.bytes.begin());
    out += k.hex();
  }
  return out;
}

std::string sha256_hex(std::string_view text) {
  detail::Sha256 hash;
  hash.update(text.data(), text.size());
  const auto digest = hash.digest();
  return hex(digest);
}

TEST(Sha256, GivesTheStandardsVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, GivesTheSameDigestHoweverTheBytesArrive) {
  std::string text(200, '\0');
  for (std::size_t i = 0; i < text.size(); ++i) text[i] = static_cast<char>(i * 7 + 3);
  const std::string whole = sha256_hex(text);
  for (std::size_t split = 0; split <= text.size(); ++split) {
    detail::Sha256 hash;
    hash.update(text.data(), split);
    hash.update(text.data() + split, text.size() - split);
    EXPECT_EQ(hex(hash.digest()), whole) << "split at " << split;
  }
}

/// The namespace of a float pool of 2 layers, 2 kv heads x 8, blocks of 4, for `model`.
detail::BlockSpace float_space(std::string_view model = "qwen3-0.6b", std::size_t block_tokens = 4) {
  return detail::block_space<float>(model, block_tokens, 2, 2, 8, {}, {});
}

TEST(BlockKeys, AreThoseDocsStoreMdDefinesOnEveryBuild) {
  // Computed with Python's hashlib from the definition in docs/store.md.
  const detail::BlockSpace space = float_space();
  EXPECT_EQ(hex(space.digest), "ce191b9bcd0e776c7e7f65d8ed2ed94aad456a1779643e46ac10e545f92cd4e1");
  const std::vector<std::int32_t> ids = {1, 2, 3, -4, 5, 6, 7, 151935};
  const std::vector<BlockKey> keys = detail::prompt_keys(space, ids, 4, 2);
  ASSERT_EQ(keys.size(), 2U);
  EXPECT_EQ(keys[0].hex(), "5556b85b8c733491c92e9c5f94c6ab75");
  EXPECT_EQ(keys[1].hex(), "c605551004c251a6f76c67aabc02ae82");
  EXPECT_EQ(keys[1], block_key(space.digest, keys[0], std::span(ids).subspan(4, 4)));
}

TEST(BlockKeys, ChangeWithEverythingTheNamespaceCoversAndWithThePrefix) {
  const std::vector<std::int32_t> ids = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<float> scales(4, 0.5F), other_scales(4, 0.25F);
  const std::vector<detail::BlockSpace> spaces = {
      float_space(),
      float_space("qwen3-0.6b@other-weights"),
      float_space("qwen3-0.6b", 8),
      detail::block_space<double>("qwen3-0.6b", 4, 2, 2, 8, {}, {}),
      detail::block_space<Eigen::bfloat16>("qwen3-0.6b", 4, 2, 2, 8, {}, {}),
      detail::block_space<float>("qwen3-0.6b", 4, 3, 2, 8, {}, {}),
      detail::block_space<float>("qwen3-0.6b", 4, 2, 1, 8, {}, {}),
      detail::block_space<float>("qwen3-0.6b", 4, 2, 2, 16, {}, {}),
      detail::block_space<fp8_e4m3_heads>("qwen3-0.6b", 4, 2, 2, 8, scales, scales),
      detail::block_space<fp8_e4m3_heads>("qwen3-0.6b", 4, 2, 2, 8, scales, other_scales),
  };
  std::vector<std::string> seen;
  for (const detail::BlockSpace& space : spaces) {
    const BlockKey first = detail::prompt_keys(space, ids, 4, 1)[0];
    EXPECT_EQ(std::count(seen.begin(), seen.end(), first.hex()), 0) << first.hex();
    seen.push_back(first.hex());
  }
  // A block's key names its whole prefix: the same ids after another first block differ.
  std::vector<std::int32_t> other = ids;
  other[0] = 9;
  EXPECT_NE(detail::prompt_keys(spaces[0], ids, 4, 2)[1], detail::prompt_keys(spaces[0], other, 4, 2)[1]);
}

/// A record of a block of random rows, with the namespace, keys and ids verify_block expects.
struct RecordCase {
  detail::BlockSpace space = float_space();
  std::vector<std::int32_t> ids = {10, 20, 30, 40, 50, 60, 70, 80};
  std::vector<BlockKey> keys = detail::prompt_keys(space, ids, 4, 2);
  std::vector<detail::RowStore<float>> rows;
  std::string record;

  RecordCase() {
    for (std::size_t l = 0; l < 2; ++l) rows.emplace_back(1, 2, 8, 4 * 3);
    std::vector<float> k(2 * 4 * 8), v(k.size());
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = static_cast<float>(i) * 0.5F;
      v[i] = -static_cast<float>(i);
    }
    for (auto& r : rows) {
      (void)r.encode(TensorView<const float>(k.data(), {1, 2, 4, 8}), TensorView<const float>(v.data(), {1, 2, 4, 8}),
                     0, 4, 4);  // block 1's slots
    }
    record = detail::encode_block<float>(space, keys[1], keys[0], std::span(ids).subspan(4, 4), rows, 4, 4);
  }
  [[nodiscard]] std::vector<std::string_view> verify(std::string_view bytes) const {
    return detail::verify_block<float>(bytes, space, keys[1], keys[0], std::span(ids).subspan(4, 4), rows, 8, 4);
  }
};

TEST(BlockRecords, CarryTheBlocksRowsWhichVerifyAndCopyIntoAnotherBlock) {
  RecordCase c;
  const std::vector<std::string_view> layers = c.verify(c.record);
  ASSERT_EQ(layers.size(), 2U);
  detail::copy_block_rows<float>(layers, c.rows, 8, 4);  // into block 2
  for (std::size_t l = 0; l < 2; ++l) {
    const Segment<float> from = c.rows[l].segment(4, 4, Positions(nullptr, 0)), to = c.rows[l].segment(8, 4, {});
    for (std::size_t h = 0; h < 2; ++h) {
      for (std::size_t t = 0; t < 4; ++t) {
        EXPECT_TRUE(std::equal(from.keys.row(0, h, t), from.keys.row(0, h, t) + 8, to.keys.row(0, h, t)));
        EXPECT_TRUE(std::equal(from.values.row(0, h, t), from.values.row(0, h, t) + 8, to.values.row(0, h, t)));
      }
    }
  }
}

TEST(BlockRecords, EveryBitFlippedAndEveryLengthCutShortIsRefused) {
  const RecordCase c;
  for (std::size_t at = 0; at < c.record.size(); ++at) {
    for (int bit = 0; bit < 8; bit += 3) {
      std::string bad = c.record;
      bad[at] = static_cast<char>(bad[at] ^ (1 << bit));
      EXPECT_THROW((void)c.verify(bad), std::runtime_error) << "byte " << at << " bit " << bit;
    }
  }
  for (std::size_t n = 0; n < c.record.size(); ++n) {
    EXPECT_THROW((void)c.verify(std::string_view(c.record).substr(0, n)), std::runtime_error) << n << " bytes";
  }
  EXPECT_THROW((void)c.verify(c.record + "x"), std::runtime_error);
}

TEST(BlockRecords, ARecordOfAnotherBlockOrNamespaceIsRefusedNamingTheField) {
  const RecordCase c;
  const auto refusal = [&](const detail::BlockSpace& space, const BlockKey& key, const BlockKey& parent,
                           std::vector<std::int32_t> ids) {
    try {
      (void)detail::verify_block<float>(c.record, space, key, parent, ids, c.rows, 8, 4);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const std::vector<std::int32_t> own(c.ids.begin() + 4, c.ids.end());
  EXPECT_THAT(refusal(float_space("another"), c.keys[1], c.keys[0], own),
              HasSubstr("namespace: model: expected \"another\" (the pool's), found \"qwen3-0.6b\""));
  EXPECT_THAT(refusal(float_space("qwen3-0.6b", 8), c.keys[1], c.keys[0], own),
              HasSubstr("namespace: block_tokens: expected 8 (the pool's), found 4"));
  EXPECT_THAT(refusal(c.space, c.keys[0], c.keys[0], own), HasSubstr("key: expected " + c.keys[0].hex()));
  EXPECT_THAT(refusal(c.space, c.keys[1], BlockKey{}, own), HasSubstr("parent key: expected 0000"));
  std::vector<std::int32_t> other = own;
  other[3] = 81;
  EXPECT_THAT(refusal(c.space, c.keys[1], c.keys[0], other),
              HasSubstr("token id 3: expected 81 (the prompt's), found 80"));
  EXPECT_EQ(refusal(c.space, c.keys[1], c.keys[0], own), "accepted");
}

}  // namespace
}  // namespace kvcache
