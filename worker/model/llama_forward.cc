#include "worker/model/llama_forward.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "worker/kernels/embedding.h"
#include "worker/kernels/gelu_tanh_and_mul.h"
#include "worker/kernels/kernel_checks.h"
#include "worker/kernels/linear.h"
#include "worker/kernels/lm_head.h"
#include "worker/kernels/paged_attention.h"
#include "worker/kernels/rms_norm.h"
#include "worker/kernels/rope_kv_cache.h"
#include "worker/kernels/sampling.h"
#include "worker/kernels/silu_and_mul.h"

namespace pdworker {
namespace {

constexpr size_t kAlignment = 256;

size_t Aligned(size_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

// Query rows of the largest uniform decode launch: the decode attention
// workspace is sized for it.
int MaxDecodeTokens(const LlamaForwardOptions& o) {
  return std::min(o.max_num_tokens,
                  o.max_num_seqs * o.uniform_decode_query_len);
}

size_t AttentionWorkspaceBytes(const ModelConfig& c,
                               const LlamaForwardOptions& o, DeviceKind kind) {
  if (kind != DeviceKind::kCuda) return 0;
  return kernels::PagedAttentionWorkspaceBytes(
      MaxDecodeTokens(o), static_cast<int>(c.num_attention_heads),
      static_cast<int>(c.head_dim), o.max_blocks_per_seq, o.block_size);
}

// The LM head's greedy tile folds (one row), on CUDA only.
size_t HeadTilesBytes(DeviceKind kind) {
  return kind == DeviceKind::kCuda ? kernels::GreedyTilesBytes(1) : 0;
}

// The megakernel's table and barrier, where it is asked for on CUDA.
size_t MegakernelBytes(const ModelConfig& c, const LlamaForwardOptions& o,
                       DeviceKind kind) {
  if (o.kernel_options.decode_megakernel == DecodeMegakernel::kOff) return 0;
  return kernels::DecodeMegakernelBytes(kind,
                                        static_cast<int>(c.num_hidden_layers));
}

}  // namespace

size_t LlamaForward::ActivationBytes(const ModelConfig& c,
                                     const LlamaForwardOptions& o,
                                     DeviceKind kind) {
  const size_t e = DTypeSize(kernels::ModelDTypeFor(kind));
  const size_t f = sizeof(float);
  const size_t t = o.max_num_tokens, s = MaxLogitsRows(o);
  return Aligned(t * c.hidden_size * e) * 2 +
         Aligned(t * (c.q_size() + 2 * c.kv_size()) * e) +
         Aligned(t * c.q_size() * e) +
         Aligned(t * 2 * c.intermediate_size * e) +
         Aligned(t * c.intermediate_size * e) + Aligned(s * c.hidden_size * e) +
         Aligned(s * c.vocab_size * f) +
         Aligned(c.RotaryDim() / 2 * f) *
             (c.local_rope_theta.has_value() ? 2 : 1) +
         Aligned(AttentionWorkspaceBytes(c, o, kind)) +
         Aligned(HeadTilesBytes(kind)) + Aligned(MegakernelBytes(c, o, kind));
}

size_t LlamaForward::KvCacheBytes(const ModelConfig& c,
                                  const LlamaForwardOptions& o,
                                  DeviceKind kind) {
  const size_t per_layer = static_cast<size_t>(o.num_blocks) * o.block_size *
                           c.kv_size() *
                           DTypeSize(kernels::ModelDTypeFor(kind));
  return 2 * c.num_hidden_layers * Aligned(per_layer);
}

LlamaForward::LlamaForward(const ModelConfig& config,
                           const LlamaWeights& weights, const StepBuffers& step,
                           const LlamaForwardOptions& options, Stream& stream)
    : config_(config),
      weights_(weights),
      step_(step),
      options_(options),
      stream_(stream) {}

absl::StatusOr<std::unique_ptr<LlamaForward>> LlamaForward::Create(
    const ModelConfig& config, const LlamaWeights& weights,
    const StepBuffers& step, const LlamaForwardOptions& options, Device& device,
    Stream& stream, const CaptureLifecycle& capture_lifecycle) {
  if (options.max_num_tokens <= 0 || options.max_num_seqs <= 0 ||
      options.num_blocks <= 0 || options.block_size <= 0 ||
      options.max_blocks_per_seq <= 0 ||
      options.uniform_decode_query_len <= 0) {
    return absl::InvalidArgumentError("LlamaForward: options must be positive");
  }
  kernels::RopeConfig rope = RopeConfigFor(config);
  PDW_RETURN_IF_ERROR(kernels::ValidateRopeConfig(rope));
  const DeviceKind kind = device.kind();
  if (weights.dtype != kernels::ModelDTypeFor(kind)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LlamaForward: ", DTypeName(weights.dtype), " weights on a ",
        DeviceKindName(kind), " device, whose kernels compute in ",
        DTypeName(kernels::ModelDTypeFor(kind))));
  }

