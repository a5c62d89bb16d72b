// RAII owners for raw CUDA runtime and cuBLAS handles. Their deleters never
// throw and ignore errors (a failing destroy during teardown has no one to
// report to but the log).
#ifndef PDWORKER_WORKER_RUNTIME_CUDA_HANDLES_H_
#define PDWORKER_WORKER_RUNTIME_CUDA_HANDLES_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <type_traits>

namespace pdworker {

struct CudaStreamDeleter {
  void operator()(cudaStream_t stream) const noexcept {
    cudaStreamDestroy(stream);
  }
};
struct CudaEventDeleter {
  void operator()(cudaEvent_t event) const noexcept { cudaEventDestroy(event); }
};
struct CudaGraphDeleter {
  void operator()(cudaGraph_t graph) const noexcept { cudaGraphDestroy(graph); }
};
struct CudaGraphExecDeleter {
  void operator()(cudaGraphExec_t exec) const noexcept {
    cudaGraphExecDestroy(exec);
  }
};
struct CublasHandleDeleter {
  void operator()(cublasHandle_t handle) const noexcept {
    cublasDestroy(handle);
  }
};

using UniqueCudaStream =
    std::unique_ptr<std::remove_pointer_t<cudaStream_t>, CudaStreamDeleter>;
using UniqueCudaEvent =
    std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, CudaEventDeleter>;
using UniqueCudaGraph =
    std::unique_ptr<std::remove_pointer_t<cudaGraph_t>, CudaGraphDeleter>;
using UniqueCudaGraphExec =
    std::unique_ptr<std::remove_pointer_t<cudaGraphExec_t>,
                    CudaGraphExecDeleter>;
using UniqueCublasHandle =
    std::unique_ptr<std::remove_pointer_t<cublasHandle_t>, CublasHandleDeleter>;

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_CUDA_HANDLES_H_
