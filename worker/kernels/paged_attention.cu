// Paged attention on CUDA: bf16 query and KV cache, fp32 scores, online
// softmax and accumulation, bf16 output.
//
// Both routines are built from one CTA-level loop, AttendKeyRange: a CTA
// holds up to kMaxRows query rows that share one kv head (the query heads of
// a GQA group, times the query tokens of one request for decode) and walks a
// range of cache positions in tiles of kKeyTile keys:
//   (a) locate each key of the tile through the block table,
//   (b) scores: one warp per key, lanes over head_dim pairs, a shuffle tree
//       per row (q is staged in shared memory as fp32),
//   (c) online softmax: one warp per row rescales the running max and sum,
//   (d) accumulation: thread (group, pair) adds p·V for its dims (2·pair,
//       2·pair + 1) over the keys j ≡ group (mod groups) of the tile.
// At the end the per-group accumulators are summed in a fixed order. No
// atomics anywhere, so results are deterministic: an eager launch and a
// graph replay of the same shape give the same bits.
//
// Grids come only from the fixed shape (num_tokens, heads, max_num_seqs,
// max_blocks_per_seq); lengths, query offsets and block tables are read on
// the device, and CTAs with nothing to do return at once. One captured graph
// therefore serves every step of its padded shape.
#include <cmath>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/paged_attention_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

using cuda::FromFloat;
using cuda::ToFloat;
using cuda::WarpMax;
using cuda::WarpSum;
using cuda::WarpSumToLane0;

constexpr int kThreads = 128;
constexpr int kNumWarps = kThreads / cuda::kWarpSize;
constexpr int kKeyTile = 64;  // keys per softmax step
constexpr int kMaxRows = kCudaAttentionMaxRowsPerCta;
constexpr int kMaxHeadDim = kCudaAttentionMaxHeadDim;
constexpr int kReduceThreads = 128;
// Partition CTAs per (request, head chunk); more partitions are looped over.
// 32 × 512 keys: a 16k-token context still gets one CTA per partition.
constexpr int kMaxPartitionCtas = 32;
constexpr float kNegInf = -INFINITY;

static_assert(kMaxHeadDim / 2 <= kThreads,
              "one thread per head_dim pair must fit in the CTA");

// Everything a CTA keeps in shared memory (about 19 KB).
struct SharedState {
  float2 q[kMaxRows][kMaxHeadDim / 2];  // query rows, fp32, by dim pair
  float probs[kMaxRows][kKeyTile];      // scores, then exp weights, of a tile
  float row_max[kMaxRows];              // running max of each row
  float row_sum[kMaxRows];              // running softmax denominator
  float row_rescale[kMaxRows];          // this tile's correction factor
  int last_position[kMaxRows];          // causal limit: keys <= this
  // Element offset of each tile key's K/V row (kv head applied) in the
  // caches; -1 when its block id is outside the cache.
  int64_t key_offset[kKeyTile];
  // Per-group partial outputs: [groups][kMaxRows][head_dim] with groups *
  // head_dim / 2 <= kThreads.
  float partial[kThreads * 2 * kMaxRows];
};

// Max over the warp of an int, in every lane.
__device__ __forceinline__ int WarpMaxInt(int v) {
  for (int offset = cuda::kWarpSize / 2; offset > 0; offset /= 2) {
    v = max(v, __shfl_xor_sync(cuda::kFullMask, v, offset));
  }
  return v;
}

// Stages query rows [0, num_rows) into s.q and resets their softmax state.
// Row `row` is head first_head + row / k of token row token_base + row % k
// (k query tokens per request; varlen CTAs have one token, k = 1). Called
// by all threads (strided over rows × dim pairs); the caller synchronizes.
__device__ void StageQueryRows(SharedState& s,
                               const PagedAttentionCudaParams& p, int num_rows,
                               int token_base, int k, int first_head) {
  const int pairs = p.head_dim / 2;
  for (int idx = threadIdx.x; idx < num_rows * pairs; idx += kThreads) {
    const int row = idx / pairs;
    const int i = idx % pairs;
    const __nv_bfloat16* q =
        p.query +
        static_cast<int64_t>(token_base + row % k) * p.query_row_stride +
        static_cast<int64_t>(first_head + row / k) * p.head_dim + 2 * i;
    s.q[row][i] = make_float2(ToFloat(q[0]), ToFloat(q[1]));
  }
  if (threadIdx.x < num_rows) {
    s.row_max[threadIdx.x] = kNegInf;
    s.row_sum[threadIdx.x] = 0.0f;
  }
}