  // CUDA kernels written without a GPU run only where asked for: refused by
  // name otherwise (the fused epilogues and the megakernel never run them).
  if (const std::vector<std::string> unverified =
          UnverifiedCudaFeatures(config);
      kind == DeviceKind::kCuda && !unverified.empty() &&
      options.kernel_options.unverified_cuda_kernels ==
          UnverifiedCudaKernels::kRefuse) {
    return absl::UnimplementedError(absl::StrCat(
        "LlamaForward: ", ArchitectureName(config.architecture), "'s ",
        absl::StrJoin(unverified, ", "),
        " have CUDA kernels that have not run on a GPU yet; serve this model "
        "with --device=cpu, or try them with "
        "--unverified_cuda_kernels=allow"));
  }
  if (kind == DeviceKind::kCuda &&
      options.uniform_decode_query_len >
          kernels::kCudaAttentionMaxUniformQueryLen) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LlamaForward: the CUDA decode attention handles query lengths up to ",
        kernels::kCudaAttentionMaxUniformQueryLen,
        " (1 + speculative tokens), got uniform_decode_query_len=",
        options.uniform_decode_query_len));
  }

  std::unique_ptr<LlamaForward> f(
      new LlamaForward(config, weights, step, options, stream));
  PDW_ASSIGN_OR_RETURN(
      f->activation_arena_,
      Arena::Create(device, {ActivationBytes(config, options, kind), kAlignment,
                             "activations"}));
  PDW_ASSIGN_OR_RETURN(
      f->kv_arena_, Arena::Create(device, {KvCacheBytes(config, options, kind),
                                           kAlignment, "kv_cache"}));
  const int64_t t = options.max_num_tokens, s = MaxLogitsRows(options);
  Arena& a = *f->activation_arena_;
  const size_t element = DTypeSize(weights.dtype);
  // Bytes of n activation (or KV) elements, and of n fp32 values.
  auto elements = [element](int64_t n) {
    return static_cast<size_t>(n) * element;
  };
  auto floats = [](int64_t n) {
    return static_cast<size_t>(n) * sizeof(float);
  };
  LlamaActivations& act = f->act_;
  PDW_ASSIGN_OR_RETURN(
      act.residual, a.Allocate(elements(t * config.hidden_size), "residual"));
  PDW_ASSIGN_OR_RETURN(act.hidden,
                       a.Allocate(elements(t * config.hidden_size), "hidden"));
  PDW_ASSIGN_OR_RETURN(
      act.qkv,
      a.Allocate(elements(t * (config.q_size() + 2 * config.kv_size())),
                 "qkv"));
  PDW_ASSIGN_OR_RETURN(act.attn_out,
                       a.Allocate(elements(t * config.q_size()), "attn_out"));
  PDW_ASSIGN_OR_RETURN(
      act.gate_up,
      a.Allocate(elements(t * 2 * config.intermediate_size), "gate_up"));
  PDW_ASSIGN_OR_RETURN(
      act.mlp_act,
      a.Allocate(elements(t * config.intermediate_size), "mlp_act"));
  PDW_ASSIGN_OR_RETURN(
      act.gathered, a.Allocate(elements(s * config.hidden_size), "gathered"));
  PDW_ASSIGN_OR_RETURN(act.logits,
                       a.Allocate(floats(s * config.vocab_size), "logits"));
  PDW_ASSIGN_OR_RETURN(act.inv_freq,
                       a.Allocate(floats(config.RotaryDim() / 2), "inv_freq"));
  const std::vector<float> inv_freq = kernels::ComputeRopeInvFreq(rope);
  PDW_RETURN_IF_ERROR(stream.CopyToDevice(act.inv_freq, inv_freq.data(),
                                          inv_freq.size() * sizeof(float)));
  if (config.local_rope_theta.has_value()) {
    // Gemma 3's sliding layers: plain RoPE on their own base.
    kernels::RopeConfig local;
    local.head_dim = rope.head_dim;
    local.theta = *config.local_rope_theta;
    PDW_RETURN_IF_ERROR(kernels::ValidateRopeConfig(local));
    PDW_ASSIGN_OR_RETURN(
        act.local_inv_freq,
        a.Allocate(floats(config.RotaryDim() / 2), "local_inv_freq"));
    const std::vector<float> local_freq = kernels::ComputeRopeInvFreq(local);
    PDW_RETURN_IF_ERROR(stream.CopyToDevice(act.local_inv_freq,
                                            local_freq.data(),
                                            local_freq.size() * sizeof(float)));
  }
  const size_t workspace_bytes = AttentionWorkspaceBytes(config, options, kind);
  if (workspace_bytes > 0) {
    PDW_ASSIGN_OR_RETURN(act.attention_workspace,
                         a.Allocate(workspace_bytes, "attention_workspace"));
  }
  if (HeadTilesBytes(kind) > 0) {
    PDW_ASSIGN_OR_RETURN(act.greedy_tiles,
                         a.Allocate(HeadTilesBytes(kind), "greedy_tiles"));
  }
  const size_t megakernel_bytes = MegakernelBytes(config, options, kind);
  if (megakernel_bytes > 0) {
    PDW_ASSIGN_OR_RETURN(act.megakernel,
                         a.Allocate(megakernel_bytes, "megakernel"));
  }

  const int64_t cache_elems = static_cast<int64_t>(options.num_blocks) *
                              options.block_size * config.kv_size();
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    PDW_ASSIGN_OR_RETURN(
        DeviceBuffer k,
        f->kv_arena_->Allocate(elements(cache_elems), "key_cache"));
    PDW_ASSIGN_OR_RETURN(
        DeviceBuffer v,
        f->kv_arena_->Allocate(elements(cache_elems), "value_cache"));
    f->key_cache_.push_back(k);
    f->value_cache_.push_back(v);
  }
  f->input_addresses_ = {
      step.token_ids.data(),       step.positions.data(),
      step.slot_mapping.data(),    step.seq_lens.data(),
      step.query_start_loc.data(), step.num_reqs.data(),
      step.block_tables.data(),    step.logits_indices.data()};

  LlamaForward* self = f.get();
  GraphWrapperOptions full_options;
  full_options.name = "full_forward";
  full_options.input_address_check = options.input_address_check;
  f->full_ = std::make_unique<GraphWrapper>(GraphWrapper::Params{
      [self](const ForwardContext& ctx) { return self->RunBody(ctx); },
      RuntimeMode::kFull, &stream, &capture_lifecycle, full_options});
  for (int64_t i = 0; i <= config.num_hidden_layers; ++i) {
    GraphWrapperOptions piece_options;
    piece_options.name = absl::StrCat("piece_", i);
    piece_options.input_address_check = options.input_address_check;
    const int piece = static_cast<int>(i);
    f->pieces_.push_back(std::make_unique<GraphWrapper>(GraphWrapper::Params{
        [self, piece](const ForwardContext& ctx) {
          return self->RunPiece(piece, ctx);
        },
        RuntimeMode::kPiecewise, &stream, &capture_lifecycle, piece_options}));
  }
  for (int n = 1; n <= kernels::kLinearSkinnyMaxTokens; ++n) {
    f->fuses_decode_layers_[n] =
        n <= f->options_.max_num_tokens && f->CanFuseDecodeLayers(n);
  }
  if (options.kernel_options.decode_megakernel == DecodeMegakernel::kOn) {
    PDW_RETURN_IF_ERROR(f->CreateMegakernel());
  }
  return f;
}

