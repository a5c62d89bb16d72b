// CUDA launchers of paged attention (worker/kernels/paged_attention.h):
// bf16 query / KV cache / output, fp32 scores, softmax and accumulation.
// Plain C++ with CUDA runtime types; included only where PDW_HAVE_CUDA.
#ifndef PDWORKER_WORKER_KERNELS_PAGED_ATTENTION_CUDA_H_
#define PDWORKER_WORKER_KERNELS_PAGED_ATTENTION_CUDA_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace pdworker {
namespace kernels {

// Query rows (heads × query tokens of one request) one CTA attends with:
// they share every K/V load. The uniform decode routine needs
// uniform_query_len <= this; larger GQA groups are split across CTAs.
inline constexpr int kCudaAttentionMaxRowsPerCta = 8;
// Largest head_dim: query rows are staged in shared memory and one thread
// per pair of dims accumulates the output (128 threads per CTA).
inline constexpr int kCudaAttentionMaxHeadDim = 256;

struct PagedAttentionCudaParams {
  // Step metadata, read on device (so a captured graph serves any step).
  const int32_t* num_reqs = nullptr;         // [1], varlen only
  const int32_t* query_start_loc = nullptr;  // [max_num_seqs + 1], varlen
  const int32_t* seq_lens = nullptr;         // [max_num_seqs]
  const int32_t* block_tables = nullptr;  // [max_num_seqs, max_blocks_per_seq]
  const __nv_bfloat16* query = nullptr;   // rows query_row_stride apart
  const __nv_bfloat16* key_cache = nullptr;    // [slots, kv_heads, head_dim]
  const __nv_bfloat16* value_cache = nullptr;  // [slots, kv_heads, head_dim]
  __nv_bfloat16* output = nullptr;  // [num_tokens, num_heads, head_dim]
  // Decode only: split-K partials, PagedAttentionWorkspaceBytes(...) bytes.
  float* workspace = nullptr;
  int num_tokens = 0;
  int max_num_seqs = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // even, <= kCudaAttentionMaxHeadDim
  int block_size = 0;
  int num_blocks = 0;
  int max_blocks_per_seq = 0;
  int query_row_stride = 0;
  float scale = 0.0f;         // resolved (never 0 here)
  int uniform_query_len = 0;  // decode only
  int partition_tokens = 0;   // decode only: keys per split-K partition
};

// Varlen causal attention: one CTA per (token row, kv head [, head chunk]);
// writes every output row (zeros for rows no request owns).
cudaError_t LaunchPagedAttentionVarlenCuda(const PagedAttentionCudaParams& p,
                                           cudaStream_t stream);

// Uniform decode, flash-decoding: CTAs per (request, kv head [, head
// chunk], partition slot) write normalized partial outputs of
// partition_tokens keys each, with their max and sum, into the workspace (at
// most 32 partition CTAs per request and chunk; longer contexts loop); a
// reduce kernel (one CTA per (token, head)) combines each row's partitions.
cudaError_t LaunchPagedAttentionDecodeCuda(const PagedAttentionCudaParams& p,
                                           cudaStream_t stream);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_PAGED_ATTENTION_CUDA_H_
