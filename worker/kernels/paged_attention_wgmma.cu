// Varlen paged attention on Hopper's warpgroup MMA (wgmma, sm_90a), for
// head_dim 64 and 128: the FlashAttention-2 algorithm of
// paged_attention_mma.cu with its matrix products moved from mma.sync to
// wgmma, the step FlashAttention-3 builds on. Same tiles, masking, grid and
// outputs as that kernel; what changes is where the operands come from:
//  - S = Q·Kᵀ reads Q and K straight from shared memory (no ldmatrix into
//    registers), one wgmma per 16 head dims for a warpgroup's 64 rows ×
//    all kTileKeys keys, so each K tile is read once per warpgroup instead
//    of once per warp;
//  - O += P·V takes P from registers (the S accumulator rounded to bf16, in
//    place) and V from shared memory, transposed by the hardware (no
//    ldmatrix.trans).
// The mma.sync kernel is bound by those shared-memory reads and the
// softmax (bench/RESULTS.md, issue 22); this one leaves the softmax.
//
// A CTA (2 warpgroups, 256 threads) owns one query tile of 128 rows (128 /
// G query tokens × the G heads of one kv head's group) of one request;
// warpgroup w owns rows [64w, 64w + 64). Per key tile of kTileKeys
// positions: cp.async gathers K and V through the block table into
// 128-byte-swizzled panels (wgmma.cuh), double-buffered; S on the tensor
// cores; the online softmax on the accumulator fragments
// (mma_tile::SoftmaxTile, the mma.sync kernel's); O on the tensor cores.
// No atomics and a fixed key order: deterministic, graph replay gives the
// eager bits. Grids come from the launch shape only.
//
// Not measured yet: written without a GPU (2026-11-27); the tests of
// paged_attention_mma_cuda_test cover it on sm_90a devices, and
// prefill_attention_bench times it beside the mma.sync kernel. kAuto does
// not pick it until a GPU run shows it correct and faster.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/mma_tile.cuh"
#include "worker/kernels/paged_attention_cuda.h"
#include "worker/kernels/varlen_tile.cuh"
#include "worker/kernels/wgmma.cuh"

namespace pdworker {
namespace kernels {
namespace {

using cuda::mma_tile::CommitCopies;
using cuda::mma_tile::kChunk;
using cuda::mma_tile::PackBf16x2;
using cuda::mma_tile::PackProbabilities;
using cuda::mma_tile::RescaleRows;
using cuda::mma_tile::SharedAddress;
using cuda::mma_tile::SoftmaxTile;
using cuda::mma_tile::WaitCopies;
using cuda::varlen_tile::FindTileKeys;
using cuda::varlen_tile::LoadKvTile;
using cuda::varlen_tile::LoadQueryTile;
using cuda::varlen_tile::StartTile;
using cuda::varlen_tile::TileAssignment;
using cuda::varlen_tile::TileKeys;
using cuda::wgmma::kPanelBytes;
using cuda::wgmma::kWarpGroupThreads;

constexpr int kWarpGroups = 2;
constexpr int kThreads = kWarpGroups * kWarpGroupThreads;
constexpr int kGroupRows = 64;                       // rows per warpgroup
constexpr int kTileRows = kWarpGroups * kGroupRows;  // query rows per CTA
constexpr float kLog2e = 1.4426950408889634f;

template <int kHeadDim, int kTileKeys>
struct TileSizes {
  static constexpr int kPanels = kHeadDim / 64;  // 64-dim panels per row
  static constexpr int kQBytes = kTileRows * kHeadDim * 2;
  static constexpr int kKvBytes = kTileKeys * kHeadDim * 2;  // one stage
  // Q, K and V of two stages, and the slack that aligns them to 1024 bytes
  // (the swizzle's period).
  static constexpr int kSharedBytes = kQBytes + 4 * kKvBytes + 1024;
};

// Element offset of 16-byte chunk `chunk` of row `row` in a matrix of kRows
// rows stored as 64-column panels with the 128-byte swizzle (wgmma.cuh).
template <int kRows>
__device__ __forceinline__ int PanelSwizzled(int row, int chunk) {
  return (chunk >> 3) * kRows * 64 + row * 64 +
         (((chunk & 7) ^ (row & 7)) << 3);
}

template <int kHeadDim, int kTileKeys>
__global__ void __launch_bounds__(kThreads)
    WgmmaVarlenAttentionKernel(PagedAttentionCudaParams p) {
  cuda::AllowDependentLaunch();
  using Sizes = TileSizes<kHeadDim, kTileKeys>;
  constexpr int kPanels = Sizes::kPanels;
  constexpr int kKeyTiles = kTileKeys / 8;   // n8 tiles of S
  constexpr int kKeySteps = kTileKeys / 16;  // k16 steps of P·V
  constexpr int kDimSteps = kHeadDim / 16;   // k16 steps of Q·Kᵀ
  constexpr int kStepsPerPanel = 64 / 16;
  constexpr uint32_t kQPanelBytes = kTileRows * kPanelBytes;
  constexpr uint32_t kKvPanelBytes = kTileKeys * kPanelBytes;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_address = SharedAddress(smem_raw);
  __nv_bfloat16* q_tile = reinterpret_cast<__nv_bfloat16*>(
      smem_raw + ((1024 - raw_address % 1024) % 1024));
  __nv_bfloat16* k_tiles = q_tile + kTileRows * kHeadDim;       // 2 stages
  __nv_bfloat16* v_tiles = k_tiles + 2 * kTileKeys * kHeadDim;  // 2 stages
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
      [](int row, int chunk) { return PanelSwizzled<kTileRows>(row, chunk); });
  // K and V rows of key tile `tile` into stage `stage`.
  auto load_kv = [&](int tile, int stage) {
    LoadKvTile<kHeadDim, kTileKeys, kThreads>(
        p, keys, tile, k_tiles + stage * kTileKeys * kHeadDim,
        v_tiles + stage * kTileKeys * kHeadDim, key_ok[stage],
        [](int key, int chunk) {
          return PanelSwizzled<kTileKeys>(key, chunk);
        });
  };

