#include "worker/runner/model_runner.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "dispatcher/attention_cg_support.h"
#include "glog/logging.h"
#include "worker/kernels/kernel_checks.h"
#include "worker/kernels/paged_attention.h"
#include "worker/kernels/sampling.h"
#include "worker/kv_cache/kv_cache_spec.h"

namespace pdworker {
namespace {

size_t StepArenaBytes(int max_num_seqs, int max_tokens, int max_blocks,
                      size_t sampling_workspace_bytes) {
  // Metadata (8 int32 buffers), sampling buffers and workspace, with
  // alignment slack for each of the ~20 buffers.
  const size_t ints = static_cast<size_t>(max_tokens) * 3 +
                      static_cast<size_t>(max_num_seqs) * (6 + max_blocks) + 2;
  return ints * sizeof(int32_t) + max_num_seqs * sizeof(uint64_t) +
         sampling_workspace_bytes + 32 * 256;
}

}  // namespace

ModelRunner::ModelRunner(Device& device, const ModelRunnerOptions& options)
    : device_(device), options_(options) {}

ModelRunner::~ModelRunner() = default;

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(
    Device& device, const std::string& model_dir,
    const ModelRunnerOptions& options) {
  if (options.max_num_seqs <= 0 || options.max_num_batched_tokens <= 0 ||
      options.block_size <= 0 || options.uniform_decode_query_len <= 0 ||
      options.num_warmups < 0) {
    return absl::InvalidArgumentError(
        "max_num_seqs, max_num_batched_tokens, block_size and "
        "uniform_decode_query_len must be positive");
  }
  std::unique_ptr<ModelRunner> r(new ModelRunner(device, options));
  PDW_ASSIGN_OR_RETURN(r->config_, LoadModelConfig(model_dir));
  const ModelConfig& c = r->config_;
  r->max_model_len_ = options.max_model_len > 0
                          ? options.max_model_len
                          : static_cast<int>(c.max_position_embeddings);
  if (r->max_model_len_ > c.max_position_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_model_len=", r->max_model_len_,
                     " exceeds the model's max_position_embeddings=",
                     c.max_position_embeddings));
  }

  // The forward attends to the whole context: a sliding-window model is only
  // exact while sequences stay within the window.
  if (c.sliding_window.has_value() && r->max_model_len_ > *c.sliding_window) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the model uses sliding-window attention (window ", *c.sliding_window,
        " tokens), which pdworker does not implement; set max_model_len <= ",
        *c.sliding_window));
  }

  // Graph plan: role defaults + compilation config, then the attention
  // backend's CUDA graph support may downgrade the mode.
  SchedulerLimits limits{options.max_num_seqs, options.max_num_batched_tokens,
                         options.uniform_decode_query_len};
  PDW_ASSIGN_OR_RETURN(r->plan_,
                       PlanGraphs(options.role, options.compilation, limits));
  // The attention kernels of this device (CPU or CUDA) declare how much of
  // attention may live inside graphs.
  ResolvedMode resolved = ResolveMode(
      r->plan_.mode, kernels::PagedAttentionCGSupport(device.kind()),
      PiecewiseCompilation::kAvailable, options.uniform_decode_query_len);
  r->downgrade_reason_ = resolved.reason;
  if (!resolved.reason.empty()) {
    LOG(WARNING) << "cudagraph_mode " << r->plan_.mode << " -> "
                 << resolved.mode << ": " << resolved.reason;
  }
  PDW_RETURN_IF_ERROR(r->dispatcher_.Initialize(
      resolved.mode, r->plan_.capture_sizes, options.max_num_seqs,
      options.uniform_decode_query_len));
  // Until CaptureGraphs() runs, every step is eager (reason: still capturing).
  if (resolved.mode.decode_mode() != RuntimeMode::kNone ||
      resolved.mode.mixed_mode() != RuntimeMode::kNone) {
    r->dispatcher_.SetCaptureState(CaptureState::kCapturing);
  }

  // KV cache sizing.
  KvCacheSpec spec;
  spec.num_layers = static_cast<int>(c.num_hidden_layers);
  spec.num_kv_heads = static_cast<int>(c.num_key_value_heads);
  spec.head_dim = static_cast<int>(c.head_dim);
  spec.block_size = options.block_size;
  // fp32 K/V on the CPU backend, bf16 on CUDA.
  spec.dtype_bytes =
      static_cast<int>(DTypeSize(kernels::ModelDTypeFor(device.kind())));
  spec.max_model_len = r->max_model_len_;
  PDW_ASSIGN_OR_RETURN(int64_t num_blocks,
                       NumBlocksForBudget(spec, options.kv_cache_bytes));
  if (num_blocks > (int64_t{1} << 30)) num_blocks = int64_t{1} << 30;
  const int max_blocks = spec.MaxBlocksPerSeq();

  PDW_ASSIGN_OR_RETURN(r->stream_, device.CreateStream());
  PDW_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> checkpoint,
                       Checkpoint::Open(model_dir));
  PDW_ASSIGN_OR_RETURN(r->weights_,
                       LoadLlamaWeights(c, *checkpoint, device, *r->stream_));

  PDW_ASSIGN_OR_RETURN(
      const size_t sampling_workspace_bytes,
      kernels::SamplingWorkspaceBytesFor(
          device.kind(), static_cast<int>(c.vocab_size), options.max_num_seqs));
  PDW_ASSIGN_OR_RETURN(
      r->step_arena_,
      Arena::Create(
          device,
          {StepArenaBytes(options.max_num_seqs, options.max_num_batched_tokens,
                          max_blocks, sampling_workspace_bytes),
           256, "step_inputs"}));
  StepLimits step_limits{options.max_num_seqs, options.max_num_batched_tokens,
                         max_blocks};
  PDW_ASSIGN_OR_RETURN(
      r->inputs_,
      StepInputs::Create(*r->step_arena_, step_limits, options.block_size));
  PDW_ASSIGN_OR_RETURN(r->sampler_,
                       Sampler::Create(*r->step_arena_, options.max_num_seqs,
                                       static_cast<int>(c.vocab_size),
                                       sampling_workspace_bytes));

  LlamaForwardOptions fo;
  fo.max_num_tokens = options.max_num_batched_tokens;
  fo.max_num_seqs = options.max_num_seqs;
  fo.block_size = options.block_size;
  fo.num_blocks = static_cast<int>(num_blocks);
  fo.max_blocks_per_seq = max_blocks;
  fo.uniform_decode_query_len = options.uniform_decode_query_len;
  fo.input_address_check = options.input_address_check;
  PDW_ASSIGN_OR_RETURN(
      r->forward_,
      LlamaForward::Create(c, r->weights_, r->inputs_->buffers(), fo, device,
                           *r->stream_, r->capture_phase_));
  r->kv_ = std::make_unique<KvCacheManager>(
      static_cast<int32_t>(num_blocks), options.block_size, r->max_model_len_);
  PDW_RETURN_IF_ERROR(r->stream_->Synchronize());

  r->appends_.reserve(options.max_num_seqs);
  r->step_seqs_.reserve(options.max_num_seqs);
  r->sampling_.reserve(options.max_num_seqs);
  r->sample_positions_.reserve(options.max_num_seqs);
  r->sampled_.reserve(options.max_num_seqs);
  LOG(INFO) << "model runner: " << c.num_hidden_layers << " layers, hidden "
            << c.hidden_size << ", vocab " << c.vocab_size << "; mode "
            << r->plan_.mode << " -> " << resolved.mode << "; " << num_blocks
            << " KV blocks of " << options.block_size << " tokens ("
            << r->forward_->kv_cache_bytes() << " bytes), "
            << "activations " << r->forward_->activation_bytes() << " bytes";
  return r;
}

