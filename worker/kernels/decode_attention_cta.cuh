// CTA bodies of the uniform-decode attention's split-K kernels, shared by
// their kernels (paged_attention_decode_mma.cu, paged_attention.cu) and by
// the decode megakernel (decode_megakernel.cu), so each output bit is the
// same operation sequence in both. The file comment of
// paged_attention_decode_mma.cu describes the tensor-core split, the one of
// paged_attention.cu the workspace and the reduce. nvcc only.
#ifndef PDWORKER_WORKER_KERNELS_DECODE_ATTENTION_CTA_CUH_
#define PDWORKER_WORKER_KERNELS_DECODE_ATTENTION_CTA_CUH_

#include <cmath>
#include <cstdint>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/mma_tile.cuh"
#include "worker/kernels/paged_attention_cuda.h"

namespace pdworker {
namespace kernels {
namespace decode_cta {

using cuda::mma_tile::CommitCopies;
using cuda::mma_tile::CopyAsync16;
using cuda::mma_tile::kChunk;
using cuda::mma_tile::LoadMatrixX4;
using cuda::mma_tile::LoadMatrixX4Trans;
using cuda::mma_tile::PackBf16x2;
using cuda::mma_tile::SharedAddress;
using cuda::mma_tile::Swizzled;
using cuda::mma_tile::WaitCopies;

constexpr int kThreads = 128;
constexpr int kWarps = 4;
constexpr int kRows = 16;               // one m16 tile of query rows
constexpr int kTileKeys = 16 * kWarps;  // positions per K/V tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -INFINITY;

// The barrier of the 128 threads running one split CTA: 0 is the whole
// CTA's (__syncthreads; the split kernel), 1.. a named barrier of 128
// threads (bar.sync; the megakernel's two halves, warps 0-3 and 4-7).
struct CtaSync {
  int barrier;
  __device__ __forceinline__ void operator()() const {
    if (barrier == 0) {
      __syncthreads();
    } else {
      asm volatile("bar.sync %0, %1;" ::"r"(barrier), "n"(kThreads) : "memory");
    }
  }
};

template <int kHeadDim>
struct DecodeTile {
  static constexpr int kChunksPerRow = kHeadDim / kChunk;
  static constexpr int kQElems = kRows * kHeadDim;
  static constexpr int kKvElems = kTileKeys * kHeadDim;  // one K or V stage
  // Q, then K and V of two stages (after the key loop they hold the warps'
  // fp32 outputs [kWarps][kRows][kHeadDim], half their bytes), then the
  // tile's key validity [2][kTileKeys] int8 and the warps' row maxima and
  // sums [kWarps][kRows] fp32 each.
  static constexpr int kKeyOkOffset = (kQElems + 4 * kKvElems) * 2;
  static constexpr int kWarpMaxOffset = kKeyOkOffset + 2 * kTileKeys;
  static constexpr int kWarpSumOffset = kWarpMaxOffset + kWarps * kRows * 4;
  static constexpr int kSharedBytes = kWarpSumOffset + kWarps * kRows * 4;
  static_assert(kWarps * kRows * kHeadDim * 4 <= 4 * kKvElems * 2,
                "the warps' outputs fit in the K/V stages");
};

// One (request, kv head, split) of the split kernel's grid, by the 128
// threads tid = 0..127 of a CTA or of half of one (the decode megakernel
// runs two at once): `sync` is their barrier, `smem` their
// DecodeTile<kHeadDim>::kSharedBytes of shared memory (128-byte aligned).
// Returns early (a padding request, a split past the context) only where
// all of its threads do.
template <int kHeadDim>
__device__ __forceinline__ void MmaDecodeSplitCta(
    const PagedAttentionCudaParams& p, int request, int kv_head, int split,
    int tid, unsigned char* smem, CtaSync sync) {
  using Tile = DecodeTile<kHeadDim>;
  constexpr int kChunks = Tile::kChunksPerRow;
  constexpr int kDimTiles = kHeadDim / 8;   // n8 tiles of O
  constexpr int kDimSteps = kHeadDim / 16;  // k16 steps of Q·Kᵀ
  __nv_bfloat16* q_tile = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* k_tiles = q_tile + Tile::kQElems;        // 2 stages
  __nv_bfloat16* v_tiles = k_tiles + 2 * Tile::kKvElems;  // 2 stages
  auto key_ok =
      reinterpret_cast<int8_t(*)[kTileKeys]>(smem + Tile::kKeyOkOffset);
  auto warp_max =
      reinterpret_cast<float(*)[kRows]>(smem + Tile::kWarpMaxOffset);
  auto warp_sum =
      reinterpret_cast<float(*)[kRows]>(smem + Tile::kWarpSumOffset);
  const int k = p.uniform_query_len;
  const int group = p.num_heads / p.num_kv_heads;
  const int num_rows = group * k;  // row = head_in_group · k + token

  // seq_len 0: a padding request (the reduce kernel writes its zeros).
  const int seq_len = p.seq_lens[request];
  if (seq_len <= 0) return;
  const int context_len = static_cast<int>(
      min(static_cast<int64_t>(seq_len),
          static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size));
  const int span = CudaDecodeSplitSpan(context_len, p.num_splits);
  const int key_begin = split * span;
  if (key_begin >= context_len) return;  // the reduce kernel reads no more
  const int key_end = min(key_begin + span, context_len);
  const int32_t* block_table =
      p.block_tables + static_cast<int64_t>(request) * p.max_blocks_per_seq;
  const int64_t kv_row = static_cast<int64_t>(p.num_kv_heads) * kHeadDim;
  const __nv_bfloat16* k_base = p.key_cache + kv_head * kHeadDim;
  const __nv_bfloat16* v_base = p.value_cache + kv_head * kHeadDim;
  const int head0 = kv_head * group;

  // Q tile; rows past num_rows are zeros.
  for (int i = tid; i < kRows * kChunks; i += kThreads) {
    const int row = i / kChunks;
    const int chunk = i % kChunks;
    const bool real = row < num_rows;
    const __nv_bfloat16* src =
        real ? p.query +
                   static_cast<int64_t>(request * k + row % k) *
                       p.query_row_stride +
                   static_cast<int64_t>(head0 + row / k) * kHeadDim +
                   chunk * kChunk
             : p.query;
    CopyAsync16(SharedAddress(q_tile + Swizzled<kHeadDim>(row, chunk)), src,
                real ? 16 : 0);
  }

  // K and V of positions key_begin + tile · 64 + [0, 64) into `stage`.
  auto load_kv = [&](int tile, int stage) {
    __nv_bfloat16* k_dst = k_tiles + stage * Tile::kKvElems;
    __nv_bfloat16* v_dst = v_tiles + stage * Tile::kKvElems;
    for (int i = tid; i < kTileKeys * kChunks; i += kThreads) {
      const int key = i / kChunks;
      const int chunk = i % kChunks;
      const int position = key_begin + tile * kTileKeys + key;
      int64_t offset = -1;
      if (position < key_end) {
        const int32_t block = block_table[position / p.block_size];
        if (block >= 0 && block < p.num_blocks) {
          offset = (static_cast<int64_t>(block) * p.block_size +
                    position % p.block_size) *
                   kv_row;
        }
      }
      const int bytes = offset >= 0 ? 16 : 0;
      const int64_t at = (offset >= 0 ? offset : 0) + chunk * kChunk;
      const int dst = Swizzled<kHeadDim>(key, chunk);
      CopyAsync16(SharedAddress(k_dst + dst), k_base + at, bytes);
      CopyAsync16(SharedAddress(v_dst + dst), v_base + at, bytes);
      if (chunk == 0) key_ok[stage][key] = offset >= 0;
    }
  };

  const int num_tiles = (key_end - key_begin + kTileKeys - 1) / kTileKeys;
  load_kv(0, 0);
  CommitCopies();  // group 0: Q and key tile 0

  const int warp = tid / cuda::kWarpSize;
  const int lane = tid % cuda::kWarpSize;
  const int g = lane / 4;   // fragment row within 8
  const int tq = lane % 4;  // fragment column pair
  // Rows g and g + 8: query token (row % k) sits at seq_len - k + row % k
  // and sees keys up to it.
  int last_position[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) last_position[h] = seq_len - k + (g + 8 * h) % k;
  const float scale_log2 = p.scale * kLog2e;

  uint32_t q_frag[kDimSteps][4];
  float o[kDimTiles][4];
  float row_max[2] = {kNegInf, kNegInf};  // of scaled (log2) scores
  float row_sum[2] = {0.0f, 0.0f};        // this thread's share
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;
  }

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile & 1;
    if (tile + 1 < num_tiles) load_kv(tile + 1, stage ^ 1);
    CommitCopies();
    WaitCopies<1>();  // everything but the group just committed
    sync();

