#include "worker/runner/model_runner.h"

#include <algorithm>
#include <chrono>
#include <future>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/token_ids.h"
#include "dispatcher/attention_cg_support.h"
#include "glog/logging.h"
#include "worker/kernels/feed_tokens.h"
#include "worker/kernels/kernel_checks.h"
#include "worker/kernels/logprobs.h"
#include "worker/kernels/paged_attention.h"
#include "worker/kernels/sampling.h"
#include "worker/kv_cache/kv_cache_spec.h"
#include "worker/model/model_fingerprint.h"
#include "worker/runner/context_length.h"

namespace pdworker {
namespace {

// Tokens a sequence may ban at one step (its EOS and stop ids while under
// min_tokens); the engine refuses requests that would need more.
constexpr int kMaxBannedTokensPerSequence = 64;

size_t StepArenaBytes(const StepLimits& limits, size_t sampling_workspace_bytes,
                      int num_slots) {
  // Metadata (8 int32 buffers and the packed block they are unpacked from),
  // sampling parameters and bans of each logits row, the token feed, each
  // slot's sampled ids and logprobs, and the sampling workspace, with
  // alignment slack for each of the ~30 buffers.
  const size_t seqs = static_cast<size_t>(limits.max_num_seqs);
  const size_t rows = static_cast<size_t>(limits.max_logits_rows);
  // min_p rows/offsets, logprob rows, logsumexp, raw logprobs, top ids
  // and top logprobs come on top.
  const size_t ints = static_cast<size_t>(StepInputs::DeviceWords(limits)) +
                      rows * 3 + rows * 2 * kMaxBannedTokensPerSequence +
                      seqs * 2 + rows * 2 * num_slots + rows * 2 + seqs * 3 +
                      seqs * 2 * kernels::kMaxTopLogprobs;
  return ints * sizeof(int32_t) + rows * sizeof(uint64_t) +
         sampling_workspace_bytes + 48 * 256;
}

}  // namespace

ModelRunner::ModelRunner(Device& device, const ModelRunnerOptions& options)
    : device_(device), options_(options), dispatcher_(capture_lifecycle_) {}

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
  if (options.prefix_caching == PrefixCaching::kOn &&
      options.block_size > kMaxHashedBlockSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix caching needs block_size <= ", kMaxHashedBlockSize,
                     ", got ", options.block_size));
  }
  if (device.kind() != DeviceKind::kCuda &&
      options.kernel_options.linear_kernel != kernels::LinearKernel::kAuto) {
    return absl::InvalidArgumentError(absl::StrCat(
        "linear_kernel must be auto on the ", DeviceKindName(device.kind()),
        " backend (it has one GEMM)"));
  }
  if (device.kind() != DeviceKind::kCuda &&
      options.kernel_options.decode_attention_kernel !=
          kernels::DecodeAttentionKernel::kAuto) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode_attention_kernel must be auto on the ",
                     DeviceKindName(device.kind()),
                     " backend (it has one attention routine)"));
  }
  if (device.kind() != DeviceKind::kCuda &&
      options.kernel_options.decode_megakernel != DecodeMegakernel::kOff) {
    return absl::InvalidArgumentError(absl::StrCat(
        "decode_megakernel must be off on the ", DeviceKindName(device.kind()),
        " backend (the megakernel is a CUDA kernel)"));
  }
  std::unique_ptr<ModelRunner> r(new ModelRunner(device, options));
  PDW_ASSIGN_OR_RETURN(r->config_, LoadModelConfig(model_dir));
  const ModelConfig& c = r->config_;
  PDW_RETURN_IF_ERROR(kernels::CheckVarlenAttentionKernel(
      device.kind(), options.kernel_options.varlen_attention_kernel, c.head_dim,
      c.num_attention_heads, c.num_key_value_heads));
  PDW_ASSIGN_OR_RETURN(
      r->max_model_len_,
      ResolveContextLength({options.max_model_len, device.kind(),
                            options.kernel_options.unverified_cuda_kernels},
                           &r->config_));

  if (c.sliding_window.has_value() &&
      std::find(c.sliding_layers.begin(), c.sliding_layers.end(), false) ==
          c.sliding_layers.end() &&
      (device.kind() == DeviceKind::kCpu ||
       options.kernel_options.unverified_cuda_kernels ==
           UnverifiedCudaKernels::kAllow)) {
    r->free_window_ = static_cast<int>(*c.sliding_window);
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
  // capture_lifecycle_ starts kNotCaptured: until CaptureGraphs() marks it
  // ready every step is eager (still_capturing; mode_none under NONE).

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
  // An explicit --kv_cache_bytes too small for one sequence fails before
  // the weights load; a budget from the memory left is known only after.
  int64_t num_blocks = 0;
  if (options.kv_cache_bytes != 0) {
    PDW_ASSIGN_OR_RETURN(num_blocks,
                         NumBlocksForBudget(spec, options.kv_cache_bytes));
  }
  const int max_blocks = spec.MaxBlocksPerSeq();

  PDW_ASSIGN_OR_RETURN(r->stream_, device.CreateStream());
  r->stream_fence_ = StreamFence(*r->stream_);
  PDW_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> checkpoint,
                       Checkpoint::Open(model_dir));
  // The weights digest reads the same mapping as the load, on its own
  // threads while the load runs (bench/RESULTS.md, "Model load time": most
  // of its time hides behind the load). A std::async future joins in its
  // destructor, so no exit path unmaps `checkpoint` under the hashing.
  const auto load_start = std::chrono::steady_clock::now();
  std::future<absl::StatusOr<std::string>> digest_task =
      std::async(std::launch::async,
                 [&mapped = *checkpoint] { return WeightsDigest(mapped); });
  PDW_ASSIGN_OR_RETURN(r->weights_,
                       LoadLlamaWeights(c, *checkpoint, device, *r->stream_));
  const auto loaded = std::chrono::steady_clock::now();
  PDW_ASSIGN_OR_RETURN(const std::string weights_digest, digest_task.get());
  PDW_ASSIGN_OR_RETURN(r->model_fingerprint_,
                       ModelFingerprint(c, weights_digest));
  const auto seconds = [](auto from, auto to) {
    return std::chrono::duration<double>(to - from).count();
  };
  LOG(INFO) << "model fingerprint " << r->model_fingerprint_ << " (weights "
            << weights_digest << "); weights loaded in "
            << seconds(load_start, loaded) << " s, digest done "
            << seconds(loaded, std::chrono::steady_clock::now()) << " s after";

  LlamaForwardOptions fo;
  fo.max_num_tokens = options.max_num_batched_tokens;
  fo.max_num_seqs = options.max_num_seqs;
  fo.block_size = options.block_size;
  fo.max_blocks_per_seq = max_blocks;
  fo.uniform_decode_query_len = options.uniform_decode_query_len;
  fo.input_address_check = options.input_address_check;
  fo.kernel_options = options.kernel_options;
  r->max_logits_rows_ = LlamaForward::MaxLogitsRows(fo);
  PDW_ASSIGN_OR_RETURN(
      const size_t sampling_workspace_bytes,
      kernels::SamplingWorkspaceBytesFor(
          device.kind(), static_cast<int>(c.vocab_size), r->max_logits_rows_));
  // Every slot's step may have its inputs uploaded and not yet copied.
  StepLimits step_limits;
  step_limits.max_num_seqs = options.max_num_seqs;
  step_limits.max_num_batched_tokens = options.max_num_batched_tokens;
  step_limits.max_blocks_per_seq = max_blocks;
  step_limits.max_uploads_in_flight = static_cast<int>(r->slots_.size());
  step_limits.max_logits_rows = r->max_logits_rows_;
  PDW_ASSIGN_OR_RETURN(
      r->step_arena_,
      Arena::Create(device,
                    {StepArenaBytes(step_limits, sampling_workspace_bytes,
                                    static_cast<int>(r->slots_.size())),
                     256, "step_inputs"}));
  PDW_ASSIGN_OR_RETURN(r->inputs_,
                       StepInputs::Create(device, *r->step_arena_, step_limits,
                                          options.block_size));
  PDW_ASSIGN_OR_RETURN(
      r->sampler_,
      Sampler::Create(device, *r->step_arena_,
                      {r->max_logits_rows_, static_cast<int>(c.vocab_size),
                       sampling_workspace_bytes,
                       r->max_logits_rows_ * kMaxBannedTokensPerSequence,
                       static_cast<int>(r->slots_.size())}));
  const size_t seq_ints = static_cast<size_t>(options.max_num_seqs);
  const size_t row_ints = static_cast<size_t>(r->max_logits_rows_);
  for (StepSlot& slot : r->slots_) {
    PDW_ASSIGN_OR_RETURN(slot.token_ids,
                         r->step_arena_->Allocate(row_ints * sizeof(int32_t),
                                                  "sampled_token_ids"));
    PDW_ASSIGN_OR_RETURN(
        slot.logprobs,
        r->step_arena_->Allocate(row_ints * sizeof(float), "sampled_logprobs"));
    PDW_ASSIGN_OR_RETURN(slot.host,
                         device.AllocateHost(r->host_layout().bytes));
    PDW_ASSIGN_OR_RETURN(slot.start, device.CreateEvent());
    PDW_ASSIGN_OR_RETURN(slot.end, device.CreateEvent());
    slot.num_tokens.reserve(options.max_num_seqs);
  }
  PDW_ASSIGN_OR_RETURN(
      r->feed_,
      r->step_arena_->Allocate(2 * seq_ints * sizeof(int32_t), "feed_rows"));
  const size_t top = seq_ints * kernels::kMaxTopLogprobs;
  PDW_ASSIGN_OR_RETURN(
      r->logprob_rows_,
      r->step_arena_->Allocate(seq_ints * sizeof(int32_t), "logprob_rows"));
  PDW_ASSIGN_OR_RETURN(
      r->logsumexp_,
      r->step_arena_->Allocate(seq_ints * sizeof(float), "logsumexp"));
  PDW_ASSIGN_OR_RETURN(
      r->raw_logprobs_,
      r->step_arena_->Allocate(seq_ints * sizeof(float), "raw_logprobs"));
  PDW_ASSIGN_OR_RETURN(
      r->top_token_ids_,
      r->step_arena_->Allocate(top * sizeof(int32_t), "top_token_ids"));
  PDW_ASSIGN_OR_RETURN(
      r->top_logprobs_,
      r->step_arena_->Allocate(top * sizeof(float), "top_logprobs"));

  if (options.kv_cache_bytes == 0) {
    PDW_ASSIGN_OR_RETURN(const MemoryStats memory, device.GetMemoryStats());
    const int64_t activation_bytes = static_cast<int64_t>(
        LlamaForward::ActivationBytes(c, fo, device.kind()));
    PDW_ASSIGN_OR_RETURN(
        const KvCacheBudget budget,
        ComputeKvCacheBudget(
            {device.kind(), options.gpu_memory_utilization, memory,
             device.kind() == DeviceKind::kCpu ? HostMemAvailableBytes() : -1,
             activation_bytes}));
    absl::StatusOr<int64_t> blocks =
        NumBlocksForBudget(spec, budget.kv_cache_bytes);
    if (!blocks.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the KV cache cannot hold one sequence of max_model_len=",
          spec.max_model_len, " (",
          spec.MaxBlocksPerSeq() * spec.BytesPerBlock(),
          " bytes): ", budget.ToString(options.gpu_memory_utilization),
          "; lower --max_model_len, raise --gpu_memory_utilization, or set "
          "--kv_cache_bytes"));
    }
    num_blocks = *blocks;
    LOG(INFO) << "memory (--gpu_memory_utilization="
              << options.gpu_memory_utilization
              << "): " << budget.ToString(options.gpu_memory_utilization);
  }
  if (num_blocks > (int64_t{1} << 30)) num_blocks = int64_t{1} << 30;
  fo.num_blocks = static_cast<int>(num_blocks);
  PDW_ASSIGN_OR_RETURN(
      r->forward_,
      LlamaForward::Create(c, r->weights_, r->inputs_->buffers(), fo, device,
                           *r->stream_, r->capture_lifecycle_));
  r->kv_ = std::make_unique<KvCacheManager>(
      static_cast<int32_t>(num_blocks), options.block_size, r->max_model_len_,
      PrefixCacheConfig{options.prefix_caching, r->model_fingerprint_});
  PDW_RETURN_IF_ERROR(r->stream_->Synchronize());

  r->appends_.reserve(options.max_num_seqs);
  r->step_seqs_.reserve(options.max_num_seqs);
  r->sampling_.reserve(r->max_logits_rows_);
  r->sample_positions_.reserve(r->max_logits_rows_);
  r->banned_rows_.reserve(r->max_logits_rows_ * kMaxBannedTokensPerSequence);
  r->banned_token_ids_.reserve(r->max_logits_rows_ *
                               kMaxBannedTokensPerSequence);
  r->feed_host_.reserve(2 * options.max_num_seqs);
  LOG(INFO) << "model runner: " << c.num_hidden_layers << " layers, hidden "
            << c.hidden_size << ", vocab " << c.vocab_size << "; mode "
            << r->plan_.mode << " -> " << resolved.mode << "; weights "
            << r->weights_.arena->capacity_bytes() << " bytes, step buffers "
            << r->step_arena_->capacity_bytes() << " bytes, activations "
            << r->forward_->activation_bytes() << " bytes, " << num_blocks
            << " KV blocks of " << options.block_size << " tokens ("
            << r->forward_->kv_cache_bytes() << " bytes); max concurrency "
            << static_cast<double>(num_blocks) / max_blocks
            << "x at max_model_len=" << r->max_model_len_;
  return r;
}

