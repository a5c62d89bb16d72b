// CudaStream: a cudaStream_t with its cuBLAS handle, and CUDA stream capture.
#ifndef PDWORKER_WORKER_RUNTIME_CUDA_STREAM_H_
#define PDWORKER_WORKER_RUNTIME_CUDA_STREAM_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "worker/runtime/cuda_handles.h"
#include "worker/runtime/stream.h"

namespace pdworker {

class CudaDevice;

// Ops enqueue kernels on native() (via OpContext::cuda_stream); during capture
// CUDA records them (cudaStreamCaptureModeThreadLocal, so only this thread's
// unsafe calls can invalidate the capture). The cuBLAS handle is bound to the
// stream with a workspace allocated here, so cuBLAS calls are capturable.
class CudaStream final : public Stream {
 public:
  // Allocates the cuBLAS workspace (`cublas_workspace_bytes`) from `device`.
  static absl::StatusOr<std::unique_ptr<CudaStream>> Create(
      CudaDevice& device, size_t cublas_workspace_bytes);
  ~CudaStream() override;

  cudaStream_t native() const { return stream_.get(); }
  cublasHandle_t cublas() const { return cublas_.get(); }

 protected:
  absl::Status DoLaunch(absl::string_view name, Op op) override;
  absl::Status DoCopyToDevice(DeviceBuffer dst, const void* src,
                              size_t size_bytes) override;
  // From pinned memory: cudaMemcpyAsync returns before the DMA runs.
  absl::Status DoCopyToDeviceAsync(DeviceBuffer dst, const void* src,
                                   size_t size_bytes) override;
  absl::Status DoCopyToHost(void* dst, DeviceBuffer src,
                            size_t size_bytes) override;
  // cudaMemcpyAsync without synchronizing. Truly asynchronous only into
  // pinned memory (Device::AllocateHost); into pageable memory the runtime
  // may stage the copy and block the host until it is done.
  absl::Status DoCopyToHostAsync(void* dst, DeviceBuffer src,
                                 size_t size_bytes) override;
  absl::Status DoCopyOnDevice(DeviceBuffer dst, DeviceBuffer src,
                              size_t size_bytes) override;
  absl::Status DoSynchronize() override;
  absl::Status DoRecordEvent(Event& event) override;
  absl::Status DoBeginCapture() override;
  absl::StatusOr<std::unique_ptr<CapturedGraph>> DoEndCapture(
      CaptureEnd end) override;

 private:
  CudaStream(CudaDevice& device, UniqueCudaStream stream,
             DeviceMemory cublas_workspace, UniqueCublasHandle cublas);

  // Declaration order is teardown order reversed: the handle goes first, then
  // its workspace, then the stream.
  UniqueCudaStream stream_;
  DeviceMemory cublas_workspace_;
  UniqueCublasHandle cublas_;
  OpContext op_context_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_CUDA_STREAM_H_
