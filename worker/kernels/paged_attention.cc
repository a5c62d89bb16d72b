#include "worker/kernels/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL
#include "worker/kernels/kernel_checks.h"

#if PDW_HAVE_CUDA
#include "worker/kernels/paged_attention_cuda.h"
#include "worker/runtime/cuda_status.h"
#endif

namespace pdworker {
namespace kernels {
namespace {

#if PDW_HAVE_CUDA
static_assert(kTensorCoreAttentionMaxGroup == kCudaAttentionMmaMaxGroup,
              "CheckVarlenAttentionKernel states the kernels' coverage");
static_assert(kCudaAttentionMaxUniformQueryLen == kCudaAttentionMaxRowsPerCta,
              "one CTA holds every query token of a request");
static_assert(kCudaDecodeMinSplitKeys == kCudaAttentionMinSplitKeys &&
                  kCudaDecodeMaxSplits == kCudaAttentionMaxSplits,
              "the host and the kernels agree on the decode split");
#endif

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The split count of a CUDA uniform decode launch of `p` (varlen launches
// carry it too and ignore it).
int DecodeSplits(const PagedAttentionParams& p) {
  return CudaDecodeNumSplits(
      p.num_tokens, std::max(p.uniform_query_len, 1), p.num_heads,
      p.num_kv_heads,
      static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size);
}

// Exact workspace bytes of one CUDA decode launch.
size_t DecodeLaunchWorkspaceBytes(const PagedAttentionParams& p) {
  return sizeof(float) * static_cast<size_t>(p.num_tokens) * p.num_heads *
         DecodeSplits(p) * (p.head_dim + 2);
}

// Scores of one cache block live in a stack array; vLLM's block sizes are
// 8..128, so this bound is generous.
constexpr int kMaxBlockSize = 256;

// Dot product with eight independent partial sums: the compiler keeps them
// in one vector register (a single running sum would serialize on the add
// latency, and fp32 reassociation is not allowed without -ffast-math).
inline float Dot(const float* a, const float* b, int n) {
  float partial[8] = {};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int lane = 0; lane < 8; ++lane)
      partial[lane] += a[i + lane] * b[i + lane];
  }
  float tail = 0.0f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
         ((partial[4] + partial[5]) + (partial[6] + partial[7])) + tail;
}

// acc[0, n) += weight * v[0, n), written in blocks of eight lanes so that
// -O2 (whose cheap vectorizer skips loops needing a scalar epilogue)
// vectorizes it as straight-line code.
inline void AddScaled(float weight, const float* v, float* acc, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int lane = 0; lane < 8; ++lane) acc[i + lane] += weight * v[i + lane];
  }
  for (; i < n; ++i) acc[i] += weight * v[i];
}

// Query heads processed together against one kv head: each K/V row is
// loaded once and used by all of them (GQA shares a kv head between
// num_heads / num_kv_heads query heads). Their scratch lives on the stack.
constexpr int kMaxHeadsPerPass = 8;

