// Uniform decode on tensor cores, split-K (flash-decoding), for head_dim 64
// and 128 and G · k <= 16 query rows per (request, kv head) (G query heads
// per kv head, k query tokens per request).
//
// The CUDA-core split kernel (paged_attention.cu) computes every score with
// FMAs and shuffles and is instruction-bound at 30-38% of HBM once the
// batch fills the GPU (bench/RESULTS.md). Here a CTA (4 warps) owns one
// (request, kv head, split): the G · k query rows of the kv head's group
// form one m16 tile (rows past G · k are zeros), so each K/V tile loaded
// serves the whole group, and both products run on mma.m16n8k16:
//   (a) K and V tiles of 64 positions of the split's key range are gathered
//       through the block table into swizzled shared memory with cp.async,
//       double-buffered (mma_tile.cuh); invalid positions are zero-filled
//       and masked;
//   (b) warp w takes keys [16w, 16w + 16) of every tile: S = Q·Kᵀ (Q
//       fragments in registers for the whole loop, K by ldmatrix), the
//       online softmax on the fragments (exp2 with the scale folded in),
//       O += P·V (P as bf16 A fragments, V by ldmatrix.trans);
//   (c) the 4 warps' (max, sum, O) are combined in shared memory in warp
//       order, and the split's normalized output, max and sum are written to
//       the workspace exactly as the CUDA-core split kernel writes them, so
//       its reduce kernel (LaunchPagedAttentionDecodeReduceCuda) finishes
//       the job unchanged.
// Fixed orders everywhere, no atomics: a launch is deterministic and a graph
// replay gives the eager bits. Grid: (num_tokens / k, num_kv_heads,
// num_splits), from the launch shape only.
#include <cmath>
#include <cstdint>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/mma_tile.cuh"
#include "worker/kernels/paged_attention_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

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

template <int kHeadDim>
struct DecodeTile {
  static constexpr int kChunksPerRow = kHeadDim / kChunk;
  static constexpr int kQElems = kRows * kHeadDim;
  static constexpr int kKvElems = kTileKeys * kHeadDim;  // one K or V stage
  // Q, then K and V of two stages; after the key loop the K/V stages hold
  // the warps' fp32 outputs [kWarps][kRows][kHeadDim] (half their bytes).
  static constexpr int kSharedBytes = (kQElems + 4 * kKvElems) * 2;
  static_assert(kWarps * kRows * kHeadDim * 4 <= 4 * kKvElems * 2,
                "the warps' outputs fit in the K/V stages");
};

template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    MmaDecodeSplitKernel(PagedAttentionCudaParams p) {
  using Tile = DecodeTile<kHeadDim>;
  constexpr int kChunks = Tile::kChunksPerRow;
  constexpr int kDimTiles = kHeadDim / 8;   // n8 tiles of O
  constexpr int kDimSteps = kHeadDim / 16;  // k16 steps of Q·Kᵀ
  extern __shared__ __align__(128) __nv_bfloat16 smem[];
  __nv_bfloat16* q_tile = smem;
  __nv_bfloat16* k_tiles = smem + Tile::kQElems;          // 2 stages
  __nv_bfloat16* v_tiles = k_tiles + 2 * Tile::kKvElems;  // 2 stages
  __shared__ int8_t key_ok[2][kTileKeys];
  __shared__ float warp_max[kWarps][kRows];
  __shared__ float warp_sum[kWarps][kRows];

  // Programmatic dependent launch (PagedAttentionCudaParams::
  // programmatic_launch): the reduce kernel may be scheduled now; this grid
  // reads nothing before the qkv projection that wrote q and the new K/V
  // has finished, not even the step's lengths, so that every CTA waits,
  // the early-returning ones too, and this grid's end implies that one's.
  cuda::AllowDependentLaunch();
  cuda::WaitForPreviousKernel();
  const int request = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int split = blockIdx.z;
  const int k = p.uniform_query_len;
  const int group = p.num_heads / p.num_kv_heads;
  const int num_rows = group * k;  // row = head_in_group · k + token
  const int tid = threadIdx.x;

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
    __syncthreads();

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
      row_sum[h] = row_sum[h] * rescale[h] + sum;
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
    __syncthreads();  // the next iteration's loads overwrite this stage
  }
  WaitCopies<0>();
  __syncthreads();  // the K/V stages become the warps' outputs

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
  __syncthreads();

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
        sum += weight * warp_sum[w][row];
        acc += weight * warp_out[(w * kRows + row) * kHeadDim + d];
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

template <int kHeadDim>
cudaError_t LaunchSplit(const PagedAttentionCudaParams& p,
                        cudaStream_t stream) {
  constexpr int kBytes = DecodeTile<kHeadDim>::kSharedBytes;
  // More than 48 KB of dynamic shared memory (head_dim 128) must be opted
  // into, once per kernel (not a stream operation: allowed while a graph is
  // captured).
  static const cudaError_t attribute =
      cudaFuncSetAttribute(MmaDecodeSplitKernel<kHeadDim>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (attribute != cudaSuccess) return attribute;
  const dim3 grid(p.num_tokens / p.uniform_query_len, p.num_kv_heads,
                  p.num_splits);
  return cuda::LaunchKernel(
      MmaDecodeSplitKernel<kHeadDim>, grid, dim3(kThreads), kBytes, stream,
      p.programmatic_launch ? cuda::DependentLaunch::kProgrammatic
                            : cuda::DependentLaunch::kSerialized,
      p);
}

}  // namespace

bool PagedAttentionDecodeMmaSupports(const PagedAttentionCudaParams& p) {
  const int group = p.num_kv_heads > 0 ? p.num_heads / p.num_kv_heads : 0;
  return (p.head_dim == 64 || p.head_dim == 128) && group >= 1 &&
         p.uniform_query_len >= 1 && group * p.uniform_query_len <= kRows &&
         p.num_tokens % p.uniform_query_len == 0 && p.num_splits >= 1 &&
         p.query_row_stride % kChunk == 0 &&
         reinterpret_cast<uintptr_t>(p.query) % 16 == 0;
}

cudaError_t LaunchPagedAttentionDecodeSplitMmaCuda(
    const PagedAttentionCudaParams& p, cudaStream_t stream) {
  if (!PagedAttentionDecodeMmaSupports(p)) return cudaErrorInvalidValue;
  return p.head_dim == 128 ? LaunchSplit<128>(p, stream)
                           : LaunchSplit<64>(p, stream);
}

}  // namespace kernels
}  // namespace pdworker
