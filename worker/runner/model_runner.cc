#include "worker/runner/model_runner.h"

#include <algorithm>
#include <chrono>
#include <future>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "dispatcher/attention_cg_support.h"
#include "glog/logging.h"
#include "worker/kernels/kernel_checks.h"
#include "worker/kernels/logprobs.h"
#include "worker/kernels/paged_attention.h"
#include "worker/kernels/sampling.h"
#include "worker/kv_cache/kv_cache_spec.h"
#include "worker/model/model_fingerprint.h"
#include "worker/runner/context_length.h"

namespace pdworker {
namespace {

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
                      rows * 3 +
                      rows * 2 * ModelRunner::kMaxBannedTokensPerSequence +
                      seqs * 2 + rows * 2 * num_slots + rows * 2 + rows * 3 +
                      rows * 2 * kernels::kMaxTopLogprobs;
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
  const size_t top = row_ints * kernels::kMaxTopLogprobs;
  PDW_ASSIGN_OR_RETURN(
      r->logprob_rows_,
      r->step_arena_->Allocate(row_ints * sizeof(int32_t), "logprob_rows"));
  PDW_ASSIGN_OR_RETURN(
      r->logsumexp_,
      r->step_arena_->Allocate(row_ints * sizeof(float), "logsumexp"));
  PDW_ASSIGN_OR_RETURN(
      r->raw_logprobs_,
      r->step_arena_->Allocate(row_ints * sizeof(float), "raw_logprobs"));
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
