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
// Largest head_dim: query rows are staged in shared memory, and the 8-dim
// slices of one key (16-byte loads) must fit in a warp's 32 lanes. head_dim
// must also be a multiple of 8.
inline constexpr int kCudaAttentionMaxHeadDim = 256;
// Uniform decode: fewest keys a split-K CTA takes (shorter contexts use
// fewer splits), most splits per (request, kv head).
inline constexpr int kCudaAttentionMinSplitKeys = 32;
inline constexpr int kCudaAttentionMaxSplits = 64;

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
  int head_dim = 0;  // a multiple of 8, <= kCudaAttentionMaxHeadDim
  int block_size = 0;
  int num_blocks = 0;
  int max_blocks_per_seq = 0;
  int query_row_stride = 0;
  float scale = 0.0f;  // resolved (never 0 here)
  // Gemma 2's attention logit soft-capping (score = cap · tanh(score /
  // cap), 0: none) and a sliding window (a query at position p sees keys
  // (p - window, p], 0: none): the CUDA-core kernels only (the tensor-core
  // ones' Supports() are false with either), written without a GPU
  // (UnverifiedCudaKernels).
  float softcap = 0.0f;
  int sliding_window = 0;
  int uniform_query_len = 0;  // decode only
  // Tensor-core varlen only: query rows per warp, 16 or 32; 0: the default
  // (kCudaAttentionMmaTallTileMinTokens).
  int mma_warp_rows = 0;
  // Warpgroup-MMA varlen only: key positions per K/V tile, 64 or 128; 0:
  // the default for the head dim (kCudaAttentionWgmmaTileKeysHd64 / 128).
  int wgmma_tile_keys = 0;
  // Warpgroup-MMA varlen only: 1 overlaps the next key tile's S and this
  // tile's P·V with the softmax (FlashAttention-3's intra-warpgroup
  // overlap), 0 runs them one after another, -1 takes
  // kCudaAttentionWgmmaOverlapDefault.
  int wgmma_overlap = -1;
  // Decode only: split-K CTAs per (request, kv head [, head chunk]), from
  // the launch shape alone (CudaDecodeNumSplits), so one graph serves every
  // step of its shape.
  int num_splits = 0;
  // Decode only: the tensor-core split kernel instead of the CUDA-core one.
  bool decode_tensor_cores = false;
  // Decode only: launch the split and reduce kernels with programmatic
  // stream serialization, so each is scheduled while the kernel before it
  // drains (the qkv projection, then the split kernel) and waits for it
  // before reading anything (griddepcontrol.wait); they also let the next
  // kernel (the reduce, then o_proj) launch early. Without it each waits
  // for the previous kernel to finish before it is even scheduled.
  bool programmatic_launch = true;
};

// Keys one decode split CTA takes from a context of `context_len` tokens:
// the context shared evenly over `num_splits`, at least
// kCudaAttentionMinSplitKeys. The reduce kernel reads the first
// ceil(context_len / span) splits.
#ifdef __CUDACC__
__host__ __device__
#endif
    inline int
    CudaDecodeSplitSpan(int context_len, int num_splits) {
  const int even = (context_len + num_splits - 1) / num_splits;
  return even > kCudaAttentionMinSplitKeys ? even : kCudaAttentionMinSplitKeys;
}

// Varlen causal attention on CUDA cores: one CTA per (token row, kv head [,
// head chunk]); writes every output row (zeros for rows no request owns).
// The reference for the tensor-core routine below, and the routine for the
// head dims and groups it does not cover.
cudaError_t LaunchPagedAttentionVarlenCuda(const PagedAttentionCudaParams& p,
                                           cudaStream_t stream);

// Varlen causal attention on tensor cores (paged_attention_mma.cu,
// FlashAttention-2's algorithm): one CTA per (query tile of one request,
// kv head), the tile being 128 / G (head_dim 64) or 64 / G (128) query
// tokens × the G query heads of the kv head's group; K/V tiles of 64 positions
// gathered through the block table into shared memory, Q·Kᵀ and P·V with bf16
// mma.sync (fp32 accumulation). Covers head_dim 64 and 128 and GQA groups of
// 1–8; writes every output row (zeros for rows no request owns) like the
// CUDA-core routine. Needs query_start_loc non-decreasing.
inline constexpr int kCudaAttentionMmaMaxGroup = 8;
// Most query-tile CTAs per kv head a launch may need (grid.y's limit).
inline constexpr int kCudaAttentionMmaMaxTiles = 65535;

