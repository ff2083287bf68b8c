// SPDX-License-Identifier: Apache-2.0
// The checkpoint readers: the strict JSON parser, the safetensors reader on crafted malformed
// files (each must fail with a message naming the file and the tensor), the 16-bit
// conversions, a round trip of the tiny model through F32, BF16 and F16 files, sharded
// checkpoints with Hugging Face's index, and config.json as its versions write it.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <bit>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "qwen3/checkpoint.hpp"
#include "qwen3/json.hpp"
#include "qwen3/model.hpp"
#include "qwen3/safetensors.hpp"
#include "qwen3/traffic.hpp"

namespace {

namespace fs = std::filesystem;
namespace st = qwen3::safetensors;
using ::testing::AllOf;
using ::testing::HasSubstr;

// ---- JSON -----------------------------------------------------------------------------------

TEST(Json, ParsesWhatConfigsAndHeadersUse) {
  const qwen3::json::Value v = qwen3::json::parse(
      R"( {"a": [1, -2, 3.5e2, 0, 18446744073709551615], "s": "q\"\\\/\n\u00e9\ud83d\ude00", "t": true,)"
      R"( "f": false, "n": null, "o": {}} )");
  const auto& a = v.find("a")->as_array();
  ASSERT_EQ(a.size(), 5U);
  EXPECT_EQ(a[0].as_uint(), 1U);
  EXPECT_DOUBLE_EQ(a[1].as_double(), -2.0);
  EXPECT_FALSE(a[1].is_uint());
  EXPECT_DOUBLE_EQ(a[2].as_double(), 350.0);
  EXPECT_FALSE(a[2].is_uint());                        // written with an exponent: not an integer literal
  EXPECT_EQ(a[4].as_uint(), 18446744073709551615ULL);  // exact, past 2^53
  EXPECT_EQ(v.find("s")->as_string(), "q\"\\/\n\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_TRUE(v.find("t")->as_bool());
  EXPECT_FALSE(v.find("f")->as_bool());
  EXPECT_TRUE(v.find("n")->is_null());
  EXPECT_TRUE(v.find("o")->as_object().empty());
  EXPECT_EQ(v.find("missing"), nullptr);
  EXPECT_THROW((void)v.find("s")->as_uint(), qwen3::json::Error);
  EXPECT_EQ(qwen3::json::parse(qwen3::json::quote("a\"b\\c\n\x01")).as_string(), "a\"b\\c\n\x01");
}

TEST(Json, RejectsWhatIsNotStrictJson) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "byte 0: expected a value"},
      {"{\"a\": 1,}", "byte 8: expected a string key"},
      {"[1, 2,]", "byte 6: expected a value"},
      {"{\"a\": 1} x", "byte 9: expected the end of the document"},
      {"{\"a\": 01}", "no leading zero"},
      {"{\"a\": 1.}", "a digit after '.'"},
      {"{\"a\": NaN}", "expected a value"},
      {"{\"a\": \"unterminated}", "a closing '\"'"},
      {"{\"a\": \"tab\there\"}", "control characters must be escaped"},
      {"{\"a\": \"\\x\"}", "one of"},
      {"{\"a\": \"\\ud800\"}", "a low surrogate"},
      {"{\"a\": \"\\udc00\"}", "a high surrogate before a low one"},
      {"{\"a\": 1, \"a\": 2}", "\"a\" is repeated"},
      {"{\"a\" 1}", "expected ':'"},
      {"[1 2]", "expected ',' or ']'"},
      {"tru", "expected a value"},
      {"1e999", "within the range of a double"},
      {std::string(100, '[') + std::string(100, ']'), "levels of nesting"},
  };
  for (const auto& [text, message] : bad) {
    try {
      (void)qwen3::json::parse(text);
      ADD_FAILURE() << "parsed: " << text;
    } catch (const qwen3::json::Error& e) {
      EXPECT_THAT(e.what(), AllOf(HasSubstr("JSON error at byte"), HasSubstr(message))) << text;
    }
  }
}

// ---- 16-bit conversions ---------------------------------------------------------------------

