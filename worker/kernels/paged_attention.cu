// Paged attention on CUDA: bf16 query and KV cache, fp32 scores, online
// softmax and accumulation, bf16 output.
//
// Both routines are built from one CTA-level loop, AttendKeyRange: a CTA
// holds up to kRows query rows that share one kv head (the query heads of a
// GQA group, times the query tokens of one request for decode) and walks a
// range of cache positions in tiles of keys. Thread t of the CTA owns dims
// [8·sub, 8·sub + 8) (sub = t mod Lp, Lp = head_dim / 8 rounded up to a
// power of two) of the tile keys j ≡ t / Lp (mod kThreads / Lp). Per tile:
//   (a) locate each key through the block table;
//   (b) load K and V of the thread's keys (16-byte loads, all of them in
//       flight together), dot K with every row's query (staged in shared
//       memory as fp32), sum the Lp lanes of a key with shuffles;
//   (c) online softmax: one warp per row rescales the running max and sum;
//   (d) acc[row][0..8) = acc · rescale + Σ p · V from the V registers.
// At the end the threads' accumulators are summed in a fixed order
// (shuffles within a warp, then warp by warp through shared memory). No
// atomics anywhere, so results are deterministic: an eager launch and a
// graph replay of the same shape give the same bits.
//
// Grids come only from the fixed shape (num_tokens, heads, max_num_seqs,
// num_splits); lengths, query offsets and block tables are read on the
// device, and CTAs with nothing to do return at once. One captured graph
// therefore serves every step of its padded shape.
#include <cmath>
#include <cstdint>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/decode_attention_cta.cuh"
#include "worker/kernels/paged_attention_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

using cuda::Bf16x8ToFloat;
using cuda::FromFloat;
using cuda::ToFloat;
using cuda::WarpMax;
using cuda::WarpSum;

constexpr int kThreads = 128;
constexpr int kNumWarps = kThreads / cuda::kWarpSize;
constexpr int kVec = 8;    // bf16 elements per 16-byte load
constexpr int kLoads = 4;  // K (and V) loads per thread per tile
constexpr int kMaxKeyTile = 64;
constexpr int kMaxRows = kCudaAttentionMaxRowsPerCta;
constexpr int kMaxHeadDim = kCudaAttentionMaxHeadDim;
constexpr int kReduceThreads = 128;
constexpr float kNegInf = -INFINITY;

static_assert(kMaxHeadDim / kVec <= cuda::kWarpSize,
              "the lanes of one key must fit in a warp");

// Everything a CTA keeps in shared memory (about 19 KB).
struct alignas(16) SharedState {
  float q[kMaxRows][kMaxHeadDim];      // query rows, fp32
  float out[kMaxRows][kMaxHeadDim];    // the CTA's unnormalized output
  float probs[kMaxRows][kMaxKeyTile];  // scores, then exp weights, of a tile
  float row_max[kMaxRows];             // running max of each row
  float row_sum[kMaxRows];             // running softmax denominator
  float row_rescale[kMaxRows];         // this tile's correction factor
  int last_position[kMaxRows];         // causal limit: keys <= this
  // Element offset of each tile key's K/V row (kv head applied) in the
  // caches; -1 when its block id is outside the cache.
  int64_t key_offset[kMaxKeyTile];
};

// Max over the warp of an int, in every lane.
__device__ __forceinline__ int WarpMaxInt(int v) {
  for (int offset = cuda::kWarpSize / 2; offset > 0; offset /= 2) {
    v = max(v, __shfl_xor_sync(cuda::kFullMask, v, offset));
  }
  return v;
}

// Lanes per key: head_dim / kVec rounded up to a power of two (<= 32).
__device__ __forceinline__ int LanesPerKey(int head_dim) {
  const int lanes = head_dim / kVec;
  int lp = 1;
  while (lp < lanes) lp *= 2;
  return lp;
}

// Stages query rows [0, num_rows) into s.q and resets their softmax state.
// Row `row` is head first_head + row / k of token row token_base + row % k
// (k query tokens per request; varlen CTAs have one token, k = 1). Called
// by all threads (strided over rows × dims); the caller synchronizes.
__device__ void StageQueryRows(SharedState& s,
                               const PagedAttentionCudaParams& p, int num_rows,
                               int token_base, int k, int first_head) {
  for (int idx = threadIdx.x; idx < num_rows * p.head_dim; idx += kThreads) {
    const int row = idx / p.head_dim;
    const int d = idx % p.head_dim;
    s.q[row][d] = ToFloat(
        p.query[static_cast<int64_t>(token_base + row % k) *
                    p.query_row_stride +
                static_cast<int64_t>(first_head + row / k) * p.head_dim + d]);
  }
  if (threadIdx.x < num_rows) {
    s.row_max[threadIdx.x] = kNegInf;
    s.row_sum[threadIdx.x] = 0.0f;
  }
}

