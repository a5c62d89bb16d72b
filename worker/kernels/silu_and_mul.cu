// SiLU-gated MLP activation on CUDA: out = silu(gate) * up (bf16, fp32 math).
#include <cstdint>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/silu_and_mul_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

using cuda::Aligned16;
using cuda::FromFloat;
using cuda::ToFloat;

constexpr int kThreads = 256;

template <GatedActivation kActivation>
__device__ __forceinline__ float GatedMul(float gate, float up) {
  return kActivation == GatedActivation::kSilu ? cuda::SiluMul(gate, up)
                                               : cuda::GeluTanhMul(gate, up);
}

// grid: [num_tokens, ceil(intermediate / kThreads)]; one output element per
// thread. Same expression as the CPU kernel: gate / (1 + exp(-gate)) * up,
// with the accurate expf (for gate -> -inf, exp overflows to inf and the
// quotient is -0, no NaN); GeGLU's likewise (cuda::GeluTanhMul).
template <GatedActivation kActivation>
__global__ void SiluAndMulKernel(const __nv_bfloat16* __restrict__ input,
                                 __nv_bfloat16* __restrict__ output,
                                 int intermediate) {
  cuda::AllowDependentLaunch();
  cuda::WaitForPreviousKernel();  // launched with kProgrammatic
  const int i = blockIdx.y * blockDim.x + threadIdx.x;
  if (i >= intermediate) return;
  const int64_t t = blockIdx.x;
  const __nv_bfloat16* gate = input + t * 2 * intermediate;
  const __nv_bfloat16* up = gate + intermediate;
  const float g = ToFloat(gate[i]);
  output[t * intermediate + i] =
      FromFloat<__nv_bfloat16>(GatedMul<kActivation>(g, ToFloat(up[i])));
}

// The same, 8 elements per thread through 16-byte loads and stores, for
// intermediate % 8 == 0 and 16-byte aligned rows. grid: [num_tokens,
// ceil(intermediate / 8 / kThreads)].
template <GatedActivation kActivation>
__global__ void SiluAndMulVecKernel(const __nv_bfloat16* __restrict__ input,
                                    __nv_bfloat16* __restrict__ output,
                                    int intermediate) {
  cuda::AllowDependentLaunch();
  cuda::WaitForPreviousKernel();  // launched with kProgrammatic
  const int i = blockIdx.y * blockDim.x + threadIdx.x;  // vector index
  if (i >= intermediate / 8) return;
  const int64_t t = blockIdx.x;
  const uint4* gate =
      reinterpret_cast<const uint4*>(input + t * 2 * intermediate);
  const uint4* up = reinterpret_cast<const uint4*>(
      input + t * 2 * intermediate + intermediate);
  const uint4 g4 = gate[i], u4 = up[i];
  const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&g4);
  const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&u4);
  uint4 o4;
  __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&o4);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 g = __bfloat1622float2(g2[e]);
    const float2 u = __bfloat1622float2(u2[e]);
    o2[e] = __floats2bfloat162_rn(GatedMul<kActivation>(g.x, u.x),
                                  GatedMul<kActivation>(g.y, u.y));
  }
  reinterpret_cast<uint4*>(output + t * intermediate)[i] = o4;
}

template <GatedActivation kActivation>
cudaError_t LaunchGated(const SiluAndMulCudaParams& p, cudaStream_t stream) {
  if (p.intermediate_size % 8 == 0 && Aligned16(p.input) &&
      Aligned16(p.output)) {
    const dim3 grid(p.num_tokens,
                    cuda::NumBlocks(p.intermediate_size / 8, kThreads));
    return cuda::LaunchKernel(SiluAndMulVecKernel<kActivation>, grid,
                              dim3(kThreads), 0, stream,
                              cuda::DependentLaunch::kProgrammatic, p.input,
                              p.output, p.intermediate_size);
  }
  const dim3 grid(p.num_tokens, cuda::NumBlocks(p.intermediate_size, kThreads));
  return cuda::LaunchKernel(SiluAndMulKernel<kActivation>, grid, dim3(kThreads),
                            0, stream, cuda::DependentLaunch::kProgrammatic,
                            p.input, p.output, p.intermediate_size);
}

}  // namespace

cudaError_t LaunchSiluAndMulCuda(const SiluAndMulCudaParams& p,
                                 cudaStream_t stream) {
  return p.activation == GatedActivation::kSilu
             ? LaunchGated<GatedActivation::kSilu>(p, stream)
             : LaunchGated<GatedActivation::kGeluTanh>(p, stream);
}

}  // namespace kernels
}  // namespace pdworker