absl::StatusOr<CaptureSummary> ModelRunner::CaptureGraphs() {
  CaptureSessionParams p;
  p.device = &device_;
  p.stream = stream_.get();
  p.capture_lifecycle = &capture_lifecycle_;
  p.descs = dispatcher_.GetCaptureDescs();
  p.num_warmups = options_.num_warmups;
  p.prepare_inputs = [this](const BatchDescriptor& d) {
    PaddedShape shape{d.num_tokens, d.uniform ? d.num_reqs : 0,
                      UniformQueryLen(d)};
    PDW_RETURN_IF_ERROR(inputs_->BuildDummy(shape));
    return inputs_->Upload(*stream_);
  };
  p.forward = [this](const ForwardContext& ctx) { return forward_->Run(ctx); };
  // The session holds the lifecycle at kCapturing while it runs; the
  // dispatcher keeps real steps eager until every graph exists.
  const absl::StatusOr<MemoryStats> before = device_.GetMemoryStats();
  absl::StatusOr<CaptureSummary> summary = RunCaptureSession(p);
  if (!summary.ok()) {
    capture_lifecycle_.Disable();
    return summary.status();
  }
  PDW_RETURN_IF_ERROR(stream_->Synchronize());
  capture_lifecycle_.MarkReady();
  // What the graphs took (device-wide on CUDA; our allocations on the CPU),
  // against the reserve a --gpu_memory_utilization budget kept for them.
  const absl::StatusOr<MemoryStats> after = device_.GetMemoryStats();
  if (before.ok() && after.ok()) {
    const int64_t graphs = static_cast<int64_t>(after->used_bytes) -
                           static_cast<int64_t>(before->used_bytes);
    const int64_t reserve =
        device_.kind() == DeviceKind::kCuda ? kCudaGraphReserveBytes : 0;
    LOG(INFO) << "graphs: " << NumCapturedGraphs() << " captured, " << graphs
              << " bytes of device memory";
    if (options_.kv_cache_bytes == 0 && graphs > reserve) {
      LOG(WARNING) << "the graphs took " << graphs << " bytes, more than the "
                   << reserve << " bytes --gpu_memory_utilization kept for "
                   << "them: the worker uses more than that fraction";
    }
  }
  return summary;
}