// The CTA loop described at the top of the file, over cache positions
// [key_begin, key_end) of the sequence whose block-table row is
// `block_table`. Rows [0, num_rows) (num_rows <= kRows) must be staged (q,
// last_position, row_max = -inf, row_sum = 0) and synchronized. On return
// (synchronized), s.row_max / s.row_sum hold each row's softmax statistics
// and s.out[row][d] its unnormalized output.
template <int kRows>
__device__ void AttendKeyRange(SharedState& s,
                               const PagedAttentionCudaParams& p, int num_rows,
                               int kv_head, const int32_t* block_table,
                               int key_begin, int key_end) {
  const int lane = threadIdx.x % cuda::kWarpSize;
  const int warp = threadIdx.x / cuda::kWarpSize;
  const int lp = LanesPerKey(p.head_dim);
  const int sub = threadIdx.x % lp;   // dims [8·sub, 8·sub + 8)
  const int slot = threadIdx.x / lp;  // keys slot, slot + slots, ...
  const int slots = kThreads / lp;
  const bool has_dims = sub * kVec < p.head_dim;
  const int tile_keys = min(kMaxKeyTile, kLoads * slots);
  const int64_t kv_row = static_cast<int64_t>(p.num_kv_heads) * p.head_dim;
  const int64_t head_offset = static_cast<int64_t>(kv_head) * p.head_dim;
  const int dim0 = sub * kVec;

  float acc[kRows][kVec];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[r][e] = 0.0f;
  }

  for (int tile = key_begin; tile < key_end; tile += tile_keys) {
    const int n = min(tile_keys, key_end - tile);

    // (a) Where each key lives. A block id outside the cache (a corrupt
    // table; the KV cache manager never writes one) is skipped, as the CPU
    // kernel skips the whole block.
    for (int j = threadIdx.x; j < n; j += kThreads) {
      const int position = tile + j;
      const int32_t block = block_table[position / p.block_size];
      s.key_offset[j] = block >= 0 && block < p.num_blocks
                            ? (static_cast<int64_t>(block) * p.block_size +
                               position % p.block_size) *
                                      kv_row +
                                  head_offset
                            : -1;
    }
    __syncthreads();

    // (b) K and V of this thread's keys, every load issued before the first
    // use; then the scores. u · slots is the same in every thread, so the
    // break is CTA-uniform and every lane takes part in the shuffles.
    uint4 k_raw[kLoads], v_raw[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int j = u * slots + slot;
      const int64_t offset = has_dims && j < n ? s.key_offset[j] : -1;
      k_raw[u] = v_raw[u] = make_uint4(0, 0, 0, 0);
      if (offset >= 0) {
        k_raw[u] =
            __ldg(reinterpret_cast<const uint4*>(p.key_cache + offset + dim0));
        v_raw[u] = __ldg(
            reinterpret_cast<const uint4*>(p.value_cache + offset + dim0));
      }
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      if (u * slots >= n) break;
      const int j = u * slots + slot;
      float k[kVec];
      Bf16x8ToFloat(k_raw[u], k);
      float dot[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        dot[r] = 0.0f;
        if (r < num_rows && has_dims) {
          const float4 q0 = *reinterpret_cast<const float4*>(&s.q[r][dim0]);
          const float4 q1 = *reinterpret_cast<const float4*>(&s.q[r][dim0 + 4]);
          dot[r] = q0.x * k[0] + q0.y * k[1] + q0.z * k[2] + q0.w * k[3] +
                   q1.x * k[4] + q1.y * k[5] + q1.z * k[6] + q1.w * k[7];
        }
        for (int offset = lp / 2; offset > 0; offset /= 2) {
          dot[r] += __shfl_xor_sync(cuda::kFullMask, dot[r], offset);
        }
      }
      if (sub == 0 && j < n) {
        const bool cached = s.key_offset[j] >= 0;
        const int position = tile + j;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r < num_rows) {
            // Causal, and within the window when there is one (written
            // without a GPU, as the soft-cap: UnverifiedCudaKernels).
            const bool visible =
                cached && position <= s.last_position[r] &&
                (p.sliding_window <= 0 ||
                 position > s.last_position[r] - p.sliding_window);
            float score = dot[r] * p.scale;
            if (p.softcap > 0.0f) score = p.softcap * tanhf(score / p.softcap);
            s.probs[r][j] = visible ? score : kNegInf;
          }
        }
      }
    }
    __syncthreads();

    // (c) Online softmax, one warp per row: new running max, the factor
    // that rescales what was accumulated under the old one (0 when nothing
    // was: exp(-inf)), and the tile's exp weights. A row that has seen only
    // masked keys keeps max -inf and weights 0 (never exp(-inf - -inf)).
    for (int r = warp; r < num_rows; r += kNumWarps) {
      float tile_max = kNegInf;
      for (int j = lane; j < n; j += cuda::kWarpSize) {
        tile_max = fmaxf(tile_max, s.probs[r][j]);
      }
      tile_max = WarpMax(tile_max);
      const float old_max = s.row_max[r];
      const float new_max = fmaxf(old_max, tile_max);
      float tile_sum = 0.0f;
      for (int j = lane; j < n; j += cuda::kWarpSize) {
        const float e =
            new_max == kNegInf ? 0.0f : expf(s.probs[r][j] - new_max);
        s.probs[r][j] = e;
        tile_sum += e;
      }
      tile_sum = WarpSum(tile_sum);
      if (lane == 0) {
        const float rescale =
            new_max == kNegInf ? 1.0f : expf(old_max - new_max);
        s.row_rescale[r] = rescale;
        s.row_sum[r] = s.row_sum[r] * rescale + tile_sum;
        s.row_max[r] = new_max;
      }
    }
    __syncthreads();

    // (d) acc = acc · rescale + Σ_j p_j · V_j over this thread's keys (V
    // of a key outside the cache was loaded as zeros, and its p is 0).
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r < num_rows) {
        const float rescale = s.row_rescale[r];
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[r][e] *= rescale;
      }
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int j = u * slots + slot;
      if (j < n) {
        float v[kVec];
        Bf16x8ToFloat(v_raw[u], v);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r < num_rows) {
            const float w = s.probs[r][j];
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[r][e] += w * v[e];
          }
        }
      }
    }
    __syncthreads();  // the next tile rewrites probs and key_offset
  }

  // Sum the accumulators of the threads that own the same dims: the slots
  // of a warp by shuffles (lanes lp apart), then the warps in order.
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      for (int offset = lp; offset < cuda::kWarpSize; offset *= 2) {
        acc[r][e] += __shfl_xor_sync(cuda::kFullMask, acc[r][e], offset);
      }
    }
  }
  for (int w = 0; w < kNumWarps; ++w) {
    if (warp == w && lane < lp && has_dims) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < num_rows) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            float& o = s.out[r][dim0 + e];
            o = w == 0 ? acc[r][e] : o + acc[r][e];
          }
        }
      }
    }
    __syncthreads();
  }
}

