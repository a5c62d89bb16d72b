// LlamaForward: the decoder forward as pieces split at attention, wrapped for
// FULL and PIECEWISE graphs exactly like vLLM's nested wrappers.
//
//   piece 0      embed -> input_norm[0] -> qkv[0]
//   attention 0  rope + KV write + paged attention          (split op)
//   piece l      o_proj[l-1] -> post_norm -> MLP -> input_norm[l] -> qkv[l]
//   ...
//   piece L      o_proj[L-1] -> post_norm -> MLP -> final norm -> lm_head
//                (the final norm gathers the sampled rows: the LM head's
//                 gather is not a kernel of its own)
//
// Fused decode steps (CUDA, where the skinny GEMMs run, DecodeFusion::kOn):
// each RMSNorm rides in the next projection's prologue (qkv, gate_up), each
// residual add in the previous one's epilogue (o_proj, down), and RoPE with
// the KV-cache write in qkv's epilogue, so a layer is qkv -> paged attention
// -> o_proj -> gate_up -> down with no norm or RoPE kernels; the final
// norm (with the gather) stays. Bit-identical to the unfused sequence. (In
// PIECEWISE graphs the KV write then sits inside the piece before the attention
// split op.)
//
// A FULL GraphWrapper wraps the whole sequence; a PIECEWISE GraphWrapper
// wraps each piece. The ForwardContext decides which one fires: FULL -> the
// outer graph (pieces run directly inside its capture), PIECEWISE -> each
// piece's graph with attention eager in between, NONE -> everything eager.
#ifndef PDWORKER_WORKER_MODEL_LLAMA_FORWARD_H_
#define PDWORKER_WORKER_MODEL_LLAMA_FORWARD_H_

#include <array>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dispatcher/capture_lifecycle.h"
#include "dispatcher/forward_context.h"
#include "dispatcher/graph_wrapper.h"
#include "worker/kernels/decode_megakernel.h"
#include "worker/kernels/embedding.h"
#include "worker/kernels/linear.h"
#include "worker/kernels/lm_head.h"
#include "worker/kernels/paged_attention.h"
#include "worker/kernels/step_buffers.h"
#include "worker/model/forward_config.h"
#include "worker/model/llama_weights.h"
#include "worker/model/model_config.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/stream.h"

