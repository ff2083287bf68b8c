// SPDX-License-Identifier: Apache-2.0
#pragma once

// A small, strict JSON reader: what config.json and a safetensors header need, nothing more.
// Strict means RFC 8259 exactly: no comments, no trailing commas, no NaN, no leading zeros, no
// duplicate keys (a header naming a tensor twice is ambiguous), bounded nesting. Every error
// says at which byte it stopped and what it expected there.

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <variant>
#include <vector>

namespace qwen3::json {

/// A malformed document, or a value of the wrong kind asked for.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Value;
using Array = std::vector<Value>;
using Object = std::vector<std::pair<std::string, Value>>;  // in document order, keys unique

/// A number as written: integers that fit stay exact (safetensors offsets can pass 2^53).
struct Number {
  double value = 0.0;
  bool is_unsigned = false;  // written as a non-negative integer that fits std::uint64_t
  std::uint64_t unsigned_value = 0;
};

/// One JSON value.
class Value {
 public:
  Value() = default;
  explicit Value(std::nullptr_t) {}
  explicit Value(bool b) : v_(b) {}
  explicit Value(Number n) : v_(n) {}
  explicit Value(std::string s) : v_(std::move(s)) {}
  explicit Value(Array a) : v_(std::move(a)) {}
  explicit Value(Object o) : v_(std::move(o)) {}

  [[nodiscard]] bool is_null() const noexcept { return std::holds_alternative<std::nullptr_t>(v_); }
  [[nodiscard]] bool is_bool() const noexcept { return std::holds_alternative<bool>(v_); }
  [[nodiscard]] bool is_number() const noexcept { return std::holds_alternative<Number>(v_); }
  [[nodiscard]] bool is_string() const noexcept { return std::holds_alternative<std::string>(v_); }
  [[nodiscard]] bool is_array() const noexcept { return std::holds_alternative<Array>(v_); }
  [[nodiscard]] bool is_object() const noexcept { return std::holds_alternative<Object>(v_); }
  /// A number written as a non-negative integer that fits std::uint64_t.
  [[nodiscard]] bool is_uint() const noexcept {
    const Number* n = std::get_if<Number>(&v_);
    return n != nullptr && n->is_unsigned;
  }

  /// "null", "a boolean", "a number", ... for messages.
  [[nodiscard]] const char* kind() const noexcept {
    static constexpr const char* names[] = {"null", "a boolean", "a number", "a string", "an array", "an object"};
    return names[v_.index()];
  }

  /// The value, or json::Error naming the kind it is.
  [[nodiscard]] bool as_bool() const { return get<bool>("a boolean"); }
  [[nodiscard]] double as_double() const { return get<Number>("a number").value; }
  [[nodiscard]] const std::string& as_string() const { return get<std::string>("a string"); }
  [[nodiscard]] const Array& as_array() const { return get<Array>("an array"); }
  [[nodiscard]] const Object& as_object() const { return get<Object>("an object"); }

  /// A non-negative integer, exactly; json::Error for anything else (1.5, -1, 1e3, "1").
  [[nodiscard]] std::uint64_t as_uint() const {
    const auto& n = get<Number>("a non-negative integer");
    if (!n.is_unsigned) throw Error("expected a non-negative integer, given " + describe());
    return n.unsigned_value;
  }

  /// The member named `key` of an object, or nullptr; json::Error if this is not an object.
  [[nodiscard]] const Value* find(std::string_view key) const {
    for (const auto& [k, v] : as_object()) {
      if (k == key) return &v;
    }
    return nullptr;
  }

  /// A short rendering for error messages: the kind, and the value when it is a scalar.
  [[nodiscard]] std::string describe() const {
    if (is_number()) {
      const auto& n = std::get<Number>(v_);
      return "the number " + (n.is_unsigned ? std::to_string(n.unsigned_value) : std::to_string(n.value));
    }
    if (is_string()) return "the string \"" + std::get<std::string>(v_) + "\"";
    if (is_bool()) return std::get<bool>(v_) ? "true" : "false";
    return kind();
  }

 private:
  template <class T>
  const T& get(const char* wanted) const {
    if (const T* p = std::get_if<T>(&v_)) return *p;
    throw Error(std::string("expected ") + wanted + ", given " + describe());
  }

  std::variant<std::nullptr_t, bool, Number, std::string, Array, Object> v_;
};

namespace detail {

class Parser {
 public:
  explicit Parser(std::string_view text) : s_(text) {}

  Value document() {
    skip_space();
    Value v = value(0);
    skip_space();
    if (i_ != s_.size()) fail("the end of the document");
    return v;
  }

 private:
  static constexpr std::size_t max_depth = 64;  // deeper is not a config or a header; and it bounds the stack

  [[noreturn]] void fail(const std::string& expected) const {
    std::string found = "the end of the input";
    if (i_ < s_.size()) {
      const auto c = static_cast<unsigned char>(s_[i_]);
      found = (c >= 0x20 && c < 0x7f) ? "'" + std::string(1, s_[i_]) + "'" : "byte " + std::to_string(c);
    }
    throw Error("JSON error at byte " + std::to_string(i_) + ": expected " + expected + ", found " + found);
  }

  void skip_space() noexcept {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }

  [[nodiscard]] bool at(char c) const noexcept { return i_ < s_.size() && s_[i_] == c; }