absl::StatusOr<CaptureSummary> ModelRunner::CaptureGraphs() {
  CaptureSessionParams p;
  p.device = &device_;
  p.stream = stream_.get();
  p.capture_phase = &capture_phase_;
  p.descs = dispatcher_.GetCaptureDescs();
  p.num_warmups = options_.num_warmups;
  const int query_len = options_.uniform_decode_query_len;
  p.prepare_inputs = [this, query_len](const BatchDescriptor& d) {
    PaddedShape shape{d.num_tokens, d.uniform ? d.num_reqs : 0,
                      d.uniform ? query_len : 0};
    PDW_RETURN_IF_ERROR(inputs_->BuildDummy(shape));
    return inputs_->Upload(*stream_);
  };
  p.forward = [this](const ForwardContext& ctx) { return forward_->Run(ctx); };
  dispatcher_.SetCaptureState(CaptureState::kCapturing);
  absl::StatusOr<CaptureSummary> summary = RunCaptureSession(p);
  if (!summary.ok()) {
    dispatcher_.SetCaptureState(CaptureState::kDisabled);
    return summary.status();
  }
  PDW_RETURN_IF_ERROR(stream_->Synchronize());
  dispatcher_.SetCaptureState(CaptureState::kReady);
  return summary;
}

int ModelRunner::NumCapturedGraphs() const {
  int n = static_cast<int>(forward_->full_wrapper().num_graphs());
  for (const auto& piece : forward_->piece_wrappers()) {
    n += static_cast<int>(piece->num_graphs());
  }
  return n;
}