TEST(Conversions, HalfAndBfloat16MatchEigenForEveryValue) {
  for (std::uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const auto h = static_cast<std::uint16_t>(bits);
    const float mine = st::float_from_f16(h);
    const float eigen = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(h));
    if (std::isnan(eigen)) {
      EXPECT_TRUE(std::isnan(mine)) << bits;
    } else {
      EXPECT_EQ(std::bit_cast<std::uint32_t>(mine), std::bit_cast<std::uint32_t>(eigen)) << "f16 " << bits;
    }
    EXPECT_EQ(std::bit_cast<std::uint32_t>(st::float_from_bf16(h)),
              std::bit_cast<std::uint32_t>(static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(h))));
  }
  // Rounding: every float pattern in a seeded sample, plus the edges.
  qwen3::SplitMix64 rng(99);
  std::vector<float> samples = {0.0F,      -0.0F,           65504.0F,       65519.99F,         65520.0F,
                                1e-8F,     2.98e-8F,        5.96e-8F,       6.1e-5F,           INFINITY,
                                -INFINITY, 1.0F + 0x1p-11F, 1.0F + 0x1p-8F, 1.0F + 3 * 0x1p-9F};
  for (int i = 0; i < 200000; ++i) samples.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng.next())));
  for (const float f : samples) {
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(st::float_from_f16(st::f16_from_float(f))));
      EXPECT_TRUE(std::isnan(st::float_from_bf16(st::bf16_from_float(f))));
      continue;
    }
    EXPECT_EQ(st::f16_from_float(f), Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(f))) << f;
    EXPECT_EQ(st::bf16_from_float(f), Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(f))) << f;
  }
}

// ---- crafted files ----------------------------------------------------------------------------

class TempDir : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("kvcache_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  /// Writes a safetensors file: the length field (the header's own unless given), the header, the data.
  [[nodiscard]] fs::path write(const std::string& name, const std::string& header, std::size_t data_bytes,
                               std::uint64_t length = UINT64_MAX) const {
    fs::path path = dir_ / name;
    std::ofstream out(path, std::ios::binary);
    const std::uint64_t n = length == UINT64_MAX ? header.size() : length;
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
    out << header << std::string(data_bytes, '\x01');
    return path;
  }

  /// The message of the safetensors::Error that opening `path` throws (empty if none).
  static std::string open_error(const fs::path& path) {
    try {
      (void)st::File::open(path);
    } catch (const st::Error& e) {
      return e.what();
    }
    return {};
  }

  fs::path dir_;
};

using Malformed = TempDir;

TEST_F(Malformed, TruncatedFile) {
  const fs::path path = dir_ / "short.safetensors";
  std::ofstream(path, std::ios::binary) << "abc";
  EXPECT_THAT(open_error(path), AllOf(HasSubstr("short.safetensors"), HasSubstr("truncated: 3 bytes")));
}

TEST_F(Malformed, HeaderLengthBeyondTheFile) {
  const auto path = write("long.safetensors", "{}", 4, 1000);
  EXPECT_THAT(open_error(path), AllOf(HasSubstr("long.safetensors"), HasSubstr("header length 1000 runs past the end"),
                                      HasSubstr("6 bytes follow")));
  const auto huge = write("huge.safetensors", "{}", 0, UINT64_MAX - 1);
  EXPECT_THAT(open_error(huge), HasSubstr("runs past the end"));
}

TEST_F(Malformed, BadJson) {
  const auto path = write("json.safetensors", R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},})", 4);
  EXPECT_THAT(open_error(path), AllOf(HasSubstr("json.safetensors"), HasSubstr("header is not valid JSON"),
                                      HasSubstr("expected a string key")));
  const auto array = write("array.safetensors", "[]", 0);
  EXPECT_THAT(open_error(array), HasSubstr("expected a JSON object, given an array"));
}

TEST_F(Malformed, UnknownOrUnsupportedDtype) {
  const auto path =
      write("dtype.safetensors", R"({"model.norm.weight": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}})", 4);
  EXPECT_THAT(open_error(path), AllOf(HasSubstr("dtype.safetensors"), HasSubstr("tensor 'model.norm.weight'"),
                                      HasSubstr("unknown dtype 'F33'")));
  const auto i64 = write("i64.safetensors", R"({"ids": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})", 8);
  EXPECT_THAT(open_error(i64), AllOf(HasSubstr("tensor 'ids'"), HasSubstr("dtype I64 is not supported")));
}

