// Query tiles of the tensor-core varlen attention kernels
// (paged_attention_mma.cu, paged_attention_wgmma.cu): which request and
// which of its query tiles a CTA handles, the zeros of the rows no request
// owns, and the cp.async loads of Q and of K/V tiles through the block table
// (each kernel passes its shared-memory swizzle). (nvcc only; a textual
// header.)
#ifndef PDWORKER_WORKER_KERNELS_VARLEN_TILE_CUH_
#define PDWORKER_WORKER_KERNELS_VARLEN_TILE_CUH_

#include <cuda_bf16.h>

#include <cstdint>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/mma_tile.cuh"
#include "worker/kernels/paged_attention_cuda.h"

namespace pdworker {
namespace kernels {
namespace cuda {
namespace varlen_tile {

// Which request and which of its query tiles CTA tile index `t` handles:
// tiles are numbered request by request (ceil(q_len / tokens) each).
struct TileAssignment {
  int request = -1;        // -1: no tile (only the padding rows to zero)
  int first_row = 0;       // token row of the tile's first query token
  int num_tokens = 0;      // real query tokens in the tile (<= tokens per tile)
  int first_position = 0;  // absolute position of the first token
};

__device__ __forceinline__ TileAssignment
FindTile(const PagedAttentionCudaParams& p, int num_reqs, int tokens_per_tile,
         int t) {
  // Warp 0 scans the requests 32 at a time with an inclusive warp scan.
  TileAssignment a;
  const int lane = threadIdx.x;
  int before = 0;  // tiles of earlier chunks
  for (int base = 0; base < num_reqs; base += cuda::kWarpSize) {
    const int r = base + lane;
    int begin = 0, end = 0;
    if (r < num_reqs) {
      begin = min(max(p.query_start_loc[r], 0), p.num_tokens);
      end = min(max(p.query_start_loc[r + 1], begin), p.num_tokens);
    }
    const int tiles = (end - begin + tokens_per_tile - 1) / tokens_per_tile;
    int inclusive = tiles;
    for (int offset = 1; offset < cuda::kWarpSize; offset *= 2) {
      const int v = __shfl_up_sync(cuda::kFullMask, inclusive, offset);
      if (lane >= offset) inclusive += v;
    }
    const int exclusive = before + inclusive - tiles;
    const bool mine = tiles > 0 && exclusive <= t && t < exclusive + tiles;
    const unsigned owner = __ballot_sync(cuda::kFullMask, mine);
    if (owner != 0) {
      const int src = __ffs(owner) - 1;
      const int tile_in_req = __shfl_sync(cuda::kFullMask, t - exclusive, src);
      const int req_begin = __shfl_sync(cuda::kFullMask, begin, src);
      const int req_end = __shfl_sync(cuda::kFullMask, end, src);
      a.request = base + src;
      a.first_row = req_begin + tile_in_req * tokens_per_tile;
      a.num_tokens = min(tokens_per_tile, req_end - a.first_row);
      // Query token j of the request sits at seq_len - q_len + j.
      a.first_position = p.seq_lens[a.request] - (req_end - req_begin) +
                         tile_in_req * tokens_per_tile;
      return a;
    }
    before += __shfl_sync(cuda::kFullMask, inclusive, cuda::kWarpSize - 1);
  }
  return a;
}

// Rows no request owns ([0, qsl[0]) and [qsl[num_reqs], num_tokens)) get
// zeros in the G heads from head0 on, spread over the grid.y CTAs of one kv
// head (kThreads threads each, 16-byte stores).
template <int kHeadDim, int kThreads>
__device__ __forceinline__ void ZeroUnownedRows(
    const PagedAttentionCudaParams& p, int num_reqs, int group, int head0) {
  const int owned_begin = min(max(p.query_start_loc[0], 0), p.num_tokens);
  const int owned_end =
      min(max(p.query_start_loc[num_reqs], owned_begin), p.num_tokens);
  const int padding = owned_begin + (p.num_tokens - owned_end);
  const int width = group * kHeadDim;
  for (int idx = blockIdx.y; idx < padding; idx += gridDim.y) {
    const int row = idx < owned_begin ? idx : owned_end + idx - owned_begin;
    __nv_bfloat16* out = p.output +
                         static_cast<int64_t>(row) * p.num_heads * kHeadDim +
                         static_cast<int64_t>(head0) * kHeadDim;
    for (int i = threadIdx.x * 8; i < width; i += kThreads * 8) {
      *reinterpret_cast<uint4*>(out + i) = make_uint4(0, 0, 0, 0);
    }
  }
}

// The start of every CTA of a varlen kernel with tiles of kTileRows query
// rows (kTileRows / G tokens × the G heads from head0): zeros its share of
// the rows no request owns, then finds its tile, heaviest first (the last
// tile index gets the first CTAs), through `shared` (a __shared__ slot). A
// barrier; request -1: the CTA has no tile.
template <int kHeadDim, int kTileRows, int kThreads>
__device__ __forceinline__ TileAssignment
StartTile(const PagedAttentionCudaParams& p, int group, int head0,
          TileAssignment* shared) {
  const int num_reqs = min(max(p.num_reqs[0], 0), p.max_num_seqs);
  ZeroUnownedRows<kHeadDim, kThreads>(p, num_reqs, group, head0);
  const int t = gridDim.y - 1 - blockIdx.y;
  if (threadIdx.x < kWarpSize) {
    const TileAssignment a = FindTile(p, num_reqs, kTileRows / group, t);
    if (threadIdx.x == 0) *shared = a;
  }
  __syncthreads();
  return *shared;
}

// What a query tile reads of its request's keys, and where.
struct TileKeys {
  int kv_len = 0;  // keys [0, kv_len) are visible to some row of the tile
  const int32_t* block_table = nullptr;  // the request's row
  // The kv head's first K / V element of cache slot 0; slots are kv_row
  // elements apart.
  const __nv_bfloat16* k_head = nullptr;
  const __nv_bfloat16* v_head = nullptr;
  int64_t kv_row = 0;
  // A block id outside the cache (a corrupt table: the KV cache manager
  // never writes one): every key tile takes the masked path.
  bool any_bad_block = false;
};

// The keys of tile `a` (a.request >= 0) for kv head `kv_head`. A barrier:
// every thread of the CTA (kThreads) calls it.
template <int kHeadDim, int kThreads>
__device__ __forceinline__ TileKeys FindTileKeys(
    const PagedAttentionCudaParams& p, const TileAssignment& a, int kv_head) {
  TileKeys keys;
  keys.k_head = p.key_cache + kv_head * kHeadDim;
  keys.v_head = p.value_cache + kv_head * kHeadDim;
  keys.kv_row = static_cast<int64_t>(p.num_kv_heads) * kHeadDim;
  const int64_t cap = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
  const int64_t last_position =
      static_cast<int64_t>(a.first_position) + a.num_tokens - 1;
  keys.kv_len = static_cast<int>(min(last_position + 1, cap));
  keys.block_table =
      p.block_tables + static_cast<int64_t>(a.request) * p.max_blocks_per_seq;
  int bad_block = 0;
  if (keys.kv_len > 0) {
    const int blocks = (keys.kv_len + p.block_size - 1) / p.block_size;
    for (int b = threadIdx.x; b < blocks; b += kThreads) {
      const int32_t id = keys.block_table[b];
      bad_block |= id < 0 || id >= p.num_blocks;
    }
  }
  keys.any_bad_block = __syncthreads_or(bad_block) != 0;
  return keys;
}

// cp.async of the tile's query rows into q_tile: row r = token r / G, head
// r % G of the group from head0; rows from num_rows on are zero-filled.
// offset(row, chunk): the element offset of a 16-byte chunk in q_tile (the
// kernel's swizzle).
template <int kHeadDim, int kTileRows, int kThreads, typename Offset>
__device__ __forceinline__ void LoadQueryTile(
    const PagedAttentionCudaParams& p, const TileAssignment& a, int group,
    int head0, int num_rows, __nv_bfloat16* q_tile, const Offset& offset) {
  constexpr int kChunks = kHeadDim / 8;
  for (int i = threadIdx.x; i < kTileRows * kChunks; i += kThreads) {
    const int row = i / kChunks;
    const int chunk = i % kChunks;
    const bool real = row < num_rows;
    const __nv_bfloat16* src =
        real ? p.query +
                   static_cast<int64_t>(a.first_row + row / group) *
                       p.query_row_stride +
                   static_cast<int64_t>(head0 + row % group) * kHeadDim +
                   chunk * 8
             : p.query;
    mma_tile::CopyAsync16(mma_tile::SharedAddress(q_tile + offset(row, chunk)),
                          src, real ? 16 : 0);
  }
}

// Which of a key tile's rows LoadKvTile copies.
enum class KvRows {
  kKeysAndValues,  // K, V and key_ok
  kKeys,           // K and key_ok
  kValues,         // V
};

// cp.async of the rows of key tile `tile` (positions tile · kTileKeys on)
// through the block table: K into k_dst, V into v_dst (kRows says which;
// the other may be null), and key_ok[key] records which keys are real
// (below kv_len, in a valid block); the others are zero-filled.
// offset(key, chunk): as LoadQueryTile.
template <int kHeadDim, int kTileKeys, int kThreads,
          KvRows kRows = KvRows::kKeysAndValues, typename Offset>
__device__ __forceinline__ void LoadKvTile(const PagedAttentionCudaParams& p,
                                           const TileKeys& keys, int tile,
                                           __nv_bfloat16* k_dst,
                                           __nv_bfloat16* v_dst, int8_t* key_ok,
                                           const Offset& offset) {
  constexpr int kChunks = kHeadDim / 8;
  for (int i = threadIdx.x; i < kTileKeys * kChunks; i += kThreads) {
    const int key = i / kChunks;
    const int chunk = i % kChunks;
    const int position = tile * kTileKeys + key;
    int64_t at = -1;
    if (position < keys.kv_len) {
      const int32_t block = keys.block_table[position / p.block_size];
      if (block >= 0 && block < p.num_blocks) {
        at = (static_cast<int64_t>(block) * p.block_size +
              position % p.block_size) *
             keys.kv_row;
      }
    }
    const int bytes = at >= 0 ? 16 : 0;
    const int64_t from = (at >= 0 ? at : 0) + chunk * 8;
    const int dst = offset(key, chunk);
    if (kRows != KvRows::kValues) {
      mma_tile::CopyAsync16(mma_tile::SharedAddress(k_dst + dst),
                            keys.k_head + from, bytes);
    }
    if (kRows != KvRows::kKeys) {
      mma_tile::CopyAsync16(mma_tile::SharedAddress(v_dst + dst),
                            keys.v_head + from, bytes);
    }
    if (kRows != KvRows::kValues && chunk == 0) key_ok[key] = at >= 0;
  }
}

}  // namespace varlen_tile
}  // namespace cuda
}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_VARLEN_TILE_CUH_
