// ModelRunner: one model step, end to end, as in DESIGN.md's diagram:
//   1. KV cache: reserve blocks for the new tokens (all-or-nothing)
//   2. dispatcher.Dispatch -> (runtime mode, padded descriptor)
//   3. write the step's inputs into the static buffers, padding rows up to
//      the padded shape, and copy on the device the tokens that a step
//      still in flight samples
//   4. run the forward under ForwardContext{mode, descriptor}
//   5. sample the real rows (outside graphs) and copy them to the host
//   6. record (unpadded, padded, mode) in the statistics table
// Launch enqueues all of it and returns; Retire waits for the samples. So
// the engine plans and enqueues step N+1 while step N runs on the device.
#ifndef PDWORKER_WORKER_RUNNER_MODEL_RUNNER_H_
#define PDWORKER_WORKER_RUNNER_MODEL_RUNNER_H_

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "dispatcher/capture_lifecycle.h"
#include "dispatcher/compilation_config.h"
#include "dispatcher/cudagraph_dispatcher.h"
#include "dispatcher/graph_stats.h"
#include "dispatcher/graph_wrapper.h"
#include "dispatcher/role_defaults.h"
#include "dispatcher/step_info.h"
#include "worker/kv_cache/kv_cache_manager.h"
#include "worker/model/checkpoint.h"
#include "worker/model/llama_forward.h"
#include "worker/model/llama_weights.h"
#include "worker/model/model_config.h"
#include "worker/runner/kv_cache_budget.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/runner/sampler.h"
#include "worker/runner/step_inputs.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/capture_session.h"
#include "worker/runtime/device.h"
#include "worker/runtime/event.h"
#include "worker/runtime/host_memory.h"
#include "worker/runtime/stream.h"
#include "worker/runtime/stream_fence.h"

