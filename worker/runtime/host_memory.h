// HostMemory: an owner of pinned (page-locked) host memory from a Device.
#ifndef PDWORKER_WORKER_RUNTIME_HOST_MEMORY_H_
#define PDWORKER_WORKER_RUNTIME_HOST_MEMORY_H_

#include <cstddef>
#include <utility>

namespace pdworker {

class Device;

// Host memory the device can copy to and from without staging: on CUDA it is
// page-locked (cudaMallocHost), which is what makes a device-to-host
// cudaMemcpyAsync truly asynchronous; on the CPU backend it is ordinary
// aligned host memory. The host reads and writes it directly. Made by
// Device::AllocateHost, returned to that Device on destruction. Move-only;
// the Device must outlive it.
class HostMemory {
 public:
  HostMemory() = default;
  HostMemory(Device* device, void* data, size_t size_bytes)
      : device_(device), data_(data), size_bytes_(size_bytes) {}
  ~HostMemory() { Reset(); }

  HostMemory(HostMemory&& other) noexcept
      : device_(std::exchange(other.device_, nullptr)),
        data_(std::exchange(other.data_, nullptr)),
        size_bytes_(std::exchange(other.size_bytes_, 0)) {}
  HostMemory& operator=(HostMemory&& other) noexcept {
    if (this != &other) {
      Reset();
      device_ = std::exchange(other.device_, nullptr);
      data_ = std::exchange(other.data_, nullptr);
      size_bytes_ = std::exchange(other.size_bytes_, 0);
    }
    return *this;
  }
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;

  void* data() const { return data_; }
  size_t size_bytes() const { return size_bytes_; }
  // The address as T*, e.g. as<int32_t>() for sampled token ids.
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

  // Frees now (no-op when empty). Never throws. The device must be done
  // with it: wait for copies into or out of it first.
  void Reset() noexcept;

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  size_t size_bytes_ = 0;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_HOST_MEMORY_H_