namespace pdworker {

enum class DecodeFusion { kOff, kOn };
// kOn: on CUDA, the LM head of a one-row step also folds its logits for the
// greedy sampler (kernels::LmHeadWritesGreedyTiles, lm_head_greedy.cu), so a
// greedy step's sampler skips its pass over the logits; kOff: never (tests
// and benchmarks compare the two; tokens and logprobs are the same bits).
enum class GreedyHeadFusion { kOff, kOn };

// kOn: on CUDA, a one-token uniform decode step (batch 1 in its FULL graph
// and the graph's warm-up runs) runs every decoder layer in one cooperative
// kernel (kernels::DecodeMegakernelPlan: the fused step's CTA bodies, so
// the same bits, with L2 prefetch of the weights ahead); the embedding and
// the LM head stay kernels of their own. kOff: the layers' kernels one by
// one. Create refuses kOn where the megakernel cannot run the model (not
// CUDA, DecodeFusion::kOff, a head_dim other than 64 or 128, a forced
// kernel other than the CUDA-core skinny GEMM or the tensor-core decode
// attention).
enum class DecodeMegakernel { kOff, kOn };

// CUDA kernels written without a GPU that have not passed their GPU tests
// yet (UnverifiedCudaFeatures below: Qwen3's per-head q/k
// norm, partial rotary, Gemma's layer; and windowed attention): kRefuse
// (default) refuses a model that needs them on CUDA, naming them, and runs
// a windowed model within its window (ModelRunner caps max_model_len);
// kAllow runs them (the GPU tests, and a user who wants to try:
// --unverified_cuda_kernels=allow). The flag goes when a GPU run has passed
// them.
enum class UnverifiedCudaKernels { kRefuse, kAllow };

// Which kernels the forward runs: the defaults serve; tests and benchmarks
// override them to compare. ModelRunnerOptions carries the same struct
// (ModelRunner::Create refuses choices the device or model cannot run).
struct ForwardKernelOptions {
  // The GEMM of every projection and the LM head (kernels::LinearKernel;
  // kAuto on the CPU backend). A forced skinny kernel runs the launches of
  // at most kernels::kLinearSkinnyMaxTokens rows (decode steps); larger ones
  // (prefill, wide batches) use kAuto, so a benchmark can force it for a
  // whole model run.
  kernels::LinearKernel linear_kernel = kernels::LinearKernel::kAuto;
  // kOn: fuse the norms, residual adds and RoPE + KV write into the
  // projections wherever kernels::LinearCanFuse allows it for the step's
  // token count (see the file comment); kOff: never (tests and benchmarks
  // compare the two). kOn by default: on the H200 the fused 1B batch-1
  // step runs 100 kernels instead of 148, 1.078 ms instead of 1.237
  // (bench/RESULTS.md, 2026-11-27), with every logit bit-identical.
  DecodeFusion decode_fusion = DecodeFusion::kOn;
  GreedyHeadFusion greedy_head_fusion = GreedyHeadFusion::kOn;
  // Off by default until an H200 run has timed it (bench/RESULTS.md).
  DecodeMegakernel decode_megakernel = DecodeMegakernel::kOff;
  kernels::DecodeMegakernelTuning megakernel_tuning;
  // The uniform-decode attention's split kernel on CUDA. kTensorCores runs
  // the tensor-core one where it covers the model (head_dim 64 or 128, at
  // most 16 query rows per kv head) and kAuto elsewhere, so a benchmark can
  // ask for it for a whole model run.
  kernels::DecodeAttentionKernel decode_attention_kernel =
      kernels::DecodeAttentionKernel::kAuto;
  // The uniform-decode attention's kernels under programmatic dependent
  // launch (kernels::DecodeAttentionPdl); benchmarks compare.
  kernels::DecodeAttentionPdl decode_attention_pdl =
      kernels::DecodeAttentionPdl::kOn;
  // The varlen (prefill, mixed) attention kernel on CUDA; benchmarks compare
  // them over whole prefills. ModelRunner::Create refuses one the device or
  // the model does not support.
  kernels::VarlenAttentionKernel varlen_attention_kernel =
      kernels::VarlenAttentionKernel::kAuto;
  UnverifiedCudaKernels unverified_cuda_kernels =
      UnverifiedCudaKernels::kRefuse;
};

struct LlamaForwardOptions {
  int max_num_tokens = 0;  // padded query tokens per step
  int max_num_seqs = 0;    // requests per step
  int block_size = 16;     // KV tokens per block
  int num_blocks = 0;      // KV blocks per layer
  int max_blocks_per_seq = 0;
  int uniform_decode_query_len = 1;
  InputAddressCheck input_address_check = InputAddressCheck::kOff;
  ForwardKernelOptions kernel_options;
};

// Static activations, reused by every step and every graph. Element type:
// the weights' (fp32 on the CPU backend, bf16 on CUDA), except the fp32
// logits and RoPE frequencies.
struct LlamaActivations {
  DeviceBuffer residual;  // [max_tokens, hidden]
  DeviceBuffer hidden;    // [max_tokens, hidden]
  DeviceBuffer qkv;       // [max_tokens, q_size + 2 * kv_size]
  DeviceBuffer attn_out;  // [max_tokens, q_size]
  DeviceBuffer gate_up;   // [max_tokens, 2 * intermediate]
  DeviceBuffer mlp_act;   // [max_tokens, intermediate]
  DeviceBuffer gathered;  // [MaxLogitsRows, hidden]
  DeviceBuffer logits;    // [MaxLogitsRows, vocab], fp32
  DeviceBuffer inv_freq;  // [head_dim / 2], fp32
  // Gemma 3 (ModelConfig::local_rope_theta): the sliding layers' table,
  // [head_dim / 2] fp32; otherwise empty (every layer reads inv_freq).
  DeviceBuffer local_inv_freq;
  // CUDA only: the decode attention's split-K partials, sized for the
  // largest uniform decode batch (PagedAttentionWorkspaceBytes). Empty on
  // the CPU backend.
  DeviceBuffer attention_workspace;
  // CUDA only: one row's greedy tile folds (kernels::GreedyTilesBytes(1)),
  // written by the LM head of a one-row step (GreedyHeadFusion).
  DeviceBuffer greedy_tiles;
  // CUDA, DecodeMegakernel::kOn: the megakernel's layer table and barrier
  // (kernels::DecodeMegakernelBytes).
  DeviceBuffer megakernel;
};

class LlamaForward {
 public:
  // Bytes of the activation arena and of the KV cache (all layers) on a
  // device of `kind` (fp32 on the CPU backend, bf16 on CUDA).
  static size_t ActivationBytes(const ModelConfig& config,
                                const LlamaForwardOptions& options,
                                DeviceKind kind = DeviceKind::kCpu);
  static size_t KvCacheBytes(const ModelConfig& config,
                             const LlamaForwardOptions& options,
                             DeviceKind kind = DeviceKind::kCpu);

