// StepPlanner: what the next model step runs — which pending step-level
// calls (and which parts of them), and which engine-owned requests. Pure
// bookkeeping, no model and no threads, so the rules are unit-tested on
// their own (tests/engine/step_planner_test.cc).
//
// Rules, in the order they are applied:
//  1. Seats and tokens are set aside for the decodes of running requests
//     (one token each): decodes come first (vLLM v1), so no prompt ever
//     holds a running request back for more than one step.
//  2. Step-level calls, oldest first:
//     - A call that shares a sequence id with an older pending call (run in
//       this step or deferred) is deferred: per-sequence order is the arrival
//       order, and no sequence appears twice in one step.
//     - A Release that does not conflict runs before the step.
//     - A Forward call that fits what is left of the step (max_num_seqs
//       sequences, max_num_batched_tokens tokens) joins it whole; one that
//       does not fit is deferred, and younger, smaller calls may still join.
//     - A Forward call with more tokens than a whole step, one already part-
//       way through, and the oldest Forward call when the decodes left it too
//       little, is chunked: it takes as many of its remaining tokens as the
//       step has left, sequence by sequence in request order.
//     The oldest call always progresses: it sees the whole budget minus the
//     running requests' decodes, and no new request is admitted while a
//     call waits for room (so the decodes drain as requests finish).
//  3. KV blocks: the calls' blocks are counted first (step-level sequences
//     are never preempted; requests are, when that makes room for the
//     calls, and only then); then each running request's decode, then each
//     running request's next prefill chunk, in admission order. A running
//     request that cannot grow preempts the most recently admitted running
//     request (its KV is freed and it waits again, to be recomputed); when
//     it is itself the most recent, it is preempted.
//  4. Waiting requests are admitted in queue order while seats, tokens and
//     KV blocks last (a long prompt is admitted with a first chunk); the
//     first one that does not fit stops admission, so none overtakes an
//     older one. Nothing is admitted in a step that preempted. Seats held
//     for KV imports (PlanInput::reserved_seats) count as running.
#ifndef PDWORKER_WORKER_ENGINE_STEP_PLANNER_H_
#define PDWORKER_WORKER_ENGINE_STEP_PLANNER_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace pdworker {

enum class PendingKind { kForward, kRelease };

// Whether a Forward call may be split across steps.
enum class Chunking {
  kWhole,    // fits one step: runs whole, in one step
  kChunked,  // larger than a step, or already started
};

// A sequence's KV before its next piece: tokens cached and blocks held
// (both 0 for a sequence that does not exist yet).
struct SequenceKvState {
  int32_t num_tokens = 0;
  int32_t num_blocks = 0;
};

// The planner's view of one pending step-level call.
struct PendingCall {
  PendingKind kind = PendingKind::kForward;
  Chunking chunking = Chunking::kWhole;
  // Forward: the call's sequences in request order (all of them, finished
  // ones with 0 remaining tokens). Release: the ids to free.
  absl::Span<const absl::string_view> sequence_ids;
  absl::Span<const int32_t> remaining_tokens;  // Forward only; parallel
  // Forward only, parallel (or empty: the call's KV is not counted).
  absl::Span<const SequenceKvState> kv;
};

// The planner's view of one engine-owned request.
struct PendingRequest {
  // Tokens the request wants computed now: the rest of its prompt (or of
  // its tokens so far, after a preemption), or 1 to decode; 0 when it has
  // nothing to run (its last sample is still in flight).
  int32_t wanted_tokens = 0;
  int32_t num_computed = 0;  // tokens whose KV is computed or in flight
  int32_t num_blocks = 0;    // KV blocks it holds (0 while waiting)
  // Waiting requests only: false while a sample of its is still in flight
  // (it was preempted a step ago), so it cannot be recomputed yet.
  bool admissible = true;
  // Speculative decoding: of wanted_tokens, the draft tokens that follow the
  // one decode token (wanted_tokens = 1 + num_draft_tokens). Such a request
  // is a decode; its drafts are optional and may be cut (fewer tokens
  // left, or KV blocks that only preempting another request would free).
  int32_t num_draft_tokens = 0;
};

