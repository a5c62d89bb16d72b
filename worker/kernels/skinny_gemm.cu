// Skinny GEMM for decode batches: Y[T, O] = X[T, I] · W[O, I]ᵀ (+ b) with
// T <= kSkinnyGemmMaxTokens, bf16 operands, fp32 accumulation, bf16 or fp32
// output. At T = 1..8 a decode step is a weight stream: cuBLAS reaches ~62%
// of HBM on the small projections (bench/RESULTS.md), this kernel reads each
// weight row once with 16-byte loads and keeps enough of them in flight.
//
// Work split (CTA = 8 warps):
//  - the k axis is cut into chunks of 256 elements (32 lanes × 8 bf16, one
//    16-byte load per lane);
//  - a warp owns `rows_per_warp` (R) output rows and one of `k_split` (S)
//    slices of the chunks (chunk c belongs to slice c % S), so narrow
//    matrices still give the GPU O·S warps of work (split-K);
//  - the S slices of a row sit in one CTA and are summed through shared
//    memory in slice order: no atomics, no second launch.
//
// Batch invariance: every output element is the same sequence of fp32
// operations whatever T and R are: lane l accumulates, with fmaf, its 8
// elements of each of its slice's chunks in increasing k; the warp sums its
// lanes with a fixed shuffle-down tree; the slices are added in order 0..S-1;
// the bias is added last, then one rounding. S depends on (O, I) alone
// (SkinnyGemmKSplit), so row t of a padded graph replay and of an eager run
// at the real token count carry the same bits.
//
// Programmatic dependent launch: the kernel issues its first weight loads
// (weights never change during a step) before griddepcontrol.wait, which
// returns once the previous kernel in the stream has finished and its writes
// are visible; X is read and Y written only after it. Launched without the
// attribute, the wait returns at once.
#include <algorithm>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/linear_cuda.h"
#include "worker/kernels/rms_norm_row.cuh"
#include "worker/kernels/skinny_epilogue.cuh"

namespace pdworker {
namespace kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * cuda::kWarpSize;
constexpr int kChunk = cuda::kWarpSize * 8;  // k elements per warp-wide load

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
// grid: [ceil(O / (R · kWarps / S))] (kSiluAndMul: [ceil(half / (kWarps /
// S))]); block: kThreads.
template <int NT, int R, int U, typename OutT, LinearCudaEpilogue kEpi,
          bool kNorm>
__global__ void __launch_bounds__(kThreads)
    SkinnyGemmKernel(const LinearCudaParams p, int k_split) {
  // A fused decode step chains skinny GEMMs back to back (o_proj -> gate_up
  // -> down -> next qkv): let the next one be scheduled as soon as every
  // CTA of this one has started, so its weight loads overlap this grid's
  // tail. It reads nothing this grid writes before griddepcontrol.wait.
  cuda::AllowDependentLaunch();
  constexpr bool kSiluAndMul = kEpi == LinearCudaEpilogue::kSiluAndMul;
  constexpr bool kRope = kEpi == LinearCudaEpilogue::kRopeKvCache;
  constexpr bool kPaired = kSiluAndMul || kRope;
  static_assert(!kPaired || R == 2, "paired epilogues own two rows a warp");
  __shared__ float partial[kWarps][R * NT];
  __shared__ float scratch[32];
  extern __shared__ uint4 normed[];  // kNorm: [num_tokens, in_features] bf16
  const __nv_bfloat16* __restrict__ w = p.weight;
  const int num_tokens = p.num_tokens, in_features = p.in_features;
  const int out_features = p.out_features;
  const __nv_bfloat16* x =
      kNorm ? reinterpret_cast<const __nv_bfloat16*>(normed) : p.input;
  const int warp = threadIdx.x / cuda::kWarpSize;
  const int lane = threadIdx.x % cuda::kWarpSize;
  const int groups = kWarps / k_split;  // row groups per CTA
  const int group = warp / k_split, slice = warp % k_split;
  const int unit = blockIdx.x * groups + group;
  const int half = out_features / 2;
  const int num_chunks = (in_features + kChunk - 1) / kChunk;
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
      const int k = (slice + (first + u) * k_split) * kChunk + lane * 8;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        wv[u][r] = (k < in_features && row_ok[r])
                       ? cuda::LoadStreaming(w_row[r] + k)
                       : make_uint4(0, 0, 0, 0);
      }
    }
  };

  const int my_chunks = (num_chunks - slice + k_split - 1) / k_split;
  load_weights(wa, 0);
  load_weights(wb, U);  // past my_chunks: guarded, zeros
  cuda::WaitForPreviousKernel();
  if constexpr (kNorm) {
    cuda::RmsNormRowsToShared(
        p.input, p.norm_weight, reinterpret_cast<__nv_bfloat16*>(normed),
        num_tokens, in_features, in_features, p.norm_epsilon, scratch);
  }
  // Multiplies the U chunks from `first` held in `wv` into acc.
  auto consume = [&](const uint4(&wv)[U][R], int first) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = (slice + (first + u) * k_split) * kChunk + lane * 8;
      if (first + u >= my_chunks || k >= in_features) continue;
      float wf[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) cuda::Bf16x8ToFloat(wv[u][r], wf[r]);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        // NT rounds num_tokens up to 1, 2, 4 or 8: the rows past it re-read
        // the last token (no branch, so the loads stay unconditional and
        // in flight together) and their sums are never written.
        const int64_t row = t < num_tokens ? t : num_tokens - 1;
        float xf[8];
        const uint4* xv =
            reinterpret_cast<const uint4*>(x + row * in_features + k);
        cuda::Bf16x8ToFloat(kNorm ? *xv : __ldg(xv), xf);
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
  cuda::PingPong(my_chunks, U, wa, wb, load_weights, consume);

