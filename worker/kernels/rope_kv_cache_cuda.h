// CUDA launcher of RoPE + KV-cache write (worker/kernels/rope_kv_cache.h):
// bf16 q/k/v and cache, fp32 rotation.
// Plain C++ with CUDA runtime types; included only where PDW_HAVE_CUDA.
#ifndef PDWORKER_WORKER_KERNELS_ROPE_KV_CACHE_CUDA_H_
#define PDWORKER_WORKER_KERNELS_ROPE_KV_CACHE_CUDA_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace pdworker {
namespace kernels {

struct RopeKvCacheCudaParams {
  const int32_t* positions = nullptr;     // [num_tokens], read on device
  const int32_t* slot_mapping = nullptr;  // [num_tokens], read on device
  const float* inv_freq = nullptr;        // [head_dim / 2]
  __nv_bfloat16* query = nullptr;  // rows query_row_stride apart, in place
  __nv_bfloat16* key = nullptr;    // rows key_row_stride apart, in place
  const __nv_bfloat16* value = nullptr;  // rows value_row_stride apart
  __nv_bfloat16* key_cache = nullptr;    // [num_blocks * block_size, kv, d]
  __nv_bfloat16* value_cache = nullptr;
  int num_tokens = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;       // even, <= 512
  int64_t num_slots = 0;  // num_blocks * block_size
  int query_row_stride = 0;
  int key_row_stride = 0;
  int value_row_stride = 0;
  // Written without a GPU, not yet run on one (LlamaForward asks for
  // UnverifiedCudaKernels::kAllow before a model uses them):
  // Qwen3's per-head RMSNorm before the rotation (both or neither; bf16
  // [head_dim]): x * rsqrt(mean(x^2) + eps) * weight in fp32, rounded to
  // bf16 once, as the RMSNorm kernel computes a row.
  const __nv_bfloat16* q_norm_weight = nullptr;
  const __nv_bfloat16* k_norm_weight = nullptr;
  float qk_norm_epsilon = 0;
  int rotary_dim = 0;         // even, <= head_dim: the leading values rotate
  float rotary_scale = 1.0f;  // cos and sin are multiplied by it
};

// One block per token. Returns the launch error.
cudaError_t LaunchRopeKvCacheCuda(const RopeKvCacheCudaParams& p,
                                  cudaStream_t stream);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_ROPE_KV_CACHE_CUDA_H_
