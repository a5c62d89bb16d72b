// Engine-owned requests: a prompt the engine admits, prefills (chunked
// under the step budget), decodes step after step in whatever batch is
// running, and streams token by token to a callback until a stop condition
// ends it — the request-level way in (DESIGN.md, "Users and their day"),
// beside step-level Forward calls.
#ifndef PDWORKER_WORKER_ENGINE_REQUEST_H_
#define PDWORKER_WORKER_ENGINE_REQUEST_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "worker/engine/kv_lease_table.h"
#include "worker/engine/step_calls.h"
#include "worker/engine/stop_conditions.h"
#include "worker/runner/model_runner.h"
#include "worker/runner/sampler.h"

namespace pdworker {

// One output token's raw logprob and its top alternatives, most likely
// first (RequestSpec::logprobs of them).
struct TokenLogprobs {
  float logprob = 0.0f;
  std::vector<TopLogprob> top;
};

// P/D through engine-owned requests.
enum class KvHandoff {
  kNone,
  // Prefill leg: the request ends after its first token, and its prompt's
  // KV moves into a lease for a decode worker instead of being freed.
  kHoldForDecode,
};

// Decode leg: the prompt's KV was imported from a prefill worker (under
// `kv_sequence_id`, which the request takes over) and the prefill worker
// sampled the first output token.
struct ImportedPrompt {
  std::string kv_sequence_id;
  int32_t first_token_id = -1;
  float first_logprob = 0.0f;  // as the prefill worker reported it
  TokenLogprobs first_token_logprobs;
};

struct RequestSpec {
  std::string request_id;  // unique among the engine's live requests
  std::vector<int32_t> prompt;
  SamplingOptions sampling;
  StopConditions stop;
  // -1: no raw logprobs. 0..20: each output token's raw logprob (the
  // model's log_softmax, vLLM's default logprobs) and that many top
  // alternatives.
  int32_t logprobs = -1;
  KvHandoff handoff = KvHandoff::kNone;
  std::optional<ImportedPrompt> imported;
};

// What the request's callback receives after each step that gave it
// tokens, and once more (or only) when it ends.
struct RequestUpdate {
  // Tokens (and their logprobs) sampled since the previous update.
  absl::Span<const int32_t> new_token_ids;
  // log p(token) under the distribution it was drawn from (after
  // temperature and truncation).
  absl::Span<const float> new_logprobs;
  // Parallel to new_token_ids when the request asked for logprobs (empty
  // otherwise).
  absl::Span<const TokenLogprobs> new_token_logprobs;
  int32_t num_prompt_tokens = 0;
  int32_t num_output_tokens = 0;  // so far, new_token_ids included
  // Prompt tokens the prefix cache held when the request started (its
  // first start: a preempted request's recompute does not count).
  int32_t num_cached_tokens = 0;
  // The engine's step count when these tokens were read (steps run since
  // it started): consecutive tokens of a decoding request come from
  // consecutive steps unless it had to wait.
  int64_t step = 0;
  // Set on the last update of a request that finished (OK status).
  std::optional<FinishReason> finish_reason;
  // The stop_token_ids entry that ended it (kStop by a stop id; an EOS
  // reports none, as vLLM's stop_reason does).
  std::optional<int32_t> matched_token_id;
  // KvHandoff::kHoldForDecode, on the last update of a request that
  // finished: the lease that now holds its prompt's KV.
  std::optional<KvLeaseInfo> lease;
  // Not OK on the last update of a request that failed: refused when
  // admitted, a device error, the engine stopped, its deadline passed,
  // its client cancelled. Its KV is freed.
  absl::Status status;

  bool last() const { return finish_reason.has_value() || !status.ok(); }
};

struct EngineRequest {
  RequestSpec spec;
  // When its RPC arrived, the start of its latency metrics (a decode leg's
  // KV import counts in its time to first token). Epoch: when Submit runs.
  std::chrono::steady_clock::time_point arrival{};
  // Deadline and cancellation (a disconnected client aborts its request).
  std::shared_ptr<CallControl> control;
  // Called on the engine thread (or from Submit when refused). Must not
  // block; the last update is the one with last() true.
  std::function<void(const RequestUpdate&)> on_update;
};

// Aborts requests by id. All or nothing: an unknown id aborts none
// (NOT_FOUND naming it).
struct AbortOutcome {
  int freed_blocks = 0;
};
struct AbortCall {
  std::vector<std::string> request_ids;  // distinct
  std::function<void(const absl::StatusOr<AbortOutcome>&)> done;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_ENGINE_REQUEST_H_