TEST_F(Malformed, BadFields) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", "shape: expected non-negative integers"},
      {R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", "shape: expected non-negative integers"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", "expected [begin, end], given 1 numbers"},
      {R"({"w": {"dtype": "F32", "shape": [1]}})", "missing field 'data_offsets'"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}})", "unexpected field 'extra'"},
      {R"({"w": {"dtype": 32, "shape": [1], "data_offsets": [0, 4]}})", "dtype: expected a string"},
      {R"({"w": [1]})", "expected an object, given an array"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})", "end before begin"},
      {R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 4]}})", "is too large"},
      {R"({"__metadata__": {"format": 1}})", "__metadata__['format']: expected a string"},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const auto path = write("fields" + std::to_string(i) + ".safetensors", cases[i].first, 4);
    EXPECT_THAT(open_error(path),
                AllOf(HasSubstr("fields" + std::to_string(i) + ".safetensors"), HasSubstr(cases[i].second)))
        << cases[i].first;
  }
}

TEST_F(Malformed, SizeDisagreesWithShape) {
  const auto path =
      write("size.safetensors", R"({"w.weight": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 8]}})", 8);
  EXPECT_THAT(open_error(path), AllOf(HasSubstr("tensor 'w.weight'"), HasSubstr("hold 8 bytes"),
                                      HasSubstr("shape [2, 3] of BF16 needs 12")));
}

TEST_F(Malformed, OffsetsOutsideTheData) {
  const auto path =
      write("outside.safetensors", R"({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}})", 16);
  EXPECT_THAT(open_error(path), AllOf(HasSubstr("outside.safetensors"), HasSubstr("tensor 'w'"),
                                      HasSubstr("[0, 24] run past the end of the data section (16 bytes)")));
}

TEST_F(Malformed, OffsetsOverlapOrLeaveGaps) {
  const auto overlap = write("overlap.safetensors",
                             R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},)"
                             R"( "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
                             24);
  EXPECT_THAT(open_error(overlap), AllOf(HasSubstr("overlap.safetensors"), HasSubstr("tensor 'b'"),
                                         HasSubstr("[8, 24] overlap tensor 'a' [0, 16]")));
  const auto gap = write("gap.safetensors",
                         R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                         R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}})",
                         20);
  EXPECT_THAT(open_error(gap), AllOf(HasSubstr("tensor 'b'"), HasSubstr("gap of 4 bytes after tensor 'a'")));
  const auto trailing =
      write("trailing.safetensors", R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 12);
  EXPECT_THAT(open_error(trailing), AllOf(HasSubstr("trailing.safetensors"), HasSubstr("4 bytes of data after")));
}

TEST_F(Malformed, ValidFileReadsBackExactly) {
  const std::vector<float> a = {1.0F, -2.5F, 3.25F, 65504.0F, 1e-7F, 0.1F};
  st::write(dir_ / "ok.safetensors",
            {{"a32", st::Dtype::f32, {2, 3}, a}, {"a16", st::Dtype::f16, {6}, a}, {"ab16", st::Dtype::bf16, {3, 2}, a}},
            {{"format", "pt"}});
  st::File file = st::File::open(dir_ / "ok.safetensors");
  EXPECT_EQ(file.metadata().at("format"), "pt");
  ASSERT_EQ(file.tensors().size(), 3U);
  for (const char* name : {"a32", "a16", "ab16"}) {
    const st::TensorInfo* info = file.find(name);
    ASSERT_NE(info, nullptr) << name;
    std::vector<float> got(info->elements());
    file.read(*info, got);
    for (std::size_t i = 0; i < a.size(); ++i) {
      const float want = info->dtype == st::Dtype::f32   ? a[i]
                         : info->dtype == st::Dtype::f16 ? st::float_from_f16(st::f16_from_float(a[i]))
                                                         : st::float_from_bf16(st::bf16_from_float(a[i]));
      EXPECT_EQ(got[i], want) << name << "[" << i << "]";
    }
  }
  EXPECT_EQ(file.find("nope"), nullptr);
  std::vector<float> wrong(5);
  EXPECT_THROW(file.read(*file.find("a32"), wrong), std::invalid_argument);
}

// ---- checkpoints ------------------------------------------------------------------------------

using Checkpoint = TempDir;

qwen3::Config tiny_config(bool tied = true) {
  qwen3::Config c;
  c.layers = 2;
  c.tied = tied;
  return c;
}

std::vector<qwen3::TokenId> some_tokens() {
  const std::string text = "safetensors round trip";
  return {text.begin(), text.end()};
}

double max_abs_diff(const qwen3::Matrix& a, const qwen3::Matrix& b) {
  return static_cast<double>((a - b).cwiseAbs().maxCoeff());
}

