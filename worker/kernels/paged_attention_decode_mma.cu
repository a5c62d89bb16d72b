// Uniform decode on tensor cores, split-K (flash-decoding), for head_dim 64
// and 128 and G · k <= 16 query rows per (request, kv head) (G query heads
// per kv head, k query tokens per request).
//
// The CUDA-core split kernel (paged_attention.cu) computes every score with
// FMAs and shuffles and is instruction-bound at 30-38% of HBM once the
// batch fills the GPU (bench/RESULTS.md). Here a CTA (4 warps) owns one
// (request, kv head, split): the G · k query rows of the kv head's group
// form one m16 tile (rows past G · k are zeros), so each K/V tile loaded
// serves the whole group, and both products run on mma.m16n8k16:
//   (a) K and V tiles of 64 positions of the split's key range are gathered
//       through the block table into swizzled shared memory with cp.async,
//       double-buffered (mma_tile.cuh); invalid positions are zero-filled
//       and masked;
//   (b) warp w takes keys [16w, 16w + 16) of every tile: S = Q·Kᵀ (Q
//       fragments in registers for the whole loop, K by ldmatrix), the
//       online softmax on the fragments (exp2 with the scale folded in),
//       O += P·V (P as bf16 A fragments, V by ldmatrix.trans);
//   (c) the 4 warps' (max, sum, O) are combined in shared memory in warp
//       order, and the split's normalized output, max and sum are written to
//       the workspace exactly as the CUDA-core split kernel writes them, so
//       its reduce kernel (LaunchPagedAttentionDecodeReduceCuda) finishes
//       the job unchanged.
// Fixed orders everywhere, no atomics: a launch is deterministic and a graph
// replay gives the eager bits. Grid: (num_tokens / k, num_kv_heads,
// num_splits), from the launch shape only.
#include <cmath>
#include <cstdint>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/decode_attention_cta.cuh"
#include "worker/kernels/paged_attention_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

using cuda::mma_tile::kChunk;
using decode_cta::CtaSync;
using decode_cta::DecodeTile;
using decode_cta::kRows;
using decode_cta::kThreads;
using decode_cta::MmaDecodeSplitCta;

template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    MmaDecodeSplitKernel(PagedAttentionCudaParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  // Programmatic dependent launch (PagedAttentionCudaParams::
  // programmatic_launch): the reduce kernel may be scheduled now; this grid
  // reads nothing before the qkv projection that wrote q and the new K/V
  // has finished, not even the step's lengths, so that every CTA waits,
  // the early-returning ones too, and this grid's end implies that one's.
  cuda::AllowDependentLaunch();
  cuda::WaitForPreviousKernel();
  MmaDecodeSplitCta<kHeadDim>(p, blockIdx.x, blockIdx.y, blockIdx.z,
                              threadIdx.x, smem, CtaSync{0});
}

template <int kHeadDim>
cudaError_t LaunchSplit(const PagedAttentionCudaParams& p,
                        cudaStream_t stream) {
  constexpr int kBytes = DecodeTile<kHeadDim>::kSharedBytes;
  // More than 48 KB of dynamic shared memory (head_dim 128) must be opted
  // into, once per kernel (not a stream operation: allowed while a graph is
  // captured).
  static const cudaError_t attribute =
      cudaFuncSetAttribute(MmaDecodeSplitKernel<kHeadDim>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (attribute != cudaSuccess) return attribute;
  const dim3 grid(p.num_tokens / p.uniform_query_len, p.num_kv_heads,
                  p.num_splits);
  return cuda::LaunchKernel(
      MmaDecodeSplitKernel<kHeadDim>, grid, dim3(kThreads), kBytes, stream,
      p.programmatic_launch ? cuda::DependentLaunch::kProgrammatic
                            : cuda::DependentLaunch::kSerialized,
      p);
}

}  // namespace

bool PagedAttentionDecodeMmaSupports(const PagedAttentionCudaParams& p) {
  if (p.softcap > 0.0f || p.sliding_window > 0) return false;  // CUDA cores
  const int group = p.num_kv_heads > 0 ? p.num_heads / p.num_kv_heads : 0;
  return (p.head_dim == 64 || p.head_dim == 128) && group >= 1 &&
         p.uniform_query_len >= 1 && group * p.uniform_query_len <= kRows &&
         p.num_tokens % p.uniform_query_len == 0 && p.num_splits >= 1 &&
         p.query_row_stride % kChunk == 0 &&
         reinterpret_cast<uintptr_t>(p.query) % 16 == 0;
}

cudaError_t LaunchPagedAttentionDecodeSplitMmaCuda(
    const PagedAttentionCudaParams& p, cudaStream_t stream) {
  if (!PagedAttentionDecodeMmaSupports(p)) return cudaErrorInvalidValue;
  return p.head_dim == 128 ? LaunchSplit<128>(p, stream)
                           : LaunchSplit<64>(p, stream);
}

}  // namespace kernels
}  // namespace pdworker