// Query heads [0, num_q) at `q` (head_dim apart) against cache positions
// [0, context_len) of one request through its block table, all reading kv
// head `kv_head`: out = softmax(q·Kᵀ·scale)·V, block by block with a running
// maximum (online softmax), so no score buffer of context length is needed.
// Blocks whose id is outside the cache are skipped (a corrupt block table
// must not read out of bounds; the KV cache manager never writes one).
// Writes zeros for a head that attended to nothing.
// Positions before `window_start` are masked (a sliding window).
void AttendHeads(const PagedAttentionParams& p, const float* q, int num_q,
                 int kv_head, const int32_t* block_table, int context_len,
                 int window_start, float* out) {
  const int head_dim = p.head_dim;
  const int64_t kv_row = static_cast<int64_t>(p.num_kv_heads) * head_dim;
  const int64_t head_offset = static_cast<int64_t>(kv_head) * head_dim;
  const float* key_cache = p.key_cache.as<const float>();
  const float* value_cache = p.value_cache.as<const float>();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  float acc[kMaxHeadsPerPass][kMaxHeadDim];
  float scores[kMaxHeadsPerPass][kMaxBlockSize];
  float running_max[kMaxHeadsPerPass];
  float denominator[kMaxHeadsPerPass];
  for (int h = 0; h < num_q; ++h) {
    std::fill(acc[h], acc[h] + head_dim, 0.0f);
    running_max[h] = kNegInf;
    denominator[h] = 0.0f;
  }

  const int num_context_blocks =
      (context_len + p.block_size - 1) / p.block_size;
  for (int b = window_start / p.block_size; b < num_context_blocks; ++b) {
    const int32_t block_id = block_table[b];
    if (block_id < 0 || block_id >= p.num_blocks) continue;
    const int n = std::min(p.block_size, context_len - b * p.block_size);
    const int64_t first_row = static_cast<int64_t>(block_id) * p.block_size;
    const float* keys = key_cache + first_row * kv_row + head_offset;
    const float* values = value_cache + first_row * kv_row + head_offset;

    float block_max[kMaxHeadsPerPass];
    std::fill(block_max, block_max + num_q, kNegInf);
    // Positions of this block before the window: masked (exp gives 0).
    const int first_visible = std::max(0, window_start - b * p.block_size);
    for (int j = 0; j < first_visible; ++j) {
      for (int h = 0; h < num_q; ++h) scores[h][j] = kNegInf;
    }
    for (int j = first_visible; j < n; ++j) {
      const float* k = keys + j * kv_row;
      for (int h = 0; h < num_q; ++h) {
        scores[h][j] = Dot(q + h * head_dim, k, head_dim) * p.scale;
        if (p.softcap > 0.0f) {
          scores[h][j] = p.softcap * std::tanh(scores[h][j] / p.softcap);
        }
        block_max[h] = std::max(block_max[h], scores[h][j]);
      }
    }
    for (int h = 0; h < num_q; ++h) {
      if (block_max[h] > running_max[h]) {
        // Rescale what was accumulated under the old maximum (exp(-inf) = 0
        // on the first block, when there is nothing to rescale).
        const float correction = std::exp(running_max[h] - block_max[h]);
        for (int d = 0; d < head_dim; ++d) acc[h][d] *= correction;
        denominator[h] *= correction;
        running_max[h] = block_max[h];
      }
      for (int j = 0; j < n; ++j) {
        scores[h][j] = std::exp(scores[h][j] - running_max[h]);
        denominator[h] += scores[h][j];
      }
    }
    for (int j = 0; j < n; ++j) {
      const float* v = values + j * kv_row;
      for (int h = 0; h < num_q; ++h) {
        AddScaled(scores[h][j], v, acc[h], head_dim);
      }
    }
  }
  for (int h = 0; h < num_q; ++h) {
    float* o = out + h * head_dim;
    if (denominator[h] > 0.0f) {
      const float inv = 1.0f / denominator[h];
      for (int d = 0; d < head_dim; ++d) o[d] = acc[h][d] * inv;
    } else {
      std::fill(o, o + head_dim, 0.0f);
    }
  }
}

