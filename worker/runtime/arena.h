// Arena: the static buffers of the worker, carved from one device allocation.
#ifndef PDWORKER_WORKER_RUNTIME_ARENA_H_
#define PDWORKER_WORKER_RUNTIME_ARENA_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/runtime/device.h"
#include "worker/runtime/device_buffer.h"

namespace pdworker {

struct ArenaOptions {
  // Size of the single device allocation backing the arena.
  size_t capacity_bytes = 0;
  // Every buffer starts at a multiple of this (a power of two). 256 bytes
  // matches cudaMalloc's guarantee and suits vectorized kernels.
  size_t alignment_bytes = 256;
  // Shown in errors, e.g. "activations".
  std::string name = "arena";
};

// A bump allocator over one big device allocation made at startup. Captured
// graphs read and write these buffers at fixed addresses, so every graph
// shares the same memory and graphs cost no activation memory of their own.
// Buffers are never freed individually; they live as long as the arena.
//
// Allocate fails while a stream of the device is capturing (and invalidates
// the capture): static buffers are laid out before capture, never inside it.
class Arena {
 public:
  static absl::StatusOr<std::unique_ptr<Arena>> Create(
      Device& device, const ArenaOptions& options);

  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // A new buffer of `size_bytes` (> 0), aligned to alignment_bytes.
  // RESOURCE_EXHAUSTED when it does not fit; the arena is unchanged then.
  // `label` names the buffer in errors.
  absl::StatusOr<DeviceBuffer> Allocate(size_t size_bytes,
                                        absl::string_view label = "buffer");

  // Bytes handed out so far, alignment padding included.
  size_t used_bytes() const { return used_bytes_; }
  size_t capacity_bytes() const { return memory_.size_bytes(); }
  // The whole underlying allocation (e.g. to export it over CUDA IPC).
  DeviceBuffer allocation() const { return memory_.buffer(); }
  size_t free_bytes() const { return capacity_bytes() - used_bytes_; }
  const std::string& name() const { return options_.name; }

 private:
  Arena(Device& device, DeviceMemory memory, ArenaOptions options);

  Device& device_;
  DeviceMemory memory_;
  ArenaOptions options_;
  size_t used_bytes_ = 0;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_ARENA_H_