// The kv head and query heads [first_head, first_head + num_heads_here) a
// CTA handles, from its blockIdx.y = kv_head * chunks + chunk.
struct HeadChunk {
  int kv_head;
  int first_head;
  int num_heads;
};

__device__ __forceinline__ HeadChunk ChunkOf(const PagedAttentionCudaParams& p,
                                             int heads_per_cta) {
  const int group_size = p.num_heads / p.num_kv_heads;
  const int chunks = (group_size + heads_per_cta - 1) / heads_per_cta;
  const int chunk = blockIdx.y % chunks;
  HeadChunk c;
  c.kv_head = blockIdx.y / chunks;
  c.first_head = c.kv_head * group_size + chunk * heads_per_cta;
  c.num_heads = min(heads_per_cta, group_size - chunk * heads_per_cta);
  return c;
}

// ---------------------------------------------------------------------------
// Varlen (prefill / mixed). grid: [num_tokens, num_kv_heads * chunks].
// ---------------------------------------------------------------------------
template <int kRows>
__global__ void __launch_bounds__(kThreads)
    VarlenAttentionKernel(PagedAttentionCudaParams p, int heads_per_cta) {
  cuda::AllowDependentLaunch();
  __shared__ SharedState s;
  __shared__ int request_s;
  const int t = blockIdx.x;
  const HeadChunk chunk = ChunkOf(p, heads_per_cta);
  const int num_rows = chunk.num_heads;

  // Which request owns token row t: the last r (as the CPU kernel, which
  // writes requests in order) whose clamped query range contains it.
  if (threadIdx.x < cuda::kWarpSize) {
    const int num_reqs = min(max(p.num_reqs[0], 0), p.max_num_seqs);
    int found = -1;
    for (int r = threadIdx.x; r < num_reqs; r += cuda::kWarpSize) {
      const int begin = min(max(p.query_start_loc[r], 0), p.num_tokens);
      const int end = min(max(p.query_start_loc[r + 1], begin), p.num_tokens);
      if (begin <= t && t < end) found = r;
    }
    found = WarpMaxInt(found);
    if (threadIdx.x == 0) request_s = found;
  }
  __syncthreads();
  const int request = request_s;

  // The token's absolute position and how much of the cache it sees.
  int64_t context_len = 0;
  if (request >= 0) {
    const int begin = min(max(p.query_start_loc[request], 0), p.num_tokens);
    const int end =
        min(max(p.query_start_loc[request + 1], begin), p.num_tokens);
    const int64_t last_position =
        static_cast<int64_t>(p.seq_lens[request]) - (end - begin) + (t - begin);
    context_len =
        min(last_position + 1,
            static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size);
  }
  __nv_bfloat16* out = p.output +
                       static_cast<int64_t>(t) * p.num_heads * p.head_dim +
                       static_cast<int64_t>(chunk.first_head) * p.head_dim;
  if (context_len <= 0) {  // padding row, or nothing visible: zeros
    for (int i = threadIdx.x; i < num_rows * p.head_dim; i += kThreads) {
      out[i] = FromFloat<__nv_bfloat16>(0.0f);
    }
    return;
  }

  StageQueryRows(s, p, num_rows, t, 1, chunk.first_head);
  if (threadIdx.x < num_rows) {
    s.last_position[threadIdx.x] = static_cast<int>(context_len - 1);
  }
  __syncthreads();

  const int32_t* block_table =
      p.block_tables + static_cast<int64_t>(request) * p.max_blocks_per_seq;
  AttendKeyRange<kRows>(s, p, num_rows, chunk.kv_head, block_table, 0,
                        static_cast<int>(context_len));

  for (int i = threadIdx.x; i < num_rows * p.head_dim; i += kThreads) {
    const int row = i / p.head_dim;
    const float sum = s.row_sum[row];
    const float o = s.out[row][i % p.head_dim];
    out[i] = FromFloat<__nv_bfloat16>(sum > 0.0f ? o / sum : 0.0f);
  }
}