#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float sum = cuda::WarpSumToLane0(acc[r][t]);
      if (lane == 0) partial[warp][r * NT + t] = sum;
    }
  }
  __syncthreads();
  if constexpr (kPaired) {
    // One thread per (group, token): both rows of the pair, each summed
    // over the slices in order; skinny_epilogue.cuh does the rest.
    if (threadIdx.x >= groups * NT) return;
    const int g = threadIdx.x / NT, t = threadIdx.x % NT;
    const int o = blockIdx.x * groups + g;
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
    cuda::StoreSkinnyPair<kEpi>(p, t, o, pair_row(o), pair_offset, sums[0],
                                sums[1]);
    return;
  }
  // One thread per (group, row, token) adds the slices in order.
  const int per_group = R * NT;
  if (threadIdx.x >= groups * per_group) return;
  const int g = threadIdx.x / per_group, j = threadIdx.x % per_group;
  const int row = (blockIdx.x * groups + g) * R + j / NT;
  const int t = j % NT;
  if (row >= out_features || t >= num_tokens) return;
  float sum = partial[g * k_split][j];
  for (int s = 1; s < k_split; ++s) sum += partial[g * k_split + s][j];
  cuda::StoreSkinnyRow<OutT, kEpi>(p, t, row, sum);
}

template <int NT, typename OutT, LinearCudaEpilogue kEpi, bool kNorm>
cudaError_t LaunchForTokens(const LinearCudaParams& p, int k_split,
                            cudaStream_t stream) {
  constexpr bool kPaired = kEpi == LinearCudaEpilogue::kSiluAndMul ||
                           kEpi == LinearCudaEpilogue::kRopeKvCache;
  // Two rows per warp from 3 tokens up halves the L1 reads of X per weight
  // byte; fewer chunks in flight keep the registers of 8 tokens in budget.
  // U is per buffer: the two buffers hold what one batch of 4 (8 tokens:
  // 2) chunks held before, so registers and occupancy stay where they were
  // measured, and a slice of at most 2U chunks still has all of its loads
  // issued before the first multiply.
  constexpr int R = NT >= 3 || kPaired ? 2 : 1;
  constexpr int U = NT >= 5 ? 1 : 2;
  const int units = kPaired ? p.out_features / 2 : p.out_features;
  const int units_per_cta = (kPaired ? 1 : R) * (kWarps / k_split);
  return cuda::LaunchKernel(
      SkinnyGemmKernel<NT, R, U, OutT, kEpi, kNorm>,
      dim3(cuda::NumBlocks(units, units_per_cta)), dim3(kThreads),
      kNorm ? sizeof(__nv_bfloat16) * p.num_tokens * p.in_features : 0, stream,
      p.programmatic_launch ? cuda::DependentLaunch::kProgrammatic
                            : cuda::DependentLaunch::kSerialized,
      p, k_split);
}

