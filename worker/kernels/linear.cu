// Dense layer on CUDA: output = input · weightᵀ (+ bias) through cuBLAS,
// bf16 operands with fp32 accumulation (CUBLAS_COMPUTE_32F).
#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/linear_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

constexpr int kThreads = 256;

// grid: [num_tokens, ceil(out_features / kThreads)]. Writes the bias into
// every output row, so that the GEMM with beta = 1 adds it inside its fp32
// epilogue: one rounding of (x·w + b), as the CPU kernel computes it.
template <typename OutT>
__global__ void BroadcastBiasKernel(const __nv_bfloat16* __restrict__ bias,
                                    OutT* __restrict__ output,
                                    int out_features) {
  const int o = blockIdx.y * blockDim.x + threadIdx.x;
  if (o >= out_features) return;
  output[static_cast<int64_t>(blockIdx.x) * out_features + o] =
      cuda::FromFloat<OutT>(cuda::ToFloat(bias[o]));
}

}  // namespace

LinearCudaResult LaunchLinearCuda(const LinearCudaParams& p,
                                  cudaStream_t stream, cublasHandle_t cublas) {
  LinearCudaResult result;
  const bool fp32_out = p.output_type == LinearCudaOutput::kFloat32;
  float beta = 0.0f;
  if (p.bias != nullptr) {
    const dim3 grid(p.num_tokens, cuda::NumBlocks(p.out_features, kThreads));
    if (fp32_out) {
      BroadcastBiasKernel<<<grid, kThreads, 0, stream>>>(
          p.bias, static_cast<float*>(p.output), p.out_features);
    } else {
      BroadcastBiasKernel<<<grid, kThreads, 0, stream>>>(
          p.bias, static_cast<__nv_bfloat16*>(p.output), p.out_features);
    }
    result.launch = cudaGetLastError();
    if (result.launch != cudaSuccess) return result;
    beta = 1.0f;
  }
  // Row-major Y[T, O] = X[T, I] · W[O, I]ᵀ is column-major Yᵀ[O, T] =
  // op(W)[O, I] · Xᵀ[I, T] where the row-major W buffer read column-major is
  // Wᵀ [I, O] (lda = I), hence CUBLAS_OP_T on it; X read column-major is
  // Xᵀ [I, T] (ldb = I); Yᵀ is [O, T] column-major (ldc = O). alpha and beta
  // are host scalars: cuBLAS reads them at enqueue time (and bakes them into
  // a captured graph). The algorithm is cuBLAS's heuristic for (O, T, I):
  // deterministic for a given shape, possibly different across token counts.
  const float alpha = 1.0f;
  result.cublas =
      cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, p.out_features,
                   p.num_tokens, p.in_features, &alpha, p.weight, CUDA_R_16BF,
                   p.in_features, p.input, CUDA_R_16BF, p.in_features, &beta,
                   p.output, fp32_out ? CUDA_R_32F : CUDA_R_16BF,
                   p.out_features, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  return result;
}

}  // namespace kernels
}  // namespace pdworker
