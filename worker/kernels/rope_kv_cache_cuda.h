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
};

// One block per token. Returns the launch error.
cudaError_t LaunchRopeKvCacheCuda(const RopeKvCacheCudaParams& p,
                                  cudaStream_t stream);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_ROPE_KV_CACHE_CUDA_H_
