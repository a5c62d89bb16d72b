// Token bans on CUDA: logits[rows[i], token_ids[i]] = -inf (see token_mask.h).
#include <algorithm>
#include <cmath>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/token_mask_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

constexpr int kThreads = 256;
// Bans per step are at most a few per request; the cap only bounds the grid
// for absurd counts (the loop strides over the rest).
constexpr unsigned int kMaxBlocks = 1024;

// grid: [min(ceil(num_bans / kThreads), kMaxBlocks)], block: kThreads; one
// thread per ban, grid-stride. Duplicate bans store the same -inf.
__global__ void BanTokensKernel(float* __restrict__ logits,
                                const int32_t* __restrict__ rows,
                                const int32_t* __restrict__ token_ids,
                                int num_bans, int num_rows, int vocab_size) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < num_bans; i += stride) {
    const int32_t row = rows[i];
    const int32_t token = token_ids[i];
    if (row < 0 || row >= num_rows || token < 0 || token >= vocab_size) {
      continue;  // a corrupt entry: never write out of bounds
    }
    logits[static_cast<int64_t>(row) * vocab_size + token] = -INFINITY;
  }
}

}  // namespace

cudaError_t LaunchBanTokensCuda(const BanTokensCudaParams& p,
                                cudaStream_t stream) {
  if (p.num_bans <= 0) return cudaSuccess;
  const unsigned int grid =
      std::min(cuda::NumBlocks(p.num_bans, kThreads), kMaxBlocks);
  BanTokensKernel<<<grid, kThreads, 0, stream>>>(
      p.logits, p.rows, p.token_ids, p.num_bans, p.num_rows, p.vocab_size);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace pdworker
