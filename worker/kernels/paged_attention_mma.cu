// Varlen paged attention on tensor cores (FlashAttention-2's algorithm over
// the paged KV cache), for head_dim 64 and 128: prefill, chunked prefill,
// cached prefixes and mixed batches.
//
// A CTA (4 warps) owns one query tile of one request and one kv head: the
// tile's 4 · kWarpRows rows (kWarpRows 16 or 32) are consecutive
// query tokens × the G query heads of the kv head's GQA group (row =
// token_in_tile · G + head_in_group; G <= 8), so every K/V tile it loads
// serves the whole group. Warp w owns rows [w · kWarpRows, (w + 1) ·
// kWarpRows), one or two m16 MMA tiles. Per key tile of 64 positions:
//   (a) cp.async loads of K and V rows through the block table into shared
//       memory (double-buffered: tile i+1 loads while tile i computes);
//       positions past the tile's last visible key, and block ids outside
//       the cache, are zero-filled and masked;
//   (b) S = Q·Kᵀ with mma.m16n8k16 (bf16 in, fp32 accumulate), Q fragments
//       held in registers for the whole key loop, each K fragment read once
//       per warp for all its m16 tiles;
//   (c) online softmax on the fragments (exp2 with the scale folded in),
//       the causal / validity mask only on tiles that need it;
//   (d) O += P·V with P converted to bf16 A fragments in registers and V
//       read by ldmatrix.trans.
// At the end O / l is rounded to bf16 and stored. No atomics; the key loop
// and every reduction have a fixed order, so a launch is deterministic and a
// graph replay gives the eager bits.
//
// Shared memory rows are 16-byte chunks XOR-swizzled by (row mod 8), so the
// 8 rows one ldmatrix reads sit in 8 different bank groups.
//
// Grid: (num_kv_heads, ceil(num_tokens / tokens_per_tile) + min(max_num_seqs,
// num_tokens)): from the launch shape only, enough for any split of
// num_tokens into requests (each request adds at most one partial tile).
// Tiles are handed out heaviest first (the last tiles of the last request
// see the longest context). Every CTA also zero-fills its share of the rows
// no request owns. Requires query_start_loc non-decreasing (as StepInputs
// writes it).
//
// Measured on an H200 (bench/RESULTS.md, issue 22): 176 TFLOP/s causal at 8k
// tokens at head_dim 64, 185 at 128 (32 rows per warp).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/mma_tile.cuh"
#include "worker/kernels/paged_attention_cuda.h"
#include "worker/kernels/varlen_tile.cuh"

