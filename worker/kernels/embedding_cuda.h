// CUDA launcher of the embedding lookup (worker/kernels/embedding.h), bf16.
// Plain C++ with CUDA runtime types; included only where PDW_HAVE_CUDA.
#ifndef PDWORKER_WORKER_KERNELS_EMBEDDING_CUDA_H_
#define PDWORKER_WORKER_KERNELS_EMBEDDING_CUDA_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace pdworker {
namespace kernels {

struct EmbeddingCudaParams {
  const int32_t* token_ids = nullptr;    // [num_tokens], read on device
  const __nv_bfloat16* table = nullptr;  // [vocab_size, hidden_size]
  __nv_bfloat16* output = nullptr;       // [num_tokens, hidden_size]
  int num_tokens = 0;
  int vocab_size = 0;
  int hidden_size = 0;
  // Gemma's embedding multiplier: rows are bf16(float(row) * scale) (1: a
  // plain copy). Written without a GPU (UnverifiedCudaKernels).
  float scale = 1.0f;
};

// One block per token row. Returns the launch error (cudaGetLastError).
cudaError_t LaunchEmbeddingCuda(const EmbeddingCudaParams& p,
                                cudaStream_t stream);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_EMBEDDING_CUDA_H_