  // Allocates activations and the KV cache (two arenas) and builds the
  // wrappers, which capture only while `capture_lifecycle` is kCapturing.
  // `weights`, `step`, `stream` and `capture_lifecycle` must outlive the
  // forward.
  static absl::StatusOr<std::unique_ptr<LlamaForward>> Create(
      const ModelConfig& config, const LlamaWeights& weights,
      const StepBuffers& step, const LlamaForwardOptions& options,
      Device& device, Stream& stream,
      const CaptureLifecycle& capture_lifecycle);

  LlamaForward(const LlamaForward&) = delete;
  LlamaForward& operator=(const LlamaForward&) = delete;

  // Logits rows a step may have: max_num_seqs x uniform_decode_query_len
  // (a verifying request has one after each of its 1 + k tokens). The
  // step's logits_indices buffer must hold this many.
  static int MaxLogitsRows(const LlamaForwardOptions& options) {
    return options.max_num_seqs * options.uniform_decode_query_len;
  }

  // Runs (captures, replays) one forward for `context`; the step's metadata
  // must already be in the StepBuffers. Logits row i is the logits after
  // token logits_indices[i]; rows up to LogitsRows(context) are computed.
  absl::Status Run(const ForwardContext& context);

  // Rows the LM head computes for `context`: every token's for a uniform
  // key (its requests' num_reqs x query length: all of a verifying step's
  // rows), otherwise min(num_tokens, MaxLogitsRows) (a mixed key fixes only
  // the token count; every row count up to it must fit).
  int LogitsRows(const ForwardContext& context) const;

  DeviceBuffer logits() const { return act_.logits; }
  // The greedy tile folds the LM head writes with the logits in a forward
  // of `context` (kernels::SamplingParams::greedy_tiles), or empty where it
  // writes none.
  DeviceBuffer GreedyTiles(const ForwardContext& context) const;
  const GraphWrapper& full_wrapper() const { return *full_; }
  const std::vector<std::unique_ptr<GraphWrapper>>& piece_wrappers() const {
    return pieces_;
  }
  size_t activation_bytes() const { return activation_arena_->used_bytes(); }
  size_t kv_cache_bytes() const { return kv_arena_->used_bytes(); }
  // The one allocation holding every layer's K and V cache.
  DeviceBuffer kv_cache_allocation() const { return kv_arena_->allocation(); }
  // Per-layer K and V caches, [num_blocks, block_size, kv_heads, head_dim]
  // of dtype().
  const std::vector<DeviceBuffer>& key_caches() const { return key_cache_; }
  const std::vector<DeviceBuffer>& value_caches() const { return value_cache_; }
  // Element type of the weights, activations and KV cache.
  DType dtype() const { return weights_.dtype; }
  // True when a step of `num_tokens` runs fused (the file comment):
  // DecodeFusion::kOn and LinearCanFuse for every projection (the layers
  // share shapes and the weights' alignment).
  bool FusesDecodeLayers(int num_tokens) const {
    return num_tokens >= 0 && num_tokens <= kernels::kLinearSkinnyMaxTokens &&
           fuses_decode_layers_[num_tokens];
  }

