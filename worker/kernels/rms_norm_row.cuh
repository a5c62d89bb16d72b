// The arithmetic of one RMSNorm row, shared by the RMSNorm kernel
// (rms_norm.cu) and the skinny GEMMs' RMSNorm prologue (skinny_gemm.cu,
// skinny_gemm_mma.cu), so that a projection that normalizes its own input
// computes bit for bit the row the RMSNorm kernel would have written: the
// fused decode step equals the unfused one.
//
// The order is that of a 256-thread block over 16-byte vectors: thread i
// adds the squares of vectors i, i + 256, ... (8 fmaf each, in element
// order), then cuda::BlockSum; inv_rms = 1 / sqrt(mean + eps) with IEEE
// sqrt and division; each element is rounded once, bf16(v · inv_rms · w).
// (nvcc only; a textual header.)
#ifndef PDWORKER_WORKER_KERNELS_RMS_NORM_ROW_CUH_
#define PDWORKER_WORKER_KERNELS_RMS_NORM_ROW_CUH_

#include "worker/kernels/cuda_common.cuh"

namespace pdworker {
namespace kernels {
namespace cuda {

// The block size the order above is defined for.
constexpr int kRmsNormThreads = 256;

__device__ __forceinline__ float AddSquares(const float (&v)[8], float sum) {
#pragma unroll
  for (int e = 0; e < 8; ++e) sum = __fmaf_rn(v[e], v[e], sum);
  return sum;
}

__device__ __forceinline__ float InvRms(float sum_squares, int hidden_size,
                                        float epsilon) {
  return 1.0f / sqrtf(sum_squares / static_cast<float>(hidden_size) + epsilon);
}

// 8 floats -> 8 bf16 (round to nearest even), the inverse of Bf16x8ToFloat.
__device__ __forceinline__ uint4 PackBf16x8(const float (&f)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    w[i] = *reinterpret_cast<const uint32_t*>(&h);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// bf16(v · inv_rms · w) for 8 elements.
__device__ __forceinline__ uint4 NormalizeBf16x8(const float (&v)[8],
                                                 float inv_rms, uint4 weight) {
  float g[8];
  Bf16x8ToFloat(weight, g);
#pragma unroll
  for (int e = 0; e < 8; ++e) g[e] = v[e] * inv_rms * g[e];
  return PackBf16x8(g);
}

// RMSNorm of `rows` rows of x ([rows, hidden_size] bf16 in global memory,
// 16-byte aligned, hidden_size % 8 == 0) into xs ([rows, xs_stride] bf16,
// shared memory, 16-byte aligned rows). Every thread of a kRmsNormThreads
// block calls it; `scratch` is __shared__ float[32]. Ends with
// __syncthreads, so xs is ready for the whole block.
__device__ __forceinline__ void RmsNormRowsToShared(
    const __nv_bfloat16* x, const __nv_bfloat16* __restrict__ weight,
    __nv_bfloat16* xs, int rows, int hidden_size, int xs_stride, float epsilon,
    float* scratch) {
  const int vectors = hidden_size / 8;
  const uint4* w = reinterpret_cast<const uint4*>(weight);
  for (int t = 0; t < rows; ++t) {
    const uint4* row = reinterpret_cast<const uint4*>(
        x + static_cast<int64_t>(t) * hidden_size);
    float sum_squares = 0.0f;
    for (int i = threadIdx.x; i < vectors; i += kRmsNormThreads) {
      float v[8];
      Bf16x8ToFloat(row[i], v);
      sum_squares = AddSquares(v, sum_squares);
    }
    const float inv_rms =
        InvRms(BlockSum(sum_squares, scratch), hidden_size, epsilon);
    uint4* out = reinterpret_cast<uint4*>(xs + t * xs_stride);
    for (int i = threadIdx.x; i < vectors; i += kRmsNormThreads) {
      float v[8];
      Bf16x8ToFloat(row[i], v);
      out[i] = NormalizeBf16x8(v, inv_rms, w[i]);
    }
  }
  __syncthreads();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_RMS_NORM_ROW_CUH_
