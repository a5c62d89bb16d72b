// The greedy row reduction shared by the greedy sampler (sampling_greedy.cu)
// and the LM head that folds its own logits (lm_head_greedy.cu): the argmax
// of a row of logits, its lowest id on ties, and the sum of exp(logit - max)
// for the log-softmax. Both kernels fold every row in the one order defined
// here, so a token and its logprob carry the same bits whichever of them
// did the first pass. (nvcc only; a textual header.)
//
// The order: a row of `vocab` ids is cut into kGreedySlices slices of span
// ceil(vocab / kGreedySlices) ids, each slice into kGreedyTilesPerSlice
// tiles of ceil(span / kGreedyTilesPerSlice) ids (the last ones may be
// short or empty).
//  - Tile: lane l of one warp folds ids first + l, first + l + 32, ... in
//    ascending order, one id at a time; then WarpFold (shuffle-down tree,
//    lane 0).
//  - Slice: its tiles 0..7 folded one after the other (FoldSliceTiles).
//  - Row: its 64 slices by BlockFold<64> (two warp trees, warp 0 then 1).
#ifndef PDWORKER_WORKER_KERNELS_GREEDY_FOLD_CUH_
#define PDWORKER_WORKER_KERNELS_GREEDY_FOLD_CUH_

#include <climits>
#include <cmath>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/sampling_logit.cuh"

namespace pdworker {
namespace kernels {
namespace cuda {

constexpr int kGreedySlices = 64;
constexpr int kGreedyTilesPerSlice = 8;
constexpr int kGreedyTilesPerRow = kGreedySlices * kGreedyTilesPerSlice;

// A tile's, slice's or row's fold: the largest logit, its lowest id
// (INT_MAX when every logit is -inf) and sum(exp(logit - max)) over the ids
// it covers (0 when max is -inf). An empty range folds to {-inf, INT_MAX,
// 0}, which Fold treats as the identity.
struct GreedyPartial {
  float max;
  int index;
  float sum;
};

__device__ __forceinline__ GreedyPartial EmptyGreedyPartial() {
  return {-INFINITY, INT_MAX, 0.0f};
}

// a then b, with the ids of a below those of b or the two disjoint: the
// larger max wins, ties to the lower id; the sums are rescaled to the new
// max. The multiply-adds are spelled out (__fmaf_rn, __fmul_rn) so that no
// kernel that inlines this contracts them its own way: the slice kernel and
// the LM head must fold to the same bits.
__device__ __forceinline__ GreedyPartial Fold(const GreedyPartial& a,
                                              const GreedyPartial& b) {
  GreedyPartial f;
  f.max = fmaxf(a.max, b.max);
  f.index = a.max > b.max   ? a.index
            : b.max > a.max ? b.index
                            : min(a.index, b.index);
  f.sum = f.max == -INFINITY ? 0.0f
                             : __fmaf_rn(a.sum, expf(a.max - f.max),
                                         __fmul_rn(b.sum, expf(b.max - f.max)));
  return f;
}

// Folds lane l with lane l + offset for offset = 16, 8, ..., 1: lane 0 ends
// with the warp's fold, in a fixed order.
__device__ __forceinline__ GreedyPartial WarpFold(GreedyPartial v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    GreedyPartial other;
    other.max = __shfl_down_sync(kFullMask, v.max, offset);
    other.index = __shfl_down_sync(kFullMask, v.index, offset);
    other.sum = __shfl_down_sync(kFullMask, v.sum, offset);
    v = Fold(v, other);
  }
  return v;
}

// Thread 0 gets the block's fold: warps in order, each a fixed tree.
template <int kBlockThreads>
__device__ __forceinline__ GreedyPartial BlockFold(GreedyPartial v) {
  constexpr int kWarps = kBlockThreads / kWarpSize;
  __shared__ GreedyPartial warps[kWarps];
  v = WarpFold(v);
  const int warp = threadIdx.x / kWarpSize;
  if (threadIdx.x % kWarpSize == 0) warps[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) v = Fold(v, warps[w]);
  }
  return v;
}

// Ids [begin, end) of tile `tile` (in [0, kGreedyTilesPerRow)) of a row of
// `vocab` ids; begin >= end for an empty tile.
struct GreedyTileRange {
  int begin;
  int end;
};

__host__ __device__ __forceinline__ int GreedyTileSpan(int vocab) {
  const int slice_span = (vocab + kGreedySlices - 1) / kGreedySlices;
  return (slice_span + kGreedyTilesPerSlice - 1) / kGreedyTilesPerSlice;
}

__device__ __forceinline__ GreedyTileRange GreedyTileOf(int vocab, int tile) {
  const int slice = tile / kGreedyTilesPerSlice;
  const int slice_span = (vocab + kGreedySlices - 1) / kGreedySlices;
  const int slice_begin = slice * slice_span;
  const int slice_end = min(vocab, slice_begin + slice_span);
  const int begin =
      slice_begin + tile % kGreedyTilesPerSlice * GreedyTileSpan(vocab);
  return {begin, min(slice_end, begin + GreedyTileSpan(vocab))};
}

// One warp folds a tile: values[i] is the logit of id first_id + i, for i
// in [0, count). Lane 0 returns the tile's fold (the other lanes: partial
// folds). kUnroll loads per lane are in flight before any is folded (a tile
// of a 128k-152k vocabulary is 8-10 ids per lane: one round trip).
__device__ __forceinline__ GreedyPartial
FoldGreedyTile(const float* __restrict__ values, int count, int first_id) {
  constexpr int kUnroll = 8;
  const int lane = threadIdx.x % kWarpSize;
  GreedyPartial local = EmptyGreedyPartial();
  for (int first = lane; first < count; first += kUnroll * kWarpSize) {
    float l[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = first + u * kWarpSize;
      l[u] = i < count ? Logit(values[i]) : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // ascending ids
      if (l[u] > local.max) {
        // -inf max: 0 · 0 + 1
        local.sum = __fmaf_rn(local.sum, expf(local.max - l[u]), 1.0f);
        local.max = l[u];
        local.index = first_id + first + u * kWarpSize;
      } else if (l[u] != -INFINITY) {
        local.sum = __fadd_rn(local.sum, expf(l[u] - local.max));
      }
    }
  }
  return WarpFold(local);
}

// A slice's fold from its kGreedyTilesPerSlice tile folds, in tile order.
__device__ __forceinline__ GreedyPartial
FoldSliceTiles(const GreedyPartial* tiles) {
  GreedyPartial v = tiles[0];
  for (int t = 1; t < kGreedyTilesPerSlice; ++t) v = Fold(v, tiles[t]);
  return v;
}

// Thread 0 of a kGreedySlices-thread block, thread s holding slice s's
// fold, writes the row's token and logprob.
__device__ __forceinline__ void FinishGreedyRow(const GreedyPartial& slice,
                                                int32_t* token_id,
                                                float* logprob) {
  const GreedyPartial row = BlockFold<kGreedySlices>(slice);
  if (threadIdx.x != 0) return;
  if (row.max == -INFINITY) {  // nothing has mass: token 0, logprob -inf
    *token_id = 0;
    *logprob = -INFINITY;
    return;
  }
  *token_id = row.index;
  // logit[token] - max is exactly 0 for the argmax.
  *logprob = -logf(row.sum);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_GREEDY_FOLD_CUH_