// All heads of query row `token` of request `request`, whose last visible
// cache position is `last_position` (the token's own position).
void AttendToken(const PagedAttentionParams& p, int token, int request,
                 int64_t last_position) {
  const int64_t row_elements = static_cast<int64_t>(p.num_heads) * p.head_dim;
  float* out = p.output.as<float>() + token * row_elements;
  // The block table holds only max_blocks_per_seq blocks; positions past it
  // cannot be located.
  const int64_t context_len = std::min<int64_t>(
      last_position + 1,
      static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size);
  if (context_len <= 0) {
    std::fill(out, out + row_elements, 0.0f);
    return;
  }
  // A sliding window: the last `sliding_window` positions, its own included.
  const int64_t window_start =
      p.sliding_window > 0
          ? std::max<int64_t>(0, last_position + 1 - p.sliding_window)
          : 0;
  const float* q = p.query.as<const float>() +
                   static_cast<int64_t>(token) * p.query_row_stride;
  const int32_t* block_table =
      p.block_tables.as<const int32_t>() +
      static_cast<int64_t>(request) * p.max_blocks_per_seq;
  // Query heads h share kv head h / group; go through each group in passes
  // of at most kMaxHeadsPerPass heads.
  const int group = p.num_heads / p.num_kv_heads;
  for (int h = 0; h < p.num_heads;) {
    const int num_q = std::min(group - h % group, kMaxHeadsPerPass);
    AttendHeads(p, q + static_cast<int64_t>(h) * p.head_dim, num_q, h / group,
                block_table, static_cast<int>(context_len),
                static_cast<int>(window_start),
                out + static_cast<int64_t>(h) * p.head_dim);
    h += num_q;
  }
}

void VarlenAttentionCpu(const PagedAttentionParams& p) {
  const int64_t row_elements = static_cast<int64_t>(p.num_heads) * p.head_dim;
  // Padding rows (and rows of malformed requests) read as zeros.
  std::memset(p.output.data(), 0, sizeof(float) * p.num_tokens * row_elements);
  const int32_t* query_start = p.query_start_loc.as<const int32_t>();
  const int32_t* seq_lens = p.seq_lens.as<const int32_t>();
  const int num_reqs =
      std::clamp(p.num_reqs.as<const int32_t>()[0], 0, p.max_num_seqs);
  for (int r = 0; r < num_reqs; ++r) {
    const int begin = std::clamp(query_start[r], 0, p.num_tokens);
    const int end = std::clamp(query_start[r + 1], begin, p.num_tokens);
    const int64_t first_position =
        static_cast<int64_t>(seq_lens[r]) - (end - begin);
    for (int t = begin; t < end; ++t) {
      AttendToken(p, t, r, first_position + (t - begin));
    }
  }
}

void UniformDecodeAttentionCpu(const PagedAttentionParams& p) {
  const int k = p.uniform_query_len;
  const int num_requests = p.num_tokens / k;
  const int32_t* seq_lens = p.seq_lens.as<const int32_t>();
  for (int r = 0; r < num_requests; ++r) {
    // seq_len 0 (padding request) gives last positions < 0: zeros.
    const int64_t first_position = static_cast<int64_t>(seq_lens[r]) - k;
    for (int j = 0; j < k; ++j) {
      AttendToken(p, r * k + j, r, seq_lens[r] > 0 ? first_position + j : -1);
    }
  }
}

enum class Routine { kVarlen, kUniformDecode };

// Validates `p` for `routine` on `stream`'s backend and returns it with
// defaults resolved (dense query stride, 1/sqrt(head_dim) scale) in
// *resolved.
absl::Status CheckAndResolve(const Stream& stream, const char* op,
                             Routine routine, const PagedAttentionParams& p,
                             PagedAttentionParams* resolved) {
  absl::Status status =
      FirstError({CheckPositive(op, "num_tokens", p.num_tokens),
                  CheckPositive(op, "max_num_seqs", p.max_num_seqs),
                  CheckPositive(op, "num_heads", p.num_heads),
                  CheckPositive(op, "num_kv_heads", p.num_kv_heads),
                  CheckPositive(op, "head_dim", p.head_dim),
                  CheckPositive(op, "block_size", p.block_size),
                  CheckPositive(op, "num_blocks", p.num_blocks),
                  CheckPositive(op, "max_blocks_per_seq", p.max_blocks_per_seq),
                  CheckModelDType(stream, op, "dtype", p.dtype),
                  CheckBackendImplemented(stream, op)});
  if (!status.ok()) return status;
  if (p.num_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: num_heads (%d) must be a multiple of num_kv_heads (%d)", op,
        p.num_heads, p.num_kv_heads));
  }
  const bool on_cuda = stream.kind() == DeviceKind::kCuda;
  if (!on_cuda && (p.head_dim > kMaxHeadDim || p.block_size > kMaxBlockSize)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: head_dim %d / block_size %d exceed the CPU kernel's limits %d / "
        "%d",
        op, p.head_dim, p.block_size, kMaxHeadDim, kMaxBlockSize));
  }