  void expect(char c, const char* what) {
    if (!at(c)) fail(what);
    ++i_;
  }

  void literal(std::string_view word) {
    if (s_.substr(i_, word.size()) != word) fail("a value");
    i_ += word.size();
  }

  Value value(std::size_t depth) {
    if (i_ >= s_.size()) fail("a value");
    switch (s_[i_]) {
      case '{':
        return object(depth + 1);
      case '[':
        return array(depth + 1);
      case '"':
        return Value(string());
      case 't':
        literal("true");
        return Value(true);
      case 'f':
        literal("false");
        return Value(false);
      case 'n':
        literal("null");
        return Value(nullptr);
      default:
        return Value(number());
    }
  }

  Value object(std::size_t depth) {
    if (depth > max_depth) fail("at most " + std::to_string(max_depth) + " levels of nesting");
    ++i_;  // '{'
    Object members;
    skip_space();
    if (at('}')) {
      ++i_;
      return Value(std::move(members));
    }
    while (true) {
      skip_space();
      if (!at('"')) fail("a string key");
      const std::size_t key_at = i_;
      std::string key = string();
      for (const auto& [k, v] : members) {
        if (k == key) {
          i_ = key_at;
          fail("a key not seen before in this object (\"" + key + "\" is repeated)");
        }
      }
      skip_space();
      expect(':', "':'");
      skip_space();
      Value v = value(depth);
      members.emplace_back(std::move(key), std::move(v));
      skip_space();
      if (at(',')) {
        ++i_;
        continue;
      }
      expect('}', "',' or '}'");
      return Value(std::move(members));
    }
  }

  Value array(std::size_t depth) {
    if (depth > max_depth) fail("at most " + std::to_string(max_depth) + " levels of nesting");
    ++i_;  // '['
    Array items;
    skip_space();
    if (at(']')) {
      ++i_;
      return Value(std::move(items));
    }
    while (true) {
      skip_space();
      items.push_back(value(depth));
      skip_space();
      if (at(',')) {
        ++i_;
        continue;
      }
      expect(']', "',' or ']'");
      return Value(std::move(items));
    }
  }

  unsigned hex4() {
    unsigned code = 0;
    for (int k = 0; k < 4; ++k) {
      if (i_ >= s_.size()) fail("four hex digits after \\u");
      const char c = s_[i_];
      unsigned digit = 0;
      if (c >= '0' && c <= '9') {
        digit = static_cast<unsigned>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        digit = static_cast<unsigned>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        digit = static_cast<unsigned>(c - 'A' + 10);
      } else {
        fail("four hex digits after \\u");
      }
      code = code * 16 + digit;
      ++i_;
    }
    return code;
  }

  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xc0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xe0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }

  std::string string() {
    ++i_;  // '"'
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("a closing '\"'");
      const char c = s_[i_];
      if (c == '"') {
        ++i_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail("a character (control characters must be escaped)");
      if (c != '\\') {
        out += c;
        ++i_;
        continue;
      }
      ++i_;
      if (i_ >= s_.size()) fail("an escape character");
      const char e = s_[i_++];
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xdc00 && cp <= 0xdfff) fail("a high surrogate before a low one");
          if (cp >= 0xd800 && cp <= 0xdbff) {
            if (s_.substr(i_, 2) != "\\u") fail("a low surrogate (\\uDC00-\\uDFFF) after a high one");
            i_ += 2;
            const unsigned low = hex4();
            if (low < 0xdc00 || low > 0xdfff) fail("a low surrogate (\\uDC00-\\uDFFF) after a high one");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
          }
          append_utf8(out, cp);
          break;
        }
        default:
          --i_;
          fail("one of \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u");
      }
    }
  }

  Number number() {
    const std::size_t start = i_;
    const auto digits = [&] {
      const std::size_t from = i_;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      return i_ - from;
    };
    bool integer = true;
    if (at('-')) ++i_;
    if (at('0')) {
      ++i_;
      if (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9')
        fail("no leading zero (a number may not start 0 then a digit)");
    } else if (digits() == 0) {
      fail("a value");
    }
    if (at('.')) {
      ++i_;
      integer = false;
      if (digits() == 0) fail("a digit after '.'");
    }
    if (at('e') || at('E')) {
      ++i_;
      integer = false;
      if (at('+') || at('-')) ++i_;
      if (digits() == 0) fail("a digit in the exponent");
    }
    const std::string_view text = s_.substr(start, i_ - start);
    Number n;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n.value);
    if (ec == std::errc::result_out_of_range || end != text.data() + text.size()) {
      i_ = start;
      fail("a number within the range of a double");
    }
    if (integer && text[0] != '-') {
      const auto [uend, uec] = std::from_chars(text.data(), text.data() + text.size(), n.unsigned_value);
      n.is_unsigned = uec == std::errc() && uend == text.data() + text.size();
    }
    return n;
  }

  std::string_view s_;
  std::size_t i_ = 0;
};

}  // namespace detail

/// Parses a whole document; json::Error "JSON error at byte N: expected X, found Y".
[[nodiscard]] inline Value parse(std::string_view text) { return detail::Parser(text).document(); }

/// `s` as a JSON string literal, quotes included.
[[nodiscard]] inline std::string quote(std::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20) {
      static constexpr char hex[] = "0123456789abcdef";
      out += "\\u00";
      out += hex[u >> 4];
      out += hex[u & 0xf];
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace qwen3::json
