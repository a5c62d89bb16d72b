// Sampled-token feed on CUDA: token_ids[dst_indices[i]] =
// sampled_token_ids[src_rows[i]] (see feed_tokens.h).
#include <algorithm>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/feed_tokens_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

constexpr int kThreads = 256;
// Feeds per step are at most one per decoding request; the cap only bounds
// the grid for absurd counts (the loop strides over the rest).
constexpr unsigned int kMaxBlocks = 1024;

// grid: [min(ceil(num_feeds / kThreads), kMaxBlocks)], block: kThreads; one
// thread per feed, grid-stride. Two feeds to one index race (undefined).
__global__ void FeedSampledTokensKernel(
    const int32_t* __restrict__ sampled_token_ids,
    const int32_t* __restrict__ src_rows, int32_t* __restrict__ token_ids,
    const int32_t* __restrict__ dst_indices, int num_feeds, int num_sampled,
    int num_tokens) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < num_feeds; i += stride) {
    const int32_t src = src_rows[i];
    const int32_t dst = dst_indices[i];
    if (src < 0 || src >= num_sampled || dst < 0 || dst >= num_tokens) {
      continue;  // a corrupt entry: never access out of bounds
    }
    token_ids[dst] = sampled_token_ids[src];
  }
}

}  // namespace

cudaError_t LaunchFeedSampledTokensCuda(const FeedSampledTokensCudaParams& p,
                                        cudaStream_t stream) {
  if (p.num_feeds <= 0) return cudaSuccess;
  const unsigned int grid =
      std::min(cuda::NumBlocks(p.num_feeds, kThreads), kMaxBlocks);
  FeedSampledTokensKernel<<<grid, kThreads, 0, stream>>>(
      p.sampled_token_ids, p.src_rows, p.token_ids, p.dst_indices, p.num_feeds,
      p.num_sampled, p.num_tokens);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace pdworker