#if PDW_HAVE_CUDA
  if (on_cuda &&
      (p.head_dim % 8 != 0 || p.head_dim > kCudaAttentionMaxHeadDim)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the CUDA kernels need a head_dim that is a multiple of 8 and <= "
        "%d, got %d",
        op, kCudaAttentionMaxHeadDim, p.head_dim));
  }
  // 16-byte loads of K and V rows (head_dim % 8 == 0 keeps every row
  // aligned once the base is).
  if (on_cuda &&
      (reinterpret_cast<uintptr_t>(p.key_cache.data()) % 16 != 0 ||
       reinterpret_cast<uintptr_t>(p.value_cache.data()) % 16 != 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the CUDA kernels need 16-byte aligned key and value caches", op));
  }
#endif
  if (!(p.scale >= 0.0f) || std::isinf(p.scale)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: scale must be finite and >= 0 (0: 1/sqrt(head_dim)), got %g", op,
        p.scale));
  }
  if (!(p.softcap >= 0.0f) || std::isinf(p.softcap)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: softcap must be finite and >= 0 (0: none), got %g",
                        op, p.softcap));
  }
  if (p.sliding_window < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: sliding_window must be >= 0 (0: none), got %d", op,
                        p.sliding_window));
  }
  *resolved = p;
  const int q_width = p.num_heads * p.head_dim;
  if (resolved->query_row_stride == 0) resolved->query_row_stride = q_width;
  if (resolved->query_row_stride < q_width) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: query_row_stride %d is below the row width %d", op,
                        p.query_row_stride, q_width));
  }
  if (resolved->scale == 0.0f) {
    resolved->scale = static_cast<float>(1.0 / std::sqrt(p.head_dim));
  }
  if (routine == Routine::kUniformDecode) {
    status = CheckPositive(op, "uniform_query_len", p.uniform_query_len);
    if (!status.ok()) return status;
    if (p.num_tokens % p.uniform_query_len != 0 ||
        p.num_tokens / p.uniform_query_len > p.max_num_seqs) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: num_tokens %d must be a multiple of uniform_query_len %d with "
          "at most max_num_seqs=%d requests",
          op, p.num_tokens, p.uniform_query_len, p.max_num_seqs));
    }
#if PDW_HAVE_CUDA
    if (on_cuda && p.uniform_query_len > kCudaAttentionMaxRowsPerCta) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: the CUDA decode kernel takes uniform_query_len <= %d, got %d",
          op, kCudaAttentionMaxRowsPerCta, p.uniform_query_len));
    }