namespace pdworker {
namespace kernels {
namespace {

using cuda::mma_tile::CommitCopies;
using cuda::mma_tile::kChunk;
using cuda::mma_tile::LoadMatrixX4;
using cuda::mma_tile::LoadMatrixX4Trans;
using cuda::mma_tile::PackBf16x2;
using cuda::mma_tile::PackProbabilities;
using cuda::mma_tile::RescaleRows;
using cuda::mma_tile::SharedAddress;
using cuda::mma_tile::SoftmaxTile;
using cuda::mma_tile::Swizzled;
using cuda::mma_tile::WaitCopies;
using cuda::varlen_tile::FindTileKeys;
using cuda::varlen_tile::LoadKvTile;
using cuda::varlen_tile::LoadQueryTile;
using cuda::varlen_tile::StartTile;
using cuda::varlen_tile::TileAssignment;
using cuda::varlen_tile::TileKeys;

constexpr int kThreads = 128;
constexpr int kWarps = 4;
constexpr int kTileKeys = 64;  // key positions per tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -INFINITY;

// Query rows per warp: 16 (one m16 tile) or 32 (two m16 tiles sharing every
// K/V fragment: half the shared-memory reads per FLOP, but 255 registers at
// head_dim 64, so fewer CTAs per SM; head_dim 128 only runs 16).
template <int kHeadDim, int kWarpRowsArg>
struct TileSizes {
  static constexpr int kWarpRows = kWarpRowsArg;
  static constexpr int kMTiles = kWarpRows / 16;
  static constexpr int kTileRows = kWarps * kWarpRows;  // query rows per CTA
  static constexpr int kQElems = kTileRows * kHeadDim;
  static constexpr int kKvElems = kTileKeys * kHeadDim;  // one K or V stage
  // Q, then K and V of two stages.
  static constexpr int kSharedBytes = (kQElems + 4 * kKvElems) * 2;
};

// --- The kernel
// ---------------------------------------------------------------

template <int kHeadDim, int kWarpRowsArg>
__global__ void __launch_bounds__(kThreads)
    MmaVarlenAttentionKernel(PagedAttentionCudaParams p) {
  cuda::AllowDependentLaunch();
  using Sizes = TileSizes<kHeadDim, kWarpRowsArg>;
  constexpr int kTileRows = Sizes::kTileRows;
  constexpr int kWarpRows = Sizes::kWarpRows;
  constexpr int kMTiles = Sizes::kMTiles;
  constexpr int kDimTiles = kHeadDim / 8;    // n8 tiles of O
  constexpr int kDimSteps = kHeadDim / 16;   // k16 steps of Q·Kᵀ
  constexpr int kKeyTiles = kTileKeys / 8;   // n8 tiles of S
  constexpr int kKeySteps = kTileKeys / 16;  // k16 steps of P·V
  extern __shared__ __align__(128) __nv_bfloat16 smem[];
  __nv_bfloat16* q_tile = smem;
  __nv_bfloat16* k_tiles = smem + Sizes::kQElems;          // 2 stages
  __nv_bfloat16* v_tiles = k_tiles + 2 * Sizes::kKvElems;  // 2 stages
  __shared__ TileAssignment tile_s;
  __shared__ int8_t key_ok[2][kTileKeys];

  const int kv_head = blockIdx.x;
  const int group = p.num_heads / p.num_kv_heads;  // G <= 8
  const int head0 = kv_head * group;
  const int tid = threadIdx.x;

  // Zeros for the rows no request owns, then this CTA's tile.
  const TileAssignment a =
      StartTile<kHeadDim, kTileRows, kThreads>(p, group, head0, &tile_s);
  if (a.request < 0) return;

  const int num_rows = a.num_tokens * group;
  const TileKeys keys = FindTileKeys<kHeadDim, kThreads>(p, a, kv_head);
  const int kv_len = keys.kv_len;
  const bool any_bad_block = keys.any_bad_block;

  LoadQueryTile<kHeadDim, kTileRows, kThreads>(
      p, a, group, head0, num_rows, q_tile,
      [](int row, int chunk) { return Swizzled<kHeadDim>(row, chunk); });
  // K and V rows of key tile `tile` into stage `stage`.
  auto load_kv = [&](int tile, int stage) {
    LoadKvTile<kHeadDim, kTileKeys, kThreads>(
        p, keys, tile, k_tiles + stage * Sizes::kKvElems,
        v_tiles + stage * Sizes::kKvElems, key_ok[stage],
        [](int key, int chunk) { return Swizzled<kHeadDim>(key, chunk); });
  };

  const int num_key_tiles =
      kv_len > 0 ? (kv_len + kTileKeys - 1) / kTileKeys : 0;
  if (num_key_tiles > 0) load_kv(0, 0);
  CommitCopies();  // group 0: Q (+ key tile 0)

  const int warp = tid / cuda::kWarpSize;
  const int lane = tid % cuda::kWarpSize;
  const int g = lane / 4;   // fragment row within 8
  const int tq = lane % 4;  // fragment column pair
  // This thread's rows: warp row mt·16 + g + 8h of m16 tile mt (h = 0, 1),
  // and their positions.
  int position[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      position[mt][h] =
          a.first_position + (warp * kWarpRows + mt * 16 + g + 8 * h) / group;
    }
  }
  const float scale_log2 = p.scale * kLog2e;
  // Warps whose rows are all past the tile skip the math (not the loads or
  // barriers).
  const bool warp_has_rows = warp * kWarpRows < num_rows;