int LlamaForward::LogitsRows(const ForwardContext& context) const {
  const BatchDescriptor& d = context.batch_descriptor;
  if (d.uniform) return d.num_tokens;
  return std::min(d.num_tokens, MaxLogitsRows(options_));
}

absl::Status LlamaForward::Run(const ForwardContext& context) {
  const int num_tokens = context.batch_descriptor.num_tokens;
  if (num_tokens <= 0 || num_tokens > options_.max_num_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("forward of ", num_tokens, " tokens outside [1, ",
                     options_.max_num_tokens, "]"));
  }
  return full_->Run(context, input_addresses_);
}

absl::Status LlamaForward::CreateMegakernel() {
  if (stream_.kind() != DeviceKind::kCuda) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LlamaForward: decode_megakernel on runs on the CUDA backend only, "
        "not on ",
        DeviceKindName(stream_.kind())));
  }
  if (options_.uniform_decode_query_len != 1 || !FusesDecodeLayers(1)) {
    return absl::InvalidArgumentError(
        "LlamaForward: decode_megakernel on needs the fused one-token decode "
        "step (decode_fusion on, uniform_decode_query_len 1, bf16 layers the "
        "skinny GEMM fuses)");
  }
  std::vector<kernels::DecodeMegakernelLayer> layers;
  for (int l = 0; l < static_cast<int>(config_.num_hidden_layers); ++l) {
    const LayerLinears linears = Linears(l, 1, /*fused=*/true);
    layers.push_back({linears.qkv, linears.o_proj, linears.gate_up,
                      linears.down,
                      AttentionParams(l, 1, /*uniform_query_len=*/1)});
  }
  kernels::DecodeMegakernelParams params;
  params.memory = act_.megakernel;
  params.layers = std::move(layers);
  params.next_weights = weights_.lm_head;  // the head runs right after
  params.tuning = options_.kernel_options.megakernel_tuning;
  PDW_ASSIGN_OR_RETURN(megakernel_,
                       kernels::DecodeMegakernelPlan::Create(stream_, params));
  return absl::OkStatus();
}

