// Greedy sampling on CUDA (SamplingPath::kGreedy, sampling_cuda.h): the
// argmax of each row and its log-softmax, in fp32.
#include <climits>
#include <cmath>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/sampling_cuda.h"
#include "worker/kernels/sampling_logit.cuh"

namespace pdworker {
namespace kernels {
namespace {

using cuda::Logit;

constexpr float kNegInf = -INFINITY;

// --- Greedy rows (SamplingPath::kGreedy): kGreedySlices blocks per row. ---
//
// One 1024-thread block per row read the row's 128k logits twice from one
// SM (~1 MB at one SM's share of L2 bandwidth: several microseconds at batch
// 1, with the rest of the GPU idle). Now each row is cut into kGreedySlices
// slices, each reduced in one pass by its own block to (max, argmax, sum of
// exp(logit - max)), and a second kernel combines a row's slices in slice
// order. The slicing and both reduction orders depend on the vocabulary
// alone, so a row's token and logprob do not depend on its batch.

constexpr int kGreedySlices = 64;
constexpr int kGreedyThreads = 256;

// A slice's (or a whole row's) reduction: the largest logit, its lowest id
// (INT_MAX when every logit is -inf), and sum(exp(logit - max)) over the
// ids it covers (0 when max is -inf).
struct GreedyPartial {
  float max;
  int index;
  float sum;
};

// a then b, with the ids of a below those of b or the two disjoint: the
// larger max wins, ties to the lower id; the sums are rescaled to the new
// max. Every row and slice folds its parts in one fixed order.
__device__ __forceinline__ GreedyPartial Fold(const GreedyPartial& a,
                                              const GreedyPartial& b) {
  GreedyPartial f;
  f.max = fmaxf(a.max, b.max);
  f.index = a.max > b.max   ? a.index
            : b.max > a.max ? b.index
                            : min(a.index, b.index);
  f.sum = f.max == kNegInf
              ? 0.0f
              : a.sum * expf(a.max - f.max) + b.sum * expf(b.max - f.max);
  return f;
}

// Folds lane l with lane l + offset for offset = 16, 8, ..., 1: lane 0 ends
// with the warp's fold, in a fixed order.
__device__ __forceinline__ GreedyPartial WarpFold(GreedyPartial v) {
  for (int offset = cuda::kWarpSize / 2; offset > 0; offset /= 2) {
    GreedyPartial other;
    other.max = __shfl_down_sync(cuda::kFullMask, v.max, offset);
    other.index = __shfl_down_sync(cuda::kFullMask, v.index, offset);
    other.sum = __shfl_down_sync(cuda::kFullMask, v.sum, offset);
    v = Fold(v, other);
  }
  return v;
}

// Thread 0 gets the block's fold: warps in order, each a fixed tree.
template <int kBlockThreads>
__device__ __forceinline__ GreedyPartial BlockFold(GreedyPartial v) {
  constexpr int kWarps = kBlockThreads / cuda::kWarpSize;
  __shared__ GreedyPartial warps[kWarps];
  v = WarpFold(v);
  const int warp = threadIdx.x / cuda::kWarpSize;
  if (threadIdx.x % cuda::kWarpSize == 0) warps[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) v = Fold(v, warps[w]);
  }
  return v;
}

// grid: [kGreedySlices, num_reqs], block: kGreedyThreads. Slice s of row r:
// ids [s · span, (s + 1) · span) ∩ [0, vocab), span = ceil(vocab /
// kGreedySlices); each thread folds its ids in ascending order (one pass:
// the running sum is rescaled when the max grows).
__global__ void __launch_bounds__(kGreedyThreads)
    GreedySliceKernel(const float* __restrict__ logits, int vocab,
                      GreedyPartial* __restrict__ partials) {
  cuda::AllowDependentLaunch();
  const int slice = blockIdx.x, r = blockIdx.y;
  const float* row = logits + static_cast<int64_t>(r) * vocab;
  const int span = (vocab + kGreedySlices - 1) / kGreedySlices;
  const int begin = slice * span, end = min(vocab, begin + span);
  GreedyPartial local{kNegInf, INT_MAX, 0.0f};
  // kUnroll loads in flight per thread before any is folded (a slice of a
  // 128k-152k vocabulary is 8-10 per thread): one L2 round trip, not one
  // per logit.
  constexpr int kUnroll = 8;
  for (int first = begin + threadIdx.x; first < end;
       first += kUnroll * kGreedyThreads) {
    float l[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = first + u * kGreedyThreads;
      l[u] = v < end ? Logit(__ldg(row + v)) : kNegInf;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // ascending ids
      if (l[u] > local.max) {
        local.sum = local.sum * expf(local.max - l[u]) + 1.0f;  // -inf: 0·0
        local.max = l[u];
        local.index = first + u * kGreedyThreads;
      } else if (l[u] != kNegInf) {
        local.sum += expf(l[u] - local.max);
      }
    }
  }
  const GreedyPartial block = BlockFold<kGreedyThreads>(local);
  if (threadIdx.x == 0) partials[r * kGreedySlices + slice] = block;
}

// grid: [num_reqs], block: kGreedySlices (one thread per slice). Launched
// with programmatic stream serialization: it is scheduled while the slice
// kernel drains and waits for it before reading.
__global__ void __launch_bounds__(kGreedySlices)
    GreedyCombineKernel(const GreedyPartial* __restrict__ partials,
                        int32_t* __restrict__ token_ids,
                        float* __restrict__ logprobs) {
  cuda::WaitForPreviousKernel();
  const int r = blockIdx.x;
  const GreedyPartial row =
      BlockFold<kGreedySlices>(partials[r * kGreedySlices + threadIdx.x]);
  if (threadIdx.x != 0) return;
  if (row.max == kNegInf) {  // nothing has mass: token 0, logprob -inf
    token_ids[r] = 0;
    logprobs[r] = kNegInf;
    return;
  }
  token_ids[r] = row.index;
  // logit[token] - max is exactly 0 for the argmax.
  logprobs[r] = -logf(row.sum);
}

}  // namespace

size_t GreedySamplingCudaWorkspaceBytes(int num_reqs) {
  return static_cast<size_t>(num_reqs) * kGreedySlices * sizeof(GreedyPartial);
}

cudaError_t LaunchGreedySamplingCuda(const SamplingCudaParams& p,
                                     cudaStream_t stream) {
  auto* partials = static_cast<GreedyPartial*>(p.workspace);
  GreedySliceKernel<<<dim3(kGreedySlices, p.num_reqs), kGreedyThreads, 0,
                      stream>>>(p.logits, p.vocab_size, partials);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  return cuda::LaunchKernel(GreedyCombineKernel, dim3(p.num_reqs),
                            dim3(kGreedySlices), 0, stream,
                            cuda::DependentLaunch::kProgrammatic,
                            static_cast<const GreedyPartial*>(partials),
                            p.sampled_token_ids, p.sampled_logprobs);
}

}  // namespace kernels
}  // namespace pdworker
