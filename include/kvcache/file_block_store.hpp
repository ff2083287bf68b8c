// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cerrno>
#include <cstddef>
#include <filesystem>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include "kvcache/block_store.hpp"
#include "kvcache/detail/atomic_file.hpp"
#include "kvcache/version.hpp"

#if defined(KVCACHE_POSIX_FILES)
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#else
#include <fstream>
#endif

namespace kvcache {
inline namespace KVCACHE_ABI {

/// Where a FileBlockStore keeps its records and which model's blocks it holds.
struct FileBlockStoreConfig {
  std::filesystem::path directory{};
  std::string model{};  // the engine's id of the model and its weights: part of every key's namespace
};

/// A block store in a directory: one file per block, `<directory>/<2 hex>/<32 hex>.kvblock`
/// (the key's first two digits spread the files over 256 subdirectories). A record is written
/// under a temporary name, synced and renamed (detail::AtomicFile), so a reader or a crash never
/// finds a torn one; several threads and processes on one host may share the directory. Nothing
/// is evicted: records are immutable and content-keyed, so deleting any file at any time is
/// safe (it becomes a miss), and an operator bounds the directory by age (docs/store.md).
///
///   kvcache::FileBlockStore store({.directory = "/var/cache/kvcache", .model = "Qwen3-0.6B@c1899de"});
///   kvcache::PrefixReuse hit = seq.reuse_prefix(prompt, store);
class FileBlockStore {
 public:
  /// Creates the directory if it is missing. std::invalid_argument for an empty directory or
  /// model, BlockStoreError if the directory cannot be created.
  explicit FileBlockStore(FileBlockStoreConfig config) : config_(std::move(config)) {
    if (config_.directory.empty()) {
      throw std::invalid_argument("FileBlockStore: config.directory: expected a directory, given an empty path");
    }
    if (config_.model.empty()) {
      throw std::invalid_argument("FileBlockStore: config.model: expected the model's id, given an empty string");
    }
    std::error_code error;
    std::filesystem::create_directories(config_.directory, error);
    if (error) fail("cannot create the directory " + config_.directory.string(), error.message());
  }

  [[nodiscard]] std::string_view model() const noexcept { return config_.model; }
  [[nodiscard]] const std::filesystem::path& directory() const noexcept { return config_.directory; }
  /// The file that holds `key`'s record.
  [[nodiscard]] std::filesystem::path path_of(const BlockKey& key) const {
    const std::string hex = key.hex();
    return config_.directory / hex.substr(0, 2) / (hex + ".kvblock");
  }

  /// How many leading keys have a record. BlockStoreError if one cannot be looked up.
  [[nodiscard]] std::size_t contains(std::span<const BlockKey> keys) const {
    for (std::size_t i = 0; i < keys.size(); ++i) {
      std::error_code error;
      const bool held = std::filesystem::is_regular_file(path_of(keys[i]), error);
      // A path through a file (ENOTDIR) holds no record either.
      if (error && error != std::errc::no_such_file_or_directory && error != std::errc::not_a_directory) {
        fail("cannot look up " + path_of(keys[i]).string(), error.message());
      }
      if (!held) return i;
    }
    return keys.size();
  }

  /// Reads the records of the leading keys held into records[0..n) and returns n.
  /// std::invalid_argument unless records.size() == keys.size(); BlockStoreError for a file
  /// that exists but cannot be read whole.
  std::size_t get(std::span<const BlockKey> keys, std::span<std::string> records) const {
    check_sizes("get", keys.size(), records.size(), "records to fill");
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (!read(path_of(keys[i]), records[i])) return i;
    }
    return keys.size();
  }

  /// Writes each record under its key, atomically and durably (temporary file, fsync, rename,
  /// fsync of its directory). std::invalid_argument unless records.size() == keys.size();
  /// BlockStoreError naming the file and the reason (disk full, no permission, ...) for the first
  /// record that cannot be written: the records before it are written, it and those after are not.
  void put(std::span<const BlockKey> keys, std::span<const std::string> records) const {
    check_sizes("put", keys.size(), records.size(), "records");
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const std::filesystem::path path = path_of(keys[i]);
      std::error_code error;
      if (std::filesystem::create_directory(path.parent_path(), error)) {
        detail::AtomicFile::sync_directory(config_.directory, "FileBlockStore");
      } else if (error) {
        fail("cannot create the directory " + path.parent_path().string(), error.message());
      }
      try {
        detail::AtomicFile file(path, "FileBlockStore");
        file.write(records[i]);
        file.commit();
      } catch (const BlockStoreError&) {
        throw;
      } catch (const std::runtime_error& e) {
        throw BlockStoreError(e.what());
      }
    }
  }

 private:
  [[noreturn]] static void fail(const std::string& what, const std::string& reason) {
    throw BlockStoreError("FileBlockStore: " + what + ": " + reason);
  }
  static void check_sizes(const char* call, std::size_t keys, std::size_t records, const char* what) {
    if (keys != records) {
      throw std::invalid_argument("FileBlockStore::" + std::string(call) + ": " + what + ": expected " +
                                  std::to_string(keys) + " (one per key), given " + std::to_string(records));
    }
  }

#if defined(KVCACHE_POSIX_FILES)
  /// The whole file into `out`; false if there is no such file.
  static bool read(const std::filesystem::path& path, std::string& out) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int error = errno;
      if (error == ENOENT || error == ENOTDIR) return false;
      fail("cannot open " + path.string(), detail::error_text(error));
    }
    struct Closer {
      int fd;
      ~Closer() { ::close(fd); }
    } closer{fd};
    struct stat info {};
    if (::fstat(fd, &info) != 0) {
      const int error = errno;
      fail("cannot stat " + path.string(), detail::error_text(error));
    }
    out.resize(static_cast<std::size_t>(info.st_size));
    for (std::size_t done = 0; done < out.size();) {
      const ssize_t got = ::read(fd, out.data() + done, out.size() - done);
      const int error = errno;
      if (got < 0 && error == EINTR) continue;
      if (got < 0) fail("cannot read " + path.string(), detail::error_text(error));
      if (got == 0) {
        fail("cannot read " + path.string(), "it ends at byte " + std::to_string(done) + " of the " +
                                                 std::to_string(out.size()) + " it had when opened");
      }
      done += static_cast<std::size_t>(got);
    }
    return true;
  }
#else
  static bool read(const std::filesystem::path& path, std::string& out) {
    std::error_code error;
    const auto size = std::filesystem::file_size(path, error);
    if (error == std::errc::no_such_file_or_directory || error == std::errc::not_a_directory) return false;
    if (error) fail("cannot stat " + path.string(), error.message());
    std::ifstream in(path, std::ios::binary);
    out.resize(static_cast<std::size_t>(size));
    if (!in.read(out.data(), static_cast<std::streamsize>(out.size()))) fail("cannot read " + path.string(), "");
    return true;
  }
#endif

  FileBlockStoreConfig config_;
};

static_assert(BlockStore<FileBlockStore>);

}  // namespace KVCACHE_ABI
}  // namespace kvcache