// The CTA loop described at the top of the file, over cache positions
// [key_begin, key_end) of the sequence whose block-table row is
// `block_table`. Rows [0, num_rows) must be staged (q, last_position,
// row_max = -inf, row_sum = 0) and synchronized. On return (synchronized),
// s.row_max / s.row_sum hold each row's softmax statistics and s.partial
// the per-group unnormalized outputs; call SumPartials next.
__device__ void AttendKeyRange(SharedState& s,
                               const PagedAttentionCudaParams& p, int num_rows,
                               int kv_head, const int32_t* block_table,
                               int key_begin, int key_end) {
  const int lane = threadIdx.x % cuda::kWarpSize;
  const int warp = threadIdx.x / cuda::kWarpSize;
  const int pairs = p.head_dim / 2;
  const int groups = kThreads / pairs;
  const int group = threadIdx.x / pairs;
  const int pair = threadIdx.x % pairs;
  const bool accumulates = group < groups;
  const int64_t kv_row = static_cast<int64_t>(p.num_kv_heads) * p.head_dim;
  const int64_t head_offset = static_cast<int64_t>(kv_head) * p.head_dim;

  float acc[kMaxRows][2];
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) acc[r][0] = acc[r][1] = 0.0f;

  for (int tile = key_begin; tile < key_end; tile += kKeyTile) {
    const int n = min(kKeyTile, key_end - tile);

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

    // (b) Scores, one warp per key. Loop bounds are warp-uniform, so every
    // lane takes part in the shuffles.
    for (int j = warp; j < n; j += kNumWarps) {
      const int64_t offset = s.key_offset[j];
      float dot[kMaxRows];
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) dot[r] = 0.0f;
      if (offset >= 0) {
        const __nv_bfloat162* key =
            reinterpret_cast<const __nv_bfloat162*>(p.key_cache + offset);
        for (int i = lane; i < pairs; i += cuda::kWarpSize) {
          const float2 k = __bfloat1622float2(key[i]);
#pragma unroll
          for (int r = 0; r < kMaxRows; ++r) {
            if (r < num_rows) dot[r] += s.q[r][i].x * k.x + s.q[r][i].y * k.y;
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        if (r >= num_rows) break;
        const float total = WarpSumToLane0(dot[r]);
        if (lane == 0) {
          const bool visible = offset >= 0 && tile + j <= s.last_position[r];
          s.probs[r][j] = visible ? total * p.scale : kNegInf;
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

    // (d) acc = acc · rescale + Σ_j p_j · V_j over this thread's keys.
    if (accumulates) {
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        if (r < num_rows) {
          acc[r][0] *= s.row_rescale[r];
          acc[r][1] *= s.row_rescale[r];
        }
      }
      for (int j = group; j < n; j += groups) {
        const int64_t offset = s.key_offset[j];
        if (offset < 0) continue;
        const float2 v =
            __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(
                p.value_cache + offset)[pair]);
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
          if (r < num_rows) {
            const float w = s.probs[r][j];
            acc[r][0] += w * v.x;
            acc[r][1] += w * v.y;
          }
        }
      }
    }
    __syncthreads();  // the next tile rewrites probs and key_offset
  }

  if (accumulates) {
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r < num_rows) {
        float* out = s.partial + (group * kMaxRows + r) * p.head_dim;
        out[2 * pair] = acc[r][0];
        out[2 * pair + 1] = acc[r][1];
      }
    }
  }
  __syncthreads();
}

