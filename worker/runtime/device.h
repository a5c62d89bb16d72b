// Device: the backend-neutral interface to one compute device (CPU or GPU).
#ifndef PDWORKER_WORKER_RUNTIME_DEVICE_H_
#define PDWORKER_WORKER_RUNTIME_DEVICE_H_

#include <cstddef>
#include <memory>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/runtime/capture_registry.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/host_memory.h"

namespace pdworker {

class Event;
class Stream;

enum class DeviceKind { kCpu, kCuda };

// "cpu" or "cuda".
absl::string_view DeviceKindName(DeviceKind kind);
std::ostream& operator<<(std::ostream& os, DeviceKind kind);

// Device memory in bytes. On CUDA this is the whole GPU as cudaMemGetInfo sees
// it (other processes included); on the CPU backend it is the allocations
// made through this Device against its configured capacity.
struct MemoryStats {
  size_t used_bytes = 0;
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};

// One device. Creates the streams, events and allocations that live on it.
// All of these must be created at startup: while any stream of this device is
// capturing a graph, Allocate/AllocateHost/CreateStream/CreateEvent fail with
// FAILED_PRECONDITION and invalidate the capture (CUDA forbids cudaMalloc and
// cudaMallocHost during stream capture, and the step path must not allocate
// anyway).
//
// The Device must outlive everything it created.
class Device {
 public:
  virtual ~Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  virtual DeviceKind kind() const = 0;
  // Human-readable, e.g. "cpu" or "cuda:0 (NVIDIA H100 80GB HBM3)".
  virtual std::string name() const = 0;
  virtual absl::StatusOr<MemoryStats> GetMemoryStats() const = 0;

  // Allocates `size_bytes` (> 0) of device memory, aligned to at least 256
  // bytes. RESOURCE_EXHAUSTED when the device is full.
  absl::StatusOr<DeviceMemory> Allocate(size_t size_bytes);
  // Allocates `size_bytes` (> 0) of pinned host memory, aligned to at least
  // 64 bytes (a cache line), for copies that must not block the host, e.g.
  // Stream::CopyToHostAsync of sampled tokens. Not counted in MemoryStats.
  // RESOURCE_EXHAUSTED when the host cannot pin that much.
  absl::StatusOr<HostMemory> AllocateHost(size_t size_bytes);
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream();
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent();

  // Streams of this device that are capturing right now.
  CaptureRegistry& capture_registry() { return capture_registry_; }

 protected:
  Device() = default;

  virtual absl::StatusOr<void*> DoAllocate(size_t size_bytes) = 0;
  virtual void DoFree(void* data, size_t size_bytes) noexcept = 0;
  virtual absl::StatusOr<void*> DoAllocateHost(size_t size_bytes) = 0;
  virtual void DoFreeHost(void* data, size_t size_bytes) noexcept = 0;
  virtual absl::StatusOr<std::unique_ptr<Stream>> DoCreateStream() = 0;
  virtual absl::StatusOr<std::unique_ptr<Event>> DoCreateEvent() = 0;

 private:
  friend class DeviceMemory;
  friend class HostMemory;

  CaptureRegistry capture_registry_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_DEVICE_H_