    if (tile == 0) {
#pragma unroll
      for (int ks = 0; ks < kDimSteps; ++ks) {
        const int row = (lane % 8) + ((lane / 8) % 2) * 8;
        const int chunk = ks * 2 + lane / 16;
        LoadMatrixX4(q_frag[ks],
                     SharedAddress(q_tile + Swizzled<kHeadDim>(row, chunk)));
      }
    }
    const __nv_bfloat16* k_tile = k_tiles + stage * Tile::kKvElems;
    const __nv_bfloat16* v_tile = v_tiles + stage * Tile::kKvElems;
    const int key16 = 16 * warp;  // this warp's keys in the tile

    // (b) S = Q·Kᵀ over the warp's 16 keys (two n8 tiles).
    float s[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < kDimSteps; ++ks) {
      uint32_t b[4];
      const int key = key16 + (lane % 8) + (lane / 16) * 8;
      const int chunk = ks * 2 + (lane / 8) % 2;
      LoadMatrixX4(b, SharedAddress(k_tile + Swizzled<kHeadDim>(key, chunk)));
      cuda::Mma16816(s[0], q_frag[ks], b[0], b[1]);
      cuda::Mma16816(s[1], q_frag[ks], b[2], b[3]);
    }

    // Scale and mask: element e of s[n] is row g + 8·(e / 2), key key16 +
    // 8n + 2tq + (e & 1) of the tile.
    const int position0 = key_begin + tile * kTileKeys;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = key16 + 8 * n + 2 * tq + (e & 1);
        const bool visible =
            key_ok[stage][j] && position0 + j <= last_position[e / 2];
        s[n][e] = visible ? s[n][e] * scale_log2 : kNegInf;
      }
    }
    // Online softmax per row (the quad of lanes holding it).
    float rescale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = fmaxf(row_max[h], fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]),
                                        fmaxf(s[1][2 * h], s[1][2 * h + 1])));
      m = fmaxf(m, __shfl_xor_sync(cuda::kFullMask, m, 1));
      m = fmaxf(m, __shfl_xor_sync(cuda::kFullMask, m, 2));
      // A row that has seen only masked keys keeps max -inf: its weights
      // are exp2(-inf) = 0 (never exp2(-inf - -inf)).
      rescale[h] = m == kNegInf ? 1.0f : exp2f(row_max[h] - m);
      row_max[h] = m;
      const float base = m == kNegInf ? 0.0f : m;
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        s[n][2 * h] = exp2f(s[n][2 * h] - base);
        s[n][2 * h + 1] = exp2f(s[n][2 * h + 1] - base);
        sum += s[n][2 * h] + s[n][2 * h + 1];
      }
      row_sum[h] = __fmaf_rn(row_sum[h], rescale[h], sum);
    }
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
      o[n][0] *= rescale[0];
      o[n][1] *= rescale[0];
      o[n][2] *= rescale[1];
      o[n][3] *= rescale[1];
    }

    // O += P·V: the two n8 tiles of P are the A fragment of the warp's 16
    // keys.
    const uint32_t pa[4] = {
        PackBf16x2(s[0][0], s[0][1]), PackBf16x2(s[0][2], s[0][3]),
        PackBf16x2(s[1][0], s[1][1]), PackBf16x2(s[1][2], s[1][3])};