/// `w` with every value rounded through `dtype`, as it comes back from a file of that dtype.
qwen3::Weights rounded(qwen3::Weights w, st::Dtype dtype) {
  qwen3::for_each_tensor(w, [&](const std::string&, auto& tensor, const auto&) {
    for (Eigen::Index i = 0; i < tensor.size(); ++i) {
      float& x = tensor.data()[i];
      x = dtype == st::Dtype::bf16  ? st::float_from_bf16(st::bf16_from_float(x))
          : dtype == st::Dtype::f16 ? st::float_from_f16(st::f16_from_float(x))
                                    : x;
    }
  });
  return w;
}

TEST_F(Checkpoint, RoundTripGivesTheSameLogits) {
  for (const bool tied : {true, false}) {
    for (const st::Dtype dtype : {st::Dtype::f32, st::Dtype::bf16, st::Dtype::f16}) {
      const qwen3::Weights original = qwen3::random_weights(tiny_config(tied), 5);
      const fs::path dir = dir_ / (std::string(st::dtype_name(dtype)) + (tied ? "_tied" : "_untied"));
      qwen3::save_checkpoint(dir, original, dtype, tied ? 1 : 3);
      qwen3::Model loaded(qwen3::load_checkpoint(dir));
      EXPECT_EQ(loaded.config().tied, tied);
      EXPECT_EQ(loaded.config().layers, 2U);
      qwen3::Model expected(rounded(original, dtype));
      qwen3::Model exact(original);
      const auto tokens = some_tokens();
      const qwen3::Matrix got = loaded.forward_uncached(tokens);
      EXPECT_LE(max_abs_diff(got, expected.forward_uncached(tokens)), 1e-5) << st::dtype_name(dtype);
      if (dtype == st::Dtype::f32) {
        EXPECT_EQ(max_abs_diff(got, exact.forward_uncached(tokens)), 0.0);
      } else {
        // Rounded weights give visibly different, but nearby, logits: the file was really 16-bit.
        const double drift = max_abs_diff(got, exact.forward_uncached(tokens));
        EXPECT_GT(drift, 1e-5) << st::dtype_name(dtype);
        EXPECT_LT(drift, 0.5) << st::dtype_name(dtype);
      }
    }
  }
}

TEST_F(Checkpoint, FilesHoldExactlyTheParametersTheTrafficReportCounts) {
  for (const bool tied : {true, false}) {
    const fs::path dir = dir_ / (tied ? "tied" : "untied");
    qwen3::save_checkpoint(dir, qwen3::random_weights(tiny_config(tied)), st::Dtype::bf16, 2);
    std::uint64_t elements = 0;
    std::uint64_t bytes = 0;
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.path().extension() != ".safetensors") continue;
      const st::File file = st::File::open(entry.path());
      for (const st::TensorInfo& t : file.tensors()) {
        elements += t.elements();
        bytes += t.end - t.begin;
      }
    }
    EXPECT_EQ(elements, qwen3::parameters(tiny_config(tied)));
    EXPECT_EQ(bytes, 2 * qwen3::parameters(tiny_config(tied)));
  }
}

TEST_F(Checkpoint, MissingTensorNamesItAndTheFiles) {
  const qwen3::Weights w = qwen3::random_weights(tiny_config());
  qwen3::save_checkpoint(dir_, w);
  std::vector<st::TensorToWrite> all;
  qwen3::for_each_tensor(w, [&](const std::string& name, const auto& t, const std::vector<std::size_t>& shape) {
    if (name != "model.layers.1.mlp.up_proj.weight") {
      all.push_back({name,
                     st::Dtype::f32,
                     {shape.begin(), shape.end()},
                     std::span<const float>(t.data(), static_cast<std::size_t>(t.size()))});
    }
  });
  st::write(dir_ / "model.safetensors", all);
  try {
    (void)qwen3::load_checkpoint(dir_);
    FAIL() << "loaded a checkpoint with a tensor missing";
  } catch (const st::Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("tensor 'model.layers.1.mlp.up_proj.weight' not found in"),
                                HasSubstr("model.safetensors")));
  }
}

