// SPDX-License-Identifier: Apache-2.0
#pragma once

// A variant's own settings in a state file (a ring's window, sinks and slack; a capacity), named
// by the variant itself: HEAD holds them after the shape every cache shares, as a count of
// (name, value) pairs. A variant lists them in one private member beside its other state code,
//
//   template <class Settings>
//   void state_settings(Settings& settings) const {
//     settings.may_differ("capacity", capacity_);   // the file's tokens must fit, checked apart
//     settings.must_match("window", window_);       // a load refuses another value
//   }
//
// so a new variant or setting changes neither state_file.hpp nor the file's version. A file's
// setting the loading cache does not list must be 0; one it lists that the file lacks reads as 0.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kvcache/detail/state_container.hpp"
#include "kvcache/version.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

/// The shape every cache has, which HEAD holds before the settings: no setting takes these names.
inline constexpr std::string_view kShapeFields[] = {"layers", "batch", "kv_heads", "head_dim"};

[[nodiscard]] inline bool is_shape_field(std::string_view name) noexcept {
  return std::find(std::begin(kShapeFields), std::end(kShapeFields), name) != std::end(kShapeFields);
}

/// One setting as a file holds it, and whether a load requires the cache's own value.
struct StateSetting {
  std::string name;
  std::size_t value = 0;
  bool must_match = false;
};

/// The settings a cache lists through its state_settings(), in its order.
class StateSettings {
 public:
  /// A setting a file loads only into a cache with the same value.
  void must_match(std::string_view name, std::size_t value) { add(name, value, true); }
  /// A setting the cache loaded into may differ in (what it bounds is checked by the load).
  void may_differ(std::string_view name, std::size_t value) { add(name, value, false); }
  [[nodiscard]] const std::vector<StateSetting>& list() const noexcept { return list_; }

 private:
  void add(std::string_view name, std::size_t value, bool must_match) {
    KVCACHE_ASSERT(find(name) == nullptr, "a variant lists each setting once");
    KVCACHE_ASSERT(!is_shape_field(name), "HEAD holds the shape before the settings");
    list_.push_back({std::string(name), value, must_match});
  }
  [[nodiscard]] const StateSetting* find(std::string_view name) const noexcept {
    const auto it = std::find_if(list_.begin(), list_.end(), [&](const StateSetting& s) { return s.name == name; });
    return it == list_.end() ? nullptr : &*it;
  }

  std::vector<StateSetting> list_;
};

/// The names version 1 gave its fixed counts after the shape, in their order.
inline constexpr const char* kVersion1Settings[] = {"capacity", "window", "sinks", "slack"};

/// Writes `settings`: a u64 count, then each name (a u32 length and its characters) and value.
inline void write_settings(PayloadWriter& out, const std::vector<StateSetting>& settings) {
  out.u64(settings.size());
  for (const StateSetting& s : settings) {
    out.str(s.name);
    out.u64(s.value);
  }
}

/// Reads what write_settings wrote (`version` 2 on) or version 1's fixed counts; refuses a name
/// given twice or one of the shape's.
inline std::vector<StateSetting> read_settings(PayloadReader& in, std::uint32_t version) {
  std::vector<StateSetting> settings;
  if (version == 1) {
    for (const char* name : kVersion1Settings) settings.push_back({name, in.u64(name)});
    return settings;
  }
  const std::size_t count = in.u64("settings");
  // Each takes at least 12 bytes: a count no payload backs allocates nothing.
  in.require(count <= in.size() / 12, "settings",
             "at most " + std::to_string(in.size() / 12) + " (the payload's bytes)", std::to_string(count));
  for (std::size_t i = 0; i < count; ++i) {
    StateSetting s;
    s.name = in.str("setting name");
    s.value = in.u64("setting value");
    const bool repeated =
        std::any_of(settings.begin(), settings.end(), [&](const StateSetting& x) { return x.name == s.name; });
    in.require(!repeated, "setting name", "a name not given before", printable(s.name) + " again");
    in.require(!is_shape_field(s.name), "setting name", "a name other than the shape's", printable(s.name));
    settings.push_back(std::move(s));
  }
  return settings;
}

/// The value a file gives a setting: 0 when it gives none.
inline std::size_t setting_value(const std::vector<StateSetting>& file, std::string_view name) {
  const auto it = std::find_if(file.begin(), file.end(), [&](const StateSetting& s) { return s.name == name; });
  return it == file.end() ? 0 : it->value;
}

/// Checks a file's settings against the cache's own: std::invalid_argument naming the first
/// that differs where it must match, or that the cache does not list and the file sets.
inline void check_settings(const std::vector<StateSetting>& own, const std::vector<StateSetting>& file,
                           const std::string& variant) {
  const auto differs = [](const std::string& name, const std::string& expected, std::size_t found) {
    throw std::invalid_argument("kvcache::load_state: the file's " + name + ": expected " + expected +
                                " (the cache loaded into), found " + std::to_string(found));
  };
  for (const StateSetting& s : own) {
    const std::size_t found = setting_value(file, s.name);
    if (s.must_match && found != s.value) differs(s.name, std::to_string(s.value), found);
  }
  for (const StateSetting& s : file) {
    const bool listed = std::any_of(own.begin(), own.end(), [&](const StateSetting& x) { return x.name == s.name; });
    if (!listed && s.value != 0) differs(printable(s.name), "0 (" + variant + " has no such setting)", s.value);
  }
}

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
