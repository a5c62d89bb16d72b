// Skinny GEMM on the tensor cores for decode batches of 1..8 tokens:
// Y[T, O] = X[T, I] · W[O, I]ᵀ (+ b), bf16 operands, fp32 accumulation,
// bf16 or fp32 output. The CUDA-core skinny GEMM (skinny_gemm.cu) spends 8
// FMAs per 16 bytes of weights per token and falls behind cuBLAS from 2
// tokens on the wide matrices (gate_up, LM head: 0.5-0.9x at 2-8 tokens,
// bench/RESULTS.md); here one mma.m16n8k16 does 16 rows × 8 tokens × 16 k,
// so the kernel stays a weight stream at any T <= 8.
//
// Operands are swapped: A (16×16, row-major) is 16 weight rows — W's own
// layout — and B (16×8, column-major) is Xᵀ, column j = token j, so the
// 8 columns of an mma are the (up to) 8 tokens. A lane loads 16 contiguous
// bytes (8 k) of its two weight rows and of its token, and feeds them to
// two mmas: k is permuted inside each 32-element chunk (the same
// permutation on A and B, which a dot product does not see), so every load
// is a full 16-byte vector and a warp reads 64 contiguous bytes per row.
// Lane l (g = l / 4, c = l % 4) loads, for chunk base k0,
//   W[row0 + g][k0 + 8c .. +7], W[row0 + g + 8][k0 + 8c .. +7], X[g][..]
// and mma h (0, 1) takes elements 4h .. 4h+3 of each: logical k 2c, 2c+1
// are physical 8c + 4h + {0, 1}, logical 2c+8, 2c+9 are 8c + 4h + {2, 3}.
//
// Work split (CTA = 8 warps): a warp owns one block of 16 rows (kSiluAndMul:
// 16 gate rows and the 16 up rows that pair with them) and one of S
// contiguous slices of the k chunks (split-K); the slices of a row block sit
// in one CTA and are summed through shared memory in slice order. No
// atomics.
//
// Batch invariance: D[i][j] of an mma depends on row i of A and column j of
// B only, and everything else about a row — the chunks, their order, S
// (SkinnyMmaKSplit: a function of O and I), the slice sum, the bias, the
// rounding — is independent of T. Columns past T re-read the last token and
// are never written. So row t carries the same bits at every T in 1..8: a
// batch padded to its graph's size and the same batch run eagerly agree.
// (They differ from the CUDA-core kernel's bits: the tensor cores add in
// another order.)
//
// Programmatic dependent launch as in skinny_gemm.cu: the first weight
// loads are issued before cuda::WaitForPreviousKernel, X after it.
#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/linear_cuda.h"
#include "worker/kernels/rms_norm_row.cuh"
#include "worker/kernels/skinny_epilogue.cuh"