TEST_F(Checkpoint, DirectoryWithATrailingSlashIsNamedInMessages) {
  const qwen3::Weights w = qwen3::random_weights(tiny_config());
  qwen3::save_checkpoint(dir_, w);
  // The checkpoint itself loads through any spelling of its directory.
  for (const std::string& spelling : {dir_.string() + "/", dir_.string() + "/.", dir_.string() + "//"}) {
    EXPECT_EQ(qwen3::load_checkpoint(spelling).config.layers, 2U) << spelling;
  }
  st::write(dir_ / "model.safetensors", {});
  for (const std::string& spelling : {dir_.string() + "/", dir_.string() + "/.", dir_.string() + "/sub/.."}) {
    try {
      (void)qwen3::load_checkpoint(spelling);
      ADD_FAILURE() << "loaded a checkpoint with no tensors: " << spelling;
    } catch (const st::Error& e) {
      EXPECT_THAT(e.what(), ::testing::StartsWith(dir_.filename().string() + ": tensor '")) << spelling;
    }
  }
}

TEST_F(Checkpoint, WrongShapeDuplicateAndStrayTensorsAreErrors) {
  const qwen3::Weights w = qwen3::random_weights(tiny_config());
  qwen3::save_checkpoint(dir_, w);
  const std::vector<float> values(std::size_t{128} * 64, 0.5F);
  const auto expect_error = [&](const std::vector<std::string>& parts) {
    try {
      (void)qwen3::load_checkpoint(dir_);
      ADD_FAILURE() << "loaded";
    } catch (const st::Error& e) {
      for (const auto& p : parts) EXPECT_THAT(e.what(), HasSubstr(p));
    }
  };
  // A second file with a tensor the first also has.
  st::write(dir_ / "extra.safetensors", {{"model.norm.weight", st::Dtype::f32, {128}, {values.data(), 128}}});
  expect_error({"model.safetensors", "tensor 'model.norm.weight': also in extra.safetensors"});
  // A tensor no Qwen3 layer has (a bias, say).
  st::write(dir_ / "extra.safetensors",
            {{"model.layers.0.self_attn.q_proj.bias", st::Dtype::f32, {128}, {values.data(), 128}}});
  expect_error({"extra.safetensors", "tensor 'model.layers.0.self_attn.q_proj.bias'", "not part of a Qwen3 model"});
  fs::remove(dir_ / "extra.safetensors");
  // The right name with the wrong shape.
  std::vector<st::TensorToWrite> all;
  qwen3::for_each_tensor(w, [&](const std::string& name, const auto& t, const std::vector<std::size_t>& shape) {
    if (name == "model.layers.0.self_attn.k_proj.weight") {
      all.push_back({name, st::Dtype::f32, {128, 64}, values});
    } else {
      all.push_back({name,
                     st::Dtype::f32,
                     {shape.begin(), shape.end()},
                     std::span<const float>(t.data(), static_cast<std::size_t>(t.size()))});
    }
  });
  st::write(dir_ / "model.safetensors", all);
  expect_error({"model.safetensors", "tensor 'model.layers.0.self_attn.k_proj.weight'", "shape [128, 64]",
                "expected [64, 128] from config.json"});
  // A malformed file among good ones is reported as itself.
  std::ofstream(dir_ / "broken.safetensors", std::ios::binary) << "xy";
  expect_error({"broken.safetensors", "truncated"});
}

// ---- sharded checkpoints with an index ------------------------------------------------------

using WeightMap = std::map<std::string, std::string>;  // tensor -> shard file name

/// What the shards in `dir` hold, as the index's weight_map would say.
WeightMap weight_map_of(const fs::path& dir) {
  WeightMap map;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    const st::File file = st::File::open(entry.path());
    for (const st::TensorInfo& t : file.tensors()) map.emplace(t.name, entry.path().filename().string());
  }
  return map;
}

/// Writes `dir`/model.safetensors.index.json as Hugging Face lays it out.
void write_index(const fs::path& dir, const WeightMap& map) {
  std::ofstream out(dir / "model.safetensors.index.json", std::ios::binary);
  out << "{\n  \"metadata\": {\"total_size\": 123456},\n  \"weight_map\": {";
  const char* separator = "\n";
  for (const auto& [tensor, shard] : map) {
    out << separator << "    " << qwen3::json::quote(tensor) << ": " << qwen3::json::quote(shard);
    separator = ",\n";
  }
  out << "\n  }\n}\n";
}

/// A tied two-shard checkpoint of `w` in `dir` with its index, as Hugging Face writes one.
WeightMap save_indexed(const fs::path& dir, const qwen3::Weights& w) {
  qwen3::save_checkpoint(dir, w, st::Dtype::f32, 2);
  WeightMap map = weight_map_of(dir);
  write_index(dir, map);
  return map;
}