struct StepBudget {
  int max_num_seqs = 0;
  int max_num_batched_tokens = 0;
  int block_size = 1;  // KV tokens per block
};

struct PlanInput {
  absl::Span<const PendingCall* const> calls;       // oldest first
  absl::Span<const PendingRequest* const> running;  // admission order
  absl::Span<const PendingRequest* const> waiting;  // queue order
  int32_t free_kv_blocks = 0;
  // Running seats held for requests about to run that are in no list yet
  // (KV imports of decode legs): admissions keep running requests plus
  // these within max_num_seqs.
  int32_t reserved_seats = 0;
};

enum class PieceSource {
  kCall,             // `index` into PlanInput::calls
  kRunningRequest,   // `index` into PlanInput::running
  kAdmittedRequest,  // `index` into PlanInput::waiting (admitted now)
};

// `num_tokens` tokens of one sequence, starting where its previous pieces
// ended: sequence `sequence` of a call, or a request's tokens.
struct StepPiece {
  PieceSource source = PieceSource::kCall;
  int index = 0;
  int sequence = 0;  // calls only
  int32_t num_tokens = 0;
};

struct StepPlan {
  std::vector<int> releases;  // Release calls to run before the step
  std::vector<int> forwards;  // Forward calls in the step, ascending
  // Running requests to preempt before the step (most recent first).
  std::vector<int> preempted;
  std::vector<int> admitted;  // waiting requests that now run, in order
  // The step's batch: the calls' pieces grouped by call, then the requests'
  // (decodes first, then prefill chunks, then admissions).
  std::vector<StepPiece> pieces;
  int num_tokens = 0;
  // A Forward call was deferred for lack of room (admission was held).
  bool call_deferred = false;

  bool empty() const { return releases.empty() && pieces.empty(); }
};

class StepPlanner {
 public:
  explicit StepPlanner(const StepBudget& budget) : budget_(budget) {}

  // Plans the next step. Reuses its scratch, so steady-state planning does
  // not allocate.
  void Plan(const PlanInput& input, StepPlan* plan);
  // Step-level calls only (no requests, KV not counted).
  void Plan(absl::Span<const PendingCall* const> calls, StepPlan* plan);

  const StepBudget& budget() const { return budget_; }

 private:
  int32_t BlocksFor(int32_t num_tokens) const {
    return (num_tokens + budget_.block_size - 1) / budget_.block_size;
  }
  void PlanCalls(const PlanInput& input, StepPlan* plan);
  enum class RoomResult {
    kFits,             // `blocks` fit now
    kRequesterIsLast,  // not enough even with every more recent one gone
    kBlocked,          // the next victim already has a piece of this step
  };
  // Makes room for `blocks` KV blocks by preempting running requests, most
  // recent first, down to (not including) `requester` (-1: any). A request
  // already given a piece of this step is never preempted.
  RoomResult MakeRoom(const PlanInput& input, int64_t blocks, int requester,
                      StepPlan* plan);
  void Preempt(const PlanInput& input, int request, StepPlan* plan);
  // Gives running request `r` a piece of `num_tokens` tokens if its KV
  // blocks fit (preempting others or itself as the rules say); false when
  // it got none. Seats and tokens are the caller's to count.
  bool ScheduleRunning(const PlanInput& input, int r, int32_t num_tokens,
                       StepPlan* plan);

  StepBudget budget_;
  absl::flat_hash_set<absl::string_view> claimed_;
  // Per step: seats, tokens and KV blocks left.
  int seats_left_ = 0;
  int tokens_left_ = 0;
  int64_t blocks_left_ = 0;
  // Running requests: preempted this step, or already given a piece.
  std::vector<bool> gone_;
  std::vector<bool> scheduled_;
  // Decode seats/tokens set aside and not yet used: the tokens (1, plus
  // the drafts that fit), 0 when none.
  std::vector<int32_t> reserved_;
  int tail_ = 0;  // running requests [0, tail_) not preempted
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_ENGINE_STEP_PLANNER_H_
