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
// warpgroup w owns rows [64w, 64w + 64). Key tiles of kTileKeys positions
// are gathered by cp.async through the block table into 128-byte-swizzled
// panels (wgmma.cuh), K and V double-buffered, and the online softmax runs
// on the accumulator fragments (mma_tile::SoftmaxTile, the mma.sync
// kernel's). Two schedules per warpgroup (WgmmaSchedule):
//  - serial: S on the tensor cores, wait, softmax, P·V, wait; K/V of the
//    next tile load meanwhile. Other warpgroups on the SM fill the gaps.
//  - overlapped (FlashAttention-3's intra-warpgroup overlap): K runs one
//    tile ahead of V; S of tile t + 1 and P·V of tile t are issued
//    together, and the softmax of t + 1 runs while P·V of t is still on the
//    tensor cores; P of t + 1 is packed into the A registers only after
//    P·V of t is done (ptxas serializes every wgmma of a kernel that writes
//    a wgmma's input registers while one is in flight: C7513).
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
#include <type_traits>

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
using cuda::varlen_tile::KvRows;
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

template <int kHeadDim, int kTileKeys, bool kOverlap>
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
  // Rows of key tile `tile` into shared memory: K (and key_ok) into K
  // stage `k_stage`, V into V stage `v_stage` (kRows: which).
  auto load_kv = [&](auto rows, int tile, int k_stage, int v_stage) {
    LoadKvTile<kHeadDim, kTileKeys, kThreads, decltype(rows)::value>(
        p, keys, tile, k_tiles + k_stage * kTileKeys * kHeadDim,
        v_tiles + v_stage * kTileKeys * kHeadDim, key_ok[k_stage],
        [](int key, int chunk) {
          return PanelSwizzled<kTileKeys>(key, chunk);
        });
  };
  using Both = std::integral_constant<KvRows, KvRows::kKeysAndValues>;
  using Keys = std::integral_constant<KvRows, KvRows::kKeys>;
  using Values = std::integral_constant<KvRows, KvRows::kValues>;
  // Every thread's copies done and visible to wgmma, then a CTA barrier.
  auto wait_loads = [] {
    WaitCopies<0>();
    cuda::wgmma::FenceSharedForAsyncProxy();
    __syncthreads();
  };

  const int num_key_tiles =
      kv_len > 0 ? (kv_len + kTileKeys - 1) / kTileKeys : 0;

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
  auto fence_o = [&] {
#pragma unroll
    for (int panel = 0; panel < kPanels; ++panel) {
      cuda::wgmma::FenceOperands(o[panel]);
    }
  };

  // Issues S = Q·Kᵀ for the K tile in stage `k_stage`: 64 rows × kTileKeys
  // keys per warpgroup, 16 dims per wgmma (32 bytes into the panel's
  // 128-byte rows). The caller commits.
  auto issue_qk = [&](float(&s)[kKeyTiles][4], int k_stage) {
    const uint32_t k_address =
        SharedAddress(k_tiles + k_stage * kTileKeys * kHeadDim);
#pragma unroll
    for (int ks = 0; ks < kDimSteps; ++ks) {
      const uint32_t panel = ks / kStepsPerPanel;
      const uint32_t inner = (ks % kStepsPerPanel) * 32;
      cuda::wgmma::MmaSs(
          s,
          cuda::wgmma::Descriptor(q_address + panel * kQPanelBytes + inner, 16),
          cuda::wgmma::Descriptor(k_address + panel * kKvPanelBytes + inner,
                                  16),
          ks > 0 ? 1 : 0);
    }
  };
  // Issues O += P·V for the V tile in stage `v_stage`: P as bf16 A
  // fragments in registers (16 keys each), V transposed from shared memory,
  // 16 keys (2048 bytes) per wgmma. The caller commits.
  auto issue_pv = [&](const uint32_t(&pa)[kKeySteps][4], int v_stage) {
    const uint32_t v_address =
        SharedAddress(v_tiles + v_stage * kTileKeys * kHeadDim);
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
  };
  // Scale, mask, online softmax of key tile `tile` (the mma.sync kernel's):
  // s becomes its probabilities; `rescale`: the factor O takes.
  auto scale_exp = [&](float(&s)[kKeyTiles][4], int tile, int k_stage,
                       float(&rescale)[2]) {
    const int key0 = tile * kTileKeys;
    const bool needs_mask = any_bad_block ||
                            key0 + kTileKeys - 1 > a.first_position ||
                            key0 + kTileKeys > kv_len;
    SoftmaxTile(s, row_max, row_sum, rescale, scale_log2, needs_mask,
                key_ok[k_stage], key0, position, tq);
  };
  // The probabilities as bf16 P fragments (16 keys each).
  auto pack = [](const float(&s)[kKeyTiles][4], uint32_t(&pa)[kKeySteps][4]) {
#pragma unroll
    for (int kk = 0; kk < kKeySteps; ++kk) PackProbabilities(s, kk, pa[kk]);
  };
  auto rescale_o = [&](const float(&rescale)[2]) {
#pragma unroll
    for (int panel = 0; panel < kPanels; ++panel) {
      RescaleRows(o[panel], rescale);
    }
  };

  float s[kKeyTiles][4];
  uint32_t pa[kKeySteps][4];
  float rescale[2];
  if constexpr (!kOverlap) {
    // K and V of tile t + 1 load while tile t computes: S, wait, softmax,
    // P·V, wait.
    if (num_key_tiles > 0) load_kv(Both(), 0, 0, 0);
    CommitCopies();  // Q (+ key tile 0)
    for (int tile = 0; tile < num_key_tiles; ++tile) {
      const int stage = tile & 1;
      if (tile + 1 < num_key_tiles) {
        load_kv(Both(), tile + 1, stage ^ 1, stage ^ 1);
      }
      CommitCopies();
      WaitCopies<1>();  // everything but the group just committed
      cuda::wgmma::FenceSharedForAsyncProxy();
      __syncthreads();
      if (group_has_rows) {
        float s[kKeyTiles][4];
        uint32_t pa[kKeySteps][4];
        float rescale[2];
        cuda::wgmma::Fence();
        issue_qk(s, stage);
        cuda::wgmma::Commit();
        cuda::wgmma::Wait<0>();
        cuda::wgmma::FenceOperands(s);
        scale_exp(s, tile, stage, rescale);
        pack(s, pa);
        rescale_o(rescale);
        fence_o();
        cuda::wgmma::Fence();
        issue_pv(pa, stage);
        cuda::wgmma::Commit();
        cuda::wgmma::Wait<0>();
        fence_o();
      }
      __syncthreads();  // the next iteration's loads overwrite this stage
    }
  } else {
    // FlashAttention-3's intra-warpgroup overlap: K runs one tile ahead of
    // V. In iteration t the tensor cores take S of tile t + 1 and then P·V
    // of tile t, and the softmax of tile t + 1 runs while P·V of tile t is
    // still in flight; O takes tile t + 1's rescale once P·V is done. Tile
    // t's K (and key_ok) sit in K stage t % 2, its V in V stage t % 2;
    // iteration t loads K of t + 2 and V of t + 1 into the stages tile
    // t - 1 freed.
    if (num_key_tiles > 0) load_kv(Keys(), 0, 0, 0);
    CommitCopies();  // Q + K of tile 0
    if (num_key_tiles > 1) load_kv(Keys(), 1, 1, 0);
    if (num_key_tiles > 0) load_kv(Values(), 0, 0, 0);
    CommitCopies();  // K of tile 1, V of tile 0
    WaitCopies<1>();
    cuda::wgmma::FenceSharedForAsyncProxy();
    __syncthreads();
    if (group_has_rows && num_key_tiles > 0) {
      cuda::wgmma::Fence();
      issue_qk(s, 0);
      cuda::wgmma::Commit();
      cuda::wgmma::Wait<0>();
      cuda::wgmma::FenceOperands(s);
      scale_exp(s, 0, 0, rescale);
      pack(s, pa);
      rescale_o(rescale);
    }
    // Tiles with a successor, then the last one (P·V alone): no branch
    // around a wgmma inside the loop, which ptxas would serialize.
    for (int tile = 0; tile + 1 < num_key_tiles; ++tile) {
      const int stage = tile & 1;
      // K of tile + 1, V of tile; every warpgroup is done with tile - 1's V
      // and tile's K (its S ran in the previous iteration).
      wait_loads();
      if (tile + 2 < num_key_tiles) load_kv(Keys(), tile + 2, stage, 0);
      load_kv(Values(), tile + 1, 0, stage ^ 1);
      CommitCopies();
      if (group_has_rows) {
        fence_o();
        cuda::wgmma::Fence();
        issue_qk(s, stage ^ 1);
        cuda::wgmma::Commit();
        issue_pv(pa, stage);
        cuda::wgmma::Commit();
        cuda::wgmma::Wait<1>();  // S of tile + 1 (P·V may still run)
        cuda::wgmma::FenceOperands(s);
        scale_exp(s, tile + 1, stage ^ 1, rescale);
        cuda::wgmma::Wait<0>();
        fence_o();
        rescale_o(rescale);
        // P of tile + 1 into the A registers once P·V of tile no longer
        // reads them (ptxas serializes every wgmma if registers a wgmma
        // reads are written while one is in flight).
        pack(s, pa);
      }
    }
    if (num_key_tiles > 0) {
      wait_loads();  // V of the last tile
      if (group_has_rows) {
        fence_o();
        cuda::wgmma::Fence();
        issue_pv(pa, (num_key_tiles - 1) & 1);
        cuda::wgmma::Commit();
        cuda::wgmma::Wait<0>();
        fence_o();
      }
    }
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

template <int kHeadDim, int kTileKeys, bool kOverlap>
cudaError_t Launch(const PagedAttentionCudaParams& p, cudaStream_t stream) {
  constexpr int kBytes = TileSizes<kHeadDim, kTileKeys>::kSharedBytes;
  // More than 48 KB of dynamic shared memory must be opted into, once per
  // kernel (not a stream operation: allowed while a graph is captured).
  static const cudaError_t attribute = cudaFuncSetAttribute(
      WgmmaVarlenAttentionKernel<kHeadDim, kTileKeys, kOverlap>,
      cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (attribute != cudaSuccess) return attribute;
  const int tokens_per_tile = kTileRows / (p.num_heads / p.num_kv_heads);
  const int tiles = (p.num_tokens + tokens_per_tile - 1) / tokens_per_tile +
                    std::min(p.max_num_seqs, p.num_tokens);
  const dim3 grid(p.num_kv_heads, tiles);
  WgmmaVarlenAttentionKernel<kHeadDim, kTileKeys, kOverlap>
      <<<grid, kThreads, kBytes, stream>>>(p);
  return cudaGetLastError();
}

template <int kHeadDim, int kTileKeys>
cudaError_t LaunchSchedule(const PagedAttentionCudaParams& p,
                           cudaStream_t stream) {
  return PagedAttentionWgmmaOverlaps(p)
             ? Launch<kHeadDim, kTileKeys, true>(p, stream)
             : Launch<kHeadDim, kTileKeys, false>(p, stream);
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

bool PagedAttentionWgmmaOverlaps(const PagedAttentionCudaParams& p) {
  return p.wgmma_overlap < 0 ? kCudaAttentionWgmmaOverlapDefault
                             : p.wgmma_overlap != 0;
}

int PagedAttentionWgmmaTileKeys(const PagedAttentionCudaParams& p) {
  if (p.wgmma_tile_keys != 0) return p.wgmma_tile_keys;
  return p.head_dim == 64 ? kCudaAttentionWgmmaTileKeysHd64
                          : kCudaAttentionWgmmaTileKeysHd128;
}

bool PagedAttentionWgmmaSupports(const PagedAttentionCudaParams& p) {
  if (p.softcap > 0.0f || p.sliding_window > 0) return false;  // CUDA cores
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
    return wide ? LaunchSchedule<128, 128>(p, stream)
                : LaunchSchedule<128, 64>(p, stream);
  }
  return wide ? LaunchSchedule<64, 128>(p, stream)
              : LaunchSchedule<64, 64>(p, stream);
}

}  // namespace kernels
}  // namespace pdworker