/// The message of the safetensors::Error that loading `dir` throws (empty if none).
std::string load_error(const fs::path& dir) {
  try {
    (void)qwen3::load_checkpoint(dir);
  } catch (const st::Error& e) {
    return e.what();
  }
  return {};
}

const char* const shard1 = "model-00001-of-00002.safetensors";
const char* const shard2 = "model-00002-of-00002.safetensors";

TEST_F(Checkpoint, IndexPicksTheShardsAndOtherFilesAreIgnored) {
  const qwen3::Weights w = qwen3::random_weights(tiny_config(), 7);
  const WeightMap map = save_indexed(dir_, w);
  ASSERT_EQ(map.at("model.embed_tokens.weight"), shard1);
  ASSERT_EQ(map.at("model.norm.weight"), shard2);
  // A single-file copy beside the shards, with other values (as some repositories ship): the
  // index says where each tensor is, so it is not read, nor is its duplicate an error.
  const std::vector<float> other(128, 9.0F);
  st::write(dir_ / "consolidated.safetensors", {{"model.norm.weight", st::Dtype::f32, {128}, other}});
  const qwen3::Weights loaded = qwen3::load_checkpoint(dir_);
  EXPECT_EQ(loaded.final_norm, w.final_norm);
  const auto tokens = some_tokens();
  EXPECT_EQ(max_abs_diff(qwen3::Model(loaded).forward_uncached(tokens), qwen3::Model(w).forward_uncached(tokens)), 0.0);
}

TEST_F(Checkpoint, IndexNamingAMissingShardNamesTheShard) {
  save_indexed(dir_, qwen3::random_weights(tiny_config()));
  fs::remove(dir_ / shard2);
  // The directory is named as a canonical path, which may differ from dir_ by a symbolic link.
  EXPECT_THAT(load_error(dir_),
              AllOf(HasSubstr(std::string("shard ") + shard2 + " named by model.safetensors.index.json: not found in "),
                    HasSubstr(dir_.filename().string() + " (the index places "), HasSubstr(" tensors there)")));
}

TEST_F(Checkpoint, IndexAndShardsThatDisagreeAreErrors) {
  const qwen3::Weights w = qwen3::random_weights(tiny_config());
  WeightMap map = save_indexed(dir_, w);
  // The second shard rewritten without a tensor the index places in it.
  const std::string dropped = "model.norm.weight";
  std::vector<st::TensorToWrite> rest;
  const st::File second = st::File::open(dir_ / shard2);
  qwen3::for_each_tensor(w, [&](const std::string& name, const auto& t, const std::vector<std::size_t>& shape) {
    if (name != dropped && second.find(name) != nullptr) {
      rest.push_back({name,
                      st::Dtype::f32,
                      {shape.begin(), shape.end()},
                      std::span<const float>(t.data(), static_cast<std::size_t>(t.size()))});
    }
  });
  st::write(dir_ / shard2, rest);
  EXPECT_THAT(load_error(dir_), AllOf(HasSubstr("model.safetensors.index.json: tensor '" + dropped + "'"),
                                      HasSubstr(std::string("not found in ") + shard2)));
  // The index without it: then it is a tensor of the model that no shard holds.
  map.erase(dropped);
  write_index(dir_, map);
  EXPECT_THAT(load_error(dir_),
              HasSubstr("model.safetensors.index.json: tensor '" + dropped + "' not found in the weight_map"));
  // A shard holding a tensor the index places in the other shard, or does not name.
  save_indexed(dir_, w);
  map = weight_map_of(dir_);
  map["model.embed_tokens.weight"] = shard2;
  write_index(dir_, map);
  EXPECT_THAT(load_error(dir_), HasSubstr(std::string(shard1) +
                                          ": tensor 'model.embed_tokens.weight': model.safetensors.index.json "
                                          "places it in " +
                                          shard2));
  map.erase("model.embed_tokens.weight");
  write_index(dir_, map);
  EXPECT_THAT(load_error(dir_), HasSubstr(std::string(shard1) + ": tensor 'model.embed_tokens.weight': not in the "
                                                                "weight_map of model.safetensors.index.json"));
}