  // Q fragments stay in registers for the whole key loop unless they would
  // not fit (head_dim 128 at 32 rows per warp: O alone takes 128 registers):
  // then they are re-read from shared memory once per key tile, each
  // serving the 4 key groups of 16.
  constexpr bool kQInRegisters = kHeadDim * kWarpRows <= 64 * 32;
  uint32_t q_frag[kMTiles][kQInRegisters ? kDimSteps : 1][4];
  float o[kMTiles][kDimTiles][4];
  float row_max[kMTiles][2];  // of scaled (log2) scores
  float row_sum[kMTiles][2];  // this thread's share
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.0f;
    }
    row_max[mt][0] = row_max[mt][1] = kNegInf;
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }

  for (int tile = 0; tile < num_key_tiles; ++tile) {
    const int stage = tile & 1;
    if (tile + 1 < num_key_tiles) load_kv(tile + 1, stage ^ 1);
    CommitCopies();
    WaitCopies<1>();  // everything but the group just committed
    __syncthreads();

    if (warp_has_rows) {
      if (kQInRegisters && tile == 0) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int ks = 0; ks < kDimSteps; ++ks) {
            const int row =
                warp * kWarpRows + mt * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
            const int chunk = ks * 2 + lane / 16;
            LoadMatrixX4(
                q_frag[mt][kQInRegisters ? ks : 0],
                SharedAddress(q_tile + Swizzled<kHeadDim>(row, chunk)));
          }
        }
      }
      const __nv_bfloat16* k_tile = k_tiles + stage * Sizes::kKvElems;
      const __nv_bfloat16* v_tile = v_tiles + stage * Sizes::kKvElems;

      // (b) S = Q·Kᵀ: kWarpRows rows × 64 keys per warp; each K fragment
      // serves every m16 tile.
      float s[kMTiles][kKeyTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.0f;
        }
      }
#pragma unroll
      for (int ks = 0; ks < kDimSteps; ++ks) {  // 16 dims at a time
        if (!kQInRegisters) {
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            const int row =
                warp * kWarpRows + mt * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
            const int chunk = ks * 2 + lane / 16;
            LoadMatrixX4(
                q_frag[mt][0],
                SharedAddress(q_tile + Swizzled<kHeadDim>(row, chunk)));
          }
        }
#pragma unroll
        for (int kp = 0; kp < kKeyTiles / 2; ++kp) {  // 16 keys at a time
          uint32_t b[4];
          const int key = kp * 16 + (lane % 8) + (lane / 16) * 8;
          const int chunk = ks * 2 + (lane / 8) % 2;
          LoadMatrixX4(b,
                       SharedAddress(k_tile + Swizzled<kHeadDim>(key, chunk)));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            const uint32_t(&q)[4] = q_frag[mt][kQInRegisters ? ks : 0];
            cuda::Mma16816(s[mt][2 * kp], q, b[0], b[1]);
            cuda::Mma16816(s[mt][2 * kp + 1], q, b[2], b[3]);
          }
        }
      }

      // (c) Scale, mask, online softmax. Element e of s[mt][n]: row mt·16 +
      // g + 8·(e / 2) of the warp, key tile·64 + 8n + 2tq + (e & 1).
      const int key0 = tile * kTileKeys;
      const bool needs_mask = any_bad_block ||
                              key0 + kTileKeys - 1 > a.first_position ||
                              key0 + kTileKeys > kv_len;
      float rescale[kMTiles][2];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        SoftmaxTile(s[mt], row_max[mt], row_sum[mt], rescale[mt], scale_log2,
                    needs_mask, key_ok[stage], key0, position[mt], tq);
        RescaleRows(o[mt], rescale[mt]);
      }

      // (d) O += P·V: P's accumulator layout is the A fragment layout of the
      // 16 keys of two adjacent n8 tiles; each V fragment serves every m16
      // tile.
