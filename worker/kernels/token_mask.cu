// The logit masks on CUDA (see token_mask.h): token bans, and the mask below
// each row's max minus an offset (min_p).
#include <algorithm>
#include <cmath>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/token_mask_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

constexpr int kBanThreads = 256;
// Bans per step are at most a few per request; the cap only bounds the grid
// for absurd counts (the loop strides over the rest).
constexpr unsigned int kMaxBlocks = 1024;
// One block per masked row; a Llama-3 row (128256 logits) is ~31 float4
// loads per thread and pass.
constexpr int kMaskThreads = 1024;

// grid: [min(ceil(num_bans / kBanThreads), kMaxBlocks)], block: kBanThreads;
// one thread per ban, grid-stride. Duplicate bans store the same -inf.
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

// Max over the whole block, returned to every thread (max is exact: the
// order does not matter). blockDim.x must be a multiple of 32; every thread
// of the block must call it. `scratch` is __shared__ float[32].
__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x % cuda::kWarpSize;
  const int warp = threadIdx.x / cuda::kWarpSize;
  const int num_warps = blockDim.x / cuda::kWarpSize;
  v = cuda::WarpMax(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const float partial =
        cuda::WarpMax(lane < num_warps ? scratch[lane] : -INFINITY);
    if (lane == 0) scratch[0] = partial;
  }
  __syncthreads();
  return scratch[0];
}

// True when logit `x` is masked under `threshold` (never NaN: see below).
// NaN counts as -inf and is stored as -inf even when threshold is -inf.
__device__ __forceinline__ bool MaskedBelow(float x, float threshold) {
  return x < threshold || isnan(x);
}

// grid: [num_rows], block: kMaskThreads. Block i masks row r = rows[i]:
// pass 1 reduces the row's max (fmaxf drops NaN, so NaN counts as -inf),
// pass 2 stores -inf over every logit below max + offsets[i] and over every
// NaN. kVec4: the rows are 16-byte aligned (aligned base, vocab_size % 4 ==
// 0) and are read as float4.
//
// A row listed twice is masked by two blocks at once. That is safe because
// masking never changes the row's max (only logits below max + offset <=
// max, and NaNs, are stored), so both blocks reduce the same max whatever
// they see of each other's stores; and each block stores only the elements
// it masks, one float at a time, never a value it read (a float4 store
// could put back a logit the other block had just masked). The result is
// the union of both masks, as on the CPU.
template <bool kVec4>
__global__ void __launch_bounds__(kMaskThreads)
    MaskBelowMaxKernel(float* logits, const int32_t* __restrict__ rows,
                       const float* __restrict__ offsets, int num_logit_rows,
                       int vocab_size) {
  __shared__ float scratch[cuda::kWarpSize];
  const int32_t row = rows[blockIdx.x];
  // Uniform over the block: the whole block returns before BlockMax.
  if (row < 0 || row >= num_logit_rows) return;  // never out of bounds
  float* l = logits + static_cast<int64_t>(row) * vocab_size;
  const float offset = offsets[blockIdx.x];
  // -inf, NaN and positive offsets mask nothing but the NaNs (NaN fails both
  // tests). With a finite offset, threshold is never NaN: max is -inf, +inf
  // or finite, never NaN.
  float threshold = -INFINITY;
  if (offset <= 0.0f && offset > -INFINITY) {
    float max = -INFINITY;
    if (kVec4) {
      const float4* l4 = reinterpret_cast<const float4*>(l);
      for (int j = threadIdx.x; j < vocab_size / 4; j += kMaskThreads) {
        const float4 v = l4[j];
        max = fmaxf(max, fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)));
      }
    } else {
      for (int j = threadIdx.x; j < vocab_size; j += kMaskThreads) {
        max = fmaxf(max, l[j]);
      }
    }
    threshold = BlockMax(max, scratch) + offset;  // <= max: the max stays
  }
  if (kVec4) {
    const float4* l4 = reinterpret_cast<const float4*>(l);
    for (int j = threadIdx.x; j < vocab_size / 4; j += kMaskThreads) {
      const float4 v = l4[j];
      float* out = l + 4 * static_cast<int64_t>(j);
      if (MaskedBelow(v.x, threshold)) out[0] = -INFINITY;
      if (MaskedBelow(v.y, threshold)) out[1] = -INFINITY;
      if (MaskedBelow(v.z, threshold)) out[2] = -INFINITY;
      if (MaskedBelow(v.w, threshold)) out[3] = -INFINITY;
    }
  } else {
    for (int j = threadIdx.x; j < vocab_size; j += kMaskThreads) {
      if (MaskedBelow(l[j], threshold)) l[j] = -INFINITY;
    }
  }
}

}  // namespace

cudaError_t LaunchBanTokensCuda(const BanTokensCudaParams& p,
                                cudaStream_t stream) {
  if (p.num_bans <= 0) return cudaSuccess;
  const unsigned int grid =
      std::min(cuda::NumBlocks(p.num_bans, kBanThreads), kMaxBlocks);
  BanTokensKernel<<<grid, kBanThreads, 0, stream>>>(
      p.logits, p.rows, p.token_ids, p.num_bans, p.num_rows, p.vocab_size);
  return cudaGetLastError();
}

cudaError_t LaunchMaskBelowMaxCuda(const MaskBelowMaxCudaParams& p,
                                   cudaStream_t stream) {
  if (p.num_rows <= 0) return cudaSuccess;
  if (p.vocab_size % 4 == 0 && cuda::Aligned16(p.logits)) {
    MaskBelowMaxKernel<true><<<p.num_rows, kMaskThreads, 0, stream>>>(
        p.logits, p.rows, p.offsets, p.num_logit_rows, p.vocab_size);
  } else {
    MaskBelowMaxKernel<false><<<p.num_rows, kMaskThreads, 0, stream>>>(
        p.logits, p.rows, p.offsets, p.num_logit_rows, p.vocab_size);
  }
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace pdworker
