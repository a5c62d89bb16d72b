// The arithmetic of RoPE + KV-cache write for one (q | k | v) pair of one
// token, shared by the RoPE kernel (rope_kv_cache.cu) and the skinny GEMMs'
// qkv epilogue (skinny_gemm.cu, skinny_gemm_mma.cu), so that a qkv
// projection that rotates and stores its own output writes bit for bit what
// the projection followed by the RoPE kernel writes.
// (nvcc only; a textual header.)
#ifndef PDWORKER_WORKER_KERNELS_ROPE_KV_ROW_CUH_
#define PDWORKER_WORKER_KERNELS_ROPE_KV_ROW_CUH_

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/rope_kv_cache_cuda.h"

namespace pdworker {
namespace kernels {
namespace cuda {

// cos and sin of the angle float(position) · inv_freq, the fp32 product
// Hugging Face and vLLM compute, with the accurate (non fast-math) sincosf.
__device__ __forceinline__ void RopeCosSin(int32_t position, float inv_freq,
                                           float* c, float* s) {
  sincosf(static_cast<float>(position) * inv_freq, s, c);
}

// The rotation of the pair (a, b) = (x[i], x[i + head_dim / 2]) (the
// rotate_half convention), each product and sum rounded on its own (no
// contraction into fma, as the CPU kernel computes it), then one rounding
// to bf16 each.
__device__ __forceinline__ void RopeRotate(float a, float b, float c, float s,
                                           __nv_bfloat16* lo,
                                           __nv_bfloat16* hi) {
  *lo = FromFloat<__nv_bfloat16>(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
  *hi = FromFloat<__nv_bfloat16>(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
}

// Token t's fused qkv row [num_heads | num_kv_heads | num_kv_heads] ×
// head_dim: the elements r0 and r0 + head_dim / 2 (r0 % head_dim <
// head_dim / 2) hold x0 and x1, the projection's bf16-rounded values as
// floats. q and k pairs are rotated and written back; k and v pairs are also
// written to the cache at slot_mapping[t] (skipped for -1 padding or a slot
// beyond the cache), exactly as RopeKvCacheKernel does.
__device__ __forceinline__ void StoreQkvPair(const RopeKvCacheCudaParams& p,
                                             __nv_bfloat16* qkv_row, int t,
                                             int r0, float x0, float x1) {
  const int half = p.head_dim / 2;
  const int h = r0 / p.head_dim, i = r0 % p.head_dim;
  __nv_bfloat16 lo = FromFloat<__nv_bfloat16>(x0);
  __nv_bfloat16 hi = FromFloat<__nv_bfloat16>(x1);
  if (h < p.num_heads + p.num_kv_heads) {
    float c, s;
    RopeCosSin(p.positions[t], p.inv_freq[i], &c, &s);
    RopeRotate(x0, x1, c, s, &lo, &hi);
  }
  qkv_row[r0] = lo;
  qkv_row[r0 + half] = hi;
  if (h < p.num_heads) return;
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0 || slot >= p.num_slots) return;
  const bool is_key = h < p.num_heads + p.num_kv_heads;
  const int kv_head = h - p.num_heads - (is_key ? 0 : p.num_kv_heads);
  __nv_bfloat16* dst = (is_key ? p.key_cache : p.value_cache) +
                       slot * p.num_kv_heads * p.head_dim +
                       kv_head * p.head_dim + i;
  dst[0] = lo;
  dst[half] = hi;
}

}  // namespace cuda
}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_ROPE_KV_ROW_CUH_