bool LlamaForward::UsesDecodeMegakernel(const ForwardContext& context) const {
  const BatchDescriptor& d = context.batch_descriptor;
  return megakernel_.has_value() && d.uniform && d.num_tokens == 1 &&
         context.runtime_mode != RuntimeMode::kPiecewise;
}

absl::Status LlamaForward::RunBody(const ForwardContext& context) {
  if (UsesDecodeMegakernel(context)) {
    // The same launches as below, the layers' kernels in one.
    PDW_RETURN_IF_ERROR(kernels::LaunchEmbedding(stream_, EmbeddingFor(1)));
    PDW_RETURN_IF_ERROR(megakernel_->Launch(stream_));
    return RunHead(context, /*fused=*/true);
  }
  const int num_layers = static_cast<int>(config_.num_hidden_layers);
  for (int layer = 0; layer < num_layers; ++layer) {
    PDW_RETURN_IF_ERROR(pieces_[layer]->Run(context, input_addresses_));
    PDW_RETURN_IF_ERROR(RunAttention(layer, context));
  }
  return pieces_[num_layers]->Run(context, input_addresses_);
}

kernels::LinearKernel LlamaForward::LinearKernelFor(int rows) const {
  const kernels::LinearKernel k = options_.kernel_options.linear_kernel;
  const bool skinny = k == kernels::LinearKernel::kSkinnyGemm ||
                      k == kernels::LinearKernel::kSkinnyMma;
  return skinny && rows > kernels::kLinearSkinnyMaxTokens
             ? kernels::LinearKernel::kAuto
             : k;
}

LlamaForward::LayerLinears LlamaForward::Linears(int layer, int num_tokens,
                                                 bool fused) const {
  const LlamaLayerWeights& w = weights_.layers[layer];
  const int hidden = static_cast<int>(config_.hidden_size);
  const int inter = static_cast<int>(config_.intermediate_size);
  const int q_size = static_cast<int>(config_.q_size());
  const int qkv_size =
      static_cast<int>(config_.q_size() + 2 * config_.kv_size());
  const float eps = static_cast<float>(config_.rms_norm_eps);
  const DType dtype = weights_.dtype;
  const kernels::LinearKernel kernel = LinearKernelFor(num_tokens);
  // {input, weight, bias, output, num_tokens, in_features, out_features,
  //  dtype, output_dtype, kernel}
  LayerLinears l{{act_.hidden, w.qkv, w.qkv_bias, act_.qkv, num_tokens, hidden,
                  qkv_size, dtype, dtype, kernel},
                 {act_.attn_out, w.o_proj, w.o_bias, act_.hidden, num_tokens,
                  q_size, hidden, dtype, dtype, kernel},
                 {act_.hidden,
                  w.gate_up,
                  {},
                  act_.gate_up,
                  num_tokens,
                  hidden,
                  2 * inter,
                  dtype,
                  dtype,
                  kernel},
                 {act_.mlp_act,
                  w.down,
                  {},
                  act_.hidden,
                  num_tokens,
                  inter,
                  hidden,
                  dtype,
                  dtype,
                  kernel}};
  if (!fused) return l;
  auto normalize_input = [&](kernels::LinearParams& p, DeviceBuffer weight) {
    p.input = act_.residual;
    p.prologue = kernels::LinearPrologue::kRmsNorm;
    p.norm_weight = weight;
    p.norm_epsilon = eps;
  };
  normalize_input(l.qkv, w.input_norm);
  l.qkv.epilogue = kernels::LinearEpilogue::kRopeKvCache;
  l.qkv.rope = RopeParams(layer, num_tokens);
  normalize_input(l.gate_up, w.post_norm);
  l.gate_up.output = act_.mlp_act;
  l.gate_up.epilogue = kernels::LinearEpilogue::kSiluAndMul;
  for (kernels::LinearParams* p : {&l.o_proj, &l.down}) {
    p->output = act_.residual;
    p->epilogue = kernels::LinearEpilogue::kAddResidual;
  }
  return l;
}