namespace pdworker {

struct ModelRunnerOptions {
  Role role = Role::kBoth;
  CompilationConfig compilation;      // overrides the role's graph defaults
  int max_num_seqs = 64;              // requests per step
  int max_num_batched_tokens = 2048;  // query tokens per step
  // The KV cache's bytes; 0: what --gpu_memory_utilization leaves once the
  // weights, step buffers and activations are counted (kv_cache_budget.h).
  int64_t kv_cache_bytes = int64_t{64} << 20;
  double gpu_memory_utilization = kDefaultGpuMemoryUtilization;
  int block_size = 16;    // KV tokens per block
  int max_model_len = 0;  // tokens per sequence; 0: max_position_embeddings
  int uniform_decode_query_len = 1;  // 1 + speculative tokens
  int num_warmups = 1;               // eager runs before each capture
  InputAddressCheck input_address_check = InputAddressCheck::kOff;
  // The forward's kernels (ForwardKernelOptions); off CUDA every choice
  // must be kAuto and the megakernel off.
  ForwardKernelOptions kernel_options;
  // Automatic prefix caching (KvCacheManager): a sequence a step creates
  // starts with its longest cached prefix, and the step computes only the
  // rest. Hashes are salted with model_fingerprint(). Needs block_size <=
  // kMaxHashedBlockSize. Off here (tests count exact step shapes); the
  // worker's --enable_prefix_caching turns it on by default.
  PrefixCaching prefix_caching = PrefixCaching::kOff;
};

// A token the host does not know yet: what the step in flight in slot `slot`
// sampled after the last token of its sequence `row` (the index in that
// step's batch; see ModelRunner::Launch).
struct SampleRef {
  int slot = -1;
  int row = -1;
};

// One sequence's part of a step.
// Whether a step may give back the sequence's blocks that left every
// layer's window (models whose every layer slides; see
// KvCacheManager::FreeOutsideWindow). kFree only for a sequence that will
// be neither detached for a handoff nor truncated: the engine's own
// requests that stay on this worker.
enum class WindowBlocks { kKeep, kFree };

struct SequenceStep {
  std::string sequence_id;
  std::vector<int32_t> token_ids;  // new tokens (prompt chunk or last token)
  SamplingOptions sampling;
  SequenceCreation creation = SequenceCreation::kCreateIfMissing;
  // Set when the last of `token_ids` (a placeholder) is still being sampled
  // by a step in flight: the runner copies it into the step's input on the
  // device, never through the host.
  std::optional<SampleRef> last_token_from;
  // Token ids the sampler must not pick for this sequence (min_tokens).
  std::vector<int32_t> banned_token_ids;
  // -1: no raw logprobs. 0..kernels::kMaxTopLogprobs: the sampled token's
  // raw logprob (log_softmax of the model's logits, before temperature,
  // masks and truncation: vLLM's default) and that many top alternatives.
  int32_t num_top_logprobs = -1;
  WindowBlocks window_blocks = WindowBlocks::kKeep;
  // Tokens the step samples: one after each of the last num_samples of
  // `token_ids` (1: the next token; 1 + k to verify k draft tokens, the
  // last k of `token_ids`). In [1, min(token_ids.size(),
  // uniform_decode_query_len)]; above 1, no last_token_from. Those tokens are
  // always computed (never taken from the prefix cache). Each row is sampled on
  // its own, at its own position (the RNG counter), with this sequence's
  // options and bans; raw logprobs (num_top_logprobs) come for every row.
  int32_t num_samples = 1;
};

// A step of `token_ids` for `sequence_id` with default (greedy) sampling.
inline SequenceStep MakeSequenceStep(std::string sequence_id,
                                     std::vector<int32_t> token_ids,
                                     SequenceCreation creation) {
  SequenceStep step;
  step.sequence_id = std::move(sequence_id);
  step.token_ids = std::move(token_ids);
  step.creation = creation;
  return step;
}

struct TopLogprob {
  int32_t token_id = -1;
  float logprob = 0.0f;
};

struct SequenceResult {
  int32_t token_id = -1;  // sampled after the step's last token
  // log p(token) under the distribution it was drawn from (after
  // temperature and truncation; see kernels::LogprobMode::kProcessed).
  float logprob = 0.0f;
  int32_t num_tokens = 0;  // sequence length after the step (KV cached)
  // Of the step's tokens of a sequence it created, those found in the
  // prefix cache (not computed).
  int32_t cached_tokens = 0;
  // When the step asked (SequenceStep::num_top_logprobs >= 0): the raw
  // logprob of `token_id` and the top alternatives, most likely first.
  float raw_logprob = 0.0f;
  std::vector<TopLogprob> top_logprobs;
  // With SequenceStep::num_samples = n > 1: what was sampled after each of
  // the n - 1 tokens before the last (the target's choice at each draft
  // position, in order), and its logprob as `logprob`. Empty for n = 1.
  std::vector<int32_t> prior_token_ids;
  std::vector<float> prior_logprobs;
  // And, when the step asked (num_top_logprobs >= 0), their raw logprobs
  // and top alternatives, as raw_logprob and top_logprobs are the last's.
  std::vector<float> prior_raw_logprobs;
  std::vector<std::vector<TopLogprob>> prior_top_logprobs;
};

struct StepResult {
  StepInfo info;
  std::vector<SequenceResult> sequences;  // in the order of the batch
};

class ModelRunner {
 public:
  // Loads `model_dir`, resolves the graph mode, allocates everything. Graphs
  // are captured by CaptureGraphs(); until then steps run eagerly (reason
  // still_capturing).
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(
      Device& device, const std::string& model_dir,
      const ModelRunnerOptions& options);

  ModelRunner(const ModelRunner&) = delete;
  ModelRunner& operator=(const ModelRunner&) = delete;
  ~ModelRunner();

  // Warms up and captures every graph the dispatcher can hand out; on
  // success graph steps start, on failure capture is disabled (every step
  // eager, reason capture_disabled).
  absl::StatusOr<CaptureSummary> CaptureGraphs();

  // Steps enqueued and not yet retired, at most.
  static constexpr int kMaxStepsInFlight = 3;
  // Tokens a sequence may ban at one step (its EOS and stop ids while under
  // min_tokens); the engine refuses requests that would need more.
  static constexpr int kMaxBannedTokensPerSequence = 64;

  // Enqueues one step and returns its slot (a SampleRef for the next steps'
  // inputs, and the argument of Retire). Every error leaves the runner
  // unchanged (no KV allocated, no sequence advanced): INVALID_ARGUMENT (bad
  // ids, tokens, sampling, duplicate sequence, too many sequences, tokens or
  // banned ids, past max_model_len, a SampleRef to no step in flight),
  // NOT_FOUND / ALREADY_EXISTS (per SequenceStep::creation),
  // RESOURCE_EXHAUSTED (KV cache full), FAILED_PRECONDITION
  // (kMaxStepsInFlight steps in flight). The KV cache already counts the
  // step's tokens when this returns. Not thread-safe: one engine thread.
  absl::StatusOr<int> Launch(absl::Span<const SequenceStep> batch);
  // Waits for the oldest step in flight, which must be `slot`, and returns
  // what it sampled. An error is the device's (a fault in this step or an
  // earlier one; every later step fails too): the step's KV stays counted,
  // for the caller to free.
  absl::StatusOr<StepResult> Retire(int slot);
  int steps_in_flight() const { return static_cast<int>(in_flight_.size()); }