  const int num_key_tiles =
      kv_len > 0 ? (kv_len + kTileKeys - 1) / kTileKeys : 0;
  if (num_key_tiles > 0) load_kv(0, 0);
  CommitCopies();  // group 0: Q (+ key tile 0)

  const int warp_group = tid / kWarpGroupThreads;
  const int warp = (tid % kWarpGroupThreads) / cuda::kWarpSize;  // in group
  const int lane = tid % cuda::kWarpSize;
  const int g = lane / 4;   // fragment row within 8
  const int tq = lane % 4;  // fragment column pair
  // This thread's rows g and g + 8 of its warp's 16, and their positions.
  const int row0 = warp_group * kGroupRows + warp * 16 + g;
  const int position[2] = {a.first_position + row0 / group,
                           a.first_position + (row0 + 8) / group};
  const float scale_log2 = p.scale * kLog2e;
  // wgmma is issued by a whole warpgroup: a warpgroup whose rows are all
  // past the tile skips the math (not the loads or barriers) as a unit.
  const bool group_has_rows = warp_group * kGroupRows < num_rows;

  const uint32_t q_address =
      SharedAddress(q_tile) + warp_group * kGroupRows * kPanelBytes;
  float o[kPanels][8][4];  // this warpgroup's O, one n64 tile per panel
  float row_max[2] = {-INFINITY, -INFINITY};  // of scaled (log2) scores
  float row_sum[2] = {0.0f, 0.0f};            // this thread's share
#pragma unroll
  for (int panel = 0; panel < kPanels; ++panel) {
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[panel][n][e] = 0.0f;
    }
  }

  for (int tile = 0; tile < num_key_tiles; ++tile) {
    const int stage = tile & 1;
    if (tile + 1 < num_key_tiles) load_kv(tile + 1, stage ^ 1);
    CommitCopies();
    WaitCopies<1>();  // everything but the group just committed
    cuda::wgmma::FenceSharedForAsyncProxy();
    __syncthreads();

    if (group_has_rows) {
      const uint32_t k_address =
          SharedAddress(k_tiles + stage * kTileKeys * kHeadDim);
      const uint32_t v_address =
          SharedAddress(v_tiles + stage * kTileKeys * kHeadDim);

      // (b) S = Q·Kᵀ: 64 rows × kTileKeys keys per warpgroup, 16 dims per
      // wgmma (32 bytes into the panel's 128-byte rows).
      float s[kKeyTiles][4];
      cuda::wgmma::Fence();
#pragma unroll
      for (int ks = 0; ks < kDimSteps; ++ks) {
        const uint32_t panel = ks / kStepsPerPanel;
        const uint32_t inner = (ks % kStepsPerPanel) * 32;
        cuda::wgmma::MmaSs(s,
                           cuda::wgmma::Descriptor(
                               q_address + panel * kQPanelBytes + inner, 16),
                           cuda::wgmma::Descriptor(
                               k_address + panel * kKvPanelBytes + inner, 16),
                           ks > 0 ? 1 : 0);
      }
      cuda::wgmma::Commit();
      cuda::wgmma::Wait<0>();
      cuda::wgmma::FenceOperands(s);

      // (c) Scale, mask, online softmax (the mma.sync kernel's).
      const int key0 = tile * kTileKeys;
      const bool needs_mask = any_bad_block ||
                              key0 + kTileKeys - 1 > a.first_position ||
                              key0 + kTileKeys > kv_len;
      float rescale[2];
      SoftmaxTile(s, row_max, row_sum, rescale, scale_log2, needs_mask,
                  key_ok[stage], key0, position, tq);
#pragma unroll
      for (int panel = 0; panel < kPanels; ++panel) {
        RescaleRows(o[panel], rescale);
      }

      // (d) O += P·V: P as bf16 A fragments in registers (16 keys each),
      // V transposed from shared memory, 16 keys (2048 bytes) per wgmma.
      uint32_t pa[kKeySteps][4];
#pragma unroll
      for (int kk = 0; kk < kKeySteps; ++kk) PackProbabilities(s, kk, pa[kk]);
#pragma unroll
      for (int panel = 0; panel < kPanels; ++panel) {
        cuda::wgmma::FenceOperands(o[panel]);
      }
      cuda::wgmma::Fence();
#pragma unroll
      for (int kk = 0; kk < kKeySteps; ++kk) {
#pragma unroll
        for (int panel = 0; panel < kPanels; ++panel) {
          cuda::wgmma::MmaRsTransB(
              o[panel], pa[kk],
              cuda::wgmma::Descriptor(
                  v_address + panel * kKvPanelBytes + kk * 16 * kPanelBytes,
                  kKvPanelBytes),
              1);
        }
      }
      cuda::wgmma::Commit();
      cuda::wgmma::Wait<0>();
#pragma unroll
      for (int panel = 0; panel < kPanels; ++panel) {
        cuda::wgmma::FenceOperands(o[panel]);
      }
    }
    __syncthreads();  // the next iteration's loads overwrite this stage
  }
  WaitCopies<0>();  // nothing may be in flight when the CTA exits