 private:
  LlamaForward(const ModelConfig& config, const LlamaWeights& weights,
               const StepBuffers& step, const LlamaForwardOptions& options,
               Stream& stream);

  // The body the FULL wrapper wraps: pieces and attention in order.
  absl::Status RunBody(const ForwardContext& context);
  // Piece `i` in [0, num_layers]; see the file comment.
  absl::Status RunPiece(int i, const ForwardContext& context);
  // The embedding of piece 0 and the final norm + LM head of the last piece.
  kernels::EmbeddingParams EmbeddingFor(int num_tokens) const;
  absl::Status RunHead(const ForwardContext& context, bool fused);
  // True when `context` runs its layers in the megakernel: a plan exists,
  // a uniform one-token key, not piecewise.
  bool UsesDecodeMegakernel(const ForwardContext& context) const;
  // Builds megakernel_ from the fused one-token step's launches (Create).
  absl::Status CreateMegakernel();
  // The paged attention launch of `layer` for a step of `num_tokens`: the
  // decode routine's params for a uniform descriptor of query length
  // `uniform_query_len` (UniformQueryLen), the varlen routine's for 0.
  kernels::PagedAttentionParams AttentionParams(int layer, int num_tokens,
                                                int uniform_query_len) const;
  absl::Status RunAttention(int layer, const ForwardContext& context);
  // The four projections of a layer. Unfused: qkv reads act_.hidden (the
  // normalized residual), o_proj and down write act_.hidden (the residual's
  // update), gate_up writes act_.gate_up. Fused: qkv and gate_up read
  // act_.residual with an RMSNorm prologue (qkv also RoPE + the KV-cache
  // write, gate_up SiLU-and-mul into act_.mlp_act), o_proj and down add
  // into act_.residual.
  struct LayerLinears {
    kernels::LinearParams qkv, o_proj, gate_up, down;
  };
  LayerLinears Linears(int layer, int num_tokens, bool fused) const;
  // RoPE + KV-cache write of `layer` on act_.qkv's first num_tokens rows.
  kernels::RopeKvCacheParams RopeParams(int layer, int num_tokens) const;
  // FusesDecodeLayers's answer, worked out from LinearCanFuse.
  bool CanFuseDecodeLayers(int num_tokens) const;
  // The tail of a piece: o_proj and MLP of `layer`.
  absl::Status RunOutputAndMlp(int layer, int num_tokens, bool fused);
  // options_.kernel_options.linear_kernel for a launch of `rows` rows (see the
  // option).
  kernels::LinearKernel LinearKernelFor(int rows) const;
  // The LM head of a forward of `context`: act_.gathered's rows into
  // act_.logits, and act_.greedy_tiles where it can write them.
  kernels::LmHeadParams LmHeadFor(const ForwardContext& context) const;

  const ModelConfig config_;
  const LlamaWeights& weights_;
  const StepBuffers step_;
  const LlamaForwardOptions options_;
  Stream& stream_;
  std::unique_ptr<Arena> activation_arena_;
  std::unique_ptr<Arena> kv_arena_;
  LlamaActivations act_;
  std::vector<DeviceBuffer> key_cache_, value_cache_;
  std::unique_ptr<GraphWrapper> full_;
  std::vector<std::unique_ptr<GraphWrapper>> pieces_;
  // Addresses every graph reads (for InputAddressCheck).
  std::vector<const void*> input_addresses_;
  // FusesDecodeLayers for 0..kernels::kLinearSkinnyMaxTokens tokens, worked
  // out once at Create (a step asks once per piece and per attention layer;
  // larger steps never fuse: no skinny GEMM runs them).
  std::array<bool, kernels::kLinearSkinnyMaxTokens + 1> fuses_decode_layers_{};
  // DecodeMegakernel::kOn on CUDA: the plan one-token uniform steps launch.
  std::optional<kernels::DecodeMegakernelPlan> megakernel_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_MODEL_LLAMA_FORWARD_H_
