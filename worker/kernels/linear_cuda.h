// CUDA launcher of the dense layer (worker/kernels/linear.h): cuBLAS GEMM,
// bf16 inputs, fp32 accumulation, bf16 or fp32 output.
// Plain C++ with CUDA runtime types; included only where PDW_HAVE_CUDA.
#ifndef PDWORKER_WORKER_KERNELS_LINEAR_CUDA_H_
#define PDWORKER_WORKER_KERNELS_LINEAR_CUDA_H_

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace pdworker {
namespace kernels {

enum class LinearCudaOutput { kBFloat16, kFloat32 };

struct LinearCudaParams {
  const __nv_bfloat16* input = nullptr;   // [num_tokens, in_features]
  const __nv_bfloat16* weight = nullptr;  // [out_features, in_features]
  const __nv_bfloat16* bias = nullptr;    // [out_features] or nullptr
  void* output = nullptr;  // [num_tokens, out_features] of output_type
  LinearCudaOutput output_type = LinearCudaOutput::kBFloat16;
  int num_tokens = 0;
  int in_features = 0;
  int out_features = 0;
};

// What went wrong, if anything: the bias broadcast kernel's launch error and
// cuBLAS's status.
struct LinearCudaResult {
  cudaError_t launch = cudaSuccess;
  cublasStatus_t cublas = CUBLAS_STATUS_SUCCESS;
};

// `cublas` must be bound to `stream` with a fixed workspace (CudaStream does
// both), so the call is capturable and never allocates.
LinearCudaResult LaunchLinearCuda(const LinearCudaParams& p,
                                  cudaStream_t stream, cublasHandle_t cublas);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_LINEAR_CUDA_H_