namespace pdworker {
namespace kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * cuda::kWarpSize;
constexpr int kRowsPerBlock = 16;  // mma M
constexpr int kTokens = 8;         // mma N: the tokens of one launch
constexpr int kChunk = 4 * 8;      // k per warp-wide load: 4 lanes × 8 bf16
// Chunks of weights a warp holds in registers per row block: two buffers of
// half as many (ping-pong), so one buffer's loads are in flight while the
// tensor cores consume the other. With a single buffer of 8 (load 8,
// consume 8, load the next 8) it reached 1.1-2.9 TB/s on the H200
// (2026-11-27) against cuBLAS's 3.8; each batch waiting a full memory
// latency is the likely cause, not yet confirmed by a run of this version.
constexpr int kMaxChunksInFlight = 8;

// kEpi kSiluAndMul: W is [gate; up] (2 · half rows); block b of the warp is
// gate rows b·16 .. +15 (r = 0) and up rows half + b·16 .. +15 (r = 1), and
// Y[T, half] = silu(gate) · up, each of gate and up (+ bias) rounded to bf16
// first, as the unfused GEMM writes them.
// kEpi kAddResidual: Y (bf16) is the residual stream, updated in place, Y =
// bf16(Y + bf16(x·w + b)) (one thread reads and writes each element).
// kEpi kRopeKvCache: Y is the fused qkv row of each token; block r = 0 holds
// 16 pairs' first elements (i of a head, i < head_dim / 2), r = 1 their
// partners (i + head_dim / 2), which the epilogue rotates (q, k) and writes
// to the KV cache (k, v) as the RoPE kernel would (rope_kv_row.cuh).
// kNorm: x is the pre-norm residual; the CTA writes RMSNorm(x) into shared
// memory first (rms_norm_row.cuh: the RMSNorm kernel's bits), rows padded
// to in_features + 8 so that the 8 token rows a warp reads at once start in
// different banks. Dynamic shared memory: num_tokens · (in_features + 8)
// bf16.
// RB: row blocks per warp (kSiluAndMul: 2); U: chunks per load buffer (two
// buffers).
// grid: [ceil(blocks / (kWarps / S))] with blocks = ceil(O / 16)
// (kSiluAndMul: ceil(half / 16)); block: kThreads.
template <int RB, int U, typename OutT, LinearCudaEpilogue kEpi, bool kNorm>
__global__ void __launch_bounds__(kThreads)
    SkinnyMmaKernel(const LinearCudaParams p, int k_split) {
  // A fused decode step chains skinny GEMMs back to back (o_proj -> gate_up
  // -> down -> next qkv): let the next one be scheduled as soon as every
  // CTA of this one has started, so its weight loads overlap this grid's
  // tail. It reads nothing this grid writes before griddepcontrol.wait.
  cuda::AllowDependentLaunch();
  constexpr bool kSiluAndMul = kEpi == LinearCudaEpilogue::kSiluAndMul;
  constexpr bool kRope = kEpi == LinearCudaEpilogue::kRopeKvCache;
  constexpr bool kPaired = kSiluAndMul || kRope;
  static_assert(!kPaired || RB == 2, "paired epilogues own two row blocks");
  // [warp][row block][row in block][token]
  __shared__ float partial[kWarps][RB][kRowsPerBlock][kTokens];
  __shared__ float scratch[32];
  extern __shared__ uint4 normed[];  // kNorm: [num_tokens, in_features + 8]
  const __nv_bfloat16* __restrict__ w = p.weight;
  const int num_tokens = p.num_tokens, in_features = p.in_features;
  const int out_features = p.out_features;
  const int x_stride = kNorm ? in_features + 8 : in_features;
  const int warp = threadIdx.x / cuda::kWarpSize;
  const int lane = threadIdx.x % cuda::kWarpSize;
  const int g = lane / 4, c = lane % 4;
  const int groups = kWarps / k_split;  // row blocks (units) per CTA
  const int group = warp / k_split, slice = warp % k_split;
  const int unit = blockIdx.x * groups + group;
  const int half = out_features / 2;
  const int num_chunks = (in_features + kChunk - 1) / kChunk;
  const int per_slice = (num_chunks + k_split - 1) / k_split;
  const int first_chunk = slice * per_slice;
  const int my_chunks = max(0, min(per_slice, num_chunks - first_chunk));
  // Paired epilogues: pair j (< half) is rows pair_row(j) and pair_row(j) +
  // pair_offset (silu-and-mul: gate j and up j; rope: elements i and i +
  // head_dim / 2 of one head). Any 16 pairs make a row block: each lane
  // loads its own rows.
  const int head_half = kRope ? p.rope.head_dim / 2 : 1;
  const int pair_offset = kRope ? head_half : half;
  auto pair_row = [&](int j) {
    return kRope ? j / head_half * p.rope.head_dim + j % head_half : j;
  };

  // Rows g and g + 8 of each of the warp's row blocks.
  const __nv_bfloat16* w_row[RB][2];
  bool row_ok[RB][2];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int in_block = unit * kRowsPerBlock + g + 8 * h;
      const int row = kPaired ? pair_row(in_block) + r * pair_offset
                              : (unit * RB + r) * kRowsPerBlock + g + 8 * h;
      row_ok[r][h] = kPaired ? in_block < half : row < out_features;
      w_row[r][h] =
          w + static_cast<int64_t>(row_ok[r][h] ? row : 0) * in_features;
    }
  }

  float acc[RB][4];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[r][e] = 0.0f;
  }

  // Weights of U chunks (first .. first + U - 1 of this slice) into one of
  // the two buffers: k of chunk i is (first_chunk + i) · kChunk + 8c;
  // in_features % 8 == 0, so a 16-byte vector is all in range or all out.
  uint4 wa[U][RB][2], wb[U][RB][2];
  auto load_weights = [&](uint4(&wv)[U][RB][2], int first) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = (first_chunk + first + u) * kChunk + 8 * c;
      const bool in_range = first + u < my_chunks && k < in_features;