template <typename OutT, LinearCudaEpilogue kEpi, bool kNorm>
cudaError_t LaunchForOutput(const LinearCudaParams& p, int k_split,
                            cudaStream_t stream) {
  // The fusions of a decode step run at one token (SkinnyFusionSupports):
  // the CUDA-core kernel is kAuto's choice there only.
  if constexpr (kNorm || kEpi == LinearCudaEpilogue::kAddResidual ||
                kEpi == LinearCudaEpilogue::kRopeKvCache) {
    if (p.num_tokens != 1) return cudaErrorInvalidValue;
    return LaunchForTokens<1, OutT, kEpi, kNorm>(p, k_split, stream);
  } else {
    // Kernels for 1, 2, 4 and 8 tokens; 3, 5, 6 and 7 run the next one up
    // with its extra token rows skipped (the same operations per element:
    // rows stay bit-identical), which halves the instantiations nvcc builds.
    if (p.num_tokens == 1) {
      return LaunchForTokens<1, OutT, kEpi, kNorm>(p, k_split, stream);
    }
    if (p.num_tokens == 2) {
      return LaunchForTokens<2, OutT, kEpi, kNorm>(p, k_split, stream);
    }
    if (p.num_tokens <= 4) {
      return LaunchForTokens<4, OutT, kEpi, kNorm>(p, k_split, stream);
    }
    return LaunchForTokens<8, OutT, kEpi, kNorm>(p, k_split, stream);
  }
}

// The variant cuda::DispatchSkinnyVariant picks.
struct Launcher {
  const LinearCudaParams& p;
  int k_split;
  cudaStream_t stream;
  template <typename OutT, LinearCudaEpilogue kEpi, bool kNorm>
  cudaError_t Run() const {
    return LaunchForOutput<OutT, kEpi, kNorm>(p, k_split, stream);
  }
};

}  // namespace

int SkinnyGemmKSplit(int in_features, int out_features) {
  // About 4,096 warp-slices of work, no more (measured on an H200 at one
  // token, bench/RESULTS.md: the best factor of every 0.5B / 1B projection
  // within 0.8 µs), and >= 2 chunks per slice so a warp still has loads to
  // overlap.
  const int num_chunks = (in_features + kChunk - 1) / kChunk;
  int k_split = 1;
  while (k_split < kWarps &&
         static_cast<int64_t>(out_features) * k_split * 2 < 8192 &&
         num_chunks >= 4 * k_split) {
    k_split *= 2;
  }
  return k_split;
}

bool SkinnyGemmSupports(const LinearCudaParams& p) {
  return p.num_tokens >= 1 && p.num_tokens <= kSkinnyGemmMaxTokens &&
         p.in_features % 8 == 0 && cuda::Aligned16(p.input) &&
         cuda::Aligned16(p.weight);
}

cudaError_t LaunchSkinnyGemmCuda(const LinearCudaParams& p, int k_split,
                                 cudaStream_t stream) {
  if (!SkinnyGemmSupports(p) || k_split < 1 || k_split > kWarps ||
      (k_split & (k_split - 1)) != 0 ||
      !SkinnyFusionSupports(p, LinearCudaKernel::kSkinnyGemm)) {
    return cudaErrorInvalidValue;
  }
  return cuda::DispatchSkinnyVariant(p, Launcher{p, k_split, stream});
}

}  // namespace kernels
}  // namespace pdworker