bool LlamaForward::CanFuseDecodeLayers(int num_tokens) const {
  if (options_.kernel_options.decode_fusion == DecodeFusion::kOff) return false;
  // The fused epilogues implement Llama's layer only.
  if (!UnverifiedCudaFeatures(config_).empty()) return false;
  // Windowed attention on CUDA (kAllow): the megakernel's attention has no
  // window.
  if (config_.sliding_window.has_value() &&
      options_.kernel_options.unverified_cuda_kernels ==
          UnverifiedCudaKernels::kAllow) {
    return false;
  }
  const LayerLinears l = Linears(0, num_tokens, /*fused=*/true);
  for (const kernels::LinearParams* p :
       {&l.qkv, &l.o_proj, &l.gate_up, &l.down}) {
    if (!kernels::LinearCanFuse(stream_, *p)) return false;
  }
  return true;
}

absl::Status LlamaForward::RunOutputAndMlp(int layer, int num_tokens,
                                           bool fused) {
  const LayerLinears l = Linears(layer, num_tokens, fused);
  const LlamaLayerWeights& w = weights_.layers[layer];
  PDW_RETURN_IF_ERROR(kernels::LaunchLinear(stream_, l.o_proj));
  if (fused) {
    // o_proj added itself to the residual; gate_up normalizes it.
    PDW_RETURN_IF_ERROR(kernels::LaunchLinear(stream_, l.gate_up));
    return kernels::LaunchLinear(stream_, l.down);
  }
  const int hidden = static_cast<int>(config_.hidden_size);
  const int inter = static_cast<int>(config_.intermediate_size);
  const float eps = static_cast<float>(config_.rms_norm_eps);
  const DType dtype = weights_.dtype;
  // Sandwich norms: the attention output is normalized before the add.
  if (!w.post_attention_output_norm.empty()) {
    PDW_RETURN_IF_ERROR(kernels::LaunchRmsNorm(
        stream_, {act_.hidden, w.post_attention_output_norm, act_.hidden,
                  num_tokens, hidden, eps, dtype}));
  }
  // residual += attention output; hidden = post_norm(residual).
  kernels::FusedAddRmsNormParams post{
      act_.hidden, act_.residual, weights_.layers[layer].post_norm,
      act_.hidden, num_tokens,    hidden,
      eps,         dtype};
  PDW_RETURN_IF_ERROR(kernels::LaunchFusedAddRmsNorm(stream_, post));
  kernels::LinearParams fused_silu = l.gate_up;
  fused_silu.output = act_.mlp_act;
  fused_silu.epilogue = kernels::LinearEpilogue::kSiluAndMul;
  if (config_.layer.activation == MlpActivation::kGeluTanh) {
    PDW_RETURN_IF_ERROR(kernels::LaunchLinear(stream_, l.gate_up));
    PDW_RETURN_IF_ERROR(kernels::LaunchGeluTanhAndMul(
        stream_, {act_.gate_up, act_.mlp_act, num_tokens, inter, dtype}));
  } else if (kernels::LinearCanFuse(stream_, fused_silu)) {
    // One kernel: the skinny GEMM's epilogue writes silu(gate) · up.
    PDW_RETURN_IF_ERROR(kernels::LaunchLinear(stream_, fused_silu));
  } else {
    PDW_RETURN_IF_ERROR(kernels::LaunchLinear(stream_, l.gate_up));
    kernels::SiluAndMulParams silu{act_.gate_up, act_.mlp_act, num_tokens,
                                   inter, dtype};
    PDW_RETURN_IF_ERROR(kernels::LaunchSiluAndMul(stream_, silu));
  }
  PDW_RETURN_IF_ERROR(kernels::LaunchLinear(stream_, l.down));
  if (w.post_mlp_output_norm.empty()) return absl::OkStatus();
  // Sandwich norms: the MLP output is normalized before the add.
  return kernels::LaunchRmsNorm(
      stream_, {act_.hidden, w.post_mlp_output_norm, act_.hidden, num_tokens,
                hidden, eps, dtype});
}