#pragma unroll
      for (int kk = 0; kk < kKeySteps; ++kk) {
        uint32_t pa[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          PackProbabilities(s[mt], kk, pa[mt]);
        }
#pragma unroll
        for (int nd = 0; nd < kDimTiles / 2; ++nd) {  // 16 dims at a time
          uint32_t b[4];
          const int key = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
          const int chunk = nd * 2 + lane / 16;
          LoadMatrixX4Trans(
              b, SharedAddress(v_tile + Swizzled<kHeadDim>(key, chunk)));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            cuda::Mma16816(o[mt][2 * nd], pa[mt], b[0], b[1]);
            cuda::Mma16816(o[mt][2 * nd + 1], pa[mt], b[2], b[3]);
          }
        }
      }
    }
    __syncthreads();  // the next iteration's loads overwrite this stage
  }
  WaitCopies<0>();  // nothing may be in flight when the CTA exits

  // Epilogue: the row sums over the quad, O / l, bf16 stores. A row that saw
  // no key (position < 0) is written as zeros.
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[mt][h];
      sum += __shfl_xor_sync(cuda::kFullMask, sum, 1);
      sum += __shfl_xor_sync(cuda::kFullMask, sum, 2);
      const int row = warp * kWarpRows + mt * 16 + g + 8 * h;
      if (row >= num_rows) continue;
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      __nv_bfloat16* out =
          p.output +
          (static_cast<int64_t>(a.first_row + row / group) * p.num_heads +
           head0 + row % group) *
              kHeadDim;
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        *reinterpret_cast<uint32_t*>(out + 8 * n + 2 * tq) =
            PackBf16x2(o[mt][n][2 * h] * inv, o[mt][n][2 * h + 1] * inv);
      }
    }
  }
}

template <int kHeadDim, int kWarpRows>
cudaError_t Launch(const PagedAttentionCudaParams& p, cudaStream_t stream) {
  using Sizes = TileSizes<kHeadDim, kWarpRows>;
  constexpr int kBytes = Sizes::kSharedBytes;
  // More than 48 KB of dynamic shared memory must be opted into, once per
  // kernel (not a stream operation: allowed while a graph is captured).
  static const cudaError_t attribute =
      cudaFuncSetAttribute(MmaVarlenAttentionKernel<kHeadDim, kWarpRows>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (attribute != cudaSuccess) return attribute;
  const int tokens_per_tile = Sizes::kTileRows / (p.num_heads / p.num_kv_heads);
  const int tiles = (p.num_tokens + tokens_per_tile - 1) / tokens_per_tile +
                    min(p.max_num_seqs, p.num_tokens);
  const dim3 grid(p.num_kv_heads, tiles);
  MmaVarlenAttentionKernel<kHeadDim, kWarpRows>
      <<<grid, kThreads, kBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

int PagedAttentionMmaWarpRows(const PagedAttentionCudaParams& p) {
  if (p.mma_warp_rows != 0) return p.mma_warp_rows;
  return p.num_tokens >= kCudaAttentionMmaTallTileMinTokens ? 32 : 16;
}

bool PagedAttentionMmaSupports(const PagedAttentionCudaParams& p) {
  if (p.softcap > 0.0f || p.sliding_window > 0) return false;  // CUDA cores
  const int group = p.num_kv_heads > 0 ? p.num_heads / p.num_kv_heads : 0;
  const int warp_rows = PagedAttentionMmaWarpRows(p);
  if ((p.head_dim != 64 && p.head_dim != 128) || group < 1 ||
      (warp_rows != 16 && warp_rows != 32) ||
      group > kCudaAttentionMmaMaxGroup || p.num_tokens <= 0 ||
      p.query_row_stride % kChunk != 0 ||
      reinterpret_cast<uintptr_t>(p.query) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.output) % 16 != 0) {
    return false;
  }
  const int64_t tokens_per_tile = kWarps * PagedAttentionMmaWarpRows(p) / group;
  const int64_t tiles = (p.num_tokens + tokens_per_tile - 1) / tokens_per_tile +
                        std::min(p.max_num_seqs, p.num_tokens);
  return tiles <= kCudaAttentionMmaMaxTiles;
}

cudaError_t LaunchPagedAttentionVarlenMmaCuda(const PagedAttentionCudaParams& p,
                                              cudaStream_t stream) {
  if (!PagedAttentionMmaSupports(p)) return cudaErrorInvalidValue;
  if (p.head_dim == 128) {
    return PagedAttentionMmaWarpRows(p) == 32 ? Launch<128, 32>(p, stream)
                                              : Launch<128, 16>(p, stream);
  }
  return PagedAttentionMmaWarpRows(p) == 32 ? Launch<64, 32>(p, stream)
                                            : Launch<64, 16>(p, stream);
}

}  // namespace kernels
}  // namespace pdworker