int ModelRunner::NumCapturedGraphs() const {
  int n = static_cast<int>(forward_->full_wrapper().num_graphs());
  for (const auto& piece : forward_->piece_wrappers()) {
    n += static_cast<int>(piece->num_graphs());
  }
  return n;
}

ModelRunner::HostLayout ModelRunner::host_layout() const {
  // Every logits row's id and logprob, then the raw logprobs, top ids and
  // top logprobs of at most max_num_seqs sequences that asked.
  const size_t rows = static_cast<size_t>(max_logits_rows_);
  const size_t seqs = static_cast<size_t>(options_.max_num_seqs);
  const size_t top = seqs * kernels::kMaxTopLogprobs;
  HostLayout l;
  l.logprobs = l.ids + rows * sizeof(int32_t);
  l.raw = l.logprobs + rows * sizeof(float);
  l.top_ids = l.raw + seqs * sizeof(float);
  l.top_values = l.top_ids + top * sizeof(int32_t);
  l.bytes = l.top_values + top * sizeof(float);
  return l;
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
    PDW_RETURN_IF_ERROR(
        CheckTokenIds(absl::StrCat("sequence '", s.sequence_id, "': token_ids"),
                      s.token_ids, config_.vocab_size));
    absl::Status sampling = ValidateSamplingOptions(s.sampling);
    if (!sampling.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence '", s.sequence_id, "': ", sampling.message()));
    }
    const int64_t max_top =
        std::min<int64_t>(kernels::kMaxTopLogprobs, config_.vocab_size);
    if (s.num_top_logprobs < -1 || s.num_top_logprobs > max_top) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence '", s.sequence_id, "': num_top_logprobs=",
                       s.num_top_logprobs, " outside [-1, ", max_top, "]"));
    }
    if (s.num_samples < 1 ||
        s.num_samples > static_cast<int64_t>(s.token_ids.size()) ||
        s.num_samples > options_.uniform_decode_query_len) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence '", s.sequence_id, "': num_samples=", s.num_samples,
          " outside [1, min(", s.token_ids.size(),
          " new tokens, uniform_decode_query_len=",
          options_.uniform_decode_query_len, ")]"));
    }
    if (s.num_samples > 1) {
      if (s.last_token_from.has_value() || s.num_top_logprobs >= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence '", s.sequence_id, "': num_samples=", s.num_samples,
            " cannot be combined with ",
            s.last_token_from.has_value() ? "last_token_from"
                                          : "num_top_logprobs"));
      }
      // The multi-row unpack and uniform verify steps have not run on a
      // GPU yet (issue 45's wave runs model_runner_gpu_test's
      // SampledRowsMatchOneTokenSteps).
      if (device_.kind() == DeviceKind::kCuda &&
          options_.kernel_options.unverified_cuda_kernels !=
              UnverifiedCudaKernels::kAllow) {
        return absl::UnimplementedError(
            absl::StrCat("sequence '", s.sequence_id,
                         "': num_samples > 1 on CUDA has not run on a GPU yet; "
                         "--unverified_cuda_kernels=allow runs it"));
      }
    }
    if (s.banned_token_ids.size() > kMaxBannedTokensPerSequence) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence '", s.sequence_id, "': ", s.banned_token_ids.size(),
          " banned token ids; at most ", kMaxBannedTokensPerSequence));
    }
    if (s.last_token_from.has_value()) {
      const SampleRef& ref = *s.last_token_from;
      const bool in_flight = std::find(in_flight_.begin(), in_flight_.end(),
                                       ref.slot) != in_flight_.end();
      if (!in_flight || ref.row < 0 ||
          ref.row >= static_cast<int>(slots_[ref.slot].num_tokens.size())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence '", s.sequence_id, "': its last token comes from row ",
            ref.row, " of slot ", ref.slot, ", which is no step in flight"));
      }
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