absl::Status LlamaForward::RunPiece(int i, const ForwardContext& context) {
  const int num_tokens = context.batch_descriptor.num_tokens;
  const int num_layers = static_cast<int>(config_.num_hidden_layers);
  const int hidden = static_cast<int>(config_.hidden_size);
  const float eps = static_cast<float>(config_.rms_norm_eps);
  const DType dtype = weights_.dtype;
  // A function of the token count alone, so every piece of a step, its
  // graph and its eager run agree.
  const bool fused = FusesDecodeLayers(num_tokens);

  if (i == 0) {
    // residual = embed(tokens); hidden = input_norm[0](residual).
    PDW_RETURN_IF_ERROR(
        kernels::LaunchEmbedding(stream_, EmbeddingFor(num_tokens)));
    if (!fused) {
      kernels::RmsNormParams norm{act_.residual, weights_.layers[0].input_norm,
                                  act_.hidden,   num_tokens,
                                  hidden,        eps,
                                  dtype};
      PDW_RETURN_IF_ERROR(kernels::LaunchRmsNorm(stream_, norm));
    }
    return kernels::LaunchLinear(stream_, Linears(0, num_tokens, fused).qkv);
  }

  PDW_RETURN_IF_ERROR(RunOutputAndMlp(i - 1, num_tokens, fused));
  if (i < num_layers) {
    if (!fused) {
      // residual += mlp output; hidden = input_norm[i](residual).
      kernels::FusedAddRmsNormParams next{
          act_.hidden, act_.residual, weights_.layers[i].input_norm,
          act_.hidden, num_tokens,    hidden,
          eps,         dtype};
      PDW_RETURN_IF_ERROR(kernels::LaunchFusedAddRmsNorm(stream_, next));
    }
    return kernels::LaunchLinear(stream_, Linears(i, num_tokens, fused).qkv);
  }
  return RunHead(context, fused);
}

kernels::EmbeddingParams LlamaForward::EmbeddingFor(int num_tokens) const {
  kernels::EmbeddingParams p{step_.token_ids,
                             weights_.embed_tokens,
                             act_.residual,
                             num_tokens,
                             static_cast<int>(config_.vocab_size),
                             static_cast<int>(config_.hidden_size),
                             weights_.dtype};
  p.scale = static_cast<float>(config_.embedding_multiplier);
  return p;
}

absl::Status LlamaForward::RunHead(const ForwardContext& context, bool fused) {
  const int num_tokens = context.batch_descriptor.num_tokens;
  const int hidden = static_cast<int>(config_.hidden_size);
  const float eps = static_cast<float>(config_.rms_norm_eps);
  const DType dtype = weights_.dtype;
  // The final norm of each request's last token only (it also gathers
  // those rows, logits_indices[r], into `gathered`; -1 gives a zero row),
  // then their logits. Rows nobody samples are never normalized. A head
  // that normalizes its own row (LmHeadFor) is the whole of it.
  const int num_rows = LogitsRows(context);
  const kernels::LmHeadParams head = LmHeadFor(context);
  if (!head.norm_weight.empty()) return kernels::LaunchLmHead(stream_, head);
  if (fused) {
    // down already added itself to the residual.
    kernels::RmsNormParams final_norm{act_.residual, weights_.final_norm,
                                      act_.gathered, num_rows,
                                      hidden,        eps,
                                      dtype};
    final_norm.row_indices = step_.logits_indices;
    final_norm.num_input_rows = num_tokens;
    PDW_RETURN_IF_ERROR(kernels::LaunchRmsNorm(stream_, final_norm));
  } else {
    kernels::FusedAddRmsNormParams final_norm{
        act_.hidden,   act_.residual, weights_.final_norm,
        act_.gathered, num_rows,      hidden,
        eps,           dtype};
    final_norm.row_indices = step_.logits_indices;
    final_norm.num_input_rows = num_tokens;
    PDW_RETURN_IF_ERROR(kernels::LaunchFusedAddRmsNorm(stream_, final_norm));
  }
  return kernels::LaunchLmHead(stream_, head);
}

