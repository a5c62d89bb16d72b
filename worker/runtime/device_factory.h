// CreateDevice: picks the backend, so callers need no CUDA headers or #ifs.
#ifndef PDWORKER_WORKER_RUNTIME_DEVICE_FACTORY_H_
#define PDWORKER_WORKER_RUNTIME_DEVICE_FACTORY_H_

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "worker/runtime/cpu_device.h"
#include "worker/runtime/device.h"

namespace pdworker {

struct DeviceOptions {
  CpuDeviceOptions cpu;
  // CUDA device ordinal and per-stream cuBLAS workspace.
  int cuda_ordinal = 0;
  size_t cublas_workspace_bytes = size_t{32} << 20;
};

// True when this binary was built with the CUDA backend (PDW_HAVE_CUDA=1).
bool CudaBackendCompiledIn();

// The CPU device always works. For kCuda: UNIMPLEMENTED when the binary was
// built without CUDA, UNAVAILABLE when no GPU is visible.
absl::StatusOr<std::unique_ptr<Device>> CreateDevice(
    DeviceKind kind, const DeviceOptions& options = {});

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_DEVICE_FACTORY_H_
