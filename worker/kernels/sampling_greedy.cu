// Greedy sampling on CUDA (SamplingPath::kGreedy, sampling_cuda.h): the
// argmax of each row and its log-softmax, in fp32.
#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/greedy_fold.cuh"
#include "worker/kernels/sampling_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

using cuda::GreedyPartial;
using cuda::kGreedySlices;
using cuda::kGreedyTilesPerRow;
using cuda::kGreedyTilesPerSlice;

// --- Greedy rows (SamplingPath::kGreedy): kGreedySlices blocks per row. ---
//
// One 1024-thread block per row read the row's 128k logits twice from one
// SM (~1 MB at one SM's share of L2 bandwidth: several microseconds at batch
// 1, with the rest of the GPU idle). Now each row is cut into kGreedySlices
// slices, each reduced in one pass by its own block, one warp per tile
// (greedy_fold.cuh), and a second kernel combines a row's slices in slice
// order. The order depends on the vocabulary alone, so a row's token and
// logprob do not depend on its batch, and an LM head that folded its own
// tiles (lm_head_greedy.cu) leaves only the second kernel to run, with the
// same bits.

constexpr int kGreedyThreads = kGreedyTilesPerSlice * cuda::kWarpSize;

// grid: [kGreedySlices, num_reqs], block: kGreedyThreads. Warp w folds tile
// w of slice blockIdx.x; thread 0 folds the tiles in order.
__global__ void __launch_bounds__(kGreedyThreads)
    GreedySliceKernel(const float* __restrict__ logits, int vocab,
                      GreedyPartial* __restrict__ partials) {
  cuda::AllowDependentLaunch();
  __shared__ GreedyPartial tiles[kGreedyTilesPerSlice];
  const int slice = blockIdx.x, r = blockIdx.y;
  const int warp = threadIdx.x / cuda::kWarpSize;
  const cuda::GreedyTileRange tile =
      cuda::GreedyTileOf(vocab, slice * kGreedyTilesPerSlice + warp);
  const float* row = logits + static_cast<int64_t>(r) * vocab;
  const GreedyPartial folded = cuda::FoldGreedyTile(
      row + min(tile.begin, vocab), max(0, tile.end - tile.begin), tile.begin);
  if (threadIdx.x % cuda::kWarpSize == 0) tiles[warp] = folded;
  __syncthreads();
  if (threadIdx.x == 0) {
    partials[r * kGreedySlices + slice] = cuda::FoldSliceTiles(tiles);
  }
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
  cuda::FinishGreedyRow(partials[r * kGreedySlices + threadIdx.x],
                        token_ids + r, logprobs + r);
}

// The same from the LM head's tile folds: grid [num_reqs], block
// kGreedySlices; thread s folds slice s's tiles in order, as the slice
// kernel's thread 0 does.
__global__ void __launch_bounds__(kGreedySlices)
    GreedyCombineTilesKernel(const GreedyPartial* __restrict__ tiles,
                             int32_t* __restrict__ token_ids,
                             float* __restrict__ logprobs) {
  cuda::WaitForPreviousKernel();
  const int r = blockIdx.x;
  const GreedyPartial slice = cuda::FoldSliceTiles(
      tiles + r * kGreedyTilesPerRow + threadIdx.x * kGreedyTilesPerSlice);
  cuda::FinishGreedyRow(slice, token_ids + r, logprobs + r);
}

}  // namespace

size_t GreedySamplingCudaWorkspaceBytes(int num_reqs) {
  return static_cast<size_t>(num_reqs) * kGreedySlices * sizeof(GreedyPartial);
}

size_t GreedyTilesCudaBytes(int num_reqs) {
  return static_cast<size_t>(num_reqs) * kGreedyTilesPerRow *
         sizeof(GreedyPartial);
}

cudaError_t LaunchGreedySamplingCuda(const SamplingCudaParams& p,
                                     cudaStream_t stream) {
  if (p.greedy_tiles != nullptr) {
    return cuda::LaunchKernel(GreedyCombineTilesKernel, dim3(p.num_reqs),
                              dim3(kGreedySlices), 0, stream,
                              cuda::DependentLaunch::kProgrammatic,
                              static_cast<const GreedyPartial*>(p.greedy_tiles),
                              p.sampled_token_ids, p.sampled_logprobs);
  }
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
