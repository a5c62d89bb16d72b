// CUDA IPC for the KV handoff between two processes on one host: the prefill
// worker exports its KV cache allocation once (cudaIpcGetMemHandle); a decode
// worker on the same host maps it (cudaIpcOpenMemHandle) and copies a lease's
// blocks device to device, never through host memory.
//
// Built without CUDA (PDW_HAVE_CUDA=0) every call returns UNIMPLEMENTED, so
// callers need no #if.
#ifndef PDWORKER_WORKER_TRANSFER_CUDA_IPC_H_
#define PDWORKER_WORKER_TRANSFER_CUDA_IPC_H_

#include <memory>
#include <mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "worker/runtime/device_buffer.h"

namespace pdworker {

// The opaque cudaIpcMemHandle_t bytes (64) of the allocation that starts at
// `allocation.data()`. UNIMPLEMENTED without CUDA; errors from the driver
// otherwise (e.g. memory not from cudaMalloc).
absl::StatusOr<std::string> ExportCudaIpcHandle(DeviceBuffer allocation);

// This host's identity for "same host?" checks: the kernel's boot id
// (/proc/sys/kernel/random/boot_id), shared by every container on a node
// and different on every other machine. Empty when unreadable.
std::string HostId();

// Mappings of other processes' exported allocations, opened on first use
// and kept until destruction (opening costs a driver call and maps memory;
// a decode worker pulls from the same few prefill workers all day).
// Thread-safe.
class CudaIpcMappings {
 public:
  CudaIpcMappings() = default;
  // Closes every mapping (cudaIpcCloseMemHandle).
  ~CudaIpcMappings();
  CudaIpcMappings(const CudaIpcMappings&) = delete;
  CudaIpcMappings& operator=(const CudaIpcMappings&) = delete;

  // The mapped allocation of `handle` (`size_bytes` long). UNIMPLEMENTED
  // without CUDA; UNAVAILABLE when the driver refuses (other host, no
  // shared IPC namespace, no peer access between the GPUs).
  absl::StatusOr<DeviceBuffer> Open(const std::string& handle,
                                    size_t size_bytes);

 private:
  std::mutex mu_;
  absl::flat_hash_map<std::string, DeviceBuffer> open_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_TRANSFER_CUDA_IPC_H_