// Output element `d` of row `row`, unnormalized: the per-group partials
// summed in group order (fixed, so deterministic).
__device__ __forceinline__ float SumPartials(const SharedState& s,
                                             const PagedAttentionCudaParams& p,
                                             int row, int d) {
  const int groups = kThreads / (p.head_dim / 2);
  float o = 0.0f;
  for (int g = 0; g < groups; ++g) {
    o += s.partial[(g * kMaxRows + row) * p.head_dim + d];
  }
  return o;
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
__global__ void __launch_bounds__(kThreads)
    VarlenAttentionKernel(PagedAttentionCudaParams p, int heads_per_cta) {
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
  AttendKeyRange(s, p, num_rows, chunk.kv_head, block_table, 0,
                 static_cast<int>(context_len));

  for (int i = threadIdx.x; i < num_rows * p.head_dim; i += kThreads) {
    const int row = i / p.head_dim;
    const float sum = s.row_sum[row];
    const float o = SumPartials(s, p, row, i % p.head_dim);
    out[i] = FromFloat<__nv_bfloat16>(sum > 0.0f ? o / sum : 0.0f);
  }
}

// ---------------------------------------------------------------------------
// Uniform decode, split-K. Partition kernel grid: [num_tokens / k,
// num_kv_heads * chunks, min(max_partitions, kMaxPartitionCtas)]; reduce
// kernel grid: [num_tokens, num_heads]. Workspace (fp32): partial outputs
// [num_tokens, num_heads, max_partitions, head_dim], then maxima and sums
// [num_tokens, num_heads, max_partitions] each.
// ---------------------------------------------------------------------------
struct DecodeWorkspace {
  float* out;
  float* max;
  float* sum;
};

__device__ __forceinline__ DecodeWorkspace
Carve(const PagedAttentionCudaParams& p, int max_partitions) {
  const int64_t slots =
      static_cast<int64_t>(p.num_tokens) * p.num_heads * max_partitions;
  DecodeWorkspace w;
  w.out = p.workspace;
  w.max = p.workspace + slots * p.head_dim;
  w.sum = w.max + slots;
  return w;
}

__global__ void __launch_bounds__(kThreads)
    DecodePartitionKernel(PagedAttentionCudaParams p, int heads_per_cta,
                          int max_partitions) {
  __shared__ SharedState s;
  const int request = blockIdx.x;
  const int k = p.uniform_query_len;
  const HeadChunk chunk = ChunkOf(p, heads_per_cta);
  const int num_rows = chunk.num_heads * k;  // row = head_in_chunk * k + j

  // seq_len 0: a padding request (the reduce kernel writes its zeros).
  const int seq_len = p.seq_lens[request];
  if (seq_len <= 0) return;
  const int context_len = static_cast<int>(
      min(static_cast<int64_t>(seq_len),
          static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size));
  const int32_t* block_table =
      p.block_tables + static_cast<int64_t>(request) * p.max_blocks_per_seq;
  const DecodeWorkspace w = Carve(p, max_partitions);

  // Partitions blockIdx.z, blockIdx.z + gridDim.z, ...: the grid holds at
  // most kMaxPartitionCtas partitions per (request, head chunk), so a large
  // max_model_len does not launch a sea of empty CTAs, while contexts up to
  // kMaxPartitionCtas partitions are still spread one partition per CTA.
  for (int partition = blockIdx.z; partition < max_partitions;
       partition += gridDim.z) {
    const int key_begin = partition * p.partition_tokens;
    if (key_begin >= context_len) break;  // beyond this request's context
    const int key_end = min(key_begin + p.partition_tokens, context_len);

    StageQueryRows(s, p, num_rows, request * k, k, chunk.first_head);
    if (threadIdx.x < num_rows) {
      // Query token j sits at position seq_len - k + j and sees keys up to
      // it (negative: sees nothing, and the row comes out as zeros).
      s.last_position[threadIdx.x] = seq_len - k + threadIdx.x % k;
    }
    __syncthreads();

    AttendKeyRange(s, p, num_rows, chunk.kv_head, block_table, key_begin,
                   key_end);

    // Every row of a partition that has keys is written (max -inf and sum 0
    // for a row masked throughout it), so the reduce kernel may read all
    // partitions below ceil(context_len / partition_tokens).
    for (int i = threadIdx.x; i < num_rows * p.head_dim; i += kThreads) {
      const int row = i / p.head_dim;
      const int d = i % p.head_dim;
      const int64_t token = static_cast<int64_t>(request) * k + row % k;
      const int64_t slot =
          (token * p.num_heads + chunk.first_head + row / k) * max_partitions +
          partition;
      const float sum = s.row_sum[row];
      const float o = SumPartials(s, p, row, d);
      w.out[slot * p.head_dim + d] = sum > 0.0f ? o / sum : 0.0f;
      if (d == 0) {
        w.max[slot] = s.row_max[row];
        w.sum[slot] = sum;
      }
    }
    __syncthreads();  // the next partition restages the shared state
  }
}

__global__ void __launch_bounds__(kReduceThreads)
    DecodeReduceKernel(PagedAttentionCudaParams p, int max_partitions) {
  const int token = blockIdx.x;
  const int head = blockIdx.y;
  const int k = p.uniform_query_len;
  const int seq_len = p.seq_lens[token / k];
  __nv_bfloat16* out =
      p.output +
      (static_cast<int64_t>(token) * p.num_heads + head) * p.head_dim;
  const int64_t context_len =
      min(static_cast<int64_t>(seq_len),
          static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size);
  const int num_partitions =
      context_len <= 0
          ? 0
          : static_cast<int>((context_len + p.partition_tokens - 1) /
                             p.partition_tokens);
  const DecodeWorkspace w = Carve(p, max_partitions);
  const int64_t base =
      (static_cast<int64_t>(token) * p.num_heads + head) * max_partitions;

  float global_max = kNegInf;
  for (int q = 0; q < num_partitions; ++q) {
    global_max = fmaxf(global_max, w.max[base + q]);
  }
  if (global_max == kNegInf) {  // padding request or nothing visible
    for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
      out[d] = FromFloat<__nv_bfloat16>(0.0f);
    }
    return;
  }
  // Partition q contributes exp(max_q - global_max) · sum_q of the total
  // mass; its stored output is already divided by sum_q.
  float total = 0.0f;
  for (int q = 0; q < num_partitions; ++q) {
    total += expf(w.max[base + q] - global_max) * w.sum[base + q];
  }
  for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
    float o = 0.0f;
    for (int q = 0; q < num_partitions; ++q) {
      const float weight = expf(w.max[base + q] - global_max) * w.sum[base + q];
      o += weight * w.out[(base + q) * p.head_dim + d];
    }
    out[d] = FromFloat<__nv_bfloat16>(o / total);
  }
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
  VarlenAttentionKernel<<<grid, kThreads, 0, stream>>>(p, heads_per_cta);
  return cudaGetLastError();
}

cudaError_t LaunchPagedAttentionDecodeCuda(const PagedAttentionCudaParams& p,
                                           cudaStream_t stream) {
  const int k = p.uniform_query_len;
  const int group_size = p.num_heads / p.num_kv_heads;
  const int heads_per_cta = max(1, min(group_size, kMaxRows / k));
  const int64_t max_context =
      static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
  const int max_partitions = static_cast<int>(
      (max_context + p.partition_tokens - 1) / p.partition_tokens);
  const dim3 grid(p.num_tokens / k,
                  p.num_kv_heads * NumChunks(p, heads_per_cta),
                  min(max_partitions, kMaxPartitionCtas));
  DecodePartitionKernel<<<grid, kThreads, 0, stream>>>(p, heads_per_cta,
                                                       max_partitions);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  const dim3 reduce_grid(p.num_tokens, p.num_heads);
  DecodeReduceKernel<<<reduce_grid, kReduceThreads, 0, stream>>>(
      p, max_partitions);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace pdworker
