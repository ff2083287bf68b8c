// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

namespace kvcache::detail {

/// Cache-line aligned storage of `size` trivially copyable elements, zero-filled unless asked not to.
/// Fixed size: it never reallocates, so pointers into it stay valid for its lifetime.
template <class T>
class AlignedBuffer {
  static_assert(std::is_trivially_copyable_v<T>, "kvcache stores elements with memcpy: T must be trivially copyable.");

 public:
  static constexpr std::size_t alignment = 64;

  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t size, bool zero_fill = true)
      : data_(size == 0 ? nullptr : static_cast<T*>(::operator new (size * sizeof(T), std::align_val_t{alignment}))),
        size_(size) {
    if (zero_fill && size_ != 0) std::memset(static_cast<void*>(data_.get()), 0, size_ * sizeof(T));
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
  struct Free {
    void operator()(T* p) const noexcept { ::operator delete (static_cast<void*>(p), std::align_val_t{alignment}); }
  };
  std::unique_ptr<T, Free> data_;
  std::size_t size_ = 0;
};

}  // namespace kvcache::detail