kernels::LmHeadParams LlamaForward::LmHeadFor(
    const ForwardContext& context) const {
  kernels::LmHeadParams head;
  head.hidden = act_.gathered;  // no logits_indices: already gathered
  head.weight = weights_.lm_head;
  head.logits = act_.logits;
  head.num_tokens = context.batch_descriptor.num_tokens;
  head.num_rows = LogitsRows(context);
  head.hidden_size = static_cast<int>(config_.hidden_size);
  head.vocab_size = static_cast<int>(config_.vocab_size);
  head.dtype = weights_.dtype;
  head.linear_kernel = LinearKernelFor(head.num_rows);
  head.softcap = static_cast<float>(config_.final_logit_softcapping);
  if (options_.kernel_options.greedy_head_fusion == GreedyHeadFusion::kOff)
    return head;
  head.greedy_tiles = act_.greedy_tiles;
  if (FusesDecodeLayers(head.num_tokens)) {
    // The last down projection added itself to the residual: the head can
    // normalize its row itself, instead of the final norm kernel.
    kernels::LmHeadParams normalizing = head;
    normalizing.hidden = act_.residual;
    normalizing.norm_weight = weights_.final_norm;
    normalizing.norm_epsilon = static_cast<float>(config_.rms_norm_eps);
    normalizing.norm_row_index = step_.logits_indices;
    if (kernels::LmHeadWritesGreedyTiles(stream_, normalizing)) {
      return normalizing;
    }
  }
  if (!kernels::LmHeadWritesGreedyTiles(stream_, head)) head.greedy_tiles = {};
  return head;
}

DeviceBuffer LlamaForward::GreedyTiles(const ForwardContext& context) const {
  return LmHeadFor(context).greedy_tiles;
}

kernels::RopeKvCacheParams LlamaForward::RopeParams(int layer,
                                                    int num_tokens) const {
  const int heads = static_cast<int>(config_.num_attention_heads);
  const int kv_heads = static_cast<int>(config_.num_key_value_heads);
  const int head_dim = static_cast<int>(config_.head_dim);
  const int q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const int qkv_stride = q_size + 2 * kv_size;
  const DType dtype = weights_.dtype;
  const size_t element = DTypeSize(dtype);
  const size_t row_bytes =
      static_cast<size_t>(num_tokens) * qkv_stride * element;
  // q, k and v are column slices of the fused qkv rows.
  const DeviceBuffer qkv = act_.qkv.Slice(0, row_bytes);
  kernels::RopeKvCacheParams rope;
  rope.positions = step_.positions;
  rope.slot_mapping = step_.slot_mapping;
  rope.inv_freq = config_.SlidesAt(layer) && !act_.local_inv_freq.empty()
                      ? act_.local_inv_freq
                      : act_.inv_freq;
  rope.query = qkv;
  rope.key = qkv.Slice(q_size * element, row_bytes - q_size * element);
  rope.value = qkv.Slice((q_size + kv_size) * element,
                         row_bytes - (q_size + kv_size) * element);
  rope.key_cache = key_cache_[layer];
  rope.value_cache = value_cache_[layer];
  rope.num_tokens = num_tokens;
  rope.num_heads = heads;
  rope.num_kv_heads = kv_heads;
  rope.head_dim = head_dim;
  if (config_.RotaryDim() != config_.head_dim) {
    rope.rotary_dim = static_cast<int>(config_.RotaryDim());
  }
  if (!FoldsAttentionFactor(config_)) {
    rope.rotary_scale =
        static_cast<float>(config_.rope_scaling.attention_factor);
  }
  rope.block_size = options_.block_size;
  rope.num_blocks = options_.num_blocks;
  rope.query_row_stride = qkv_stride;
  rope.key_row_stride = qkv_stride;
  rope.value_row_stride = qkv_stride;
  rope.dtype = dtype;
  const LlamaLayerWeights& w = weights_.layers[layer];
  if (config_.layer.qk_norm == QkNorm::kPerHeadRms) {
    rope.q_norm_weight = w.q_norm;
    rope.k_norm_weight = w.k_norm;
    rope.qk_norm_epsilon = static_cast<float>(config_.rms_norm_eps);
  }
  return rope;
}

