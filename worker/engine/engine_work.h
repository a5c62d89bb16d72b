// The engine's units of work, shared by its .cc files (engine.cc: the
// loop; engine_completion.cc: finishing requests and calls, publishing;
// engine_submit.cc: the entry points other threads call). Private to
// worker/engine: the engine's thread owns every object here.
#ifndef PDWORKER_WORKER_ENGINE_ENGINE_WORK_H_
#define PDWORKER_WORKER_ENGINE_ENGINE_WORK_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "worker/engine/engine.h"

namespace pdworker {

// One queued step-level call and the engine's bookkeeping for it.
struct Engine::Entry {
  // Exactly one of the two is set.
  std::unique_ptr<ForwardCall> forward;
  std::unique_ptr<ReleaseCall> release;
  CallControl* control = nullptr;  // owned by the call

  // The planner's view; its spans point into `ids`, `remaining` and `kv`,
  // which are sized once and never reallocated.
  std::vector<absl::string_view> ids;
  std::vector<int32_t> remaining;   // Forward: tokens not yet run, per sequence
  std::vector<SequenceKvState> kv;  // Forward: refreshed before each plan
  PendingCall view;

  // Forward progress: each sequence's length before the call's first piece
  // of it ran (-1: not run yet), for rollback.
  std::vector<int32_t> length_before;
  // Each sequence's tokens found in the prefix cache (its first piece's).
  std::vector<int32_t> cached_tokens;
  // Steps with a piece of this call that are still on the device: the call
  // is running and finishes with them, whatever happens meanwhile.
  int steps_in_flight = 0;
  ForwardOutcome outcome;
  ReleaseOutcome release_outcome;
  // Set once the call is finished: OK, or the error it completes with.
  std::optional<absl::Status> final_status;

  bool started() const {
    for (const int32_t len : length_before) {
      if (len >= 0) return true;
    }
    return false;
  }
  bool all_tokens_launched() const {
    for (const int32_t left : remaining) {
      if (left > 0) return false;
    }
    return true;
  }

  // Answers the RPC. The call object must not be used afterwards.
  void Finish() {
    const absl::Status& status = *final_status;
    if (forward != nullptr) {
      if (status.ok()) {
        forward->done(std::move(outcome));
      } else {
        forward->done(status);
      }
    } else if (status.ok()) {
      release->done(release_outcome);
    } else {
      release->done(status);
    }
  }
};

// One engine-owned request.
struct Engine::Request {
  enum class State { kWaiting, kRunning, kDone };

  std::unique_ptr<EngineRequest> call;
  StopRule stop;
  std::string kv_id;  // its sequence in the KV cache (kEngineSequencePrefix)
  State state = State::kWaiting;
  uint64_t ticket = 0;  // arrival order among requests and KV reservations
  // Prompt, then the outputs the host has read back.
  std::vector<int32_t> tokens;
  // Tokens whose KV is computed or being computed by a step in flight.
  int32_t num_computed = 0;
  // Prefix caching: the hashes of `tokens`' full blocks (extended as
  // outputs arrive), and the prompt tokens its first start found cached.
  std::vector<BlockHash> block_hashes;
  int32_t num_cached_tokens = 0;
  // While it waits: the tokens the prefix cache held for it at its latest
  // lookup (GetLoads' uncached estimate; the admission looks up again).
  int32_t waiting_cached_tokens = 0;
  // Outputs sampled by steps in flight, not in `tokens` yet (at most one
  // when a step is planned), and where the latest of them is sampled.
  int32_t num_pending = 0;
  SampleRef pending_from;
  // Outputs not yet streamed.
  std::vector<int32_t> new_tokens;
  std::vector<float> new_logprobs;
  std::vector<TokenLogprobs> new_token_logprobs;
  RequestTimeline times;  // for its latency metrics
  // Speculative decoding: the drafts PlanStep proposed for its next decode
  // (verified after its last token); the share of its recent drafts
  // accepted (an average that halves the weight of each older verify); and
  // the pacing after drafts that fail (none proposed, or acceptance below
  // half): decodes left without drafting, and the next pause (doubling up
  // to a cap).
  std::vector<int32_t> drafts;
  // A verify step of its drafts is in flight: its next token is one of
  // that step's rows (which one, the host decides), so no later step may
  // take it from the device, and its KV is trimmed when the step retires.
  bool verifying = false;
  float draft_acceptance = 1.0f;
  int32_t draft_pause = 0;
  int32_t next_draft_pause = 1;

  int32_t total() const {
    return static_cast<int32_t>(tokens.size()) + num_pending;
  }
  int32_t num_outputs() const {
    return static_cast<int32_t>(tokens.size()) - stop.num_prompt_tokens;
  }
  // The update streaming the outputs not yet streamed, read at `step`.
  RequestUpdate Update(int64_t step) const {
    RequestUpdate update;
    update.new_token_ids = new_tokens;
    update.new_logprobs = new_logprobs;
    update.new_token_logprobs = new_token_logprobs;
    update.num_prompt_tokens = stop.num_prompt_tokens;
    update.num_output_tokens = num_outputs();
    update.num_cached_tokens = num_cached_tokens;
    update.step = step;
    return update;
  }
};

// A KV import's reservation waiting for room.
struct Engine::Reservation {
  std::unique_ptr<KvReservationCall> call;
  uint64_t ticket = 0;  // arrival order among requests and reservations
  // Prefix caching: the hashes of the import's full blocks, computed once.
  std::vector<BlockHash> block_hashes;
  bool hashed = false;
};

// One row of a step: a call's sequence or a request.
struct Engine::Piece {
  Entry* call = nullptr;  // a call's piece, or
  int sequence = 0;
  std::shared_ptr<Request> request;  // a request's
  int32_t num_tokens = 0;
  // The row's sample is an answer: the sequence's last token ran (calls),
  // or the request's tokens so far all ran (requests).
  bool samples = false;
  // A request's decode that verifies these drafts after its last token
  // (num_tokens = 1 + their number).
  std::vector<int32_t> drafts;
};

// A step on the device.
struct Engine::InFlightStep {
  int slot = -1;
  std::vector<Piece> pieces;  // row order
  int num_calls = 0;
  int num_requests = 0;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_ENGINE_ENGINE_WORK_H_