absl::StatusOr<int> ModelRunner::Launch(absl::Span<const SequenceStep> batch) {
  if (steps_in_flight() >= kMaxStepsInFlight) {
    return absl::FailedPreconditionError(
        absl::StrCat(kMaxStepsInFlight, " steps in flight; retire one first"));
  }
  PDW_RETURN_IF_ERROR(Validate(batch));

  // 0. Blocks that left the window of a sequence that may give them back:
  // dead for every query from its current length on (a failed step leaves
  // them freed, which changes no result).
  if (free_window_ > 0) {
    for (const SequenceStep& s : batch) {
      if (s.window_blocks == WindowBlocks::kFree &&
          kv_->Find(s.sequence_id) != nullptr) {
        PDW_RETURN_IF_ERROR(
            kv_->FreeOutsideWindow(s.sequence_id, free_window_).status());
      }
    }
  }

  // 1. KV cache: all-or-nothing (also rejects duplicates and length limits).
  // A placeholder's id is unknown to the cache until its step retires.
  appends_.clear();
  append_token_ids_.clear();
  size_t placeholder_tokens = 0;
  for (const SequenceStep& s : batch) {
    if (s.last_token_from.has_value()) placeholder_tokens += s.token_ids.size();
  }
  append_token_ids_.reserve(placeholder_tokens);  // spans below stay valid
  for (const SequenceStep& s : batch) {
    absl::Span<const int32_t> ids = s.token_ids;
    if (s.last_token_from.has_value()) {
      const size_t at = append_token_ids_.size();
      append_token_ids_.insert(append_token_ids_.end(), s.token_ids.begin(),
                               s.token_ids.end());
      append_token_ids_.back() = kUnknownTokenId;
      ids = absl::MakeConstSpan(append_token_ids_).subspan(at);
    }
    appends_.push_back({s.sequence_id, static_cast<int32_t>(ids.size()),
                        s.creation, ids, s.num_samples});
  }
  PDW_ASSIGN_OR_RETURN(StepReservation reservation, kv_->Append(appends_));
  // The step computes what the prefix cache did not hold.
  cached_tokens_.clear();
  int num_tokens = 0, max_query_len = 0;
  for (size_t r = 0; r < batch.size(); ++r) {
    const int cached = reservation.entries[r].cached_tokens;
    const int q = static_cast<int>(batch[r].token_ids.size()) - cached;
    cached_tokens_.push_back(cached);
    num_tokens += q;
    max_query_len = std::max(max_query_len, q);
  }

  // 2. Dispatch.
  const int num_reqs = static_cast<int>(batch.size());
  const BatchKind kind = ClassifyBatch(num_tokens, num_reqs, max_query_len,
                                       options_.uniform_decode_query_len);
  const DispatchResult d = dispatcher_.Dispatch(num_tokens, kind, num_reqs);

  const int slot = next_slot_;
  absl::Status status = Enqueue(batch, d, slot);
  if (!status.ok()) {
    kv_->Undo(reservation);
    return absl::Status(
        status.code(),
        absl::StrCat("step failed and was undone: ", status.message()));
  }

  // 6. Statistics.
  stats_.Record(num_tokens, d.descriptor.num_tokens, d.mode);

  StepSlot& s = slots_[slot];
  s.reservation = std::move(reservation);
  s.cached_tokens = cached_tokens_;
  s.token_fills.clear();
  for (const SequenceStep& seq : batch) {
    if (!seq.last_token_from.has_value()) continue;
    const SampleRef& from = *seq.last_token_from;
    StepSlot& source = slots_[from.slot];
    source.token_fills.push_back({seq.sequence_id,
                                  kv_->Find(seq.sequence_id)->num_tokens - 1,
                                  source.row_ends[from.row] - 1});
  }
  s.info = StepInfo{};
  s.info.mode = d.mode;
  s.info.fallback_reason = d.reason;
  s.info.descriptor = d.descriptor;
  s.info.unpadded_tokens = num_tokens;
  s.info.padded_tokens = d.descriptor.num_tokens;
  s.info.num_sequences = num_reqs;
  s.previous_slot = last_launched_slot_;
  last_launched_slot_ = slot;
  next_slot_ = (slot + 1) % static_cast<int>(slots_.size());
  in_flight_.push_back(slot);
  return slot;
}

