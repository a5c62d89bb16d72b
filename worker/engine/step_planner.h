// StepPlanner: which pending calls (and which parts of them) the next model
// step runs. Pure bookkeeping, no model and no threads, so the coalescing
// rules are unit-tested on their own (tests/server/step_planner_test.cc).
//
// Rules, scanning the queue oldest first:
//  - A call that shares a sequence id with an older pending call (run in
//    this step or deferred) is deferred: per-sequence order is the arrival
//    order, and no sequence appears twice in one step.
//  - A Release that does not conflict runs before the step.
//  - A Forward call that fits the step budget (max_num_seqs sequences,
//    max_num_batched_tokens tokens) joins the step whole; one that does not
//    fit what is left is deferred, and younger, smaller calls may still join.
//  - A Forward call with more tokens than a whole step (or already part-way
//    through) is chunked: it takes as many of its remaining tokens as the
//    budget has left, sequence by sequence in request order.
// The oldest call always gets an empty budget, so every step makes progress
// and no call starves.
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

// The planner's view of one pending call.
struct PendingCall {
  PendingKind kind = PendingKind::kForward;
  Chunking chunking = Chunking::kWhole;
  // Forward: the call's sequences in request order (all of them, finished
  // ones with 0 remaining tokens). Release: the ids to free.
  absl::Span<const absl::string_view> sequence_ids;
  absl::Span<const int32_t> remaining_tokens;  // Forward only; parallel
};

struct StepBudget {
  int max_num_seqs = 0;
  int max_num_batched_tokens = 0;
};

// `num_tokens` tokens of sequence `sequence` of pending call `call`,
// starting where that sequence's previous pieces ended.
struct StepPiece {
  int call = 0;
  int sequence = 0;
  int32_t num_tokens = 0;
};

struct StepPlan {
  std::vector<int> releases;      // Release calls to run before the step
  std::vector<int> forwards;      // Forward calls in the step, ascending
  std::vector<StepPiece> pieces;  // the step's batch, grouped by call
  int num_tokens = 0;

  bool empty() const { return releases.empty() && pieces.empty(); }
};

class StepPlanner {
 public:
  explicit StepPlanner(const StepBudget& budget) : budget_(budget) {}

  // Plans the next step over `queue` (oldest first). Reuses its scratch, so
  // steady-state planning does not allocate.
  void Plan(absl::Span<const PendingCall* const> queue, StepPlan* plan);

  const StepBudget& budget() const { return budget_; }

 private:
  StepBudget budget_;
  absl::flat_hash_set<absl::string_view> claimed_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_ENGINE_STEP_PLANNER_H_
