// SPDX-License-Identifier: Apache-2.0
#pragma once

// Reading and writing safetensors files: an 8-byte little-endian header length, a JSON header
// {"name": {"dtype": "BF16", "shape": [r, c], "data_offsets": [begin, end]}, ...}, then the
// tensors' bytes. open() validates the whole header against the file before any tensor is
// read, so a truncated or hostile file ends in a safetensors::Error naming the file and the
// tensor, never in a read outside the file.

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qwen3/json.hpp"

namespace qwen3::safetensors {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this reader copies it as it is, so it needs a little-endian host.");

/// A file that cannot be read as safetensors; the message names the file and the tensor.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Element types this reader converts to float.
enum class Dtype { f32, f16, bf16 };

/// The header's name for a dtype: "F32", "F16", "BF16".
[[nodiscard]] constexpr const char* dtype_name(Dtype d) noexcept {
  return d == Dtype::f32 ? "F32" : d == Dtype::f16 ? "F16" : "BF16";
}

/// Bytes per element.
[[nodiscard]] constexpr std::size_t dtype_size(Dtype d) noexcept { return d == Dtype::f32 ? 4 : 2; }

// IEEE binary16 and bfloat16 conversions, round to nearest even, written out so that this
// header needs no Eigen (the tests check them against Eigen::half and Eigen::bfloat16).

/// float -> bfloat16 bits, rounding to nearest even; NaN stays NaN.
[[nodiscard]] inline std::uint16_t bf16_from_float(float f) noexcept {
  const auto bits = std::bit_cast<std::uint32_t>(f);
  if ((bits & 0x7fffffffU) > 0x7f800000U) return static_cast<std::uint16_t>((bits >> 16) | 0x40U);  // quiet NaN
  return static_cast<std::uint16_t>((bits + 0x7fffU + ((bits >> 16) & 1U)) >> 16);
}

/// bfloat16 bits -> float (exact).
[[nodiscard]] inline float float_from_bf16(std::uint16_t h) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

/// binary16 bits -> float (exact, subnormals included).
[[nodiscard]] inline float float_from_f16(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000U) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fU;
  std::uint32_t mantissa = h & 0x3ffU;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000U | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return std::bit_cast<float>(sign);
  // Subnormal: shift the leading one up to the implicit bit.
  std::uint32_t e = 113;
  while ((mantissa & 0x400U) == 0) {
    mantissa <<= 1;
    --e;
  }
  return std::bit_cast<float>(sign | (e << 23) | ((mantissa & 0x3ffU) << 13));
}

/// float -> binary16 bits, rounding to nearest even; overflow gives infinity.
[[nodiscard]] inline std::uint16_t f16_from_float(float f) noexcept {
  const auto bits = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000U);
  const std::uint32_t abs = bits & 0x7fffffffU;
  if (abs > 0x7f800000U) return static_cast<std::uint16_t>(sign | 0x7e00U);   // NaN
  if (abs >= 0x477ff000U) return static_cast<std::uint16_t>(sign | 0x7c00U);  // rounds to >= 65520: infinity
  if (abs < 0x38800000U) {
    // Result is subnormal (or zero): value / 2^-24, rounded to nearest even.
    const float scaled = std::bit_cast<float>(abs) * 0x1p24F;  // exact: a power-of-two scale
    auto q = static_cast<std::uint32_t>(scaled);
    const float rest = scaled - static_cast<float>(q);
    if (rest > 0.5F || (rest == 0.5F && (q & 1U) != 0)) ++q;
    return static_cast<std::uint16_t>(sign | q);
  }
  const std::uint32_t rounded = abs + 0xfffU + ((abs >> 13) & 1U);
  return static_cast<std::uint16_t>(sign | ((rounded - 0x38000000U) >> 13));
}

/// One tensor's header entry; offsets are relative to the start of the data section.
struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::f32;
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;

  /// Elements in the tensor (validated not to overflow when the file was opened).
  [[nodiscard]] std::uint64_t elements() const noexcept {
    std::uint64_t n = 1;
    for (const std::uint64_t d : shape) n *= d;
    return n;
  }
};