absl::Status ModelRunner::Enqueue(absl::Span<const SequenceStep> batch,
                                  const DispatchResult& d, int slot) {
  StepSlot& out = slots_[slot];
  const int num_reqs = static_cast<int>(batch.size());
  PDW_RETURN_IF_ERROR(stream_->RecordEvent(*out.start));

  // 3. Inputs with padding rows up to the key's shape, then the tokens
  // that steps in flight are still sampling, copied on the device.
  PaddedShape shape{d.descriptor.num_tokens, num_reqs, 0};
  if (d.mode != RuntimeMode::kNone && d.descriptor.uniform) {
    shape = {d.descriptor.num_tokens, d.descriptor.num_reqs,
             UniformQueryLen(d.descriptor)};
  }
  step_seqs_.clear();
  for (int r = 0; r < num_reqs; ++r) {
    step_seqs_.push_back(
        {kv_->Find(batch[r].sequence_id),
         absl::MakeConstSpan(batch[r].token_ids).subspan(cached_tokens_[r]),
         batch[r].num_samples});
  }
  PDW_RETURN_IF_ERROR(inputs_->Build(step_seqs_, shape));
  PDW_RETURN_IF_ERROR(inputs_->Upload(*stream_));
  // One feed launch per source step (in practice one: the step before).
  for (const int source : in_flight_) {
    // feed_'s layout: the source logits rows (each fed sequence's last
    // row there), then their destination token indices (its last token).
    const absl::Span<const int32_t> query_start =
        inputs_->host_query_start_loc();
    const std::vector<int32_t>& source_rows = slots_[source].row_ends;
    auto fed = [&](int r) {
      const std::optional<SampleRef>& from = batch[r].last_token_from;
      return from.has_value() && from->slot == source;
    };
    feed_host_.clear();
    for (int r = 0; r < num_reqs; ++r) {
      if (fed(r)) {
        feed_host_.push_back(source_rows[batch[r].last_token_from->row] - 1);
      }
    }
    const int num_feeds = static_cast<int>(feed_host_.size());
    if (num_feeds == 0) continue;
    for (int r = 0; r < num_reqs; ++r) {
      if (fed(r)) feed_host_.push_back(query_start[r + 1] - 1);
    }
    const size_t bytes = num_feeds * sizeof(int32_t);
    PDW_RETURN_IF_ERROR(
        stream_->CopyToDevice(feed_, feed_host_.data(), 2 * bytes));
    kernels::FeedSampledTokensParams feed;
    feed.sampled_token_ids = slots_[source].token_ids;
    feed.src_rows = feed_.Slice(0, bytes);
    feed.token_ids = inputs_->buffers().token_ids;
    feed.dst_indices = feed_.Slice(bytes, bytes);
    feed.num_feeds = num_feeds;
    feed.num_sampled = source_rows.empty() ? 0 : source_rows.back();
    feed.num_tokens = shape.num_tokens;
    PDW_RETURN_IF_ERROR(kernels::LaunchFeedSampledTokens(*stream_, feed));
  }

  // 4. Forward.
  const ForwardContext context{d.mode, d.descriptor};
  PDW_RETURN_IF_ERROR(forward_->Run(context));

  // 5. Sample the real rows, then copy the samples to the host. Raw
  // logprobs come from the logits before any mask or temperature.
  out.row_ends.clear();
  for (int r = 0; r < num_reqs; ++r) {
    out.row_ends.push_back((r == 0 ? 0 : out.row_ends.back()) +
                           batch[r].num_samples);
  }
  const int num_rows = out.row_ends.back();
  out.logprob_seqs.clear();
  out.logprob_rows.clear();
  out.logprob_num_top.clear();
  out.logprob_k = 0;
  for (int r = 0; r < num_reqs; ++r) {
    if (batch[r].num_top_logprobs < 0) continue;
    out.logprob_seqs.push_back(r);
    out.logprob_rows.push_back(out.row_ends[r] - 1);
    out.logprob_num_top.push_back(batch[r].num_top_logprobs);
    out.logprob_k = std::max(out.logprob_k, batch[r].num_top_logprobs);
  }
  const int num_logprob_rows = static_cast<int>(out.logprob_rows.size());
  if (num_logprob_rows > 0) {
    PDW_RETURN_IF_ERROR(
        stream_->CopyToDevice(logprob_rows_, out.logprob_rows.data(),
                              num_logprob_rows * sizeof(int32_t)));
    kernels::TopLogprobsParams top;
    top.logits = forward_->logits();
    top.rows = logprob_rows_;
    top.logsumexp = logsumexp_;
    top.top_token_ids = top_token_ids_;
    top.top_logprobs = top_logprobs_;
    top.num_rows = num_logprob_rows;
    top.num_logit_rows = num_rows;
    top.vocab_size = static_cast<int>(config_.vocab_size);
    top.k = out.logprob_k;
    PDW_RETURN_IF_ERROR(kernels::LaunchTopLogprobs(*stream_, top));
  }
  sampling_.clear();
  sample_positions_.clear();
  banned_rows_.clear();
  banned_token_ids_.clear();
  out.num_tokens.clear();
  for (int r = 0; r < num_reqs; ++r) {
    const int32_t length = step_seqs_[r].kv->num_tokens;
    out.num_tokens.push_back(length);
    const int n = batch[r].num_samples;
    for (int j = 0; j < n; ++j) {
      const int row = out.row_ends[r] - n + j;
      sampling_.push_back(batch[r].sampling);
      // The sampled token's absolute position (the RNG counter): the
      // length after the step for the last row, one less per row before.
      sample_positions_.push_back(length - (n - 1 - j));
      for (const int32_t id : batch[r].banned_token_ids) {
        banned_rows_.push_back(row);
        banned_token_ids_.push_back(id);
      }
    }
  }
  SamplingBatch sampling;
  sampling.options = sampling_;
  sampling.positions = sample_positions_;
  sampling.banned_rows = banned_rows_;
  sampling.banned_token_ids = banned_token_ids_;
  sampling.greedy_tiles = forward_->GreedyTiles(context);
  PDW_RETURN_IF_ERROR(sampler_->Launch(*stream_, forward_->logits(), sampling,
                                       out.token_ids, out.logprobs));
  char* host = static_cast<char*>(out.host.data());
  const HostLayout layout = host_layout();
  PDW_RETURN_IF_ERROR(stream_->CopyToHostAsync(host + layout.ids, out.token_ids,
                                               num_rows * sizeof(int32_t)));
  PDW_RETURN_IF_ERROR(stream_->CopyToHostAsync(
      host + layout.logprobs, out.logprobs, num_rows * sizeof(float)));
  if (num_logprob_rows > 0) {
    kernels::GatherLogprobsParams gather;
    gather.logits = forward_->logits();
    gather.rows = logprob_rows_;
    gather.token_ids = out.token_ids;
    gather.logsumexp = logsumexp_;
    gather.logprobs = raw_logprobs_;
    gather.num_rows = num_logprob_rows;
    gather.num_logit_rows = num_rows;
    gather.vocab_size = static_cast<int>(config_.vocab_size);
    PDW_RETURN_IF_ERROR(kernels::LaunchGatherLogprobs(*stream_, gather));
    PDW_RETURN_IF_ERROR(stream_->CopyToHostAsync(
        host + layout.raw, raw_logprobs_, num_logprob_rows * sizeof(float)));
    const size_t top_count =
        static_cast<size_t>(num_logprob_rows) * out.logprob_k;
    if (top_count > 0) {
      PDW_RETURN_IF_ERROR(stream_->CopyToHostAsync(
          host + layout.top_ids, top_token_ids_, top_count * sizeof(int32_t)));
      PDW_RETURN_IF_ERROR(stream_->CopyToHostAsync(
          host + layout.top_values, top_logprobs_, top_count * sizeof(float)));
    }
  }
  return stream_->RecordEvent(*out.end);
}

