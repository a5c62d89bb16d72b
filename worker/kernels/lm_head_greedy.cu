// The LM head of a one-row step that also folds its logits for the greedy
// sampler (lm_head_cuda.h): logits = hidden · weightᵀ, fp32, and the row's
// kGreedyTilesPerRow tile folds (greedy_fold.cuh), so a greedy step's
// sampler runs one small combine kernel instead of a pass over the logits.
//
// CTA i computes tile i's logits, ~250 of a 128k vocabulary (1B: 4 KB of
// weights each, ~1 MB per CTA; 512 CTAs keep every SM streaming). Warp w
// owns the tile's rows w, w + 8, ...; its (row, k chunk) items are one
// stream through a two-buffer pipeline, so the next row's loads are in
// flight while the current row is summed. Each logit is the CUDA-core
// skinny GEMM's (skinny_gemm.cu at one token, split-K 1, which every LM
// head gets: SkinnyGemmKSplit is 1 from 4,096 outputs): lane l fmaf's its 8
// elements of each 256-element chunk in increasing k, the warp sums with
// the shuffle-down tree, no bias. So the logits carry the skinny GEMM's
// bits, and the tile folds the greedy slice kernel's.
//
// With norm_weight set the kernel also replaces the final RMSNorm: each CTA
// normalizes the step's one row into shared memory with the RMSNorm
// kernel's arithmetic (rms_norm_row.cuh) and multiplies that, so the
// logits keep their bits and the step runs one kernel fewer.
#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/greedy_fold.cuh"
#include "worker/kernels/lm_head_cuda.h"
#include "worker/kernels/rms_norm_row.cuh"

namespace pdworker {
namespace kernels {
namespace {

using cuda::GreedyPartial;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * cuda::kWarpSize;
constexpr int kChunk = cuda::kWarpSize * 8;  // k elements per warp-wide load
// (row, chunk) items per pipeline buffer: up to 2 · kItems 16-byte loads
// per lane in flight, the skinny GEMM's one-token depth.
constexpr int kItems = 2;
// Dynamic shared memory (one tile's logits, and the normalized row), within
// the 48 KiB a launch gets without an opt-in attribute.
constexpr size_t kMaxSharedBytes = 40 * 1024;

static_assert(kThreads == cuda::kRmsNormThreads,
              "the norm prologue's order is defined for 256 threads");

// Dynamic shared memory: kNorm's normalized row (in_features bf16), then
// one tile's logits (fp32).
__host__ __device__ inline size_t NormBytes(int in_features) {
  return (sizeof(__nv_bfloat16) * static_cast<size_t>(in_features) + 15) / 16 *
         16;
}

// grid: [kGreedyTilesPerRow]; block: kThreads.
template <bool kNorm>
__global__ void __launch_bounds__(kThreads)
    GreedyHeadKernel(const GreedyHeadCudaParams p) {
  // The greedy sampler's combine kernel follows (PDL): it waits for this
  // grid before reading the tiles.
  cuda::AllowDependentLaunch();
  extern __shared__ uint4 shared[];
  __shared__ float scratch[32];
  const int in_features = p.in_features;
  auto* normed = reinterpret_cast<__nv_bfloat16*>(shared);
  float* tile_logits = reinterpret_cast<float*>(
      reinterpret_cast<char*>(shared) + (kNorm ? NormBytes(in_features) : 0));
  const cuda::GreedyTileRange tile =
      cuda::GreedyTileOf(p.vocab_size, blockIdx.x);
  const int count = max(0, tile.end - tile.begin);
  const int warp = threadIdx.x / cuda::kWarpSize;
  const int lane = threadIdx.x % cuda::kWarpSize;
  const int num_chunks = (in_features + kChunk - 1) / kChunk;
  const int my_rows = count > warp ? (count - warp + kWarps - 1) / kWarps : 0;
  const int num_items = my_rows * num_chunks;  // the same in every lane
  // Item q: row j = q / num_chunks of this warp (tile row warp + j · kWarps),
  // chunk q % num_chunks.
  auto tile_row = [&](int q) { return warp + q / num_chunks * kWarps; };
  auto chunk_k = [&](int q) { return q % num_chunks * kChunk + lane * 8; };

  uint4 wa[kItems], wb[kItems];
  auto load_weights = [&](uint4(&wv)[kItems], int first) {
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      const int q = first + u;
      const int k = chunk_k(q);
      wv[u] = q < num_items && k < in_features
                  ? cuda::LoadStreaming(
                        p.weight +
                        static_cast<int64_t>(tile.begin + tile_row(q)) *
                            in_features +
                        k)
                  : make_uint4(0, 0, 0, 0);
    }
  };
  load_weights(wa, 0);
  load_weights(wb, kItems);  // past num_items: guarded, zeros
  // The hidden row is the previous kernel's output (the final norm's, or
  // with kNorm the residual stream the last down projection added to).
  cuda::WaitForPreviousKernel();
  const __nv_bfloat16* x = p.hidden;
  if constexpr (kNorm) {
    const int32_t index = *p.row_index;
    if (index >= 0 && index < p.num_input_rows) {
      cuda::RmsNormRowsToShared(
          p.hidden + static_cast<int64_t>(index) * in_features, p.norm_weight,
          normed, 1, in_features, in_features, p.norm_epsilon, scratch);
    } else {  // a zero row, as the gathering norm writes it
      for (int i = threadIdx.x; i < in_features / 8; i += kThreads) {
        shared[i] = make_uint4(0, 0, 0, 0);
      }
      __syncthreads();
    }
    x = normed;
  }