#endif
  }

  const size_t element = DTypeSize(p.dtype);
  const absl::string_view type = ShortDTypeName(p.dtype);
  const int64_t kv_width = static_cast<int64_t>(p.num_kv_heads) * p.head_dim;
  const int64_t cache_elements =
      static_cast<int64_t>(p.num_blocks) * p.block_size * kv_width;
  const std::string cache_layout = absl::StrFormat(
      "[num_blocks=%d, block_size=%d, num_kv_heads=%d, head_dim=%d] %s",
      p.num_blocks, p.block_size, p.num_kv_heads, p.head_dim, type);
  const bool needs_workspace = on_cuda && routine == Routine::kUniformDecode;
  status = FirstError(
      {routine == Routine::kVarlen ? CheckBuffer(op, "num_reqs", p.num_reqs, 1,
                                                 sizeof(int32_t), "[1] int32")
                                   : absl::OkStatus(),
       routine == Routine::kVarlen
           ? CheckBuffer(op, "query_start_loc", p.query_start_loc,
                         p.max_num_seqs + 1, sizeof(int32_t),
                         absl::StrFormat("[max_num_seqs + 1=%d] int32",
                                         p.max_num_seqs + 1))
           : absl::OkStatus(),
       CheckBuffer(op, "seq_lens", p.seq_lens, p.max_num_seqs, sizeof(int32_t),
                   absl::StrFormat("[max_num_seqs=%d] int32", p.max_num_seqs)),
       CheckBuffer(
           op, "block_tables", p.block_tables,
           static_cast<int64_t>(p.max_num_seqs) * p.max_blocks_per_seq,
           sizeof(int32_t),
           absl::StrFormat("[max_num_seqs=%d, max_blocks_per_seq=%d] int32",
                           p.max_num_seqs, p.max_blocks_per_seq)),
       CheckBuffer(
           op, "query", p.query,
           StridedElements(p.num_tokens, q_width, resolved->query_row_stride),
           element,
           absl::StrFormat("[num_tokens=%d, num_heads=%d, head_dim=%d] %s, row "
                           "stride %d",
                           p.num_tokens, p.num_heads, p.head_dim, type,
                           resolved->query_row_stride)),
       CheckBuffer(op, "key_cache", p.key_cache, cache_elements, element,
                   cache_layout),
       CheckBuffer(op, "value_cache", p.value_cache, cache_elements, element,
                   cache_layout),
       CheckBuffer(
           op, "output", p.output, static_cast<int64_t>(p.num_tokens) * q_width,
           element,
           absl::StrFormat("[num_tokens=%d, num_heads=%d, head_dim=%d] %s",
                           p.num_tokens, p.num_heads, p.head_dim, type)),
       needs_workspace
           ? CheckBuffer(op, "workspace", p.workspace,
                         static_cast<int64_t>(DecodeLaunchWorkspaceBytes(p)), 1,
                         "(head_dim + 2) * 4 * num_tokens * num_heads * "
                         "CudaDecodeNumSplits(...) bytes")
           : absl::OkStatus()});
  if (!status.ok()) return status;
  // The output is written while q and the caches are still being read.
  const size_t out_bytes = element * p.num_tokens * q_width;
  return FirstError(
      {CheckDisjoint(op, "output", p.output, out_bytes, "query", p.query,
                     element * StridedElements(p.num_tokens, q_width,
                                               resolved->query_row_stride)),
       CheckDisjoint(op, "output", p.output, out_bytes, "key_cache",
                     p.key_cache, element * cache_elements),
       CheckDisjoint(op, "output", p.output, out_bytes, "value_cache",
                     p.value_cache, element * cache_elements)});
}

#if PDW_HAVE_CUDA
PagedAttentionCudaParams ToCudaParams(const PagedAttentionParams& p) {
  PagedAttentionCudaParams c;
  c.num_reqs = p.num_reqs.as<const int32_t>();
  c.query_start_loc = p.query_start_loc.as<const int32_t>();
  c.seq_lens = p.seq_lens.as<const int32_t>();
  c.block_tables = p.block_tables.as<const int32_t>();
  c.query = p.query.as<const __nv_bfloat16>();
  c.key_cache = p.key_cache.as<const __nv_bfloat16>();
  c.value_cache = p.value_cache.as<const __nv_bfloat16>();
  c.output = p.output.as<__nv_bfloat16>();
  c.workspace = p.workspace.as<float>();
  c.num_tokens = p.num_tokens;
  c.max_num_seqs = p.max_num_seqs;
  c.num_heads = p.num_heads;
  c.num_kv_heads = p.num_kv_heads;
  c.head_dim = p.head_dim;
  c.block_size = p.block_size;
  c.num_blocks = p.num_blocks;
  c.max_blocks_per_seq = p.max_blocks_per_seq;
  c.query_row_stride = p.query_row_stride;
  c.scale = p.scale;
  c.softcap = p.softcap;
  c.sliding_window = p.sliding_window;
  c.uniform_query_len = p.uniform_query_len;
  c.num_splits = DecodeSplits(p);
  c.mma_warp_rows = p.mma_warp_rows;
  c.wgmma_tile_keys = p.wgmma_tile_keys;
  c.wgmma_overlap = p.wgmma_schedule == WgmmaSchedule::kDefault      ? -1
                    : p.wgmma_schedule == WgmmaSchedule::kOverlapped ? 1
                                                                     : 0;
  return c;
}
#endif

}  // namespace