kernels::PagedAttentionParams LlamaForward::AttentionParams(
    int layer, int num_tokens, int uniform_query_len) const {
  const int heads = static_cast<int>(config_.num_attention_heads);
  const int kv_heads = static_cast<int>(config_.num_key_value_heads);
  const int head_dim = static_cast<int>(config_.head_dim);
  kernels::PagedAttentionParams attn;
  attn.num_reqs = step_.num_reqs;
  attn.query_start_loc = step_.query_start_loc;
  attn.seq_lens = step_.seq_lens;
  attn.block_tables = step_.block_tables;
  attn.query = RopeParams(layer, num_tokens).query;
  attn.key_cache = key_cache_[layer];
  attn.value_cache = value_cache_[layer];
  attn.output = act_.attn_out;
  attn.num_tokens = num_tokens;
  attn.max_num_seqs = options_.max_num_seqs;
  attn.num_heads = heads;
  attn.num_kv_heads = kv_heads;
  attn.head_dim = head_dim;
  attn.block_size = options_.block_size;
  attn.num_blocks = options_.num_blocks;
  attn.max_blocks_per_seq = options_.max_blocks_per_seq;
  attn.query_row_stride = (heads + 2 * kv_heads) * head_dim;
  attn.dtype = weights_.dtype;
  attn.scale = AttentionScale(config_);
  attn.softcap = static_cast<float>(config_.layer.attn_logit_softcapping);
  // The CPU kernel masks to the window, and so do the CUDA-core CUDA
  // kernels when their unverified code is allowed; otherwise ModelRunner
  // keeps sequences within the window on CUDA, where the mask changes
  // nothing (and the tensor-core kernels, which have no window, may run).
  if (config_.SlidesAt(layer) &&
      (stream_.kind() == DeviceKind::kCpu ||
       options_.kernel_options.unverified_cuda_kernels ==
           UnverifiedCudaKernels::kAllow)) {
    attn.sliding_window = static_cast<int>(*config_.sliding_window);
  }
  attn.workspace = act_.attention_workspace;
  // A uniform descriptor (a uniform decode key, in its graph or in its
  // warm-up runs; never a NONE step, whose descriptor is relaxed) means the
  // inputs were laid out uniformly: use the decode routine. On the CPU it is
  // bit-identical to varlen; on CUDA it is split-K with other bits, so the
  // choice must depend on the descriptor alone for an eager run and a graph
  // of the same key to agree bit for bit.
  if (uniform_query_len > 0) {
    attn.uniform_query_len = uniform_query_len;
    attn.decode_pdl = options_.kernel_options.decode_attention_pdl;
    const bool tensor_cores_cover =
        (head_dim == 64 || head_dim == 128) &&
        heads / kv_heads * attn.uniform_query_len <= 16;
    if (options_.kernel_options.decode_attention_kernel !=
            kernels::DecodeAttentionKernel::kTensorCores ||
        tensor_cores_cover) {
      attn.decode_kernel = options_.kernel_options.decode_attention_kernel;
    }
  } else {
    attn.varlen_kernel = options_.kernel_options.varlen_attention_kernel;
  }
  return attn;
}

absl::Status LlamaForward::RunAttention(int layer,
                                        const ForwardContext& context) {
  const int num_tokens = context.batch_descriptor.num_tokens;
  // A fused step's qkv projection rotated q and k and wrote the KV cache.
  if (!FusesDecodeLayers(num_tokens)) {
    PDW_RETURN_IF_ERROR(
        kernels::LaunchRopeKvCache(stream_, RopeParams(layer, num_tokens)));
  }
  const int query_len = UniformQueryLen(context.batch_descriptor);
  const kernels::PagedAttentionParams attn =
      AttentionParams(layer, num_tokens, query_len);
  return query_len > 0
             ? kernels::LaunchPagedAttentionUniformDecode(stream_, attn)
             : kernels::LaunchPagedAttention(stream_, attn);
}

}  // namespace pdworker