#pragma unroll
    for (int nd = 0; nd < kDimTiles / 2; ++nd) {  // 16 dims at a time
      uint32_t b[4];
      const int key = key16 + (lane % 8) + ((lane / 8) % 2) * 8;
      const int chunk = nd * 2 + lane / 16;
      LoadMatrixX4Trans(b,
                        SharedAddress(v_tile + Swizzled<kHeadDim>(key, chunk)));
      cuda::Mma16816(o[2 * nd], pa, b[0], b[1]);
      cuda::Mma16816(o[2 * nd + 1], pa, b[2], b[3]);
    }
    sync();  // the next iteration's loads overwrite this stage
  }
  WaitCopies<0>();
  sync();  // the K/V stages become the warps' outputs

  // (c) Each warp's rows: the sum over the quad, the max and O to shared
  // memory; then the warps combined in order 0..3.
  float* warp_out = reinterpret_cast<float*>(k_tiles);  // [warp][row][dim]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = row_sum[h];
    sum += __shfl_xor_sync(cuda::kFullMask, sum, 1);
    sum += __shfl_xor_sync(cuda::kFullMask, sum, 2);
    const int row = g + 8 * h;
    if (tq == 0) {
      warp_max[warp][row] = row_max[h];
      warp_sum[warp][row] = sum;
    }
    float* out = warp_out + (warp * kRows + row) * kHeadDim;
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
      out[8 * n + 2 * tq] = o[n][2 * h];
      out[8 * n + 2 * tq + 1] = o[n][2 * h + 1];
    }
  }
  sync();

  // The workspace of the CUDA-core split kernel (paged_attention.cu):
  // normalized partial outputs [num_tokens, num_heads, num_splits,
  // head_dim], then maxima (natural log units of the scaled scores) and
  // sums [num_tokens, num_heads, num_splits].
  const int64_t slots =
      static_cast<int64_t>(p.num_tokens) * p.num_heads * p.num_splits;
  float* w_out = p.workspace;
  float* w_max = p.workspace + slots * p.head_dim;
  float* w_sum = w_max + slots;
  for (int i = tid; i < num_rows * kHeadDim; i += kThreads) {
    const int row = i / kHeadDim;
    const int d = i % kHeadDim;
    float m = kNegInf;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, warp_max[w][row]);
    float sum = 0.0f, acc = 0.0f;
    if (m != kNegInf) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float weight = exp2f(warp_max[w][row] - m);  // 0 for -inf
        sum = __fmaf_rn(weight, warp_sum[w][row], sum);
        acc =
            __fmaf_rn(weight, warp_out[(w * kRows + row) * kHeadDim + d], acc);
      }
    }
    const int64_t token = static_cast<int64_t>(request) * k + row % k;
    const int64_t slot =
        (token * p.num_heads + head0 + row / k) * p.num_splits + split;
    w_out[slot * p.head_dim + d] = sum > 0.0f ? acc / sum : 0.0f;
    if (d == 0) {
      w_max[slot] = m == kNegInf ? kNegInf : m * kLn2;
      w_sum[slot] = sum;
    }
  }
}

