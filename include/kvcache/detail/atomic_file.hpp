// SPDX-License-Identifier: Apache-2.0
#pragma once

// Files replaced atomically and durably: written under a temporary name in the same directory,
// synced, renamed over the final name, and the directory synced, so that a reader (or a crash,
// or a power cut) finds the old file or the new one whole, never a torn one. What save_state and
// FileBlockStore write through. POSIX; elsewhere the rename stays atomic but nothing is synced.

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <memory>
#include <ostream>
#include <stdexcept>
#include <streambuf>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#define KVCACHE_POSIX_FILES 1
#else
#include <fstream>
#endif

#include "kvcache/version.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

/// strerror's text for `error`, thread-safe.
inline std::string error_text(int error) { return std::error_code(error, std::generic_category()).message(); }

/// Numbers temporary names apart within a process (with the pid, across processes).
inline std::atomic<unsigned long> temporary_counter{0};

#if defined(KVCACHE_POSIX_FILES)

/// An output stream buffer over a file descriptor: small writes are gathered, large ones go
/// straight to write(2). The first failing write is kept (its errno) and every later one fails.
class FdStreamBuf : public std::streambuf {
 public:
  explicit FdStreamBuf(int fd) : fd_(fd), buffer_(std::size_t{1} << 16) {
    setp(buffer_.data(), buffer_.data() + buffer_.size());
  }
  FdStreamBuf(const FdStreamBuf&) = delete;
  FdStreamBuf& operator=(const FdStreamBuf&) = delete;
  ~FdStreamBuf() override = default;

  /// The errno of the first write that failed, 0 if none.
  [[nodiscard]] int error() const noexcept { return error_; }
  /// Writes out what is gathered; false (error() says why) if a write failed.
  bool drain() { return sync() == 0; }

 protected:
  int_type overflow(int_type ch) override {
    if (sync() != 0) return traits_type::eof();
    if (!traits_type::eq_int_type(ch, traits_type::eof())) {
      *pptr() = traits_type::to_char_type(ch);
      pbump(1);
    }
    return traits_type::not_eof(ch);
  }
  std::streamsize xsputn(const char* data, std::streamsize n) override {
    if (n < static_cast<std::streamsize>(buffer_.size()) / 2) return std::streambuf::xsputn(data, n);
    if (sync() != 0 || !write_all(data, static_cast<std::size_t>(n))) return 0;
    return n;
  }
  int sync() override {
    const auto pending = static_cast<std::size_t>(pptr() - pbase());
    const bool ok = pending == 0 || write_all(pbase(), pending);
    setp(buffer_.data(), buffer_.data() + buffer_.size());
    return ok ? 0 : -1;
  }

 private:
  bool write_all(const char* data, std::size_t n) {
    if (error_ != 0) return false;
    while (n != 0) {
      const ssize_t done = ::write(fd_, data, n);
      if (done < 0) {
        if (errno == EINTR) continue;
        error_ = errno;
        return false;
      }
      data += done;
      n -= static_cast<std::size_t>(done);
    }
    return true;
  }

  int fd_;
  int error_ = 0;
  std::vector<char> buffer_;
};

/// A file being written to replace `path` atomically and durably. The writer fills stream()
/// (or write()), then commit() syncs it, renames it over `path` and syncs the directory. Until
/// then `path` is untouched, and a writer destroyed uncommitted (an exception) removes its
/// temporary file. A writer killed part-way leaves its temporary file, `<name>.tmp.<pid>.<n>`,
/// which nothing reads.
///
///   detail::AtomicFile file(path, "kvcache::save_state");
///   file.stream() << bytes;
///   file.commit();
class AtomicFile {
 public:
  /// Creates the temporary file; std::runtime_error naming it and the system's reason otherwise.
  AtomicFile(std::filesystem::path path, std::string who) : path_(std::move(path)), who_(std::move(who)) {
    for (int attempt = 0;; ++attempt) {
      temporary_ = path_;
      temporary_ += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(temporary_counter.fetch_add(1));
      fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (fd_ >= 0) break;
      if (errno != EEXIST || attempt == 100) fail("cannot create", temporary_, errno);  // a stale name: next
    }
    buffer_ = std::make_unique<FdStreamBuf>(fd_);
    stream_ = std::make_unique<std::ostream>(buffer_.get());
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(temporary_.c_str());
  }