absl::StatusOr<StepResult> ModelRunner::Retire(int slot) {
  if (in_flight_.empty() || in_flight_.front() != slot) {
    return absl::FailedPreconditionError(
        absl::StrCat("Retire(", slot, "): not the oldest step in flight"));
  }
  in_flight_.pop_front();
  StepSlot& s = slots_[slot];
  PDW_RETURN_IF_ERROR(s.end->Synchronize());
  StepResult result;
  result.info = s.info;
  PDW_ASSIGN_OR_RETURN(const double device_ms,
                       s.end->ElapsedMillisecondsSince(*s.start));
  result.info.device_seconds = device_ms * 1e-3;
  if (s.previous_slot >= 0) {
    PDW_ASSIGN_OR_RETURN(
        const double idle_ms,
        s.start->ElapsedMillisecondsSince(*slots_[s.previous_slot].end));
    result.info.idle_before_seconds = std::max(idle_ms, 0.0) * 1e-3;
  }
  const int num_reqs = static_cast<int>(s.num_tokens.size());
  const HostLayout layout = host_layout();
  const char* host = static_cast<const char*>(s.host.data());
  const auto* ids = reinterpret_cast<const int32_t*>(host + layout.ids);
  const auto* logprobs = reinterpret_cast<const float*>(host + layout.logprobs);
  result.sequences.resize(num_reqs);
  for (int r = 0; r < num_reqs; ++r) {
    SequenceResult& out = result.sequences[r];
    const int last = s.row_ends[r] - 1;
    const int first = r == 0 ? 0 : s.row_ends[r - 1];
    out.token_id = ids[last];
    out.logprob = logprobs[last];
    out.prior_token_ids.assign(ids + first, ids + last);
    out.prior_logprobs.assign(logprobs + first, logprobs + last);
    out.num_tokens = s.num_tokens[r];
    out.cached_tokens = s.cached_tokens[r];
  }
  // The ids this step sampled complete later steps' blocks in the cache.
  for (const StepSlot::TokenFill& fill : s.token_fills) {
    kv_->SetTokenId(fill.sequence_id, fill.position, ids[fill.row]);
  }
  s.token_fills.clear();
  // Raw logprobs of the sequences that asked: entry i of the step's list.
  const auto* raw = reinterpret_cast<const float*>(host + layout.raw);
  const auto* top_ids = reinterpret_cast<const int32_t*>(host + layout.top_ids);
  const auto* top_values =
      reinterpret_cast<const float*>(host + layout.top_values);
  for (size_t i = 0; i < s.logprob_seqs.size(); ++i) {
    SequenceResult& out = result.sequences[s.logprob_seqs[i]];
    out.raw_logprob = raw[i];
    for (int j = 0; j < s.logprob_num_top[i]; ++j) {
      const size_t at = i * s.logprob_k + j;
      out.top_logprobs.push_back({top_ids[at], top_values[at]});
    }
  }
  return result;
}

