// RoPE (rotate_half convention) on q and k, then K/V written into the paged
// cache, on CUDA: bf16 storage, fp32 rotation.
#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/rope_kv_cache_cuda.h"
#include "worker/kernels/rope_kv_row.cuh"

namespace pdworker {
namespace kernels {
namespace {

using cuda::FromFloat;
using cuda::ToFloat;

constexpr int kThreads = 128;
constexpr int kMaxHalf = 256;  // head_dim <= 512, as the CPU kernel

// Rotates the pair (x[i], x[i + half]) of one head in place and returns the
// rotated, rounded values (the ones written to the cache for k). The math is
// rope_kv_row.cuh's, shared with the skinny GEMMs' fused qkv epilogue.
__device__ __forceinline__ void RotatePair(__nv_bfloat16* lo, int half, float c,
                                           float s, __nv_bfloat16* out_lo,
                                           __nv_bfloat16* out_hi) {
  cuda::RopeRotate(ToFloat(lo[0]), ToFloat(lo[half]), c, s, out_lo, out_hi);
  lo[0] = *out_lo;
  lo[half] = *out_hi;
}

// Qwen3's per-head RMSNorm, one warp per head (q heads, then k heads): the
// sum of squares in fp32, x * rsqrt(mean + eps) * weight rounded to bf16 in
// place (the RMSNorm kernel's arithmetic). Written without a GPU
// (UnverifiedCudaKernels).
__device__ void NormalizeHeads(const RopeKvCacheCudaParams& p, __nv_bfloat16* q,
                               __nv_bfloat16* k) {
  const int lane = threadIdx.x % cuda::kWarpSize;
  const int num_warps = blockDim.x / cuda::kWarpSize;
  for (int head = threadIdx.x / cuda::kWarpSize;
       head < p.num_heads + p.num_kv_heads; head += num_warps) {
    const bool is_q = head < p.num_heads;
    __nv_bfloat16* x =
        is_q ? q + head * p.head_dim : k + (head - p.num_heads) * p.head_dim;
    const __nv_bfloat16* weight = is_q ? p.q_norm_weight : p.k_norm_weight;
    float sum_squares = 0.0f;
    for (int i = lane; i < p.head_dim; i += cuda::kWarpSize) {
      const float value = ToFloat(x[i]);
      sum_squares += value * value;
    }
    const float inv_rms =
        rsqrtf(cuda::WarpSum(sum_squares) / p.head_dim + p.qk_norm_epsilon);
    for (int i = lane; i < p.head_dim; i += cuda::kWarpSize) {
      x[i] = FromFloat<__nv_bfloat16>(ToFloat(x[i]) * inv_rms *
                                      ToFloat(weight[i]));
    }
  }
}

// grid: [num_tokens]; block: kThreads. Every element is read and written by
// one thread, so the in-place rotation needs no synchronization beyond the
// cos/sin table (and, with q/k norm, the norm pass before it).
__global__ void RopeKvCacheKernel(RopeKvCacheCudaParams p) {
  cuda::AllowDependentLaunch();   // the attention's split kernel follows
  cuda::WaitForPreviousKernel();  // launched with kProgrammatic
  __shared__ float cos_half[kMaxHalf];
  __shared__ float sin_half[kMaxHalf];
  const int t = blockIdx.x;
  // Partial rotary: pairs (i, i + half) of the leading rotary_dim values.
  const int half = p.rotary_dim / 2;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    cuda::RopeCosSin(p.positions[t], p.inv_freq[i], &cos_half[i], &sin_half[i]);
    if (p.rotary_scale != 1.0f) {
      cos_half[i] *= p.rotary_scale;
      sin_half[i] *= p.rotary_scale;
    }
  }

  __nv_bfloat16* q = p.query + static_cast<int64_t>(t) * p.query_row_stride;
  __nv_bfloat16* k = p.key + static_cast<int64_t>(t) * p.key_row_stride;
  const __nv_bfloat16* v =
      p.value + static_cast<int64_t>(t) * p.value_row_stride;
  if (p.q_norm_weight != nullptr) NormalizeHeads(p, q, k);
  __syncthreads();
  // Slot -1 (padding) or beyond the cache: rotate, but write no KV.
  const int64_t slot = p.slot_mapping[t];
  const bool write = slot >= 0 && slot < p.num_slots;
  const int64_t kv_row = static_cast<int64_t>(p.num_kv_heads) * p.head_dim;
  // The values past the rotary part go to the cache as they are.
  const int tail = p.head_dim - p.rotary_dim;
  if (write && tail > 0) {
    for (int idx = threadIdx.x; idx < p.num_kv_heads * tail;
         idx += blockDim.x) {
      const int h = idx / tail;
      const int i = p.rotary_dim + idx % tail;
      p.key_cache[slot * kv_row + h * p.head_dim + i] = k[h * p.head_dim + i];
    }
  }

  for (int idx = threadIdx.x; idx < p.num_heads * half; idx += blockDim.x) {
    const int h = idx / half;
    const int i = idx % half;
    __nv_bfloat16 lo, hi;
    RotatePair(q + h * p.head_dim + i, half, cos_half[i], sin_half[i], &lo,
               &hi);
  }
  for (int idx = threadIdx.x; idx < p.num_kv_heads * half; idx += blockDim.x) {
    const int h = idx / half;
    const int i = idx % half;
    __nv_bfloat16 lo, hi;
    RotatePair(k + h * p.head_dim + i, half, cos_half[i], sin_half[i], &lo,
               &hi);
    if (write) {
      __nv_bfloat16* dst = p.key_cache + slot * kv_row + h * p.head_dim + i;
      dst[0] = lo;
      dst[half] = hi;
    }
  }
  if (write) {
    __nv_bfloat16* dst = p.value_cache + slot * kv_row;
    for (int i = threadIdx.x; i < kv_row; i += blockDim.x) dst[i] = v[i];
  }
}

}  // namespace

cudaError_t LaunchRopeKvCacheCuda(const RopeKvCacheCudaParams& p,
                                  cudaStream_t stream) {
  // Scheduled while the qkv projection drains (programmatic dependent
  // launch); the kernel waits for it first.
  return cuda::LaunchKernel(RopeKvCacheKernel, dim3(p.num_tokens),
                            dim3(kThreads), 0, stream,
                            cuda::DependentLaunch::kProgrammatic, p);
}

}  // namespace kernels
}  // namespace pdworker