// The split-K workspace (fp32): normalized partial outputs [num_tokens,
// num_heads, num_splits, head_dim], then maxima (natural log units of the
// scaled scores) and sums [num_tokens, num_heads, num_splits] each.
struct DecodeWorkspace {
  float* out;
  float* max;
  float* sum;
};

__device__ __forceinline__ DecodeWorkspace
Carve(const PagedAttentionCudaParams& p) {
  const int64_t slots =
      static_cast<int64_t>(p.num_tokens) * p.num_heads * p.num_splits;
  DecodeWorkspace w;
  w.out = p.workspace;
  w.max = p.workspace + slots * p.head_dim;
  w.sum = w.max + slots;
  return w;
}

__device__ __forceinline__ int ContextLen(const PagedAttentionCudaParams& p,
                                          int seq_len) {
  return static_cast<int>(
      min(static_cast<int64_t>(seq_len),
          static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size));
}

// The reduce of one (token, head): threads tid = 0..num_threads-1 each
// write dims tid, tid + num_threads, ... (every dim's value is the same
// operation sequence whatever num_threads is).
__device__ __forceinline__ void DecodeReduceCta(
    const PagedAttentionCudaParams& p, int token, int head, int tid,
    int num_threads) {
  const int k = p.uniform_query_len;
  const int seq_len = p.seq_lens[token / k];
  __nv_bfloat16* out =
      p.output +
      (static_cast<int64_t>(token) * p.num_heads + head) * p.head_dim;
  const int context_len = seq_len <= 0 ? 0 : ContextLen(p, seq_len);
  int num_splits = 0;
  if (context_len > 0) {
    const int span = CudaDecodeSplitSpan(context_len, p.num_splits);
    num_splits = (context_len + span - 1) / span;
  }
  const DecodeWorkspace w = Carve(p);
  const int64_t base =
      (static_cast<int64_t>(token) * p.num_heads + head) * p.num_splits;

  float global_max = kNegInf;
  for (int q = 0; q < num_splits; ++q) {
    global_max = fmaxf(global_max, w.max[base + q]);
  }
  if (global_max == kNegInf) {  // padding request or nothing visible
    for (int d = tid; d < p.head_dim; d += num_threads) {
      out[d] = cuda::FromFloat<__nv_bfloat16>(0.0f);
    }
    return;
  }
  // Split q contributes exp(max_q - global_max) · sum_q of the total mass;
  // its stored output is already divided by sum_q.
  float total = 0.0f;
  for (int q = 0; q < num_splits; ++q) {
    total =
        __fmaf_rn(expf(w.max[base + q] - global_max), w.sum[base + q], total);
  }
  for (int d = tid; d < p.head_dim; d += num_threads) {
    float o = 0.0f;
    for (int q = 0; q < num_splits; ++q) {
      const float weight =
          __fmul_rn(expf(w.max[base + q] - global_max), w.sum[base + q]);
      o = __fmaf_rn(weight, w.out[(base + q) * p.head_dim + d], o);
    }
    out[d] = cuda::FromFloat<__nv_bfloat16>(o / total);
  }
}

}  // namespace decode_cta
}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_DECODE_ATTENTION_CTA_CUH_