AttentionCGSupport PagedAttentionCGSupport(DeviceKind kind) {
  return kind == DeviceKind::kCuda ? kCudaPagedAttentionCGSupport
                                   : kCpuPagedAttentionCGSupport;
}

int CudaDecodeNumSplits(int num_tokens, int uniform_query_len, int num_heads,
                        int num_kv_heads, int64_t max_context) {
  if (num_tokens <= 0 || uniform_query_len <= 0 || num_heads <= 0 ||
      num_kv_heads <= 0 || max_context <= 0) {
    return 1;
  }
  const int64_t requests = std::max(num_tokens / uniform_query_len, 1);
  const int64_t group = std::max(num_heads / num_kv_heads, 1);
  // As LaunchPagedAttentionDecodeCuda splits a GQA group over CTAs.
  const int64_t heads_per_cta = std::max<int64_t>(
      1, std::min<int64_t>(
             group, kCudaAttentionMaxUniformQueryLen / uniform_query_len));
  const int64_t ctas = requests * num_kv_heads * CeilDiv(group, heads_per_cta);
  int64_t splits = CeilDiv(kCudaDecodeTargetCtas, ctas);
  splits = std::min<int64_t>(splits, kCudaDecodeMaxSplits);
  splits = std::min(splits, CeilDiv(max_context, kCudaDecodeMinSplitKeys));
  splits = std::min(splits, kCudaDecodeMaxWorkspaceSlots /
                                (static_cast<int64_t>(num_tokens) * num_heads));
  return static_cast<int>(std::max<int64_t>(splits, 1));
}

size_t PagedAttentionWorkspaceBytes(int max_decode_tokens, int num_heads,
                                    int head_dim, int max_blocks_per_seq,
                                    int block_size) {
  if (max_decode_tokens <= 0 || num_heads <= 0 || head_dim <= 0 ||
      max_blocks_per_seq <= 0 || block_size <= 0) {
    return 0;
  }
  // tokens × heads × CudaDecodeNumSplits(tokens, ...) for any tokens <= the
  // maximum T: splits <= cap, and splits <= 16384 / (tokens × heads) unless
  // that is below 1, so the product is at most max(min(cap·T·H, 16384), T·H).
  const int64_t max_context =
      static_cast<int64_t>(max_blocks_per_seq) * block_size;
  const int64_t cap = std::min<int64_t>(
      kCudaDecodeMaxSplits, CeilDiv(max_context, kCudaDecodeMinSplitKeys));
  const int64_t rows = static_cast<int64_t>(max_decode_tokens) * num_heads;
  const int64_t slots =
      std::max(std::min(cap * rows, kCudaDecodeMaxWorkspaceSlots), rows);
  // Per (token, head, split): head_dim outputs, a max and a sum.
  return sizeof(float) * static_cast<size_t>(slots) * (head_dim + 2);
}

bool PagedAttentionHasWarpgroupMma(DeviceKind kind) {
#if PDW_HAVE_CUDA
  return kind == DeviceKind::kCuda && CudaCurrentDeviceHasWgmma();
#else
  (void)kind;
  return false;
#endif
}

