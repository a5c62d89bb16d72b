// Attention over the paged KV cache: the op the forward is split at. Two
// routines share one params struct and one inner loop:
//  - varlen (prefill / mixed batches): any mix of query lengths per request;
//  - uniform decode: every request has exactly `uniform_query_len` query
//    tokens (1, or 1 + speculative tokens), laid out request after request.
// Both are causal, support GQA/MQA, and read all per-step metadata from the
// static buffers when the op runs.
#ifndef PDWORKER_WORKER_KERNELS_PAGED_ATTENTION_H_
#define PDWORKER_WORKER_KERNELS_PAGED_ATTENTION_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "dispatcher/attention_cg_support.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA
#include "worker/runtime/device.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

#if PDW_HAVE_CUDA
#include "worker/kernels/paged_attention_cuda.h"
#endif

namespace pdworker {
namespace kernels {

// The CPU kernels read num_reqs, query_start_loc, seq_lens and block_tables
// from their static buffers each time the op runs, and derive every loop
// bound from them; the closure holds only buffer pointers and the padded
// shape of the captured batch. A graph captured for one batch therefore
// stays correct for any batch of the same padded size — uniform or mixed,
// any split into requests — so attention may be inside FULL graphs always.
constexpr AttentionCGSupport kCpuPagedAttentionCGSupport =
    AttentionCGSupport::kAlways;

// The CUDA kernels obey the same contract: every per-step value (num_reqs,
// query_start_loc, seq_lens, block_tables, slots) is read by the kernels on
// the device, and every grid is sized from the params' fixed shape only
// (padded num_tokens, max_num_seqs, heads, max_blocks_per_seq); CTAs with no
// work return at once (the decode routine's split count comes from the
// launch shape, and each split takes an even share of its request's
// context). Its split-K partials live in a workspace allocated at startup
// for the largest decode batch. The tensor-core varlen kernel sizes its grid
// from (num_kv_heads, padded num_tokens, max_num_seqs) and finds each CTA's
// request and query tile on the device. All routines are therefore safe
// inside FULL graphs for any batch (mixed prefill/decode included).
constexpr AttentionCGSupport kCudaPagedAttentionCGSupport =
    AttentionCGSupport::kAlways;

// The support constant of the kernels that run on `kind`.
AttentionCGSupport PagedAttentionCGSupport(DeviceKind kind);

// CUDA uniform decode (flash-decoding): each (request, kv head [, head
// chunk]) is split over up to kCudaDecodeMaxSplits CTAs, each taking an even
// share of the context but at least kCudaDecodeMinSplitKeys keys. The split
// count depends on the launch shape only (so one captured graph serves every
// step of it): enough CTAs to fill an H100 (kCudaDecodeTargetCtas) at small
// batches, one split when the batch alone fills it, and never more partial
// rows (tokens × heads × splits) than kCudaDecodeMaxWorkspaceSlots unless
// one split already exceeds it. Example, Llama-3.2-1B (32 heads, 8 kv
// heads): batch 1 gets 64 splits, batch 8 gets 8, batch 64 and more get 1.
inline constexpr int kCudaDecodeMinSplitKeys = 32;
inline constexpr int kCudaDecodeMaxSplits = 64;
inline constexpr int kCudaDecodeTargetCtas = 512;
inline constexpr int64_t kCudaDecodeMaxWorkspaceSlots = 16384;

// Split-K CTAs per (request, kv head [, head chunk]) for a CUDA uniform
// decode launch of `num_tokens` query rows of `uniform_query_len` tokens per
// request, against contexts of at most `max_context` tokens.
int CudaDecodeNumSplits(int num_tokens, int uniform_query_len, int num_heads,
                        int num_kv_heads, int64_t max_context);

// The CUDA uniform decode routine handles query lengths up to this (1 +
// speculative tokens); a CTA holds at most 8 query rows.
inline constexpr int kCudaAttentionMaxUniformQueryLen = 8;

// Bytes of the CUDA decode routine's workspace (fp32 partial outputs, maxima
// and sums per split) for launches of up to `max_decode_tokens` query rows
// (max_num_seqs × uniform_query_len) against contexts of up to
// max_blocks_per_seq × block_size tokens: at most
// (head_dim + 2) · 4 · max(16384, max_decode_tokens · num_heads) bytes. The
// CPU kernels need none.
size_t PagedAttentionWorkspaceBytes(int max_decode_tokens, int num_heads,
                                    int head_dim, int max_blocks_per_seq,
                                    int block_size);

// Which CUDA kernel a varlen launch runs (the CPU backend has one).
enum class VarlenAttentionKernel {
  // Tensor cores (FlashAttention-2 style, mma.sync; the warpgroup-MMA
  // kernel instead on compute capability 9.0 once
  // kVarlenAttentionAutoWarpgroupMma) where they cover the shape: head_dim
  // 64 or 128, GQA groups of 1-8; the CUDA-core kernel otherwise (logged
  // once per process).
  kAuto,
  // The tensor-core kernel; InvalidArgument where it does not cover the
  // shape (tests and benchmarks).
  kTensorCores,
  // The CUDA-core kernel: one CTA per (token, kv head); the reference the
  // tensor-core kernel is tested against.
  kCudaCores,
  // Hopper's warpgroup MMA (wgmma): the tensor-core kernel's tiles with its
  // products on wgmma; compute capability 9.0 only, head_dim 64 or 128, GQA
  // groups of 1-8; InvalidArgument elsewhere. Not yet measured on a GPU, so
  // kAuto does not pick it.
  kWarpgroupMma,
};

// How the warpgroup-MMA varlen kernel orders a warpgroup's work per key
// tile (benchmarks compare; tests run both).
enum class WgmmaSchedule {
  kDefault,  // kCudaAttentionWgmmaOverlapDefault
  // S = Q·Kᵀ, wait, softmax, O += P·V, wait.
  kSerial,
  // FlashAttention-3's intra-warpgroup overlap: the next tile's S and this
  // tile's P·V are issued together, and the next tile's softmax runs while
  // P·V is on the tensor cores (10-35 more registers).
  kOverlapped,
};

// Which CUDA kernel a uniform decode launch splits the keys with (the
// reduce kernel is shared; the CPU backend has one routine).
enum class DecodeAttentionKernel {
  // The tensor-core split kernel where it covers the launch
  // (kDecodeAttentionAutoTensorCores), the CUDA-core one elsewhere.
  kAuto,
  // Tensor cores (paged_attention_decode_mma.cu): head_dim 64 or 128 and at
  // most 16 query rows per kv head (GQA group × uniform_query_len);
  // InvalidArgument elsewhere.
  kTensorCores,
  // The CUDA-core split kernel: the reference.
  kCudaCores,
};

// Whether a uniform decode launch's kernels (split, then reduce) overlap
// the kernel before each with programmatic dependent launch (CUDA): kOn
// schedules each while the previous one drains and waits for it on the
// device before any read; kOff leaves the stream's full serialization.
// The bits are the same; benchmarks compare.
enum class DecodeAttentionPdl { kOn, kOff };

// kAuto's decode kernel: the tensor-core one where it covers the launch.
// On the H200 it is ahead of the CUDA-core kernel at every batch and
// context gpu_decode_bench --attention_only measures (1.4x at batch 1 ×
// 1k, 2.8x at batch 32 × 16k: 73% of HBM against 26%; bench/RESULTS.md,
// 2026-11-27). false brings back the CUDA-core kernel everywhere.
inline constexpr bool kDecodeAttentionAutoTensorCores = true;

// kAuto's varlen kernel on compute capability 9.0 devices: the
// warpgroup-MMA one where it covers the launch (true), or the mma.sync one.
// false until a GPU run shows the warpgroup-MMA kernel correct and faster
// (scripts/gpu-check issue22).
inline constexpr bool kVarlenAttentionAutoWarpgroupMma = false;

// Largest GQA group (query heads per kv head) the tensor-core varlen
// kernels cover.
inline constexpr int kTensorCoreAttentionMaxGroup = 8;

struct PagedAttentionParams {
  // --- Step metadata (int32), read at run time. ---
  // Real requests this step, [1]. Varlen only (uniform decode may leave it
  // empty). Clamped to [0, max_num_seqs].
  DeviceBuffer num_reqs;
  // Cumulative query lengths, [max_num_seqs + 1]: request r's query tokens
  // are rows [query_start_loc[r], query_start_loc[r + 1]). Varlen only.
  DeviceBuffer query_start_loc;
  // Context length of each request INCLUDING this step's query tokens,
  // [max_num_seqs]; 0 for padding requests.
  DeviceBuffer seq_lens;
  // [max_num_seqs, max_blocks_per_seq]: cache block ids of each request's
  // positions 0, block_size, 2·block_size, ... in order (any block ids).
  DeviceBuffer block_tables;

