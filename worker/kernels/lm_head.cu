// gather_rows on CUDA: output[i] = input[indices[i]] (bf16 copy), zero rows
// for indices outside [0, num_input_rows); the final logit soft-cap.
#include <algorithm>
#include <cstdint>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/lm_head_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

constexpr int kThreads = 128;

// grid: [num_indices]; block: kThreads threads stride over the row.
__global__ void GatherRowsKernel(const __nv_bfloat16* __restrict__ input,
                                 const int32_t* __restrict__ indices,
                                 __nv_bfloat16* __restrict__ output,
                                 int num_input_rows, int row_size) {
  cuda::AllowDependentLaunch();
  const int64_t i = blockIdx.x;
  const int32_t index = indices[i];
  __nv_bfloat16* dst = output + i * row_size;
  if (index < 0 || index >= num_input_rows) {
    for (int c = threadIdx.x; c < row_size; c += blockDim.x) {
      dst[c] = __float2bfloat16(0.0f);
    }
    return;
  }
  const __nv_bfloat16* src = input + static_cast<int64_t>(index) * row_size;
  for (int c = threadIdx.x; c < row_size; c += blockDim.x) dst[c] = src[c];
}

// grid-stride over `count` logits.
__global__ void LogitSoftcapKernel(float* __restrict__ logits, int64_t count,
                                   float cap) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < count; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    logits[i] = cap * tanhf(logits[i] / cap);
  }
}

}  // namespace

cudaError_t LaunchLogitSoftcapCuda(float* logits, int64_t count, float cap,
                                   cudaStream_t stream) {
  constexpr int kSoftcapThreads = 256;
  const int64_t blocks = std::min<int64_t>(
      (count + kSoftcapThreads - 1) / kSoftcapThreads, int64_t{4096});
  LogitSoftcapKernel<<<static_cast<int>(blocks), kSoftcapThreads, 0, stream>>>(
      logits, count, cap);
  return cudaGetLastError();
}

cudaError_t LaunchGatherRowsCuda(const GatherRowsCudaParams& p,
                                 cudaStream_t stream) {
  GatherRowsKernel<<<p.num_indices, kThreads, 0, stream>>>(
      p.input, p.indices, p.output, p.num_input_rows, p.row_size);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace pdworker
