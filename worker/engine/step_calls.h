// The calls the engine queues: a validated Forward or Release request, the
// control block it shares with its RPC (deadline, cancellation), and the
// completion callback that answers the RPC.
#ifndef PDWORKER_WORKER_ENGINE_STEP_CALLS_H_
#define PDWORKER_WORKER_ENGINE_STEP_CALLS_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "dispatcher/cudagraph_dispatcher.h"
#include "dispatcher/cudagraph_mode.h"
#include "dispatcher/step_info.h"
#include "worker/engine/kv_lease_table.h"
#include "worker/runner/model_runner.h"

namespace pdworker {

// What happens to the sequence's KV cache after the call's last step.
enum class AfterStep {
  kKeep,            // stays live for the next call
  kRelease,         // release_after_step: freed
  kHoldForHandoff,  // hold_for_handoff: moved into a lease for a decode worker
};

// A Forward call that passed every stateless check.
struct ForwardCallSpec {
  // In request order. creation: start -> kMustBeNew, otherwise kMustExist
  // (a router talking to a restarted worker gets NOT_FOUND, never a silently
  // new sequence). Sampling with top_p 0 normalized to 1 (both mean off) and
  // an unset seed replaced by DefaultSeed(sequence_id).
  std::vector<SequenceStep> sequences;
  std::vector<AfterStep> after_step;  // parallel to `sequences`
  int64_t total_tokens = 0;           // sum of token_ids sizes
};

// Shared by the RPC (which may cancel it from a gRPC thread) and the
// engine (which reads it before running the call).
struct CallControl {
  // gRPC deadlines are wall-clock; max() when the client set none.
  std::chrono::system_clock::time_point deadline =
      std::chrono::system_clock::time_point::max();
  std::atomic<bool> cancelled{false};
};

struct ForwardOutcome {
  // In request order: the sample from the step that ran the sequence's
  // last token.
  std::vector<SequenceResult> sequences;
  StepInfo last_step;  // the call's last step
  int num_steps = 0;   // > 1 when the call was chunked
  // Parallel to `sequences` when any sequence was held for handoff (empty
  // otherwise): the lease that now holds its KV.
  std::vector<std::optional<KvLeaseInfo>> leases;
};

struct ForwardCall {
  ForwardCallSpec spec;
  std::shared_ptr<CallControl> control;
  // Called exactly once, from the engine thread (or from Submit when the
  // call is refused). Must not block.
  std::function<void(const absl::StatusOr<ForwardOutcome>&)> done;
};

struct ReleaseOutcome {
  int freed_blocks = 0;
};

struct ReleaseCall {
  std::vector<std::string> sequence_ids;  // validated, distinct
  std::shared_ptr<CallControl> control;
  std::function<void(const absl::StatusOr<ReleaseOutcome>&)> done;
};

// What an imported sequence becomes once its KV is in.
enum class ImportedAs {
  // A step-level sequence (ImportKv): a router steps it with Forward calls.
  kStepSequence,
  // The prompt of an engine-owned request that runs at once (a P/D decode
  // leg): its reservation also takes one of the max_num_seqs running seats,
  // held until the request joins the running requests, so that they never
  // exceed the cap.
  kRunningRequest,
};

// Detached KV blocks reserved for an import.
struct KvReservation {
  SequenceKv kv;  // blocks for the sequence's num_tokens tokens
  // Leading tokens whose blocks came from our prefix cache: their K/V is
  // already right, only the rest needs pulling.
  int32_t cached_tokens = 0;
};

// Blocks for a sequence whose KV another worker computed (a KV import).
// Waits in the engine's queue for room as a request's admission does, in
// arrival order with the waiting requests (neither overtakes the other),
// rather than failing because the cache is full for now.
struct KvReservationCall {
  std::string sequence_id;  // not live when reserved, else ALREADY_EXISTS
  int32_t num_tokens = 0;
  // num_tokens ids, or none: with prefix caching the leading blocks our
  // cache holds for these ids are reused.
  std::vector<int32_t> token_ids;
  ImportedAs imported_as = ImportedAs::kStepSequence;
  // The client's deadline and cancellation (may be null): a waiting
  // reservation ends DEADLINE_EXCEEDED / CANCELLED, having reserved
  // nothing.
  std::shared_ptr<CallControl> control;
  // Set (may be null) once what the import would pull is known to be gone
  // (its source says the lease expired or was released): a waiting
  // reservation ends NOT_FOUND. Tell the engine with NotifyCancelled().
  std::shared_ptr<const std::atomic<bool>> source_gone;
  // The end of the wait for room: RESOURCE_EXHAUSTED after it (at once when
  // it has passed and there is no room now).
  std::chrono::system_clock::time_point wait_deadline =
      std::chrono::system_clock::time_point::max();
  // Called exactly once, from the engine thread (or from Submit when
  // refused). Must not block. The blocks are the caller's from then on:
  // Engine::GiveBackKvReservation or ModelRunner::Attach.
  std::function<void(absl::StatusOr<KvReservation>)> done;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_ENGINE_STEP_CALLS_H_