// Query rows per warp of the tensor-core routine unless a launch asks for
// another: 32 (a CTA of 128 / G query tokens) from this many padded query
// rows up, 16 (64 / G tokens) below. Measured with prefill_attention_bench
// on an H200: 32 rows gain 25-27% at 2k-16k tokens (both head dims) and
// lose 8-20% at 1k, where 16 rows give more CTAs to fill the GPU. The
// choice depends on the launch shape only, so a graph keeps its kernel.
inline constexpr int kCudaAttentionMmaTallTileMinTokens = 2048;
// The rows per warp a launch runs with.
int PagedAttentionMmaWarpRows(const PagedAttentionCudaParams& p);

// True when the tensor-core routine covers this launch: head_dim 64 or 128,
// num_heads / num_kv_heads in [1, 8], 16-byte aligned query rows and output,
// and a grid within kCudaAttentionMmaMaxTiles.
bool PagedAttentionMmaSupports(const PagedAttentionCudaParams& p);

// The tensor-core varlen routine; cudaErrorInvalidValue for a launch that
// PagedAttentionMmaSupports refuses.
cudaError_t LaunchPagedAttentionVarlenMmaCuda(const PagedAttentionCudaParams& p,
                                              cudaStream_t stream);

// Varlen causal attention on Hopper's warpgroup MMA (paged_attention_wgmma.
// cu, sm_90a only): the tensor-core routine's tiles, masking and outputs with
// S = Q·Kᵀ read from shared memory by wgmma and P·V taking P from registers,
// one CTA of 2 warpgroups per (query tile of 128 / G tokens × G heads, kv
// head). Same coverage as the tensor-core routine, on compute capability 9.0
// devices only. Written without a GPU: kAuto does not select it yet.
// Key positions per K/V tile unless a launch asks for another (64 or 128).
// Not measured yet; 64 keeps two CTAs per SM at both head dims (serial).
// ptxas -v (registers per thread, no spills, no wgmma serialization),
// serial / overlapped: 111 / 121 at head_dim 64 with 64-key tiles, 134 / 167
// with 128; 126 / 161 at head_dim 128 with 64-key tiles, 214 / 209 with 128.
// Shared memory: 49 KB (head_dim 64, 64 keys), 81 KB (64, 128), 97 KB (128,
// 64), 161 KB (128, 128). prefill_attention_bench times every combination.
inline constexpr int kCudaAttentionWgmmaTileKeysHd64 = 64;
inline constexpr int kCudaAttentionWgmmaTileKeysHd128 = 64;
int PagedAttentionWgmmaTileKeys(const PagedAttentionCudaParams& p);
// Whether a warpgroup overlaps its softmax with the tensor cores unless a
// launch asks otherwise (FlashAttention-3 does). Not measured yet.
inline constexpr bool kCudaAttentionWgmmaOverlapDefault = true;
bool PagedAttentionWgmmaOverlaps(const PagedAttentionCudaParams& p);
// True when the current CUDA device runs sm_90a code (compute capability
// 9.0: H100, H200).
bool CudaCurrentDeviceHasWgmma();
// True when the warpgroup-MMA routine covers this launch: what
// PagedAttentionMmaSupports covers, tile keys 64 or 128, and a current
// device of compute capability 9.0.
bool PagedAttentionWgmmaSupports(const PagedAttentionCudaParams& p);
// cudaErrorInvalidValue for a launch PagedAttentionWgmmaSupports refuses.
cudaError_t LaunchPagedAttentionVarlenWgmmaCuda(
    const PagedAttentionCudaParams& p, cudaStream_t stream);

// Uniform decode, flash-decoding: num_splits CTAs per (request, kv head [,
// head chunk]) each write the normalized partial output of one slice of the
// context, with its max and sum, into the workspace (the CUDA-core split
// kernel, or the tensor-core one when decode_tensor_cores); a reduce kernel
// (one CTA per (token, head)) combines each row's splits.
cudaError_t LaunchPagedAttentionDecodeCuda(const PagedAttentionCudaParams& p,
                                           cudaStream_t stream);

// The tensor-core split kernel of uniform decode (paged_attention_decode_
// mma.cu): one CTA per (request, kv head, split), the G · k query rows of
// the group as one m16 tile, K/V tiles of 64 positions through shared
// memory, Q·Kᵀ and P·V on mma.sync. Writes the workspace the CUDA-core
// split kernel writes (LaunchPagedAttentionDecodeCuda runs the reduce).
// Covers head_dim 64 and 128 with G · k <= 16 and 16-byte aligned query
// rows.
bool PagedAttentionDecodeMmaSupports(const PagedAttentionCudaParams& p);
cudaError_t LaunchPagedAttentionDecodeSplitMmaCuda(
    const PagedAttentionCudaParams& p, cudaStream_t stream);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_PAGED_ATTENTION_CUDA_H_