#if PDW_HAVE_CUDA
namespace {
absl::Status LaunchWgmma(Stream& stream, const PagedAttentionCudaParams& c) {
  return LaunchCudaOp(stream, "paged_attention", [c](const OpContext& ctx) {
    return CudaStatus(LaunchPagedAttentionVarlenWgmmaCuda(
                          c, static_cast<cudaStream_t>(ctx.cuda_stream)),
                      "paged_attention (warpgroup mma)");
  });
}
}  // namespace
#endif

absl::Status CheckVarlenAttentionKernel(DeviceKind kind,
                                        VarlenAttentionKernel kernel,
                                        int64_t head_dim, int64_t num_heads,
                                        int64_t num_kv_heads) {
  if (kernel == VarlenAttentionKernel::kAuto) return absl::OkStatus();
  if (kind != DeviceKind::kCuda) {
    return absl::InvalidArgumentError(absl::StrCat(
        "varlen_attention_kernel must be auto on the ", DeviceKindName(kind),
        " backend (it has one attention routine)"));
  }
  if (kernel == VarlenAttentionKernel::kCudaCores) return absl::OkStatus();
  const int64_t group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
  if ((head_dim != 64 && head_dim != 128) || group < 1 ||
      group > kTensorCoreAttentionMaxGroup) {
    return absl::InvalidArgumentError(absl::StrCat(
        "varlen_attention_kernel: the tensor-core kernels cover head_dim 64 "
        "or 128 with GQA groups of 1-",
        kTensorCoreAttentionMaxGroup, "; the model has head_dim ", head_dim,
        " and ", num_heads, " heads over ", num_kv_heads, " kv heads"));
  }
  if (kernel == VarlenAttentionKernel::kWarpgroupMma &&
      !PagedAttentionHasWarpgroupMma(kind)) {
    return absl::InvalidArgumentError(
        "varlen_attention_kernel kWarpgroupMma needs a CUDA device of "
        "compute capability 9.0 (H100, H200)");
  }
  return absl::OkStatus();
}

absl::Status LaunchPagedAttention(Stream& stream,
                                  const PagedAttentionParams& p) {
  constexpr char kOp[] = "paged_attention";
  PagedAttentionParams resolved;
  absl::Status status =
      CheckAndResolve(stream, kOp, Routine::kVarlen, p, &resolved);
  if (!status.ok()) return status;
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) {
    const PagedAttentionCudaParams c = ToCudaParams(resolved);
    bool tensor_cores = false;
    switch (resolved.varlen_kernel) {
      case VarlenAttentionKernel::kAuto:
        if (kVarlenAttentionAutoWarpgroupMma &&
            PagedAttentionWgmmaSupports(c)) {
          return LaunchWgmma(stream, c);
        }
        tensor_cores = PagedAttentionMmaSupports(c);
        if (!tensor_cores) {
          LOG_FIRST_N(WARNING, 1)
              << "paged_attention: no tensor-core kernel for head_dim "
              << p.head_dim << " with " << p.num_heads << " heads over "
              << p.num_kv_heads
              << " kv heads (it covers head_dim 64 and 128, GQA groups of "
                 "1-8, 16-byte aligned query rows); varlen steps use the "
                 "CUDA-core kernel";
        }
        break;
      case VarlenAttentionKernel::kTensorCores:
        if (!PagedAttentionMmaSupports(c)) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s: varlen_kernel kTensorCores covers head_dim 64 or 128 and "
              "GQA groups of 1-%d with 16-byte aligned query rows; got "
              "head_dim %d, %d heads over %d kv heads, query_row_stride %d",
              kOp, kCudaAttentionMmaMaxGroup, p.head_dim, p.num_heads,
              p.num_kv_heads, resolved.query_row_stride));
        }
        tensor_cores = true;
        break;
      case VarlenAttentionKernel::kWarpgroupMma:
        if (!PagedAttentionWgmmaSupports(c)) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s: varlen_kernel kWarpgroupMma needs a compute capability "
              "9.0 device and covers head_dim 64 or 128, GQA groups of 1-%d "
              "with 16-byte aligned query rows and wgmma_tile_keys 0, 64 or "
              "128; got head_dim %d, %d heads over %d kv heads, "
              "query_row_stride %d, wgmma_tile_keys %d",
              kOp, kCudaAttentionMmaMaxGroup, p.head_dim, p.num_heads,
              p.num_kv_heads, resolved.query_row_stride, p.wgmma_tile_keys));
        }
        return LaunchWgmma(stream, c);
      case VarlenAttentionKernel::kCudaCores:
        break;
    }
    if (tensor_cores) {
      return LaunchCudaOp(stream, kOp, [c](const OpContext& ctx) {
        return CudaStatus(LaunchPagedAttentionVarlenMmaCuda(
                              c, static_cast<cudaStream_t>(ctx.cuda_stream)),
                          "paged_attention (tensor cores)");
      });
    }
    return LaunchCudaOp(stream, kOp, [c](const OpContext& ctx) {
      return CudaStatus(LaunchPagedAttentionVarlenCuda(
                            c, static_cast<cudaStream_t>(ctx.cuda_stream)),
                        "paged_attention");
    });
  }