// ---------------------------------------------------------------------------
// Uniform decode, split-K (flash-decoding). Split kernel grid: [num_tokens /
// k, num_kv_heads * chunks, num_splits]; CTA z attends keys [z·span,
// (z + 1)·span) of its request (CudaDecodeSplitSpan). Reduce kernel grid:
// [num_tokens, num_heads]. Workspace (fp32): normalized partial outputs
// [num_tokens, num_heads, num_splits, head_dim], then maxima and sums
// [num_tokens, num_heads, num_splits] each.
// ---------------------------------------------------------------------------
using decode_cta::Carve;
using decode_cta::ContextLen;
using decode_cta::DecodeWorkspace;

template <int kRows>
__global__ void __launch_bounds__(kThreads)
    DecodeSplitKernel(PagedAttentionCudaParams p, int heads_per_cta) {
  // As the tensor-core split kernel: every CTA waits for the previous kernel
  // before its first read (programmatic_launch).
  cuda::AllowDependentLaunch();
  cuda::WaitForPreviousKernel();
  __shared__ SharedState s;
  const int request = blockIdx.x;
  const int split = blockIdx.z;
  const int k = p.uniform_query_len;
  const HeadChunk chunk = ChunkOf(p, heads_per_cta);
  const int num_rows = chunk.num_heads * k;  // row = head_in_chunk * k + j

  // seq_len 0: a padding request (the reduce kernel writes its zeros).
  const int seq_len = p.seq_lens[request];
  if (seq_len <= 0) return;
  const int context_len = ContextLen(p, seq_len);
  const int span = CudaDecodeSplitSpan(context_len, p.num_splits);
  const int key_begin = split * span;
  if (key_begin >= context_len) return;  // the reduce kernel reads no more
  const int key_end = min(key_begin + span, context_len);

  StageQueryRows(s, p, num_rows, request * k, k, chunk.first_head);
  if (threadIdx.x < num_rows) {
    // Query token j sits at position seq_len - k + j and sees keys up to it
    // (negative: sees nothing, and the row comes out as zeros).
    s.last_position[threadIdx.x] = seq_len - k + threadIdx.x % k;
  }
  __syncthreads();

  const int32_t* block_table =
      p.block_tables + static_cast<int64_t>(request) * p.max_blocks_per_seq;
  AttendKeyRange<kRows>(s, p, num_rows, chunk.kv_head, block_table, key_begin,
                        key_end);

  // Every row of a split that has keys is written (max -inf and sum 0 for a
  // row masked throughout it), so the reduce kernel may read all splits
  // below ceil(context_len / span).
  const DecodeWorkspace w = Carve(p);
  for (int i = threadIdx.x; i < num_rows * p.head_dim; i += kThreads) {
    const int row = i / p.head_dim;
    const int d = i % p.head_dim;
    const int64_t token = static_cast<int64_t>(request) * k + row % k;
    const int64_t slot =
        (token * p.num_heads + chunk.first_head + row / k) * p.num_splits +
        split;
    const float sum = s.row_sum[row];
    w.out[slot * p.head_dim + d] = sum > 0.0f ? s.out[row][d] / sum : 0.0f;
    if (d == 0) {
      w.max[slot] = s.row_max[row];
      w.sum[slot] = sum;
    }
  }
}