TEST_F(Checkpoint, AConfigLargerThanItsFilesIsRefusedBeforeAnythingIsAllocated) {
  // Found by fuzz/checkpoint_fuzz: config.json's sizes were allocated before the files were
  // checked to hold them, so a lying vocab_size or num_hidden_layers asked for terabytes.
  qwen3::save_checkpoint(dir_, qwen3::random_weights(tiny_config()), st::Dtype::f16);
  qwen3::Config huge = tiny_config();
  huge.vocab = 100'000'000'000;
  std::ofstream(dir_ / "config.json", std::ios::binary | std::ios::trunc) << qwen3::config_json(huge);
  EXPECT_THAT(load_error(dir_), AllOf(HasSubstr("model.embed_tokens.weight': shape [256, 128], expected "
                                                "[100000000000, 128] from config.json")));
  huge = tiny_config();
  huge.layers = std::size_t{1} << 60;
  std::ofstream(dir_ / "config.json", std::ios::binary | std::ios::trunc) << qwen3::config_json(huge);
  EXPECT_THAT(load_error(dir_), HasSubstr("tensor 'model.layers.2.input_layernorm.weight' not found in "
                                          "model.safetensors"));
}

TEST_F(Checkpoint, MalformedIndexIsAnError) {
  save_indexed(dir_, qwen3::random_weights(tiny_config()));
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"metadata": {}})", "weight_map: missing"},
      {R"({"weight_map": []})", "weight_map: expected an object, given an array"},
      {R"({"weight_map": {"model.norm.weight": 2}})", "weight_map['model.norm.weight']: expected a file name"},
      {R"({"weight_map": {"model.norm.weight": "../model.safetensors"}})",
       R"(expected a file name in the same directory, given the string "../model.safetensors")"},
      {R"({"weight_map": {"model.norm.weight": ""}})", "expected a file name"},
      {R"({"weight_map": {},})", "not valid JSON"},
  };
  for (const auto& [text, message] : cases) {
    std::ofstream(dir_ / "model.safetensors.index.json", std::ios::binary | std::ios::trunc) << text;
    EXPECT_THAT(load_error(dir_), AllOf(HasSubstr("model.safetensors.index.json: "), HasSubstr(message))) << text;
  }
}

TEST(Config, ParsesAQwen3ConfigAndRejectsOthers) {
  const qwen3::Config c = qwen3::parse_config(R"({"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
      "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
      "intermediate_size": 3072, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "tie_word_embeddings": true,
      "rope_scaling": null, "hidden_act": "silu", "torch_dtype": "bfloat16", "attention_bias": false})");
  const qwen3::Config want = qwen3::Config::qwen3_0_6b();
  EXPECT_EQ(c.vocab, want.vocab);
  EXPECT_EQ(c.hidden, want.hidden);
  EXPECT_EQ(c.layers, want.layers);
  EXPECT_EQ(c.q_heads, want.q_heads);
  EXPECT_EQ(c.kv_heads, want.kv_heads);
  EXPECT_EQ(c.head_dim, want.head_dim);
  EXPECT_EQ(c.mlp, want.mlp);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-6F);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_TRUE(c.tied);
  // What config_json writes, parse_config reads back.
  const qwen3::Config back = qwen3::parse_config(qwen3::config_json(c));
  EXPECT_EQ(back.vocab, c.vocab);
  EXPECT_EQ(back.head_dim, c.head_dim);
  EXPECT_FLOAT_EQ(back.rms_eps, c.rms_eps);
  EXPECT_TRUE(back.tied);

  const std::string base = R"("vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 384, "rope_theta": 1e6)";
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{" + base + ", \"model_type\": \"llama\"}", "model_type: expected \"qwen3\""},
      {R"({"vocab_size": 256})", "hidden_size: missing"},
      {"{" + base + ", \"hidden_size\": 12}", "duplicate"},
      {"{" + base + ", \"rope_scaling\": {\"type\": \"yarn\"}}", "rope_scaling: expected null"},
      {"{" + base + ", \"attention_bias\": true}", "attention_bias"},
      {R"({"vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 3, "intermediate_size": 384, "rope_theta": 1e6})",
       "q_heads: expected a multiple of kv_heads 3"},
      {R"({"vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 2, "intermediate_size": 384})",
       "rope_theta: missing"},
      {R"({"vocab_size": -1})", "vocab_size: expected a positive integer"},
      {"{" + base + ",}", "not valid JSON"},
  };
  for (const auto& [text, message] : bad) {
    try {
      (void)qwen3::parse_config(text, "my/config.json");
      ADD_FAILURE() << "parsed: " << text;
    } catch (const st::Error& e) {
      // A duplicate key is a JSON error; the rest name the field.
      const std::string expected = message == "duplicate" ? "is repeated" : message;
      EXPECT_THAT(e.what(), AllOf(HasSubstr("my/config.json"), HasSubstr(expected))) << text;
    }
  }
}

