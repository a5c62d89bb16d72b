// CudaDevice: one GPU through the CUDA runtime API.
#ifndef PDWORKER_WORKER_RUNTIME_CUDA_DEVICE_H_
#define PDWORKER_WORKER_RUNTIME_CUDA_DEVICE_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/runtime/device.h"

namespace pdworker {

struct CudaDeviceOptions {
  int ordinal = 0;
  // cuBLAS workspace per stream, allocated with the stream so that cuBLAS
  // never allocates during capture. 32 MiB is what cuBLAS asks for on Hopper.
  size_t cublas_workspace_bytes = size_t{32} << 20;
};

class CudaDevice final : public Device {
 public:
  // UNAVAILABLE when there is no usable GPU with that ordinal. Makes the
  // device current on the calling thread.
  static absl::StatusOr<std::unique_ptr<CudaDevice>> Create(
      const CudaDeviceOptions& options = {});

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override { return name_; }
  // cudaMemGetInfo: the whole GPU, other processes included.
  absl::StatusOr<MemoryStats> GetMemoryStats() const override;

  int ordinal() const { return options_.ordinal; }
  // cudaSetDevice for the calling thread; the engine thread calls it once
  // before using streams created on another thread.
  absl::Status MakeCurrent() const;

 protected:
  absl::StatusOr<void*> DoAllocate(size_t size_bytes) override;
  void DoFree(void* data, size_t size_bytes) noexcept override;
  // cudaMallocHost / cudaFreeHost: page-locked, page-aligned.
  absl::StatusOr<void*> DoAllocateHost(size_t size_bytes) override;
  void DoFreeHost(void* data, size_t size_bytes) noexcept override;
  absl::StatusOr<std::unique_ptr<Stream>> DoCreateStream() override;
  absl::StatusOr<std::unique_ptr<Event>> DoCreateEvent() override;

 private:
  CudaDevice(const CudaDeviceOptions& options, std::string name)
      : options_(options), name_(std::move(name)) {}

  const CudaDeviceOptions options_;
  const std::string name_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_CUDA_DEVICE_H_