  // Epilogue: the row sums over the quad, O / l, bf16 stores. A row that saw
  // no key is written as zeros.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = row_sum[h];
    sum += __shfl_xor_sync(cuda::kFullMask, sum, 1);
    sum += __shfl_xor_sync(cuda::kFullMask, sum, 2);
    const int row = row0 + 8 * h;
    if (row >= num_rows) continue;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    __nv_bfloat16* out =
        p.output +
        (static_cast<int64_t>(a.first_row + row / group) * p.num_heads + head0 +
         row % group) *
            kHeadDim;
#pragma unroll
    for (int panel = 0; panel < kPanels; ++panel) {
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        *reinterpret_cast<uint32_t*>(out + panel * 64 + 8 * n + 2 * tq) =
            PackBf16x2(o[panel][n][2 * h] * inv, o[panel][n][2 * h + 1] * inv);
      }
    }
  }
}

template <int kHeadDim, int kTileKeys>
cudaError_t Launch(const PagedAttentionCudaParams& p, cudaStream_t stream) {
  constexpr int kBytes = TileSizes<kHeadDim, kTileKeys>::kSharedBytes;
  // More than 48 KB of dynamic shared memory must be opted into, once per
  // kernel (not a stream operation: allowed while a graph is captured).
  static const cudaError_t attribute =
      cudaFuncSetAttribute(WgmmaVarlenAttentionKernel<kHeadDim, kTileKeys>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (attribute != cudaSuccess) return attribute;
  const int tokens_per_tile = kTileRows / (p.num_heads / p.num_kv_heads);
  const int tiles = (p.num_tokens + tokens_per_tile - 1) / tokens_per_tile +
                    std::min(p.max_num_seqs, p.num_tokens);
  const dim3 grid(p.num_kv_heads, tiles);
  WgmmaVarlenAttentionKernel<kHeadDim, kTileKeys>
      <<<grid, kThreads, kBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

bool CudaCurrentDeviceHasWgmma() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                             device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor,
                             device) != cudaSuccess) {
    return false;
  }
  return major == 9 && minor == 0;
}

int PagedAttentionWgmmaTileKeys(const PagedAttentionCudaParams& p) {
  if (p.wgmma_tile_keys != 0) return p.wgmma_tile_keys;
  return p.head_dim == 64 ? kCudaAttentionWgmmaTileKeysHd64
                          : kCudaAttentionWgmmaTileKeysHd128;
}

bool PagedAttentionWgmmaSupports(const PagedAttentionCudaParams& p) {
  const int group = p.num_kv_heads > 0 ? p.num_heads / p.num_kv_heads : 0;
  const int tile_keys = PagedAttentionWgmmaTileKeys(p);
  if ((p.head_dim != 64 && p.head_dim != 128) || group < 1 ||
      group > kCudaAttentionMmaMaxGroup ||
      (tile_keys != 64 && tile_keys != 128) || p.num_tokens <= 0 ||
      p.query_row_stride % kChunk != 0 ||
      reinterpret_cast<uintptr_t>(p.query) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.output) % 16 != 0 ||
      !CudaCurrentDeviceHasWgmma()) {
    return false;
  }
  const int64_t tokens_per_tile = kTileRows / group;
  const int64_t tiles = (p.num_tokens + tokens_per_tile - 1) / tokens_per_tile +
                        std::min(p.max_num_seqs, p.num_tokens);
  return tiles <= kCudaAttentionMmaMaxTiles;
}

cudaError_t LaunchPagedAttentionVarlenWgmmaCuda(
    const PagedAttentionCudaParams& p, cudaStream_t stream) {
  if (!PagedAttentionWgmmaSupports(p)) return cudaErrorInvalidValue;
  const bool wide = PagedAttentionWgmmaTileKeys(p) == 128;
  if (p.head_dim == 128) {
    return wide ? Launch<128, 128>(p, stream) : Launch<128, 64>(p, stream);
  }
  return wide ? Launch<64, 128>(p, stream) : Launch<64, 64>(p, stream);
}

}  // namespace kernels
}  // namespace pdworker