/// "[2, 3]" for messages.
template <class Int>
[[nodiscard]] std::string shape_str(const std::vector<Int>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i != 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

/// An open, validated safetensors file. Tensors are read on demand, converted to float.
///
///   auto file = qwen3::safetensors::File::open("model.safetensors");
///   const auto* info = file.find("model.norm.weight");
///   std::vector<float> values(info->elements());
///   file.read(*info, values);
class File {
 public:
  /// Larger headers are refused rather than allocated: no real checkpoint comes close.
  static constexpr std::uint64_t max_header_bytes = 100ULL << 20;

  /// Opens and validates `path`; safetensors::Error for anything malformed.
  [[nodiscard]] static File open(const std::filesystem::path& path) {
    File f;
    f.path_ = path;
    f.name_ = path.filename().string();
    std::error_code ec;
    const std::uint64_t size = std::filesystem::file_size(path, ec);
    if (ec) f.fail("cannot read the file size (" + ec.message() + ")");
    f.stream_.open(path, std::ios::binary);
    if (!f.stream_) f.fail("cannot open the file");
    if (size < 8) f.fail("truncated: " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
    std::array<unsigned char, 8> length_bytes{};
    f.read_at(0, length_bytes.data(), 8, "the header length");
    std::uint64_t header = 0;
    for (int i = 7; i >= 0; --i) header = (header << 8) | length_bytes[static_cast<std::size_t>(i)];
    if (header > size - 8) {
      f.fail("header length " + std::to_string(header) + " runs past the end of the file (" + std::to_string(size - 8) +
             " bytes follow the length field)");
    }
    if (header > max_header_bytes) {
      f.fail("header length " + std::to_string(header) + " exceeds the " + std::to_string(max_header_bytes) +
             "-byte limit");
    }
    std::string text(static_cast<std::size_t>(header), '\0');
    f.read_at(8, text.data(), text.size(), "the header");
    f.data_start_ = 8 + header;
    f.data_bytes_ = size - 8 - header;
    json::Value root;
    try {
      root = json::parse(text);
    } catch (const json::Error& e) {
      f.fail(std::string("header is not valid JSON: ") + e.what());
    }
    if (!root.is_object()) f.fail(std::string("header: expected a JSON object, given ") + root.kind());
    for (const auto& [name, entry] : root.as_object()) {
      if (name == "__metadata__") {
        f.parse_metadata(entry);
      } else {
        f.tensors_.push_back(f.parse_tensor(name, entry));
      }
    }
    f.check_layout();
    return f;
  }

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  [[nodiscard]] const std::vector<TensorInfo>& tensors() const noexcept { return tensors_; }
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }

  /// The tensor called `name`, or nullptr.
  [[nodiscard]] const TensorInfo* find(std::string_view name) const noexcept {
    for (const TensorInfo& t : tensors_) {
      if (t.name == name) return &t;
    }
    return nullptr;
  }

  /// Reads `info` (one of tensors()) into `out`, converting to float; `out` must hold exactly
  /// its elements (std::invalid_argument otherwise). safetensors::Error if the file changed.
  void read(const TensorInfo& info, std::span<float> out) {
    if (out.size() != info.elements()) {
      throw std::invalid_argument(name_ + ": tensor '" + info.name + "': expected a buffer of " +
                                  std::to_string(info.elements()) + " floats, given " + std::to_string(out.size()));
    }
    const std::string what = "tensor '" + info.name + "'";
    if (info.dtype == Dtype::f32) {
      read_at(data_start_ + info.begin, out.data(), out.size() * 4, what);
      return;
    }
    std::vector<std::uint16_t> raw(out.size());
    read_at(data_start_ + info.begin, raw.data(), raw.size() * 2, what);
    if (info.dtype == Dtype::bf16) {
      std::transform(raw.begin(), raw.end(), out.begin(), float_from_bf16);
    } else {
      std::transform(raw.begin(), raw.end(), out.begin(), float_from_f16);
    }
  }

 private:
  File() = default;

  [[noreturn]] void fail(const std::string& message) const { throw Error(name_ + ": " + message); }
  [[noreturn]] void fail(const std::string& tensor, const std::string& message) const {
    throw Error(name_ + ": tensor '" + tensor + "': " + message);
  }

  void read_at(std::uint64_t offset, void* to, std::size_t bytes, const std::string& what) {
    stream_.clear();
    stream_.seekg(static_cast<std::streamoff>(offset));
    stream_.read(static_cast<char*>(to), static_cast<std::streamsize>(bytes));
    if (!stream_ || static_cast<std::size_t>(stream_.gcount()) != bytes) {
      fail("cannot read " + what + " (" + std::to_string(bytes) + " bytes at offset " + std::to_string(offset) +
           "): the file is shorter than its header says, or changed since it was opened");
    }
  }

  void parse_metadata(const json::Value& entry) {
    if (!entry.is_object()) fail(std::string("__metadata__: expected an object of strings, given ") + entry.kind());
    for (const auto& [key, value] : entry.as_object()) {
      if (!value.is_string()) fail("__metadata__['" + key + "']: expected a string, given " + value.describe());
      metadata_.emplace(key, value.as_string());
    }
  }

  TensorInfo parse_tensor(const std::string& name, const json::Value& entry) const {
    if (!entry.is_object()) fail(name, std::string("expected an object, given ") + entry.kind());
    for (const auto& [key, value] : entry.as_object()) {
      if (key != "dtype" && key != "shape" && key != "data_offsets") {
        fail(name, "unexpected field '" + key + "' (expected dtype, shape, data_offsets)");
      }
    }
    const auto field = [&](const char* key) -> const json::Value& {
      const json::Value* v = entry.find(key);
      if (v == nullptr) fail(name, std::string("missing field '") + key + "'");
      return *v;
    };
    TensorInfo t;
    t.name = name;
    const json::Value& dtype = field("dtype");
    if (!dtype.is_string()) fail(name, "dtype: expected a string, given " + dtype.describe());
    t.dtype = parse_dtype(name, dtype.as_string());
    const auto uints = [&](const char* key, const json::Value& v) {
      if (!v.is_array()) fail(name, std::string(key) + ": expected an array, given " + v.describe());
      std::vector<std::uint64_t> out;
      for (const json::Value& item : v.as_array()) {
        if (!item.is_uint()) {
          fail(name, std::string(key) + ": expected non-negative integers, given " + item.describe());
        }
        out.push_back(item.as_uint());
      }
      return out;
    };
    t.shape = uints("shape", field("shape"));
    const std::vector<std::uint64_t> offsets = uints("data_offsets", field("data_offsets"));
    if (offsets.size() != 2) {
      fail(name, "data_offsets: expected [begin, end], given " + std::to_string(offsets.size()) + " numbers");
    }
    t.begin = offsets[0];
    t.end = offsets[1];
    const std::string range = "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "]";
    if (t.end < t.begin) fail(name, range + ": end before begin");
    if (t.end > data_bytes_) {
      fail(name, range + " run past the end of the data section (" + std::to_string(data_bytes_) + " bytes)");
    }
    std::uint64_t bytes = dtype_size(t.dtype);
    for (const std::uint64_t d : t.shape) {
      if (d != 0 && bytes > UINT64_MAX / d) fail(name, "shape " + shape_str(t.shape) + " is too large");
      bytes *= d;
    }
    if (t.end - t.begin != bytes) {
      fail(name, range + " hold " + std::to_string(t.end - t.begin) + " bytes, but shape " + shape_str(t.shape) +
                     " of " + dtype_name(t.dtype) + " needs " + std::to_string(bytes));
    }
    return t;
  }

  Dtype parse_dtype(const std::string& tensor, const std::string& dtype) const {
    if (dtype == "F32") return Dtype::f32;
    if (dtype == "F16") return Dtype::f16;
    if (dtype == "BF16") return Dtype::bf16;
    static constexpr std::array<std::string_view, 13> other = {"F64", "F8_E4M3", "F8_E5M2", "I64", "I32",  "I16", "I8",
                                                               "U64", "U32",     "U16",     "U8",  "BOOL", "C64"};
    if (std::find(other.begin(), other.end(), dtype) != other.end()) {
      fail(tensor, "dtype " + dtype + " is not supported (expected F32, F16 or BF16)");
    }
    fail(tensor, "unknown dtype '" + dtype + "' (expected F32, F16 or BF16)");
  }

  /// The tensors must tile the data section exactly, as the format requires: sorted by offset,
  /// each starts where the previous ended, no overlaps, no gaps, nothing after the last.
  void check_layout() const {
    std::vector<const TensorInfo*> order;
    for (const TensorInfo& t : tensors_) order.push_back(&t);
    std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) {
      return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
    });
    const auto range = [](const TensorInfo* t) {
      return "[" + std::to_string(t->begin) + ", " + std::to_string(t->end) + "]";
    };
    std::uint64_t covered = 0;
    const TensorInfo* previous = nullptr;
    for (const TensorInfo* t : order) {
      if (t->begin < covered) {
        fail(t->name, "data_offsets " + range(t) + " overlap tensor '" + previous->name + "' " + range(previous));
      }
      if (t->begin > covered) {
        fail(t->name, "data_offsets " + range(t) + " leave a gap of " + std::to_string(t->begin - covered) +
                          " bytes after " + (previous != nullptr ? "tensor '" + previous->name + "'" : "the header"));
      }
      covered = t->end;
      previous = t;
    }
    if (covered != data_bytes_) {
      fail(std::to_string(data_bytes_ - covered) + " bytes of data after the last tensor" +
           (previous != nullptr ? " ('" + previous->name + "')" : std::string()) +
           ": the header does not describe them");
    }
  }

  std::filesystem::path path_;
  std::string name_;  // the file name, for messages
  std::ifstream stream_;
  std::uint64_t data_start_ = 0;
  std::uint64_t data_bytes_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