  [[nodiscard]] std::ostream& stream() noexcept { return *stream_; }
  /// Appends bytes; std::runtime_error naming the file and the reason if the system refuses them.
  void write(std::string_view bytes) {
    stream_->write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    check();
  }
  /// Throws std::runtime_error naming the file and the reason if a write has failed (disk full,
  /// file too large, ...); the stream's own message does not know why.
  void check() const {
    if (buffer_->error() != 0) fail("cannot write", temporary_, buffer_->error());
    if (!*stream_) throw std::runtime_error(who_ + ": writing " + temporary_.string() + " failed");
  }
  [[nodiscard]] const std::filesystem::path& temporary() const noexcept { return temporary_; }

  /// Writes out what is buffered, fsyncs the file, renames it over the final path and fsyncs
  /// the directory. std::runtime_error naming the step that failed; `path` is then unchanged
  /// unless the rename succeeded (only the directory's sync failed).
  void commit() {
    stream_->flush();
    (void)buffer_->drain();
    check();
    if (::fsync(fd_) != 0) fail("cannot sync", temporary_, errno);
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("cannot close", temporary_, errno);
    if (::rename(temporary_.c_str(), path_.c_str()) != 0) {
      const int error = errno;
      throw std::runtime_error(who_ + ": cannot rename " + temporary_.string() + " to " + path_.string() + ": " +
                               error_text(error));
    }
    committed_ = true;
    sync_directory(path_.parent_path(), who_);
  }

  /// fsyncs a directory, so that names created or renamed in it are on the disk. Filesystems
  /// that cannot sync a directory (EINVAL) are taken at their word.
  static void sync_directory(const std::filesystem::path& directory, const std::string& who) {
    const std::filesystem::path dir = directory.empty() ? std::filesystem::path(".") : directory;
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) fail_as(who, "cannot open directory", dir, errno);
    const int synced = ::fsync(fd) == 0 || errno == EINVAL ? 0 : errno;
    ::close(fd);
    if (synced != 0) fail_as(who, "cannot sync directory", dir, synced);
  }

 private:
  [[noreturn]] void fail(const std::string& what, const std::filesystem::path& file, int error) const {
    fail_as(who_, what, file, error);
  }
  [[noreturn]] static void fail_as(const std::string& who, const std::string& what, const std::filesystem::path& file,
                                   int error) {
    throw std::runtime_error(who + ": " + what + " " + file.string() + ": " + error_text(error));
  }

  std::filesystem::path path_;
  std::filesystem::path temporary_;
  std::string who_;
  int fd_ = -1;
  bool committed_ = false;
  std::unique_ptr<FdStreamBuf> buffer_;
  std::unique_ptr<std::ostream> stream_;
};

#else

/// Where POSIX is missing: the temporary file and the rename, without syncing.
class AtomicFile {
 public:
  AtomicFile(std::filesystem::path path, std::string who) : path_(std::move(path)), who_(std::move(who)) {
    temporary_ = path_;
    temporary_ += ".tmp." + std::to_string(temporary_counter.fetch_add(1));
    out_.open(temporary_, std::ios::binary | std::ios::trunc);
    if (!out_) throw std::runtime_error(who_ + ": cannot create " + temporary_.string());
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (committed_) return;
    out_.close();
    std::error_code ignored;
    std::filesystem::remove(temporary_, ignored);
  }
  [[nodiscard]] std::ostream& stream() noexcept { return out_; }
  void write(std::string_view bytes) {
    out_.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    check();
  }
  void check() const {
    if (!out_) throw std::runtime_error(who_ + ": writing " + temporary_.string() + " failed");
  }
  [[nodiscard]] const std::filesystem::path& temporary() const noexcept { return temporary_; }
  void commit() {
    out_.close();
    check();
    std::filesystem::rename(temporary_, path_);
    committed_ = true;
  }
  static void sync_directory(const std::filesystem::path&, const std::string&) {}

 private:
  std::filesystem::path path_;
  std::filesystem::path temporary_;
  std::string who_;
  std::ofstream out_;
  bool committed_ = false;
};

#endif

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