  // --- Tensors, of `dtype` (fp32 on the CPU backend, bf16 on CUDA). ---
  // [num_tokens, num_heads, head_dim], rows `query_row_stride` elements
  // apart (0: dense), so q may be a slice of a fused qkv output. Already
  // rotated (rope_kv_cache), whose k/v for this step are already in the cache.
  DeviceBuffer query;
  // One layer's cache, [num_blocks, block_size, num_kv_heads, head_dim].
  DeviceBuffer key_cache;
  DeviceBuffer value_cache;
  // [num_tokens, num_heads, head_dim], dense (the o_proj input). Rows no
  // real query token maps to (padding) are written with zeros.
  DeviceBuffer output;

  // --- Shape, fixed for a captured graph. ---
  int num_tokens = 0;    // padded query rows
  int max_num_seqs = 0;  // rows of seq_lens / block_tables
  int num_heads = 0;     // query heads; a multiple of num_kv_heads
  int num_kv_heads = 0;  // head h reads kv head h / (num_heads / num_kv_heads)
  int head_dim = 0;      // <= kMaxHeadDim
  int block_size = 0;    // tokens per cache block, <= 256
  int num_blocks = 0;    // blocks in the cache
  int max_blocks_per_seq = 0;
  int query_row_stride = 0;
  float scale = 0.0f;  // softmax scale; 0 means 1 / sqrt(head_dim)
  // Gemma 2's attn_logit_softcapping: each scaled score s becomes
  // softcap * tanh(s / softcap) before the softmax; 0 means none. On CUDA
  // the CUDA-core kernels only (kAuto picks them; a forced tensor-core
  // kernel refuses), written without a GPU (UnverifiedCudaKernels).
  float softcap = 0.0f;
  // > 0: a query at position i sees only positions > i - sliding_window
  // (the last sliding_window tokens, its own included; Mistral's, Gemma's
  // and transformers' mask); 0: the whole context. On CUDA as softcap.
  int sliding_window = 0;
  // Uniform decode only: query tokens per request (k >= 1); request r owns
  // rows [r·k, (r + 1)·k) and num_tokens / k (<= max_num_seqs) requests are
  // processed, padding requests (seq_len 0) included.
  int uniform_query_len = 0;
  DType dtype = DType::kFloat32;
  // CUDA varlen only: which kernel (uniform decode has one).
  VarlenAttentionKernel varlen_kernel = VarlenAttentionKernel::kAuto;
  // CUDA uniform decode only: which split kernel.
  DecodeAttentionKernel decode_kernel = DecodeAttentionKernel::kAuto;
  // CUDA uniform decode only.
  DecodeAttentionPdl decode_pdl = DecodeAttentionPdl::kOn;
  // CUDA tensor-core varlen only: query rows per warp (16 or 32); 0 takes
  // the measured default. Benchmarks and tests set it.
  int mma_warp_rows = 0;
  // CUDA warpgroup-MMA varlen only: key positions per K/V tile (64 or 128);
  // 0 takes the default for the head dim. Benchmarks and tests set it.
  int wgmma_tile_keys = 0;
  // CUDA warpgroup-MMA varlen only: how a warpgroup orders its work.
  WgmmaSchedule wgmma_schedule = WgmmaSchedule::kDefault;
  // CUDA uniform decode only: scratch of at least
  // PagedAttentionWorkspaceBytes(num_tokens, num_heads, head_dim,
  // max_blocks_per_seq, block_size) bytes, from the startup arena. Ignored
  // elsewhere (may be empty).
  DeviceBuffer workspace;
};

// True when varlen_kernel kWarpgroupMma can run on a `kind` device: CUDA,
// the current device of compute capability 9.0, in a build with CUDA.
bool PagedAttentionHasWarpgroupMma(DeviceKind kind);

// OK when varlen steps of a model (head_dim, heads over kv heads) can run
// `kernel` on a `kind` device: kAuto anywhere, the others on CUDA only,
// kTensorCores / kWarpgroupMma where they cover the model, kWarpgroupMma on
// compute capability 9.0. InvalidArgument naming what is missing.
absl::Status CheckVarlenAttentionKernel(DeviceKind kind,
                                        VarlenAttentionKernel kernel,
                                        int64_t head_dim, int64_t num_heads,
                                        int64_t num_kv_heads);

// Varlen causal attention. For r < num_reqs[0] with q_len = query_start_loc
// [r+1] − query_start_loc[r]: query token j of r sits at absolute position
// seq_lens[r] − q_len + j and attends to cache positions 0..that position
// through block_tables[r]. Every other output row is zero.
absl::Status LaunchPagedAttention(Stream& stream,
                                  const PagedAttentionParams& p);

// Uniform decode: the same math for num_tokens / uniform_query_len requests
// of uniform_query_len tokens each; query_start_loc and num_reqs are not
// read. A request with seq_len 0 (padding) gets zeros, never NaN.
// CPU: the varlen inner loop, so both routines give the same bits. CUDA:
// split-K over CudaDecodeNumSplits CTAs per request and kv head plus a
// reduce kernel (uniform_query_len <= 8); its bits differ from the varlen
// routine's (another summation order), and from a launch of another shape
// (another split), but are fixed for a given shape.
absl::Status LaunchPagedAttentionUniformDecode(Stream& stream,
                                               const PagedAttentionParams& p);

#if PDW_HAVE_CUDA
// What LaunchPagedAttentionUniformDecode checks on a CUDA stream, and the
// params of its kernels (split count, split kernel, PDL), for kernels that
// run the attention inside a bigger kernel.
absl::StatusOr<PagedAttentionCudaParams> ResolveUniformDecodeCuda(
    const Stream& stream, const PagedAttentionParams& p);
#endif

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_PAGED_ATTENTION_H_