#endif
  return stream.Launch(
      kOp, [resolved](const OpContext&) { VarlenAttentionCpu(resolved); });
}

#if PDW_HAVE_CUDA
absl::StatusOr<PagedAttentionCudaParams> ResolveUniformDecodeCuda(
    const Stream& stream, const PagedAttentionParams& p) {
  constexpr char kOp[] = "paged_attention_decode";
  PagedAttentionParams resolved;
  PDW_RETURN_IF_ERROR(
      CheckAndResolve(stream, kOp, Routine::kUniformDecode, p, &resolved));
  if (stream.kind() != DeviceKind::kCuda) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: not a CUDA stream", kOp));
  }
  PagedAttentionCudaParams c = ToCudaParams(resolved);
  c.programmatic_launch = resolved.decode_pdl == DecodeAttentionPdl::kOn;
  c.decode_tensor_cores =
      resolved.decode_kernel == DecodeAttentionKernel::kTensorCores ||
      (resolved.decode_kernel == DecodeAttentionKernel::kAuto &&
       kDecodeAttentionAutoTensorCores && PagedAttentionDecodeMmaSupports(c));
  if (c.decode_tensor_cores && !PagedAttentionDecodeMmaSupports(c)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: decode_kernel kTensorCores covers head_dim 64 or 128 with at "
        "most 16 query rows per kv head and 16-byte aligned query rows; got "
        "head_dim %d, %d heads over %d kv heads, uniform_query_len %d, "
        "query_row_stride %d",
        kOp, p.head_dim, p.num_heads, p.num_kv_heads, p.uniform_query_len,
        resolved.query_row_stride));
  }
  return c;
}
#endif

absl::Status LaunchPagedAttentionUniformDecode(Stream& stream,
                                               const PagedAttentionParams& p) {
  constexpr char kOp[] = "paged_attention_decode";
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) {
    PDW_ASSIGN_OR_RETURN(const PagedAttentionCudaParams c,
                         ResolveUniformDecodeCuda(stream, p));
    return LaunchCudaOp(stream, kOp, [c](const OpContext& ctx) {
      return CudaStatus(LaunchPagedAttentionDecodeCuda(
                            c, static_cast<cudaStream_t>(ctx.cuda_stream)),
                        "paged_attention_decode");
    });
  }
#endif
  PagedAttentionParams resolved;
  PDW_RETURN_IF_ERROR(
      CheckAndResolve(stream, kOp, Routine::kUniformDecode, p, &resolved));
  return stream.Launch(kOp, [resolved](const OpContext&) {
    UniformDecodeAttentionCpu(resolved);
  });
}

}  // namespace kernels
}  // namespace pdworker