  // Launch and Retire in one, with no other step in flight; on any error
  // (the device's included) the runner is unchanged.
  absl::StatusOr<StepResult> Execute(absl::Span<const SequenceStep> batch);

  // Frees a sequence's KV blocks. NOT_FOUND when unknown.
  absl::Status Release(absl::string_view sequence_id);

  // Rolls a sequence back to its first `num_tokens` tokens (see
  // KvCacheManager::Truncate): the undo for steps that already succeeded.
  // A shared cached block the cut falls inside is copied on the stream.
  absl::Status Truncate(absl::string_view sequence_id, int32_t num_tokens);

  // Prefix caching (see KvCacheManager): creates `sequence_id` holding the
  // longest cached prefix of `token_ids` and returns its length (0 when
  // off); its first step then continues it.
  absl::StatusOr<int32_t> StartSequence(absl::string_view sequence_id,
                                        absl::Span<const int32_t> token_ids);
  void ClearPrefixCache() { kv_->ClearPrefixCache(); }
  // The KV cache events recorded since the last call (appended to `out`).
  void TakeKvEvents(std::vector<KvCacheEvent>* out) { kv_->TakeEvents(out); }

  // KV handoff (see KvCacheManager's detached blocks): a prefill lease
  // detaches a finished sequence; an import allocates detached blocks,
  // fills them off the step thread, then attaches them under an id.
  absl::StatusOr<SequenceKv> Detach(absl::string_view sequence_id);
  // With `token_ids` and prefix caching, cached leading blocks are reused
  // (`*cached_tokens` of them; see KvCacheManager::AllocateDetached).
  // Waits for this runner's stream first: the blocks are filled on another
  // stream, which queued work here must not still write.
  absl::StatusOr<SequenceKv> AllocateDetached(
      int32_t num_tokens, absl::Span<const int32_t> token_ids = {},
      int32_t* cached_tokens = nullptr);
  absl::Status Attach(absl::string_view sequence_id, SequenceKv& kv,
                      absl::Span<const int32_t> token_ids = {});
  void FreeDetached(SequenceKv& kv);
  // The KV cache memory, for transfers. The buffers never move.
  KvCacheView kv_cache_view() const;

  // Debug/test read-backs (synchronize the stream; not during capture):
  // the last step's logits rows [0, rows) as [rows, vocab] (each
  // sequence's num_samples rows, in batch order), and one layer's whole K
  // or V cache as raw bytes.
  absl::Status ReadLogits(int rows, std::vector<float>* out);
  enum class KvPart { kKey, kValue };
  absl::Status ReadKvCache(int layer, KvPart part, std::vector<uint8_t>* out);

  const ModelConfig& model_config() const { return config_; }
  // Shape and weights (model_fingerprint.h): what the worker publishes and
  // what KV handoffs must agree on. 64 lowercase hex digits.
  const std::string& model_fingerprint() const { return model_fingerprint_; }
  const ModelRunnerOptions& options() const { return options_; }
  const GraphPlan& graph_plan() const { return plan_; }
  CudaGraphMode resolved_mode() const { return dispatcher_.mode(); }
  const std::string& downgrade_reason() const { return downgrade_reason_; }
  const CudagraphDispatcher& dispatcher() const { return dispatcher_; }
  CudagraphDispatcher& dispatcher() { return dispatcher_; }
  const CaptureLifecycle& capture_lifecycle() const {
    return capture_lifecycle_;
  }
  const GraphStats& graph_stats() const { return stats_; }
  const KvCacheManager& kv_cache() const { return *kv_; }
  // Device bytes of the KV cache (all layers, K and V).
  int64_t kv_cache_bytes() const;
  const LlamaForward& forward() const { return *forward_; }
  int max_model_len() const { return max_model_len_; }
  // Graphs captured so far (FULL + every PIECEWISE piece's).
  int NumCapturedGraphs() const;
  Stream& stream() { return *stream_; }
  Device& device() const { return device_; }

 private:
  ModelRunner(Device& device, const ModelRunnerOptions& options);

  // Everything checkable without touching state.
  absl::Status Validate(absl::Span<const SequenceStep> batch) const;
  // Steps 3-5 of Launch after the KV reservation; the caller undoes it on
  // error.
  absl::Status Enqueue(absl::Span<const SequenceStep> batch,
                       const DispatchResult& dispatch, int slot);