absl::Status ModelRunner::Validate(absl::Span<const SequenceStep> batch) const {
  if (batch.empty()) {
    return absl::InvalidArgumentError("a step needs at least one sequence");
  }
  if (static_cast<int>(batch.size()) > options_.max_num_seqs) {
    return absl::InvalidArgumentError(absl::StrCat(
        batch.size(),
        " sequences in one step; max_num_seqs=", options_.max_num_seqs));
  }
  int64_t tokens = 0;
  for (const SequenceStep& s : batch) {
    if (s.token_ids.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence '", s.sequence_id, "' has no new tokens"));
    }
    for (int32_t t : s.token_ids) {
      if (t < 0 || t >= config_.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence '", s.sequence_id, "': token id ", t,
            " outside the vocabulary [0, ", config_.vocab_size, ")"));
      }
    }
    absl::Status sampling = ValidateSamplingOptions(s.sampling);
    if (!sampling.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence '", s.sequence_id, "': ", sampling.message()));
    }
    tokens += static_cast<int64_t>(s.token_ids.size());
  }
  if (tokens > options_.max_num_batched_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat(tokens, " tokens in one step; max_num_batched_tokens=",
                     options_.max_num_batched_tokens));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepResult> ModelRunner::Execute(
    absl::Span<const SequenceStep> batch) {
  const auto start = std::chrono::steady_clock::now();
  PDW_RETURN_IF_ERROR(Validate(batch));

  // 1. KV cache: all-or-nothing (also rejects duplicates and length limits).
  appends_.clear();
  int num_tokens = 0, max_query_len = 0;
  for (const SequenceStep& s : batch) {
    const int q = static_cast<int>(s.token_ids.size());
    appends_.push_back({s.sequence_id, q, s.creation});
    num_tokens += q;
    max_query_len = std::max(max_query_len, q);
  }
  PDW_ASSIGN_OR_RETURN(StepReservation reservation, kv_->Append(appends_));

  // 3. Dispatch.
  const int num_reqs = static_cast<int>(batch.size());
  const BatchKind kind = ClassifyBatch(num_tokens, num_reqs, max_query_len,
                                       options_.uniform_decode_query_len);
  const DispatchResult d = dispatcher_.Dispatch(num_tokens, kind, num_reqs);

  // 2 + 4. Inputs with padding rows up to the key's shape.
  PaddedShape shape{d.descriptor.num_tokens, num_reqs, 0};
  if (d.mode != RuntimeMode::kNone && d.descriptor.uniform) {
    shape = {d.descriptor.num_tokens, d.descriptor.num_reqs,
             options_.uniform_decode_query_len};
  }
  step_seqs_.clear();
  for (const SequenceStep& s : batch) {
    step_seqs_.push_back({kv_->Find(s.sequence_id), s.token_ids});
  }
  absl::Status status = inputs_->Build(step_seqs_, shape);
  if (status.ok()) status = inputs_->Upload(*stream_);

  // 5. Forward.
  const ForwardContext ctx{d.mode, d.descriptor};
  if (status.ok()) status = forward_->Run(ctx);

  // 6. Sample the real rows.
  if (status.ok()) {
    sampling_.clear();
    sample_positions_.clear();
    for (int r = 0; r < num_reqs; ++r) {
      sampling_.push_back(batch[r].sampling);
      // The sampled token's absolute position: the length after the step.
      sample_positions_.push_back(step_seqs_[r].kv->num_tokens);
    }
    status = sampler_->Sample(*stream_, forward_->logits(), sampling_,
                              sample_positions_, &sampled_);
  }
  if (!status.ok()) {
    kv_->Undo(reservation);
    return absl::Status(
        status.code(),
        absl::StrCat("step failed and was undone: ", status.message()));
  }

  // 7. Statistics.
  stats_.Record(num_tokens, d.descriptor.num_tokens, d.mode);

  StepResult result;
  result.mode = d.mode;
  result.fallback_reason = d.reason;
  result.descriptor = d.descriptor;
  result.unpadded_tokens = num_tokens;
  result.padded_tokens = d.descriptor.num_tokens;
  result.sequences.resize(num_reqs);
  for (int r = 0; r < num_reqs; ++r) {
    result.sequences[r] = {sampled_[r].token_id, sampled_[r].logprob,
                           step_seqs_[r].kv->num_tokens};
  }
  result.forward_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  return result;
}

