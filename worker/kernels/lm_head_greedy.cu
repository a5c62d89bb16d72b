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
#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/greedy_fold.cuh"
#include "worker/kernels/lm_head_cuda.h"

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
// Dynamic shared memory of one tile's logits, within the 48 KiB a launch
// gets without an opt-in attribute.
constexpr int kMaxTileBytes = 40 * 1024;

// grid: [kGreedyTilesPerRow]; block: kThreads; dynamic shared memory: one
// tile's logits (fp32).
__global__ void __launch_bounds__(kThreads)
    GreedyHeadKernel(const GreedyHeadCudaParams p) {
  // The greedy sampler's combine kernel follows (PDL): it waits for this
  // grid before reading the tiles.
  cuda::AllowDependentLaunch();
  extern __shared__ float tile_logits[];
  const int in_features = p.in_features;
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
  // The hidden row is the final norm's output.
  cuda::WaitForPreviousKernel();

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
        cuda::Bf16x8ToFloat(__ldg(reinterpret_cast<const uint4*>(p.hidden + k)),
                            xf);
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

}  // namespace

bool GreedyHeadCudaSupports(const GreedyHeadCudaParams& p) {
  return p.in_features > 0 && p.in_features % 8 == 0 && p.vocab_size > 0 &&
         TileBytes(p.vocab_size) <= kMaxTileBytes &&
         cuda::Aligned16(p.hidden) && cuda::Aligned16(p.weight) &&
         reinterpret_cast<uintptr_t>(p.tiles) % alignof(GreedyPartial) == 0;
}

cudaError_t LaunchGreedyHeadCuda(const GreedyHeadCudaParams& p,
                                 cudaStream_t stream) {
  if (!GreedyHeadCudaSupports(p)) return cudaErrorInvalidValue;
  return cuda::LaunchKernel(GreedyHeadKernel, dim3(cuda::kGreedyTilesPerRow),
                            dim3(kThreads), TileBytes(p.vocab_size), stream,
                            p.programmatic_launch
                                ? cuda::DependentLaunch::kProgrammatic
                                : cuda::DependentLaunch::kSerialized,
                            p);
}

}  // namespace kernels
}  // namespace pdworker
