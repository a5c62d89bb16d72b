// Embedding lookup on CUDA: out[t, :] = table[token_ids[t], :] (bf16 copy).
#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/embedding_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

constexpr int kThreads = 128;

// grid: [num_tokens]; block: kThreads threads stride over the row. An id
// outside [0, vocab_size) gives a zero row (never an out-of-bounds read).
__global__ void EmbeddingKernel(const int32_t* __restrict__ token_ids,
                                const __nv_bfloat16* __restrict__ table,
                                __nv_bfloat16* __restrict__ output,
                                int vocab_size, int hidden_size, float scale) {
  cuda::AllowDependentLaunch();  // the first qkv projection (PDL) follows
  const int64_t t = blockIdx.x;
  const int32_t id = token_ids[t];
  __nv_bfloat16* dst = output + t * hidden_size;
  if (id < 0 || id >= vocab_size) {
    for (int i = threadIdx.x; i < hidden_size; i += blockDim.x) {
      dst[i] = __float2bfloat16(0.0f);
    }
    return;
  }
  const __nv_bfloat16* src = table + static_cast<int64_t>(id) * hidden_size;
  if (scale == 1.0f) {
    for (int i = threadIdx.x; i < hidden_size; i += blockDim.x) dst[i] = src[i];
    return;
  }
  for (int i = threadIdx.x; i < hidden_size; i += blockDim.x) {
    dst[i] = __float2bfloat16(__bfloat162float(src[i]) * scale);
  }
}

}  // namespace

cudaError_t LaunchEmbeddingCuda(const EmbeddingCudaParams& p,
                                cudaStream_t stream) {
  EmbeddingKernel<<<p.num_tokens, kThreads, 0, stream>>>(
      p.token_ids, p.table, p.output, p.vocab_size, p.hidden_size, p.scale);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace pdworker
