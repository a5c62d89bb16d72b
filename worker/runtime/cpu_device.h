// CpuDevice: the CPU backend's device (host memory standing in for device
// memory, with a capacity so exhaustion behaves like a GPU's).
#ifndef PDWORKER_WORKER_RUNTIME_CPU_DEVICE_H_
#define PDWORKER_WORKER_RUNTIME_CPU_DEVICE_H_

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/runtime/cpu_work_queue.h"
#include "worker/runtime/device.h"

namespace pdworker {

// What new allocations contain.
enum class CpuMemoryInit {
  // Every byte 0xFF: floats read as NaN and int32 as -1, so a kernel that
  // reads memory nobody wrote shows up in results (cudaMalloc gives no
  // guarantee either).
  kPoison,
  // Whatever the allocator returns; faster for very large pools.
  kUninitialized,
};

struct CpuDeviceOptions {
  // Bytes this device may hand out; 0 means the machine's physical memory.
  size_t capacity_bytes = 0;
  CpuMemoryInit memory_init = CpuMemoryInit::kPoison;
  // How every stream this device creates runs its work. kInline by default;
  // kThreaded to exercise host/device overlap as on a GPU.
  CpuStreamExecution stream_execution = CpuStreamExecution::kInline;
};

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(const CpuDeviceOptions& options = {});

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  std::string name() const override { return "cpu"; }
  // used = bytes currently allocated through this device; total = capacity.
  absl::StatusOr<MemoryStats> GetMemoryStats() const override;

 protected:
  absl::StatusOr<void*> DoAllocate(size_t size_bytes) override;
  void DoFree(void* data, size_t size_bytes) noexcept override;
  // Host memory needs no pinning here; it is aligned and initialized like
  // device memory but not counted against the capacity (it is not device
  // memory on CUDA either).
  absl::StatusOr<void*> DoAllocateHost(size_t size_bytes) override;
  void DoFreeHost(void* data, size_t size_bytes) noexcept override;
  absl::StatusOr<std::unique_ptr<Stream>> DoCreateStream() override;
  absl::StatusOr<std::unique_ptr<Event>> DoCreateEvent() override;

 private:
  const size_t capacity_bytes_;
  const CpuMemoryInit memory_init_;
  const CpuStreamExecution stream_execution_;
  std::atomic<size_t> used_bytes_{0};
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_CPU_DEVICE_H_