  float acc = 0.0f;
  auto consume = [&](const uint4(&wv)[kItems], int first) {
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      const int q = first + u;
      if (q >= num_items) continue;  // warp-uniform
      const int k = chunk_k(q);
      if (k < in_features) {
        float wf[8], xf[8];
        cuda::Bf16x8ToFloat(wv[u], wf);
        const uint4* xv = reinterpret_cast<const uint4*>(x + k);
        cuda::Bf16x8ToFloat(kNorm ? *xv : __ldg(xv), xf);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = __fmaf_rn(wf[e], xf[e], acc);
      }
      if (q % num_chunks == num_chunks - 1) {  // the row's last chunk
        const float logit = cuda::WarpSumToLane0(acc);
        if (lane == 0) {
          const int row = tile_row(q);
          p.logits[tile.begin + row] = logit;
          tile_logits[row] = logit;
        }
        acc = 0.0f;
      }
    }
  };
  cuda::PingPong(num_items, kItems, wa, wb, load_weights, consume);
  __syncthreads();
  if (warp == 0) {
    const GreedyPartial folded =
        cuda::FoldGreedyTile(tile_logits, count, tile.begin);
    if (lane == 0) static_cast<GreedyPartial*>(p.tiles)[blockIdx.x] = folded;
  }
}

size_t TileBytes(int vocab_size) {
  return sizeof(float) * static_cast<size_t>(cuda::GreedyTileSpan(vocab_size));
}

size_t SharedBytes(const GreedyHeadCudaParams& p) {
  return (p.norm_weight != nullptr ? NormBytes(p.in_features) : 0) +
         TileBytes(p.vocab_size);
}

}  // namespace

bool GreedyHeadCudaSupports(const GreedyHeadCudaParams& p) {
  const bool norm_ok =
      p.norm_weight == nullptr ||
      (cuda::Aligned16(p.norm_weight) && p.row_index != nullptr &&
       p.in_features <= kGreedyHeadNormMaxFeatures);
  return p.in_features > 0 && p.in_features % 8 == 0 && p.vocab_size > 0 &&
         SharedBytes(p) <= kMaxSharedBytes && cuda::Aligned16(p.hidden) &&
         cuda::Aligned16(p.weight) && norm_ok &&
         reinterpret_cast<uintptr_t>(p.tiles) % alignof(GreedyPartial) == 0;
}

cudaError_t LaunchGreedyHeadCuda(const GreedyHeadCudaParams& p,
                                 cudaStream_t stream) {
  if (!GreedyHeadCudaSupports(p)) return cudaErrorInvalidValue;
  // Programmatic stream serialization: the weight loads start while the
  // previous kernel (the final norm, or the last down projection) drains.
  const cuda::DependentLaunch launch = cuda::DependentLaunch::kProgrammatic;
  const dim3 grid(cuda::kGreedyTilesPerRow), block(kThreads);
  return p.norm_weight != nullptr
             ? cuda::LaunchKernel(GreedyHeadKernel<true>, grid, block,
                                  SharedBytes(p), stream, launch, p)
             : cuda::LaunchKernel(GreedyHeadKernel<false>, grid, block,
                                  SharedBytes(p), stream, launch, p);
}

}  // namespace kernels
}  // namespace pdworker