__global__ void __launch_bounds__(kReduceThreads)
    DecodeReduceKernel(PagedAttentionCudaParams p) {
  cuda::AllowDependentLaunch();
  cuda::WaitForPreviousKernel();  // the split kernel's partials
  decode_cta::DecodeReduceCta(p, blockIdx.x, blockIdx.y, threadIdx.x,
                              blockDim.x);
}

int NumChunks(const PagedAttentionCudaParams& p, int heads_per_cta) {
  const int group_size = p.num_heads / p.num_kv_heads;
  return (group_size + heads_per_cta - 1) / heads_per_cta;
}

}  // namespace

cudaError_t LaunchPagedAttentionVarlenCuda(const PagedAttentionCudaParams& p,
                                           cudaStream_t stream) {
  const int group_size = p.num_heads / p.num_kv_heads;
  const int heads_per_cta = min(group_size, kMaxRows);
  const dim3 grid(p.num_tokens, p.num_kv_heads * NumChunks(p, heads_per_cta));
  if (heads_per_cta <= 4) {
    VarlenAttentionKernel<4><<<grid, kThreads, 0, stream>>>(p, heads_per_cta);
  } else {
    VarlenAttentionKernel<kMaxRows>
        <<<grid, kThreads, 0, stream>>>(p, heads_per_cta);
  }
  return cudaGetLastError();
}

cudaError_t LaunchPagedAttentionDecodeCuda(const PagedAttentionCudaParams& p,
                                           cudaStream_t stream) {
  const int k = p.uniform_query_len;
  const int group_size = p.num_heads / p.num_kv_heads;
  const int heads_per_cta = max(1, min(group_size, kMaxRows / k));
  const dim3 grid(p.num_tokens / k,
                  p.num_kv_heads * NumChunks(p, heads_per_cta), p.num_splits);
  const cuda::DependentLaunch launch =
      p.programmatic_launch ? cuda::DependentLaunch::kProgrammatic
                            : cuda::DependentLaunch::kSerialized;
  cudaError_t error = cudaSuccess;
  if (p.decode_tensor_cores) {
    error = LaunchPagedAttentionDecodeSplitMmaCuda(p, stream);
  } else if (heads_per_cta * k <= 4) {
    error = cuda::LaunchKernel(DecodeSplitKernel<4>, grid, dim3(kThreads), 0,
                               stream, launch, p, heads_per_cta);
  } else {
    error =
        cuda::LaunchKernel(DecodeSplitKernel<kMaxRows>, grid, dim3(kThreads), 0,
                           stream, launch, p, heads_per_cta);
  }
  if (error != cudaSuccess) return error;
  const dim3 reduce_grid(p.num_tokens, p.num_heads);
  return cuda::LaunchKernel(DecodeReduceKernel, reduce_grid,
                            dim3(kReduceThreads), 0, stream, launch, p);
}

}  // namespace kernels
}  // namespace pdworker