#pragma unroll
      for (int r = 0; r < RB; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          wv[u][r][h] = in_range && row_ok[r][h]
                            ? cuda::LoadStreaming(w_row[r][h] + k)
                            : make_uint4(0, 0, 0, 0);
        }
      }
    }
  };

  // Column g of B is token g; the columns past num_tokens re-read the last
  // token (their sums are dropped).
  const __nv_bfloat16* x_row =
      (kNorm ? reinterpret_cast<const __nv_bfloat16*>(normed) : p.input) +
      static_cast<int64_t>(min(g, num_tokens - 1)) * x_stride;
  load_weights(wa, 0);
  load_weights(wb, U);  // past my_chunks: guarded, zeros
  cuda::WaitForPreviousKernel();
  if constexpr (kNorm) {
    cuda::RmsNormRowsToShared(
        p.input, p.norm_weight, reinterpret_cast<__nv_bfloat16*>(normed),
        num_tokens, in_features, x_stride, p.norm_epsilon, scratch);
  }
  // Multiplies the U chunks from `first` held in `wv` into acc.
  auto consume = [&](const uint4(&wv)[U][RB][2], int first) {
    uint4 xv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = (first_chunk + first + u) * kChunk + 8 * c;
      const uint4* xp = reinterpret_cast<const uint4*>(x_row + k);
      xv[u] = first + u < my_chunks && k < in_features
                  ? (kNorm ? *xp : __ldg(xp))
                  : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      // Out-of-range chunks are zeros on both sides: adding their (exact
      // zero) products keeps every row's operation sequence one shape.
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        const uint32_t a0[4] = {wv[u][r][0].x, wv[u][r][1].x, wv[u][r][0].y,
                                wv[u][r][1].y};
        cuda::Mma16816(acc[r], a0, xv[u].x, xv[u].y);
        const uint32_t a1[4] = {wv[u][r][0].z, wv[u][r][1].z, wv[u][r][0].w,
                                wv[u][r][1].w};
        cuda::Mma16816(acc[r], a1, xv[u].z, xv[u].w);
      }
    }
  };
  // Ping-pong: the next buffer's loads are issued before the current one is
  // consumed. Which chunks are multiplied, and in what order, depends on
  // my_chunks (the shape and S) alone, never on T.
  cuda::PingPong(my_chunks, U, wa, wb, load_weights, consume);

  // acc[r] = {D[g][2c], D[g][2c+1], D[g+8][2c], D[g+8][2c+1]}.
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    partial[warp][r][g][2 * c] = acc[r][0];
    partial[warp][r][g][2 * c + 1] = acc[r][1];
    partial[warp][r][g + 8][2 * c] = acc[r][2];
    partial[warp][r][g + 8][2 * c + 1] = acc[r][3];
  }
  __syncthreads();

  // One thread per (group, token, row of the block): the slices added in
  // order 0..S-1, then the bias, then one rounding. Consecutive threads take
  // consecutive rows of one token, so the writes are contiguous.
  auto slice_sum = [&](int gr, int r, int row, int t) {
    float sum = partial[gr * k_split][r][row][t];
    for (int s = 1; s < k_split; ++s) {
      sum += partial[gr * k_split + s][r][row][t];
    }
    return sum;
  };
  if constexpr (kPaired) {
    for (int i = threadIdx.x; i < groups * kTokens * kRowsPerBlock;
         i += kThreads) {
      const int gr = i / (kTokens * kRowsPerBlock);
      const int t = (i / kRowsPerBlock) % kTokens;
      const int row = i % kRowsPerBlock;
      const int o = (blockIdx.x * groups + gr) * kRowsPerBlock + row;
      if (o >= half || t >= num_tokens) continue;
      cuda::StoreSkinnyPair<kEpi>(p, t, o, pair_row(o), pair_offset,
                                  slice_sum(gr, 0, row, t),
                                  slice_sum(gr, 1, row, t));
    }
    return;
  }
  constexpr int kRowsPerUnit = RB * kRowsPerBlock;
  for (int i = threadIdx.x; i < groups * kTokens * kRowsPerUnit;
       i += kThreads) {
    const int gr = i / (kTokens * kRowsPerUnit);
    const int t = (i / kRowsPerUnit) % kTokens;
    const int j = i % kRowsPerUnit;
    const int o = (blockIdx.x * groups + gr) * kRowsPerUnit + j;
    if (o >= out_features || t >= num_tokens) continue;
    cuda::StoreSkinnyRow<OutT, kEpi>(
        p, t, o, slice_sum(gr, j / kRowsPerBlock, j % kRowsPerBlock, t));
  }
}

