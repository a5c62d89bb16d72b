// The batched KV copy (kv_block_copy_cuda.h): CTA (x, part) copies tokens
// [first_token + 16x, + 16) of one layer part; thread t moves 16-byte units
// t, t + 128, ... of those tokens' rows, each token's source and destination
// slot found through the block lists in the kernel parameter.
#include <cuda_runtime.h>

#include <cstdint>

#include "worker/kernels/kv_block_copy_cuda.h"

namespace pdworker {
namespace {

constexpr int kThreads = 128;
constexpr int kTokensPerCta = 16;

// __grid_constant__: the parameter is read in place (indexed at run time)
// rather than copied to each thread's stack.
__global__ void __launch_bounds__(kThreads)
    KvBlockCopyKernel(const __grid_constant__ KvBlockCopyCudaParams p) {
  const int part = blockIdx.y;
  const int first = blockIdx.x * kTokensPerCta;
  const int count = min(kTokensPerCta, p.num_tokens - first);
  const int units = static_cast<int>(p.token_bytes / 16);
  const uint4* src = reinterpret_cast<const uint4*>(p.src[part]);
  uint4* dst = reinterpret_cast<uint4*>(p.dst[part]);
  for (int i = threadIdx.x; i < count * units; i += kThreads) {
    const int token = p.first_token + first + i / units;
    const int unit = i % units;
    const int src_token = token - p.src_token_shift;
    const int dst_token = token - p.dst_token_shift;
    const int64_t src_slot =
        static_cast<int64_t>(
            p.src_blocks[src_token / p.src_block_size - p.src_first_block]) *
            p.src_block_size +
        src_token % p.src_block_size;
    const int64_t dst_slot =
        static_cast<int64_t>(
            p.dst_blocks[dst_token / p.dst_block_size - p.dst_first_block]) *
            p.dst_block_size +
        dst_token % p.dst_block_size;
    dst[dst_slot * units + unit] = src[src_slot * units + unit];
  }
}

}  // namespace

cudaError_t LaunchKvBlockCopyCuda(const KvBlockCopyCudaParams& p,
                                  cudaStream_t stream) {
  if (p.num_tokens <= 0 || p.num_parts <= 0) return cudaSuccess;
  const dim3 grid((p.num_tokens + kTokensPerCta - 1) / kTokensPerCta,
                  p.num_parts);
  KvBlockCopyKernel<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace pdworker
