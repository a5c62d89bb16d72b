#include "worker/runtime/device_factory.h"

#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL

#if PDW_HAVE_CUDA
#include "worker/runtime/cuda_device.h"
#endif

namespace pdworker {

bool CudaBackendCompiledIn() {
#if PDW_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<Device>> CreateDevice(
    DeviceKind kind, const DeviceOptions& options) {
  switch (kind) {
    case DeviceKind::kCpu:
      return std::unique_ptr<Device>(new CpuDevice(options.cpu));
    case DeviceKind::kCuda: {
#if PDW_HAVE_CUDA
      CudaDeviceOptions cuda;
      cuda.ordinal = options.cuda_ordinal;
      cuda.cublas_workspace_bytes = options.cublas_workspace_bytes;
      absl::StatusOr<std::unique_ptr<CudaDevice>> device =
          CudaDevice::Create(cuda);
      if (!device.ok()) return device.status();
      return std::unique_ptr<Device>(std::move(*device));
#else
      (void)options;
      return absl::UnimplementedError(
          "this binary was built without the CUDA backend (PDW_HAVE_CUDA=0)");
#endif
    }
  }
  return absl::InvalidArgumentError("unknown device kind");
}

}  // namespace pdworker