/// One tensor to write: float data converted to `dtype` on the way out.
struct TensorToWrite {
  std::string name;
  Dtype dtype = Dtype::f32;
  std::vector<std::uint64_t> shape;
  std::span<const float> data;
};

/// Writes `tensors` to `path` in order, with the header padded to 8 bytes as the format
/// suggests. std::invalid_argument if a tensor's data does not match its shape;
/// safetensors::Error if the file cannot be written.
inline void write(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                  const std::map<std::string, std::string>& metadata = {}) {
  std::string header = "{";
  const auto comma = [&] {
    if (header.size() > 1) header += ",";
  };
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      if (!first) header += ",";
      header += json::quote(k) + ":" + json::quote(v);
      first = false;
    }
    header += "}";
  }
  std::uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    std::uint64_t elements = 1;
    for (const std::uint64_t d : t.shape) elements *= d;
    if (elements != t.data.size()) {
      throw std::invalid_argument("safetensors::write: tensor '" + t.name + "': shape " + shape_str(t.shape) +
                                  " expects " + std::to_string(elements) + " values, given " +
                                  std::to_string(t.data.size()));
    }
    const std::uint64_t end = offset + elements * dtype_size(t.dtype);
    comma();
    std::string shape = "[";
    for (std::size_t i = 0; i < t.shape.size(); ++i) {
      if (i != 0) shape += ",";
      shape += std::to_string(t.shape[i]);
    }
    header += json::quote(t.name) + ":{\"dtype\":\"" + dtype_name(t.dtype) + "\",\"shape\":" + shape +
              "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(end) + "]}";
    offset = end;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw Error(path.filename().string() + ": cannot create the file");
  std::array<char, 8> length{};
  for (std::size_t i = 0; i < 8; ++i) length[i] = static_cast<char>((header.size() >> (8 * i)) & 0xffU);
  out.write(length.data(), 8);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const TensorToWrite& t : tensors) {
    if (t.dtype == Dtype::f32) {
      out.write(reinterpret_cast<const char*>(t.data.data()), static_cast<std::streamsize>(t.data.size() * 4));
      continue;
    }
    std::vector<std::uint16_t> raw(t.data.size());
    std::transform(t.data.begin(), t.data.end(), raw.begin(),
                   t.dtype == Dtype::bf16 ? bf16_from_float : f16_from_float);
    out.write(reinterpret_cast<const char*>(raw.data()), static_cast<std::streamsize>(raw.size() * 2));
  }
  if (!out.flush()) throw Error(path.filename().string() + ": writing failed");
}

}  // namespace qwen3::safetensors
