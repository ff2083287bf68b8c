// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>

#include "kvcache/version.hpp"
#endif

// Large cache storage asks for transparent huge pages (AlignedBuffer); define as 0 to keep the
// system's default pages.
#ifndef KVCACHE_HUGE_PAGES
#define KVCACHE_HUGE_PAGES 1
#endif

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

/// The huge page that Linux backs anonymous memory with on request (x86-64, and AArch64 with
/// 4 KiB base pages).
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

/// Whether large storage asks for huge pages: on Linux (MADV_HUGEPAGE), unless KVCACHE_HUGE_PAGES
/// is 0. Elsewhere it is neither advised nor aligned to them.
#if defined(__linux__) && defined(MADV_HUGEPAGE) && KVCACHE_HUGE_PAGES
inline constexpr bool kAdvisesHugePages = true;

/// Asks the kernel to back the whole huge pages inside [data, data + bytes) with transparent
/// huge pages. Only a hint: a kernel without them, or set to never use them, refuses or ignores it.
inline void advise_huge_pages(void* data, std::size_t bytes) noexcept {
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t first = (begin + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  const std::uintptr_t last = (begin + bytes) / kHugePageBytes * kHugePageBytes;
  if (first < last) (void)::madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
}
#else
inline constexpr bool kAdvisesHugePages = false;
inline void advise_huge_pages(void* /*data*/, std::size_t /*bytes*/) noexcept {}
#endif

/// Gives the whole pages inside [data, data + bytes) back to the system, which backs them again
/// on their next write, with zeros: for storage that holds no token (shrink_to_fit). Linux only
/// (MADV_DONTNEED); elsewhere the pages stay.
inline void release_pages(void* data, std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_DONTNEED)
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t first = (begin + page - 1) / page * page;
  const std::uintptr_t last = (begin + bytes) / page * page;
  if (first < last) (void)::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
#else
  (void)data;
  (void)bytes;
#endif
}

/// How an AlignedBuffer prepares its storage.
struct BufferOptions {
  bool zero_fill = true;
  /// Storage of a huge page or more starts on a huge-page boundary and asks for transparent huge
  /// pages (advise_huge_pages): a decode step reads the whole cache, and with 4 KiB pages every
  /// 4 KiB of it costs a TLB miss (measured in docs/memory.md). ConcatKvCache, the baseline,
  /// keeps the system's pages.
  bool huge_pages = true;
};

/// Cache-line aligned storage of `size` trivially copyable elements, prepared as `options` say.
/// Fixed size: it never reallocates, so pointers into it stay valid for its lifetime.
template <class T>
class AlignedBuffer {
  static_assert(std::is_trivially_copyable_v<T>, "kvcache stores elements with memcpy: T must be trivially copyable.");

 public:
  static constexpr std::size_t alignment = 64;

  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t size, BufferOptions options = {})
      : data_(allocate(size, options), Free{alignment_for(size, options)}), size_(size) {
    if (size_ == 0) return;
    if (alignment_for(size_, options) == kHugePageBytes) advise_huge_pages(data_.get(), bytes());
    if (options.zero_fill) std::memset(static_cast<void*>(data_.get()), 0, bytes());
  }

  // A moved-from buffer is empty (size 0), so bytes() of a moved-from cache counts nothing.
  AlignedBuffer(AlignedBuffer&& other) noexcept : data_(std::move(other.data_)), size_(std::exchange(other.size_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept {
    data_ = std::move(other.data_);
    size_ = std::exchange(other.size_, 0);
    return *this;
  }

  [[nodiscard]] T* data() noexcept { return data_.get(); }
  [[nodiscard]] const T* data() const noexcept { return data_.get(); }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return size_ * sizeof(T); }

 private:
  static std::size_t alignment_for(std::size_t size, BufferOptions options) noexcept {
    const bool huge = kAdvisesHugePages && options.huge_pages && size * sizeof(T) >= kHugePageBytes;
    return huge ? kHugePageBytes : alignment;
  }
  static T* allocate(std::size_t size, BufferOptions options) {
    if (size == 0) return nullptr;
    return static_cast<T*>(::operator new (size * sizeof(T), std::align_val_t{alignment_for(size, options)}));
  }
  struct Free {
    std::size_t alignment = AlignedBuffer::alignment;  // what the storage was allocated with
    void operator()(T* p) const noexcept { ::operator delete (static_cast<void*>(p), std::align_val_t{alignment}); }
  };
  std::unique_ptr<T, Free> data_;
  std::size_t size_ = 0;
};

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
