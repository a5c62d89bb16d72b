#include "worker/transfer/cuda_ipc.h"

#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "glog/logging.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL

#if PDW_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace pdworker {

std::string HostId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return std::string(absl::StripAsciiWhitespace(id));
}

#if PDW_HAVE_CUDA

absl::StatusOr<std::string> ExportCudaIpcHandle(DeviceBuffer allocation) {
  cudaIpcMemHandle_t handle;
  const cudaError_t error = cudaIpcGetMemHandle(&handle, allocation.data());
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("cudaIpcGetMemHandle failed: ", cudaGetErrorName(error),
                     " (", cudaGetErrorString(error), ")"));
  }
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

CudaIpcMappings::~CudaIpcMappings() {
  for (const auto& [key, buffer] : open_) {
    const cudaError_t error = cudaIpcCloseMemHandle(buffer.data());
    LOG_IF(WARNING, error != cudaSuccess)
        << "cudaIpcCloseMemHandle: " << cudaGetErrorName(error);
  }
}

absl::StatusOr<DeviceBuffer> CudaIpcMappings::Open(const std::string& handle,
                                                   size_t size_bytes) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a CUDA IPC handle is ", sizeof(cudaIpcMemHandle_t),
                     " bytes, got ", handle.size()));
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = open_.find(handle);
  if (it != open_.end()) {
    if (it->second.size_bytes() < size_bytes) {
      return absl::InvalidArgumentError(
          "the exported KV allocation is smaller than its views");
    }
    return it->second;
  }
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* base = nullptr;
  const cudaError_t error =
      cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("cudaIpcOpenMemHandle failed: ", cudaGetErrorName(error),
                     " (", cudaGetErrorString(error), ")"));
  }
  DeviceBuffer mapped(base, size_bytes);
  open_.emplace(handle, mapped);
  return mapped;
}

#else  // !PDW_HAVE_CUDA

absl::StatusOr<std::string> ExportCudaIpcHandle(DeviceBuffer /*allocation*/) {
  return absl::UnimplementedError("built without CUDA: no CUDA IPC");
}

CudaIpcMappings::~CudaIpcMappings() = default;

absl::StatusOr<DeviceBuffer> CudaIpcMappings::Open(
    const std::string& /*handle*/, size_t /*size_bytes*/) {
  return absl::UnimplementedError("built without CUDA: no CUDA IPC");
}

#endif  // PDW_HAVE_CUDA

}  // namespace pdworker
