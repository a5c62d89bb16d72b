#include "worker/runtime/cuda_device.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"
#include "worker/runtime/cuda_event.h"
#include "worker/runtime/cuda_status.h"
#include "worker/runtime/cuda_stream.h"

namespace pdworker {

absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::Create(
    const CudaDeviceOptions& options) {
  int count = 0;
  cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();  // Clear it: a missing driver is not sticky.
    return absl::UnavailableError(absl::StrCat(
        "no usable CUDA device: cudaGetDeviceCount failed with ",
        cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
  }
  if (options.ordinal < 0 || options.ordinal >= count) {
    return absl::UnavailableError(
        absl::StrFormat("CUDA device %d requested but %d device(s) visible",
                        options.ordinal, count));
  }
  absl::Status status =
      CudaStatus(cudaSetDevice(options.ordinal), "cudaSetDevice");
  if (!status.ok()) return status;
  cudaDeviceProp properties{};
  status = CudaStatus(cudaGetDeviceProperties(&properties, options.ordinal),
                      "cudaGetDeviceProperties");
  if (!status.ok()) return status;
  std::string name =
      absl::StrCat("cuda:", options.ordinal, " (", properties.name, ")");
  return std::unique_ptr<CudaDevice>(new CudaDevice(options, std::move(name)));
}

absl::Status CudaDevice::MakeCurrent() const {
  return CudaStatus(cudaSetDevice(options_.ordinal), "cudaSetDevice");
}

absl::StatusOr<MemoryStats> CudaDevice::GetMemoryStats() const {
  absl::Status current = MakeCurrent();
  if (!current.ok()) return current;
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  absl::Status status =
      CudaStatus(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  if (!status.ok()) return status;
  MemoryStats stats;
  stats.free_bytes = free_bytes;
  stats.total_bytes = total_bytes;
  stats.used_bytes = total_bytes - free_bytes;
  return stats;
}

absl::StatusOr<void*> CudaDevice::DoAllocate(size_t size_bytes) {
  absl::Status current = MakeCurrent();
  if (!current.ok()) return current;
  void* data = nullptr;
  absl::Status status = CudaStatus(
      cudaMalloc(&data, size_bytes),
      absl::StrFormat("cudaMalloc(%d bytes) on %s", size_bytes, name_));
  if (!status.ok()) {
    cudaGetLastError();  // Out-of-memory is not sticky; clear it.
    return status;
  }
  return data;
}

void CudaDevice::DoFree(void* data, size_t size_bytes) noexcept {
  const cudaError_t error = cudaFree(data);
  if (error != cudaSuccess) {
    LOG(ERROR) << "cudaFree of " << size_bytes << " bytes on " << name_
               << " failed: " << cudaGetErrorString(error);
  }
}

absl::StatusOr<void*> CudaDevice::DoAllocateHost(size_t size_bytes) {
  absl::Status current = MakeCurrent();
  if (!current.ok()) return current;
  void* data = nullptr;
  absl::Status status = CudaStatus(
      cudaMallocHost(&data, size_bytes),
      absl::StrFormat("cudaMallocHost(%d bytes) for %s", size_bytes, name_));
  if (!status.ok()) {
    cudaGetLastError();  // Out-of-memory is not sticky; clear it.
    return status;
  }
  return data;
}

void CudaDevice::DoFreeHost(void* data, size_t size_bytes) noexcept {
  const cudaError_t error = cudaFreeHost(data);
  if (error != cudaSuccess) {
    LOG(ERROR) << "cudaFreeHost of " << size_bytes << " bytes for " << name_
               << " failed: " << cudaGetErrorString(error);
  }
}

absl::StatusOr<std::unique_ptr<Stream>> CudaDevice::DoCreateStream() {
  absl::Status current = MakeCurrent();
  if (!current.ok()) return current;
  absl::StatusOr<std::unique_ptr<CudaStream>> stream =
      CudaStream::Create(*this, options_.cublas_workspace_bytes);
  if (!stream.ok()) return stream.status();
  return std::unique_ptr<Stream>(std::move(*stream));
}

absl::StatusOr<std::unique_ptr<Event>> CudaDevice::DoCreateEvent() {
  absl::Status current = MakeCurrent();
  if (!current.ok()) return current;
  absl::StatusOr<std::unique_ptr<CudaEvent>> event = CudaEvent::Create();
  if (!event.ok()) return event.status();
  return std::unique_ptr<Event>(std::move(*event));
}

}  // namespace pdworker
