// The CTA body of the CUDA-core skinny GEMM (skinny_gemm.cu, whose file
// comment has the work split and the batch-invariance argument), shared by
// its kernel and by the decode megakernel (decode_megakernel.cu), so the two
// compute every output element with the same operations. nvcc only.
#ifndef PDWORKER_WORKER_KERNELS_SKINNY_GEMM_CTA_CUH_
#define PDWORKER_WORKER_KERNELS_SKINNY_GEMM_CTA_CUH_

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/linear_cuda.h"
#include "worker/kernels/rms_norm_row.cuh"
#include "worker/kernels/skinny_epilogue.cuh"

namespace pdworker {
namespace kernels {
namespace cuda {

constexpr int kSkinnyWarps = 8;
constexpr int kSkinnyThreads = kSkinnyWarps * kWarpSize;
constexpr int kSkinnyChunk = kWarpSize * 8;  // k elements per warp-wide load

// The rows per warp (R) and chunks per load buffer (U) of a launch of NT
// tokens: the kernel's launcher and the megakernel agree through these.
// Two rows per warp from 3 tokens up halves the L1 reads of X per weight
// byte; fewer chunks in flight keep the registers of 8 tokens in budget.
// U is per buffer: the two buffers hold what one batch of 4 (8 tokens: 2)
// chunks held before, so registers and occupancy stay where they were
// measured, and a slice of at most 2U chunks still has all of its loads
// issued before the first multiply.
template <int NT, LinearCudaEpilogue kEpi>
struct SkinnyShape {
  static constexpr bool kPaired = kEpi == LinearCudaEpilogue::kSiluAndMul ||
                                  kEpi == LinearCudaEpilogue::kRopeKvCache;
  static constexpr int R = NT >= 3 || kPaired ? 2 : 1;
  static constexpr int U = NT >= 5 ? 1 : 2;
};

// Where a CTA reads X from. kReadOnly: X is not written while the kernel
// runs (a kernel of its own), so it may use the non-coherent read-only path
// (__ldg). kWrittenByKernel: an earlier phase of the same kernel wrote it
// (the megakernel's attention output and MLP activations, rewritten every
// layer): the read-only path could return a previous layer's line, so X
// takes the coherent path. The bits do not depend on it.
enum class SkinnyInput { kReadOnly, kWrittenByKernel };

// CTAs of a launch of `p` (out_features) with split-K factor `k_split`.
template <int NT, LinearCudaEpilogue kEpi>
__host__ __device__ inline int SkinnyGemmCtas(int out_features, int k_split) {
  using S = SkinnyShape<NT, kEpi>;
  const int units = S::kPaired ? out_features / 2 : out_features;
  const int per_cta = (S::kPaired ? 1 : S::R) * (kSkinnyWarps / k_split);
  const int ctas = (units + per_cta - 1) / per_cta;
  return ctas > 0 ? ctas : 1;
}

// Up to NT tokens (num_tokens of them), R rows per warp, U chunks per load
// buffer; two buffers ping-pong, so the next U chunks' loads are in flight
// while the current ones are multiplied. With one buffer the 1B down
// projection (16 chunks per slice, so 4 batches each waiting for its loads)
// reached 2.4 TB/s on the H200 against gate_up's 3.8 (2 batches); not yet
// measured with two.
// kEpi kSiluAndMul: W is [gate; up] (2 · half rows), a warp owns gate row o
// and up row o + half (R = 2), and Y[T, half] = silu(gate) · up, each of
// gate and up rounded to bf16 first, as the unfused GEMM writes them.
// kEpi kAddResidual: Y (bf16) is the residual stream, updated in place:
// Y = bf16(Y + bf16(x·w + b)), what the GEMM followed by the fused add of
// the residual computes (each element is read and written by one thread).
// kEpi kRopeKvCache: Y is the fused qkv row of each token; a warp owns the
// pair (i, i + head_dim / 2) of one head (R = 2), which the epilogue
// rotates (q, k) and writes to the KV cache (k, v) as the RoPE kernel would
// (rope_kv_row.cuh).
// kNorm: x is the pre-norm residual; the CTA first writes RMSNorm(x) into
// shared memory (rms_norm_row.cuh: the RMSNorm kernel's bits) and reads its
// X from there. Dynamic shared memory: num_tokens · in_features bf16.
// grid: [ceil(O / (R · kSkinnyWarps / S))] (kSiluAndMul: [ceil(half /
// (kSkinnyWarps / S))]; SkinnyGemmCtas); block: kSkinnyThreads. CTA `cta` of
// the grid above (blockIdx.x for the kernel; the decode megakernel walks the
// same virtual grid with fewer CTAs, so every output element is computed by the
// same warps' operation sequence either way). Every thread of the CTA calls it;
// it may return early, after its last
// __syncthreads, so a caller running CTAs back to back syncs between them.
template <int NT, int R, int U, typename OutT, LinearCudaEpilogue kEpi,
          bool kNorm, SkinnyInput kInput = SkinnyInput::kReadOnly>
__device__ __forceinline__ void SkinnyGemmCta(const LinearCudaParams& p,
                                              int k_split, int cta) {
  constexpr bool kSiluAndMul = kEpi == LinearCudaEpilogue::kSiluAndMul;
  constexpr bool kRope = kEpi == LinearCudaEpilogue::kRopeKvCache;
  constexpr bool kPaired = kSiluAndMul || kRope;
  static_assert(!kPaired || R == 2, "paired epilogues own two rows a warp");
  __shared__ float partial[kSkinnyWarps][R * NT];
  __shared__ float scratch[32];
  extern __shared__ uint4 normed[];  // kNorm: [num_tokens, in_features] bf16
  const __nv_bfloat16* __restrict__ w = p.weight;
  const int num_tokens = p.num_tokens, in_features = p.in_features;
  const int out_features = p.out_features;
  const __nv_bfloat16* x =
      kNorm ? reinterpret_cast<const __nv_bfloat16*>(normed) : p.input;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int groups = kSkinnyWarps / k_split;  // row groups per CTA
  const int group = warp / k_split, slice = warp % k_split;
  const int unit = cta * groups + group;
  const int half = out_features / 2;
  const int num_chunks = (in_features + kSkinnyChunk - 1) / kSkinnyChunk;
  // Paired epilogues: pair j (< half) is rows PairRow(j) and PairRow(j) +
  // pair_offset (silu-and-mul: gate j and up j; rope: elements i and i +
  // head_dim / 2 of one head).
  const int head_half = kRope ? p.rope.head_dim / 2 : 1;
  const int pair_offset = kRope ? head_half : half;
  auto pair_row = [&](int j) {
    return kRope ? j / head_half * p.rope.head_dim + j % head_half : j;
  };

  const __nv_bfloat16* w_row[R];
  bool row_ok[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = kPaired ? pair_row(unit) + r * pair_offset : unit * R + r;
    row_ok[r] = kPaired ? unit < half : row < out_features;
    w_row[r] = w + static_cast<int64_t>(row_ok[r] ? row : 0) * in_features;
  }

  float acc[R][NT];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;
  }

