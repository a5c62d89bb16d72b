// RMSNorm and fused residual-add + RMSNorm on CUDA (bf16, fp32 statistics).
#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/rms_norm_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

using cuda::BlockSum;
using cuda::FromFloat;
using cuda::ToFloat;

constexpr int kThreads = 256;

// grid: [num_tokens]; block: kThreads. Each thread owns the elements
// i ≡ threadIdx.x (mod kThreads) of the row in both passes, so `output` may
// alias `input` (or be written over elements the same thread read) and the
// second pass re-reads the residual values this very thread stored.
__global__ void RmsNormKernel(const __nv_bfloat16* input,
                              __nv_bfloat16* residual,
                              const __nv_bfloat16* __restrict__ weight,
                              __nv_bfloat16* output, int hidden_size,
                              float epsilon) {
  __shared__ float scratch[32];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * hidden_size;
  const __nv_bfloat16* x = input + row;

  // Pass 1: sum of squares (and, fused, the residual update).
  float sum_squares = 0.0f;
  if (residual == nullptr) {
    for (int i = threadIdx.x; i < hidden_size; i += blockDim.x) {
      const float v = ToFloat(x[i]);
      sum_squares += v * v;
    }
  } else {
    __nv_bfloat16* res = residual + row;
    for (int i = threadIdx.x; i < hidden_size; i += blockDim.x) {
      const __nv_bfloat16 updated =
          FromFloat<__nv_bfloat16>(ToFloat(res[i]) + ToFloat(x[i]));
      res[i] = updated;
      const float v = ToFloat(updated);
      sum_squares += v * v;
    }
  }
  sum_squares = BlockSum(sum_squares, scratch);
  // 1/sqrt with IEEE sqrt and division (not rsqrtf's approximation): closer
  // to the CPU kernel's double-precision statistic.
  const float inv_rms =
      1.0f / sqrtf(sum_squares / static_cast<float>(hidden_size) + epsilon);

  // Pass 2: normalize. The fused variant normalizes the stored residual.
  const __nv_bfloat16* source = residual == nullptr ? x : residual + row;
  __nv_bfloat16* out = output + row;
  for (int i = threadIdx.x; i < hidden_size; i += blockDim.x) {
    out[i] = FromFloat<__nv_bfloat16>(ToFloat(source[i]) * inv_rms *
                                      ToFloat(weight[i]));
  }
}

}  // namespace

cudaError_t LaunchRmsNormCuda(const RmsNormCudaParams& p, cudaStream_t stream) {
  RmsNormKernel<<<p.num_tokens, kThreads, 0, stream>>>(
      p.input, p.residual, p.weight, p.output, p.hidden_size, p.epsilon);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace pdworker
