// The decode megakernel's launcher (decode_megakernel.cu): every decoder
// layer of a one-token decode step in one cooperative kernel.
// Plain C++ with CUDA runtime types; included only where PDW_HAVE_CUDA.
#ifndef PDWORKER_WORKER_KERNELS_DECODE_MEGAKERNEL_CUDA_H_
#define PDWORKER_WORKER_KERNELS_DECODE_MEGAKERNEL_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "worker/kernels/linear_cuda.h"
#include "worker/kernels/paged_attention_cuda.h"

namespace pdworker {
namespace kernels {

// A layer runs six phases, each ended by a grid-wide barrier: qkv (RMSNorm
// prologue, RoPE + KV-cache epilogue), the attention's split CTAs, its
// reduce, o_proj (+ residual), gate_up (RMSNorm prologue, SiLU-and-mul), down
// (+ residual).
inline constexpr int kMegakernelPhases = 6;
// Byte ranges of weights a phase asks L2 to prefetch (cut by the host at
// matrix boundaries; unused ones have bytes == 0).
inline constexpr int kMegakernelPrefetchRanges = 4;

struct MegakernelPrefetchRange {
  const void* base = nullptr;  // 16-byte aligned
  int64_t bytes = 0;           // a multiple of 16
};

// One layer, as the fused one-token step launches it: the four projections
// on the CUDA-core skinny GEMM at one token with their split-K factors
// (SkinnyGemmKSplit), the attention on the tensor-core split kernel.
struct DecodeMegakernelLayerCuda {
  LinearCudaParams qkv, o_proj, gate_up, down;
  int qkv_k_split = 1, o_proj_k_split = 1, gate_up_k_split = 1,
      down_k_split = 1;
  PagedAttentionCudaParams attention;
  // Issued at the start of each phase, each CTA its share: the weights of
  // the phases ahead, so HBM keeps streaming through the barriers and the
  // small phases (decode_megakernel.h has the schedule).
  MegakernelPrefetchRange prefetch[kMegakernelPhases]
                                  [kMegakernelPrefetchRanges];
};

// The grid barrier's state: two words in device memory, zero before the
// first launch; every barrier leaves it ready for the next one and for the
// next launch (a graph replay) without a memset.
struct MegakernelBarrierState {
  unsigned int count;
  unsigned int generation;
};

// Where the attention's reduce runs. kLastSplit: the last split CTA of each
// (request, kv head) to finish reduces its group's heads (a counter per
// pair, reset by that CTA), so a layer is five phases; kOwnPhase: a phase
// of its own after a barrier (six). The same DecodeReduceCta either way.
enum class MegakernelReduceCuda { kLastSplit, kOwnPhase };

// The split counters (kLastSplit) sit after the barrier words, in the
// first kMegakernelStateBytes of the plan's memory: at most
// kMegakernelMaxSplitCounters (request, kv head) pairs.
inline constexpr size_t kMegakernelStateBytes = 4096;
inline constexpr size_t kMegakernelCountersOffset = 256;
inline constexpr int kMegakernelMaxSplitCounters =
    (kMegakernelStateBytes - kMegakernelCountersOffset) / sizeof(unsigned int);

struct DecodeMegakernelCudaParams {
  const DecodeMegakernelLayerCuda* layers = nullptr;  // device memory
  int num_layers = 0;
  int head_dim = 0;  // 64 or 128: the attention split's instantiation
  MegakernelBarrierState* barrier = nullptr;
  // [requests × kv heads], zero before the first launch and after each.
  unsigned int* split_counters = nullptr;
  MegakernelReduceCuda reduce = MegakernelReduceCuda::kLastSplit;
};

// Dynamic shared memory of a CTA: two attention split CTAs (the two halves
// of its 8 warps), or a skinny GEMM's normalized row of `max_norm_features`
// bf16, whichever is larger. 0 for a head_dim other than 64 or 128.
size_t DecodeMegakernelSharedBytes(int head_dim, int max_norm_features);

// How many CTAs one launch can keep resident (the cooperative limit:
// occupancy × SMs, capped at ctas_per_sm per SM when ctas_per_sm > 0), or
// the CUDA error of the queries.
cudaError_t DecodeMegakernelMaxCtas(int head_dim, size_t shared_bytes,
                                    int ctas_per_sm, int* ctas);

// The kernel on `ctas` CTAs (at most DecodeMegakernelMaxCtas: a cooperative
// launch refuses more with cudaErrorCooperativeLaunchTooLarge, so the
// barrier never waits on a CTA that cannot run).
cudaError_t LaunchDecodeMegakernelCuda(const DecodeMegakernelCudaParams& p,
                                       int ctas, size_t shared_bytes,
                                       cudaStream_t stream);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_DECODE_MEGAKERNEL_CUDA_H_