  // Loads of U chunks into one buffer: c = slice + (first + u) · S.
  uint4 wa[U][R], wb[U][R];
  auto load_weights = [&](uint4(&wv)[U][R], int first) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = (slice + (first + u) * k_split) * kSkinnyChunk + lane * 8;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        wv[u][r] = (k < in_features && row_ok[r]) ? LoadStreaming(w_row[r] + k)
                                                  : make_uint4(0, 0, 0, 0);
      }
    }
  };

  const int my_chunks = (num_chunks - slice + k_split - 1) / k_split;
  load_weights(wa, 0);
  load_weights(wb, U);  // past my_chunks: guarded, zeros
  WaitForPreviousKernel();
  if constexpr (kNorm) {
    RmsNormRowsToShared(p.input, p.norm_weight,
                        reinterpret_cast<__nv_bfloat16*>(normed), num_tokens,
                        in_features, in_features, p.norm_epsilon, scratch);
  }
  // Multiplies the U chunks from `first` held in `wv` into acc.
  auto consume = [&](const uint4(&wv)[U][R], int first) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = (slice + (first + u) * k_split) * kSkinnyChunk + lane * 8;
      if (first + u >= my_chunks || k >= in_features) continue;
      float wf[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) Bf16x8ToFloat(wv[u][r], wf[r]);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        // NT rounds num_tokens up to 1, 2, 4 or 8: the rows past it re-read
        // the last token (no branch, so the loads stay unconditional and
        // in flight together) and their sums are never written.
        const int64_t row = t < num_tokens ? t : num_tokens - 1;
        float xf[8];
        const uint4* xv =
            reinterpret_cast<const uint4*>(x + row * in_features + k);
        Bf16x8ToFloat(
            kNorm || kInput == SkinnyInput::kWrittenByKernel ? *xv : __ldg(xv),
            xf);
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            acc[r][t] = __fmaf_rn(wf[r][e], xf[e], acc[r][t]);
          }
        }
      }
    }
  };
  // The chunks are still multiplied in increasing k (the same fmaf sequence
  // as one buffer: the bits do not change), the next buffer's loads issued
  // before the current one is consumed.
  PingPong(my_chunks, U, wa, wb, load_weights, consume);

#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float sum = WarpSumToLane0(acc[r][t]);
      if (lane == 0) partial[warp][r * NT + t] = sum;
    }
  }
  __syncthreads();
  if constexpr (kPaired) {
    // One thread per (group, token): both rows of the pair, each summed
    // over the slices in order; skinny_epilogue.cuh does the rest.
    if (threadIdx.x >= groups * NT) return;
    const int g = threadIdx.x / NT, t = threadIdx.x % NT;
    const int o = cta * groups + g;
    if (o >= half || t >= num_tokens) return;
    float sums[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = partial[g * k_split][r * NT + t];
      for (int s = 1; s < k_split; ++s) {
        sum += partial[g * k_split + s][r * NT + t];
      }
      sums[r] = sum;
    }
    StoreSkinnyPair<kEpi>(p, t, o, pair_row(o), pair_offset, sums[0], sums[1]);
    return;
  }
  // One thread per (group, row, token) adds the slices in order.
  const int per_group = R * NT;
  if (threadIdx.x >= groups * per_group) return;
  const int g = threadIdx.x / per_group, j = threadIdx.x % per_group;
  const int row = (cta * groups + g) * R + j / NT;
  const int t = j % NT;
  if (row >= out_features || t >= num_tokens) return;
  float sum = partial[g * k_split][j];
  for (int s = 1; s < k_split; ++s) sum += partial[g * k_split + s][j];
  StoreSkinnyRow<OutT, kEpi>(p, t, row, sum);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_SKINNY_GEMM_CTA_CUH_