absl::StatusOr<StepResult> ModelRunner::Execute(
    absl::Span<const SequenceStep> batch) {
  if (steps_in_flight() > 0) {
    return absl::FailedPreconditionError(
        "Execute: steps are in flight; use Launch/Retire");
  }
  PDW_ASSIGN_OR_RETURN(const int slot, Launch(batch));
  absl::StatusOr<StepResult> result = Retire(slot);
  if (!result.ok()) {
    // The reservation is the latest Append: undo it so the runner is as
    // it was (a device fault leaves nothing else to trust anyway).
    kv_->Undo(slots_[slot].reservation);
    return absl::Status(result.status().code(),
                        absl::StrCat("step failed and was undone: ",
                                     result.status().message()));
  }
  return result;
}

absl::Status ModelRunner::Release(absl::string_view sequence_id) {
  return kv_->Free(sequence_id);
}

absl::Status ModelRunner::Truncate(absl::string_view sequence_id,
                                   int32_t num_tokens) {
  std::optional<BlockCopy> copy;
  PDW_RETURN_IF_ERROR(kv_->Truncate(sequence_id, num_tokens, &copy));
  if (!copy.has_value()) return absl::OkStatus();
  // Layer caches are [num_blocks, block_size, kv_heads, head_dim]: a
  // block's first tokens are one contiguous run per layer, K and V.
  const size_t token_bytes =
      static_cast<size_t>(config_.kv_size()) * DTypeSize(forward_->dtype());
  const size_t block_bytes = token_bytes * options_.block_size;
  const size_t bytes = token_bytes * copy->num_tokens;
  for (const auto* caches :
       {&forward_->key_caches(), &forward_->value_caches()}) {
    for (const DeviceBuffer& layer : *caches) {
      PDW_RETURN_IF_ERROR(stream_->CopyOnDevice(
          layer.Slice(copy->dst_block * block_bytes, bytes),
          layer.Slice(copy->src_block * block_bytes, bytes), bytes));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int32_t> ModelRunner::StartSequence(
    absl::string_view sequence_id, absl::Span<const int32_t> token_ids) {
  return kv_->StartSequence(sequence_id, token_ids);
}

absl::StatusOr<SequenceKv> ModelRunner::Detach(absl::string_view sequence_id) {
  return kv_->Detach(sequence_id);
}

absl::StatusOr<SequenceKv> ModelRunner::AllocateDetached(
    int32_t num_tokens, absl::Span<const int32_t> token_ids,
    int32_t* cached_tokens) {
  // Blocks freed while work queued on stream_ still writes them (a failed
  // step's Undo, an abort, a flushed prefix) are safe to reuse on stream_
  // (in order), not on the pull's stream, which nothing orders after it.
  PDW_RETURN_IF_ERROR(stream_fence_.Wait());
  return kv_->AllocateDetached(num_tokens, token_ids, cached_tokens);
}

absl::Status ModelRunner::Attach(absl::string_view sequence_id, SequenceKv& kv,
                                 absl::Span<const int32_t> token_ids) {
  return kv_->Attach(sequence_id, kv, token_ids);
}

void ModelRunner::FreeDetached(SequenceKv& kv) { kv_->FreeDetached(kv); }

int64_t ModelRunner::kv_cache_bytes() const {
  return static_cast<int64_t>(forward_->kv_cache_bytes());
}

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
  if (rows <= 0 || rows > max_logits_rows_) {
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