  // A step's outputs and bookkeeping, from Launch to Retire. The device
  // writes `token_ids`/`logprobs`, then copies them into `host`.
  struct StepSlot {
    DeviceBuffer token_ids;  // int32 [max logits rows]
    DeviceBuffer logprobs;   // fp32 [max logits rows]
    // Pinned, laid out as HostLayout says: the sampled ids and logprobs of
    // every logits row, then the raw logprobs, top ids and top logprobs of
    // the sequences that asked.
    HostMemory host;
    std::unique_ptr<Event> start, end;
    StepReservation reservation;
    StepInfo info;
    std::vector<int32_t> num_tokens;     // each sequence's length after it
    std::vector<int32_t> cached_tokens;  // each sequence's prefix cache hit
    // Sequence r's logits rows are [row_ends[r - 1], row_ends[r]) (from 0
    // for r = 0): its num_samples rows, the last one its next token's.
    std::vector<int32_t> row_ends;
    // Tokens of later steps that this step samples (their last_token_from
    // placeholders): the KV cache learns their ids at Retire.
    struct TokenFill {
      std::string sequence_id;
      int32_t position = 0;
      int row = 0;  // logits row of this step
    };
    std::vector<TokenFill> token_fills;
    // Sequences that asked for raw logprobs (batch index and logits row),
    // and how many alternatives each; the step computed max(num_top)
    // alternatives for all of them.
    std::vector<int32_t> logprob_seqs;
    std::vector<int32_t> logprob_rows;
    std::vector<int32_t> logprob_num_top;
    int logprob_k = 0;
    int previous_slot = -1;  // the step launched before (idle time), or -1
  };

  // Byte offsets in a StepSlot's pinned block.
  struct HostLayout {
    size_t ids = 0, logprobs = 0, raw = 0, top_ids = 0, top_values = 0,
           bytes = 0;
  };
  HostLayout host_layout() const;

  Device& device_;
  ModelRunnerOptions options_;
  // Logits rows a step may have (LlamaForward::MaxLogitsRows).
  int max_logits_rows_ = 0;
  ModelConfig config_;
  std::string model_fingerprint_;
  GraphPlan plan_;
  std::string downgrade_reason_;
  int max_model_len_ = 0;
  // > 0: every layer slides over this many tokens and the attention runs
  // the window (the CPU backend, or CUDA with its unverified window
  // kernels allowed), so steps with WindowBlocks::kFree give back blocks
  // outside it. 0: blocks are kept.
  int free_window_ = 0;
  std::unique_ptr<Stream> stream_;
  LlamaWeights weights_;
  std::unique_ptr<Arena> step_arena_;
  std::unique_ptr<StepInputs> inputs_;
  std::unique_ptr<Sampler> sampler_;
  // Where graph capture stands; read by forward_'s wrappers and by
  // dispatcher_, so it is declared before them and outlives them.
  CaptureLifecycle capture_lifecycle_;
  std::unique_ptr<LlamaForward> forward_;
  std::unique_ptr<KvCacheManager> kv_;
  CudagraphDispatcher dispatcher_;
  GraphStats stats_;
  // One more slot than steps in flight: a step's idle time reads the end
  // event of the step before it, whose slot must not be reused yet.
  std::array<StepSlot, kMaxStepsInFlight + 1> slots_;
  std::deque<int> in_flight_;  // slots, oldest first
  int next_slot_ = 0;
  int last_launched_slot_ = -1;
  // What the token feed reads, int32 [2 * max_num_seqs]: n source logits
  // rows, then their n destination token indices (one copy per feed).
  DeviceBuffer feed_;
  // Raw logprobs of one step (copied to the step's slot before the next):
  // the rows that asked [max_num_seqs], their logsumexp and raw logprob
  // [max_num_seqs], top ids and logprobs [max_num_seqs, kMaxTopLogprobs].
  DeviceBuffer logprob_rows_, logsumexp_, raw_logprobs_, top_token_ids_,
      top_logprobs_;
  // Step-path scratch, sized at startup.
  std::vector<SequenceAppend> appends_;
  std::vector<int32_t> append_token_ids_;  // rows with a placeholder last
  std::vector<int32_t> cached_tokens_;     // per row, from the reservation
  std::vector<StepSequence> step_seqs_;
  std::vector<SamplingOptions> sampling_;
  std::vector<int32_t> sample_positions_;
  std::vector<int32_t> banned_rows_, banned_token_ids_;
  std::vector<int32_t> feed_host_;  // feed_'s layout
  // Declared after every buffer stream_'s work reads or writes (weights,
  // arenas, pinned slots, the forward's activations and KV cache), so it is
  // destroyed first: a runner torn down with work queued (a failed Create,
  // a step launched and never retired) waits for it before freeing them.
  StreamFence stream_fence_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNNER_MODEL_RUNNER_H_