template <typename OutT, LinearCudaEpilogue kEpi, bool kNorm>
cudaError_t Launch(const LinearCudaParams& p, int k_split,
                   cudaStream_t stream) {
  constexpr bool kPaired = kEpi == LinearCudaEpilogue::kSiluAndMul ||
                           kEpi == LinearCudaEpilogue::kRopeKvCache;
  // A paired epilogue holds two row blocks' loads per chunk: half as many
  // chunks in flight keeps the same bytes (and registers) per warp.
  constexpr int RB = kPaired ? 2 : 1;
  constexpr int U = kMaxChunksInFlight / RB / 2;  // per buffer
  const int rows = kPaired ? p.out_features / 2 : p.out_features;
  const int units = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  return cuda::LaunchKernel(
      SkinnyMmaKernel<RB, U, OutT, kEpi, kNorm>,
      dim3(cuda::NumBlocks(units, kWarps / k_split)), dim3(kThreads),
      kNorm ? sizeof(__nv_bfloat16) * p.num_tokens * (p.in_features + 8) : 0,
      stream,
      p.programmatic_launch ? cuda::DependentLaunch::kProgrammatic
                            : cuda::DependentLaunch::kSerialized,
      p, k_split);
}

// The variant cuda::DispatchSkinnyVariant picks.
struct Launcher {
  const LinearCudaParams& p;
  int k_split;
  cudaStream_t stream;
  template <typename OutT, LinearCudaEpilogue kEpi, bool kNorm>
  cudaError_t Run() const {
    return Launch<OutT, kEpi, kNorm>(p, k_split, stream);
  }
};

}  // namespace

int SkinnyMmaKSplit(int in_features, int out_features) {
  // From linear_bench on the H200 (2026-11-27, bench/RESULTS.md): a warp's
  // serial walk over its chunks bounds these kernels, so S = 8 was the
  // fastest split on 31 of 40 rows (the 0.5B and 1B projections at 1-8
  // tokens), the LM heads (>= 4,096 row blocks, enough warps without it)
  // excepted, where S = 4 was. No more slices than chunks. A function of
  // the shape alone (batch invariance).
  const int64_t units = (out_features + kRowsPerBlock - 1) / kRowsPerBlock;
  const int num_chunks = (in_features + kChunk - 1) / kChunk;
  int k_split = units >= 4096 ? kWarps / 2 : kWarps;
  while (k_split > 1 && k_split > num_chunks) k_split /= 2;
  return k_split;
}

bool SkinnyMmaSupports(const LinearCudaParams& p) {
  return SkinnyGemmSupports(p);  // the same shapes and alignment
}

cudaError_t LaunchSkinnyMmaCuda(const LinearCudaParams& p, int k_split,
                                cudaStream_t stream) {
  if (!SkinnyMmaSupports(p) || k_split < 1 || k_split > kWarps ||
      (k_split & (k_split - 1)) != 0 ||
      !SkinnyFusionSupports(p, LinearCudaKernel::kSkinnyMma)) {
    return cudaErrorInvalidValue;
  }
  return cuda::DispatchSkinnyVariant(p, Launcher{p, k_split, stream});
}

}  // namespace kernels
}  // namespace pdworker
