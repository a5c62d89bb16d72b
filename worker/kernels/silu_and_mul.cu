// SiLU-gated MLP activation on CUDA: out = silu(gate) * up (bf16, fp32 math).
#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/silu_and_mul_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

using cuda::FromFloat;
using cuda::ToFloat;

constexpr int kThreads = 256;

// grid: [num_tokens, ceil(intermediate / kThreads)]; one output element per
// thread. Same expression as the CPU kernel: gate / (1 + exp(-gate)) * up,
// with the accurate expf (for gate -> -inf, exp overflows to inf and the
// quotient is -0, no NaN).
__global__ void SiluAndMulKernel(const __nv_bfloat16* __restrict__ input,
                                 __nv_bfloat16* __restrict__ output,
                                 int intermediate) {
  const int i = blockIdx.y * blockDim.x + threadIdx.x;
  if (i >= intermediate) return;
  const int64_t t = blockIdx.x;
  const __nv_bfloat16* gate = input + t * 2 * intermediate;
  const __nv_bfloat16* up = gate + intermediate;
  const float g = ToFloat(gate[i]);
  output[t * intermediate + i] =
      FromFloat<__nv_bfloat16>(g / (1.0f + expf(-g)) * ToFloat(up[i]));
}

}  // namespace

cudaError_t LaunchSiluAndMulCuda(const SiluAndMulCudaParams& p,
                                 cudaStream_t stream) {
  const dim3 grid(p.num_tokens, cuda::NumBlocks(p.intermediate_size, kThreads));
  SiluAndMulKernel<<<grid, kThreads, 0, stream>>>(p.input, p.output,
                                                  p.intermediate_size);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace pdworker
