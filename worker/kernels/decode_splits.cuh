// The split-K workspace of uniform decode attention (flash-decoding) and the
// combine of a row's splits, shared by the split kernels (paged_attention.cu,
// paged_attention_decode_mma.cu) and the reduce kernel. (nvcc only; a textual
// header.)
//
// Workspace (fp32): with decode_fused_reduce, first one int32 counter per
// (request, split-CTA column) slot, max_num_seqs · num_heads of them rounded
// up to 16 bytes; then normalized partial outputs [num_tokens, num_heads,
// num_splits, head_dim], then maxima (natural log units of the scaled
// scores) and sums [num_tokens, num_heads, num_splits] each.
//
// Fused reduce ("the last split combines"): every split CTA of a (request,
// column) writes its partials, fences them and counts itself in; the CTA that
// counts last combines the column's rows exactly as the reduce kernel would
// (the same CombineSplitRow, so the same bits) and resets the counter, which
// leaves the counters zero for the next launch and for graph replays. The
// count is an integer election: which CTA combines never changes a value.
#ifndef PDWORKER_WORKER_KERNELS_DECODE_SPLITS_CUH_
#define PDWORKER_WORKER_KERNELS_DECODE_SPLITS_CUH_

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/paged_attention_cuda.h"

namespace pdworker {
namespace kernels {
namespace cuda {
namespace decode_splits {

struct Workspace {
  int* counters;  // fused reduce only
  float* out;
  float* max;
  float* sum;
};

__device__ __forceinline__ Workspace Carve(const PagedAttentionCudaParams& p) {
  const int64_t slots =
      static_cast<int64_t>(p.num_tokens) * p.num_heads * p.num_splits;
  const int64_t counters =
      p.decode_fused_reduce
          ? CudaDecodeCounterSlots(p.max_num_seqs, p.num_heads)
          : 0;
  Workspace w;
  w.counters = reinterpret_cast<int*>(p.workspace);
  w.out = p.workspace + counters;
  w.max = w.out + slots * p.head_dim;
  w.sum = w.max + slots;
  return w;
}

// Keys a request of `seq_len` tokens attends to (the block table's reach).
__device__ __forceinline__ int ContextLen(const PagedAttentionCudaParams& p,
                                          int seq_len) {
  return static_cast<int>(
      min(static_cast<int64_t>(seq_len),
          static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size));
}

// Combines the splits of (token, head) into its bf16 output row, dims
// tid, tid + threads, ...: zeros for a padding request or a row that saw no
// key. Split q contributes exp(max_q - global_max) · sum_q of the total
// mass; its stored output is already divided by sum_q. kThroughL2: read the
// partials past L1 (other CTAs wrote them in this launch); the values, and
// so the bits, are the same either way.
template <bool kThroughL2>
__device__ __forceinline__ void CombineSplitRow(
    const PagedAttentionCudaParams& p, const Workspace& w, int token, int head,
    int tid, int threads) {
  const int k = p.uniform_query_len;
  const int seq_len = p.seq_lens[token / k];
  __nv_bfloat16* out =
      p.output +
      (static_cast<int64_t>(token) * p.num_heads + head) * p.head_dim;
  const int context_len = seq_len <= 0 ? 0 : ContextLen(p, seq_len);
  int num_splits = 0;
  if (context_len > 0) {
    const int span = CudaDecodeSplitSpan(context_len, p.num_splits);
    num_splits = (context_len + span - 1) / span;
  }
  const int64_t base =
      (static_cast<int64_t>(token) * p.num_heads + head) * p.num_splits;
  auto load = [](const float* at) { return kThroughL2 ? __ldcg(at) : *at; };

  float global_max = -INFINITY;
  for (int q = 0; q < num_splits; ++q) {
    global_max = fmaxf(global_max, load(w.max + base + q));
  }
  if (global_max == -INFINITY) {  // padding request or nothing visible
    for (int d = tid; d < p.head_dim; d += threads) {
      out[d] = FromFloat<__nv_bfloat16>(0.0f);
    }
    return;
  }
  float total = 0.0f;
  for (int q = 0; q < num_splits; ++q) {
    total += expf(load(w.max + base + q) - global_max) * load(w.sum + base + q);
  }
  for (int d = tid; d < p.head_dim; d += threads) {
    float o = 0.0f;
    for (int q = 0; q < num_splits; ++q) {
      const float weight =
          expf(load(w.max + base + q) - global_max) * load(w.sum + base + q);
      o += weight * load(w.out + (base + q) * p.head_dim + d);
    }
    out[d] = FromFloat<__nv_bfloat16>(o / total);
  }
}

// Fused reduce: called by every thread of every split CTA of column
// (request, column) once its partials are written (or at once, by a CTA
// with no keys). The last CTA to arrive combines the heads [first_head,
// first_head + num_heads) of the request's k tokens. A barrier.
__device__ __forceinline__ void CombineIfLastSplit(
    const PagedAttentionCudaParams& p, int request, int column, int columns,
    int first_head, int num_heads) {
  __shared__ bool last;
  __threadfence();  // this CTA's partials, visible before it counts in
  __syncthreads();
  const Workspace w = Carve(p);
  if (threadIdx.x == 0) {
    int* counter =
        w.counters + static_cast<int64_t>(request) * columns + column;
    last = atomicAdd(counter, 1) == static_cast<int>(gridDim.z) - 1;
    if (last) *counter = 0;  // every CTA of the column has counted
  }
  __syncthreads();
  if (!last) return;
  __threadfence();  // the other CTAs' partials, seen after their counts
  const int k = p.uniform_query_len;
  // One warp per (token, head) row, warps in turn over the rows.
  const int warp = threadIdx.x / kWarpSize, warps = blockDim.x / kWarpSize;
  for (int r = warp; r < num_heads * k; r += warps) {
    CombineSplitRow<true>(p, w, request * k + r % k, first_head + r / k,
                          threadIdx.x % kWarpSize, kWarpSize);
  }
}

}  // namespace decode_splits
}  // namespace cuda
}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_DECODE_SPLITS_CUH_
