#include "worker/runtime/cuda_stream.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "worker/runtime/cuda_device.h"
#include "worker/runtime/cuda_event.h"
#include "worker/runtime/cuda_graph.h"
#include "worker/runtime/cuda_status.h"

namespace pdworker {

absl::StatusOr<std::unique_ptr<CudaStream>> CudaStream::Create(
    CudaDevice& device, size_t cublas_workspace_bytes) {
  cudaStream_t raw_stream = nullptr;
  // Non-blocking: no implicit synchronization with the legacy default stream,
  // which would otherwise be an illegal dependency during capture.
  absl::Status status =
      CudaStatus(cudaStreamCreateWithFlags(&raw_stream, cudaStreamNonBlocking),
                 "cudaStreamCreateWithFlags");
  if (!status.ok()) return status;
  UniqueCudaStream stream(raw_stream);

  absl::StatusOr<DeviceMemory> workspace =
      device.Allocate(cublas_workspace_bytes);
  if (!workspace.ok()) return workspace.status();

  cublasHandle_t raw_handle = nullptr;
  status = CublasStatus(cublasCreate(&raw_handle), "cublasCreate");
  if (!status.ok()) return status;
  UniqueCublasHandle cublas(raw_handle);
  status = CublasStatus(cublasSetStream(cublas.get(), stream.get()),
                        "cublasSetStream");
  if (!status.ok()) return status;
  status = CublasStatus(cublasSetWorkspace(cublas.get(), workspace->data(),
                                           workspace->size_bytes()),
                        "cublasSetWorkspace");
  if (!status.ok()) return status;
  return std::unique_ptr<CudaStream>(new CudaStream(
      device, std::move(stream), *std::move(workspace), std::move(cublas)));
}

CudaStream::CudaStream(CudaDevice& device, UniqueCudaStream stream,
                       DeviceMemory cublas_workspace, UniqueCublasHandle cublas)
    : Stream(device),
      stream_(std::move(stream)),
      cublas_workspace_(std::move(cublas_workspace)),
      cublas_(std::move(cublas)) {
  op_context_.cuda_stream = stream_.get();
  op_context_.cublas_handle = cublas_.get();
}

CudaStream::~CudaStream() {
  if (IsCapturing()) {
    // Leave capture mode so the stream can be destroyed; drop the graph.
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(stream_.get(), &graph);
    UniqueCudaGraph discarded(graph);
    cudaGetLastError();
    AbandonCapture();
  }
}

absl::Status CudaStream::DoLaunch(absl::string_view name, Op op) {
  op(op_context_);
  // Kernel launches report configuration errors asynchronously through
  // cudaGetLastError; catch them here, next to the op that caused them.
  return CudaStatus(cudaGetLastError(),
                    absl::StrCat("launching op '", name, "'"));
}

absl::Status CudaStream::DoCopyToDevice(DeviceBuffer dst, const void* src,
                                        size_t size_bytes) {
  // From pageable memory this returns once `src` has been staged, so the
  // caller may reuse `src` right away.
  return CudaStatus(cudaMemcpyAsync(dst.data(), src, size_bytes,
                                    cudaMemcpyHostToDevice, stream_.get()),
                    "cudaMemcpyAsync(host to device)");
}

absl::Status CudaStream::DoCopyToDeviceAsync(DeviceBuffer dst, const void* src,
                                             size_t size_bytes) {
  return CudaStatus(cudaMemcpyAsync(dst.data(), src, size_bytes,
                                    cudaMemcpyHostToDevice, stream_.get()),
                    "cudaMemcpyAsync(pinned host to device)");
}

absl::Status CudaStream::DoCopyToHost(void* dst, DeviceBuffer src,
                                      size_t size_bytes) {
  absl::Status status = DoCopyToHostAsync(dst, src, size_bytes);
  if (!status.ok()) return status;
  return DoSynchronize();
}

absl::Status CudaStream::DoCopyToHostAsync(void* dst, DeviceBuffer src,
                                           size_t size_bytes) {
  return CudaStatus(cudaMemcpyAsync(dst, src.data(), size_bytes,
                                    cudaMemcpyDeviceToHost, stream_.get()),
                    "cudaMemcpyAsync(device to host)");
}

absl::Status CudaStream::DoCopyOnDevice(DeviceBuffer dst, DeviceBuffer src,
                                        size_t size_bytes) {
  return CudaStatus(cudaMemcpyAsync(dst.data(), src.data(), size_bytes,
                                    cudaMemcpyDeviceToDevice, stream_.get()),
                    "cudaMemcpyAsync(device to device)");
}

absl::Status CudaStream::DoSynchronize() {
  return CudaStatus(cudaStreamSynchronize(stream_.get()),
                    "cudaStreamSynchronize");
}

absl::Status CudaStream::DoRecordEvent(Event& event) {
  auto& cuda_event = static_cast<CudaEvent&>(event);
  absl::Status status = CudaStatus(
      cudaEventRecord(cuda_event.native(), stream_.get()), "cudaEventRecord");
  if (status.ok()) cuda_event.MarkRecorded();
  return status;
}

absl::Status CudaStream::DoBeginCapture() {
  return CudaStatus(
      cudaStreamBeginCapture(stream_.get(), cudaStreamCaptureModeThreadLocal),
      "cudaStreamBeginCapture");
}

absl::StatusOr<std::unique_ptr<CapturedGraph>> CudaStream::DoEndCapture(
    CaptureEnd end) {
  cudaGraph_t raw_graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream_.get(), &raw_graph);
  UniqueCudaGraph graph(raw_graph);
  if (end == CaptureEnd::kDiscard) {
    cudaGetLastError();  // Capture errors are not sticky; clear them.
    return nullptr;
  }
  absl::Status status = CudaStatus(ended, "cudaStreamEndCapture");
  if (!status.ok()) {
    cudaGetLastError();
    return status;
  }
  size_t num_nodes = 0;
  status = CudaStatus(cudaGraphGetNodes(graph.get(), nullptr, &num_nodes),
                      "cudaGraphGetNodes");
  if (!status.ok()) return status;

  cudaGraphExec_t raw_exec = nullptr;
  status = CudaStatus(cudaGraphInstantiate(&raw_exec, graph.get(), 0),
                      "cudaGraphInstantiate");
  if (!status.ok()) return status;
  UniqueCudaGraphExec exec(raw_exec);
  // Upload now so the first replay on the step path does not pay for it.
  status =
      CudaStatus(cudaGraphUpload(exec.get(), stream_.get()), "cudaGraphUpload");
  if (!status.ok()) return status;
  return std::unique_ptr<CapturedGraph>(
      new CudaGraph(*this, std::move(exec), num_nodes));
}

}  // namespace pdworker