absl::Status ModelRunner::Release(absl::string_view sequence_id) {
  return kv_->Free(sequence_id);
}

absl::Status ModelRunner::Truncate(absl::string_view sequence_id,
                                   int32_t num_tokens) {
  return kv_->Truncate(sequence_id, num_tokens);
}

absl::StatusOr<SequenceKv> ModelRunner::Detach(absl::string_view sequence_id) {
  return kv_->Detach(sequence_id);
}

absl::StatusOr<SequenceKv> ModelRunner::AllocateDetached(int32_t num_tokens) {
  return kv_->AllocateDetached(num_tokens);
}

absl::Status ModelRunner::Attach(absl::string_view sequence_id,
                                 SequenceKv& kv) {
  return kv_->Attach(sequence_id, kv);
}

void ModelRunner::FreeDetached(SequenceKv& kv) { kv_->FreeDetached(kv); }

KvCacheView ModelRunner::kv_cache_view() const {
  KvCacheView view;
  view.layout.num_layers = static_cast<int32_t>(config_.num_hidden_layers);
  view.layout.num_kv_heads = static_cast<int32_t>(config_.num_key_value_heads);
  view.layout.head_dim = static_cast<int32_t>(config_.head_dim);
  view.layout.dtype = std::string(DTypeName(forward_->dtype()));
  view.block_size = options_.block_size;
  view.token_bytes =
      static_cast<size_t>(config_.kv_size()) * DTypeSize(forward_->dtype());
  view.keys = forward_->key_caches();
  view.values = forward_->value_caches();
  view.allocation = forward_->kv_cache_allocation();
  return view;
}

absl::Status ModelRunner::ReadLogits(int rows, std::vector<float>* out) {
  if (rows <= 0 || rows > options_.max_num_seqs) {
    return absl::InvalidArgumentError("ReadLogits: rows out of range");
  }
  out->resize(static_cast<size_t>(rows) * config_.vocab_size);
  return stream_->CopyToHost(out->data(), forward_->logits(),
                             out->size() * sizeof(float));
}

absl::Status ModelRunner::ReadKvCache(int layer, KvPart part,
                                      std::vector<uint8_t>* out) {
  if (layer < 0 || layer >= config_.num_hidden_layers) {
    return absl::InvalidArgumentError("ReadKvCache: layer out of range");
  }
  const DeviceBuffer b = part == KvPart::kKey ? forward_->key_caches()[layer]
                                              : forward_->value_caches()[layer];
  out->resize(b.size_bytes());
  return stream_->CopyToHost(out->data(), b, b.size_bytes());
}

}  // namespace pdworker
