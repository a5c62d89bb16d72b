// Device memory: a non-owning view (DeviceBuffer) and an owner (DeviceMemory).
#ifndef PDWORKER_WORKER_RUNTIME_DEVICE_BUFFER_H_
#define PDWORKER_WORKER_RUNTIME_DEVICE_BUFFER_H_

#include <cstddef>
#include <utility>

#include "glog/logging.h"

namespace pdworker {

class Device;

// A view of `size_bytes` bytes of device memory, typically a static buffer
// carved from an Arena. Cheap to copy; does not own. On the CUDA backend the
// pointer is a device address the host must not dereference: read it back
// with Stream::CopyToHost.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(void* data, size_t size_bytes)
      : data_(data), size_bytes_(size_bytes) {}

  void* data() const { return data_; }
  size_t size_bytes() const { return size_bytes_; }
  bool empty() const { return size_bytes_ == 0; }

  // The address as T*, for kernels and op closures.
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  // Number of whole T elements in the buffer.
  template <typename T>
  size_t num_elements() const {
    return size_bytes_ / sizeof(T);
  }

  // A sub-view [offset, offset + size_bytes). CHECKs the range: slicing out
  // of bounds is a programming error, not a runtime condition.
  DeviceBuffer Slice(size_t offset, size_t size_bytes) const {
    CHECK_LE(offset, size_bytes_);
    CHECK_LE(size_bytes, size_bytes_ - offset);
    return DeviceBuffer(static_cast<char*>(data_) + offset, size_bytes);
  }

 private:
  void* data_ = nullptr;
  size_t size_bytes_ = 0;
};

// Owns one raw device allocation and returns it to its Device on
// destruction. Move-only. The Device must outlive it.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(Device* device, void* data, size_t size_bytes)
      : device_(device), data_(data), size_bytes_(size_bytes) {}
  ~DeviceMemory() { Reset(); }

  DeviceMemory(DeviceMemory&& other) noexcept
      : device_(std::exchange(other.device_, nullptr)),
        data_(std::exchange(other.data_, nullptr)),
        size_bytes_(std::exchange(other.size_bytes_, 0)) {}
  DeviceMemory& operator=(DeviceMemory&& other) noexcept {
    if (this != &other) {
      Reset();
      device_ = std::exchange(other.device_, nullptr);
      data_ = std::exchange(other.data_, nullptr);
      size_bytes_ = std::exchange(other.size_bytes_, 0);
    }
    return *this;
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  DeviceBuffer buffer() const { return DeviceBuffer(data_, size_bytes_); }
  void* data() const { return data_; }
  size_t size_bytes() const { return size_bytes_; }

  // Frees now (no-op when empty). Never throws.
  void Reset() noexcept;

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  size_t size_bytes_ = 0;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_DEVICE_BUFFER_H_