/// A small config.json object: the base fields, then `extra` (", \"key\": value" pairs).
std::string config_text(const std::string& extra) {
  return R"({"model_type": "qwen3", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 384)" +
         extra + "}";
}

/// The message of the safetensors::Error that parse_config throws for `text` (empty if none).
std::string config_error(const std::string& text) {
  try {
    (void)qwen3::parse_config(text, "my/config.json");
  } catch (const st::Error& e) {
    return e.what();
  }
  return {};
}

TEST(Config, RopeThetaInsideRopeParameters) {
  const qwen3::Config c =
      qwen3::parse_config(config_text(R"(, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0})"));
  EXPECT_DOUBLE_EQ(c.rope_theta, 5e5);
  // Both places, the same value: an older key kept beside the new one.
  const qwen3::Config both = qwen3::parse_config(
      config_text(R"(, "rope_theta": 500000, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5})"));
  EXPECT_DOUBLE_EQ(both.rope_theta, 5e5);
  // Without rope_type, or with rope_parameters null beside a top-level rope_theta.
  EXPECT_DOUBLE_EQ(qwen3::parse_config(config_text(R"(, "rope_parameters": {"rope_theta": 20000})")).rope_theta, 2e4);
  EXPECT_DOUBLE_EQ(qwen3::parse_config(config_text(R"(, "rope_theta": 20000, "rope_parameters": null)")).rope_theta,
                   2e4);

  EXPECT_THAT(config_error(config_text("")),
              AllOf(HasSubstr("my/config.json: rope_theta: missing"), HasSubstr("rope_parameters.rope_theta")));
  EXPECT_THAT(config_error(config_text(R"(, "rope_parameters": {"rope_type": "default"})")),
              HasSubstr("rope_parameters.rope_theta: missing"));
  EXPECT_THAT(config_error(config_text(R"(, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6})")),
              AllOf(HasSubstr("rope_parameters.rope_type: expected \"default\""), HasSubstr("\"yarn\"")));
  EXPECT_THAT(config_error(config_text(R"(, "rope_parameters": 1e6)")),
              HasSubstr("rope_parameters: expected an object, given the number"));
  EXPECT_THAT(config_error(config_text(R"(, "rope_parameters": {"rope_theta": "1e6"})")),
              HasSubstr("rope_parameters.rope_theta: expected a number, given the string \"1e6\""));
}

TEST(Config, RopeThetaGivenTwiceWithDifferentValuesIsRefused) {
  try {
    (void)qwen3::parse_config(
        config_text(R"(, "rope_theta": 10000, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0})"),
        "my/config.json");
    FAIL() << "parsed a config with two rotary bases";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("my/config.json"), HasSubstr("rope_theta 10000 "),
                                HasSubstr("rope_parameters.rope_theta 1000000 ")));
  }
}

TEST(Config, HeadDimAndKvHeadsDefaultAsQwen3ConfigDoes) {
  const std::string sizes = R"({"model_type": "qwen3", "vocab_size": 256, "hidden_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 8, "intermediate_size": 384, "rope_theta": 1e6)";
  // No head_dim: Qwen3's 128, not hidden / heads = 16.
  const qwen3::Config c = qwen3::parse_config(sizes + R"(, "num_key_value_heads": 2})");
  EXPECT_EQ(c.head_dim, 128U);
  EXPECT_EQ(c.q_width(), 1024U);
  EXPECT_EQ(c.kv_heads, 2U);
  // num_key_value_heads null, or absent: one kv head per query head.
  for (const std::string& kv : {std::string(R"(, "num_key_value_heads": null})"), std::string("}")}) {
    const qwen3::Config mha = qwen3::parse_config(sizes + R"(, "head_dim": 16)" + kv);
    EXPECT_EQ(mha.kv_heads, 8U) << kv;
    EXPECT_EQ(mha.head_dim, 16U) << kv;
  }
  // Written, they must still be positive integers.
  EXPECT_THAT(config_error(sizes + R"(, "head_dim": null})"), HasSubstr("head_dim: expected a positive integer"));
  EXPECT_THAT(config_error(sizes + R"(, "num_key_value_heads": 0})"),
              HasSubstr("num_key_value_heads: expected a positive integer, given the number 0"));
}

}  // namespace
