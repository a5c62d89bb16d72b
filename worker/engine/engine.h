// Engine: the one thread that owns the ModelRunner (DESIGN.md, "One step").
// Two kinds of work share it, its steps, its captured graphs and its
// statistics table:
//  - step-level calls (Forward, Release): a router schedules every step and
//    gets one token per sequence per call;
//  - engine-owned requests: a prompt the engine admits, prefills (chunked),
//    decodes step after step in whatever batch is running, and streams
//    token by token until a stop condition ends it.
//
//   Submit ──▶ queue ──plan──▶ ModelRunner::Launch(step N+1) ─┐
//                               ModelRunner::Retire(step N) ◀─┘──▶ done() /
//                                                               on_update()
//
// With StepOverlap::kOn the engine plans and enqueues step N+1 while step N
// runs on the device; the tokens step N samples for running requests reach
// step N+1's input on the device, and stop conditions are checked one step
// late (the extra token is discarded), as vLLM's async scheduling and
// SGLang's overlap scheduler do.
//
// Guarantees:
//  - A call fails or succeeds as a whole, and a failed call changes nothing:
//    a merged step that fails is retried call by call (so one bad call never
//    fails innocent ones), and a chunked call whose later chunk fails rolls
//    its earlier chunks back (created sequences are released, continued ones
//    truncated to their old length).
//  - Calls whose deadline passed or whose client cancelled are dropped
//    before they run (DEADLINE_EXCEEDED / CANCELLED), even while a step
//    runs for others or the engine is paused. A call with a step on the
//    device finishes.
//  - Per sequence, calls run in arrival order (see StepPlanner).
//  - Requests: decodes first, prefill chunks fill the rest of each step; a
//    request that cannot grow preempts the most recently admitted request
//    by recompute (its output is unchanged); no running request fails
//    because another arrived. Step-level sequences are never preempted.
//  - Aborted, finished and preempted requests give their KV back at once:
//    a step still in flight writes their blocks before any later step can
//    (one in-order stream), and work off the stream (KV imports) runs only
//    with no step in flight.
//  - A device error fails every call and request in the steps in flight,
//    with their KV freed.
// Synchronization is std::mutex / std::condition_variable / std::atomic
// (TSan sees them; Debian's absl::Mutex is not instrumented).
#ifndef PDWORKER_WORKER_ENGINE_ENGINE_H_
#define PDWORKER_WORKER_ENGINE_ENGINE_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "metrics/worker_metrics.h"
#include "worker/engine/kv_lease_table.h"
#include "worker/engine/load_tracker.h"
#include "worker/engine/request.h"
#include "worker/engine/speculative_config.h"
#include "worker/engine/step_calls.h"
#include "worker/engine/step_planner.h"
#include "worker/kv_cache/kv_cache_manager.h"
#include "worker/runner/model_runner.h"

namespace pdworker {

// Whether the engine enqueues step N+1 before it reads step N's samples.
enum class StepOverlap { kOff, kOn };

struct EngineOptions {
  // Step-level calls queued or running (Forward and Release); beyond it
  // Submit answers RESOURCE_EXHAUSTED at once instead of letting latency
  // grow unbounded.
  int max_queue = 1024;
  // Engine-owned requests submitted and not yet admitted; beyond it a new
  // request gets RESOURCE_EXHAUSTED.
  int max_waiting_requests = 1024;
  // A live step-level sequence that no step has appended to for this long,
  // and that no queued call names, is released: its router went away
  // without Release and nothing else would ever free its KV. Later calls
  // naming it get NOT_FOUND saying why. Zero: never.
  std::chrono::milliseconds sequence_idle_timeout{0};
  StepOverlap overlap = StepOverlap::kOn;
  // Speculative decoding of engine-owned requests (--speculative_config):
  // each decode step verifies the proposer's drafts after the request's
  // last token (ModelRunner's num_samples) and keeps the longest prefix
  // the target's own samples agree with, plus the target's next token, so
  // the outputs are what one-token steps would sample. The runner's
  // uniform_decode_query_len bounds the drafts (1 + k).
  SpeculativeConfig speculative;
};

// What other threads may read, published after every loop iteration.
struct EngineSnapshot {
  KvCacheStats kv;
  int64_t queued_calls = 0;       // submitted, not yet finished by the engine
  int64_t steps = 0;              // model steps run (retries included)
  int64_t dropped_deadline = 0;   // calls dropped: deadline passed
  int64_t dropped_cancelled = 0;  // calls dropped: client cancelled
  int64_t sequences_expired = 0;  // released by the idle-sequence sweep
  // Engine-owned requests.
  int64_t running_requests = 0;
  int64_t waiting_requests = 0;   // submitted or preempted, not running
  int64_t preemptions = 0;        // running requests preempted so far
  int64_t finished_requests = 0;  // ended for any reason
  // KV imports waiting for room (blocks, or a running seat).
  int64_t waiting_imports = 0;
  // Device (stream) time over all steps: busy inside steps, idle between
  // one step's end and the next one's start.
  double device_busy_seconds = 0.0;
  double device_idle_seconds = 0.0;
  // Speculative decoding (vLLM's spec_decode counters): verify steps of a
  // request with drafts, the draft tokens they verified, and those
  // accepted.
  int64_t spec_drafts = 0;
  int64_t spec_draft_tokens = 0;
  int64_t spec_accepted_tokens = 0;
  // The first device error, after which every step fails; OK until then.
  absl::Status device_error;
  // When the last step was read back (epoch: none yet).
  std::chrono::steady_clock::time_point last_step_at{};
  // What GetLoads reports for routers (SchedulerLoad):
  // Prompt tokens accepted and not computed yet, less those the prefix
  // cache held for them at their latest lookup (a request not looked up
  // yet counts in full): waiting requests, the rest of running requests'
  // prompts, and queued step-level calls' tokens.
  int64_t waiting_uncached_tokens = 0;
  // LoadTracker's rates, read when snapshot() is called: cached over prompt
  // tokens of the last 64 requests that started, and tokens sampled over
  // the last 2 s (tokens/s).
  double prefix_cache_hit_rate = 0.0;
  double generation_tokens_per_second = 0.0;
};

class Engine {
 public:
  // Starts the thread. `runner` and `metrics` (may be null) must outlive
  // the engine; from now on only the engine thread touches `runner`.
  // `leases` (may be null: hold_for_handoff calls then just keep their
  // sequence) receives the sequences of hold_for_handoff calls.
  // `kv_events` (may be null) gets the prefix cache's events after every
  // loop iteration that had some; it must outlive the engine.
  Engine(ModelRunner& runner, const EngineOptions& options,
         WorkerMetrics* metrics, KvLeaseTable* leases = nullptr,
         KvEventListener* kv_events = nullptr);
  // Stop(), then joins.
  ~Engine();

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues the call, or completes it at once (call->done, on this thread)
  // with UNAVAILABLE (stopped, or draining and the call starts a sequence)
  // or RESOURCE_EXHAUSTED (queue full). Never blocks on a step.
  void Submit(std::unique_ptr<ForwardCall> call);
  void Submit(std::unique_ptr<ReleaseCall> call);
  // Queues the request, or ends it at once (its last update, on this
  // thread): INVALID_ARGUMENT naming the field (empty prompt or id, a token
  // outside the vocabulary, bad sampling or stop values, a prompt plus
  // max_tokens past the model's maximum length), UNAVAILABLE (stopped or
  // draining), RESOURCE_EXHAUSTED (too many waiting). A request id already live
  // ends the new one with ALREADY_EXISTS (on the engine thread).
  void Submit(std::unique_ptr<EngineRequest> request);
  // Aborts live requests (queued, prefilling or decoding): each gets its
  // last update (finish reason abort) and its KV is freed before `done`
  // runs. All or nothing: NOT_FOUND naming an id that is not live.
  void Submit(std::unique_ptr<AbortCall> call);
  // Queues a KV import's reservation (see KvReservationCall), or refuses it
  // at once with UNAVAILABLE (stopped).
  void Submit(std::unique_ptr<KvReservationCall> call);
  // Frees the blocks of a reservation whose import failed, and its running
  // seat; blocks until done (between steps), like RunExclusive.
  absl::Status GiveBackKvReservation(const std::string& sequence_id,
                                     SequenceKv kv);

  // Runs `task` on the engine thread between steps, with no step in flight
  // (e.g. graph capture, KV import), and returns its status; blocks the
  // caller until then.
  absl::Status RunExclusive(std::function<absl::Status(ModelRunner&)> task);
  // Queues `task` to run between steps, with no step in flight, and returns
  // at once; UNAVAILABLE (and the task never runs) once the engine stopped.
  absl::Status Post(std::function<void(ModelRunner&)> task);

  // A queued call's or request's CallControl changed (cancelled): look at
  // it now rather than at the next step. Cheap; called from gRPC threads.
  void NotifyCancelled();

  // From now on Submit refuses calls that would create a sequence (start)
  // and new requests with UNAVAILABLE; steps and releases of live
  // sequences, queued calls and live requests still run.
  void BeginDrain();

  // Holds steps (queued calls wait; cancellations and deadlines are still
  // honoured) until Resume(). For tests that need a busy worker without
  // timing, and for operators.
  void Pause();
  void Resume();

  // Completes every queued call and live request with UNAVAILABLE (a
  // running step finishes first) and joins the thread. Idempotent.
  void Stop();

  EngineSnapshot snapshot() const;

 private:
  struct Entry;
  struct Request;
  struct Piece;
  struct InFlightStep;
  struct Reservation;

  // The loop and its stages, in the order of DESIGN.md's diagram.
  void Run();
  bool WaitForWork();  // false when stopping
  void DropExpiredWork();
  bool Paused() const;
  void AdmitIncomingRequests();
  void RunAborts();
  // KV imports' reservations: drops withdrawn ones, grants them in arrival
  // order while room lasts, ends those whose wait is over.
  void ServeKvReservations();
  // How many of the waiting requests arrived before the oldest waiting
  // reservation (all of them when none waits): only those may be admitted.
  size_t AdmissibleBeforeReservations() const;
  void PlanStep();
  void RunReleases();
  // Launches the plan; true when a step went to the device.
  bool LaunchStep();
  void RetireSteps(int keep_in_flight);
  void CompleteFinishedCalls();
  void ReleaseIdleSequences();
  void PublishSnapshot();
  // The prefix cache's events of this iteration, as one batch.
  void PublishKvEvents();

  // Launches `pieces` as one step; false (with `error`) when the runner
  // refused it, which changed nothing.
  bool LaunchPieces(absl::Span<const Piece> pieces, absl::Status* error);
  // Reads one step's samples into its calls and requests.
  void ApplyStep(InFlightStep& step, const StepResult& result);
  // A device error: the step and every later one in flight fail.
  void FailStepsInFlight(const absl::Status& error);

  // Requests.
  int32_t WantedTokens(const Request& request) const;
  // Speculative decoding (engine_speculation.cc): whether `request` drafts
  // for its next decode (so it waits for its sample in flight, which the
  // drafts continue), its drafts for the next step (`request.drafts`), and
  // what a verify step's samples accept.
  bool MayDraft(const Request& request) const;
  // True while a running request drafts from (or verifies) the sample of a
  // step in flight: the loop retires before it plans, so that request and
  // the others share the next step rather than alternating in two halves
  // (twice the steps; on a GPU each reads all the weights).
  bool WaitsForDraftSamples() const;
  void ProposeDrafts(Request& request);
  // The drafts of `piece` the target's samples `out` agree with, in order;
  // rolls the rejected ones' KV back and paces the request's drafting.
  // Returns how many were accepted.
  int32_t AcceptDrafts(Request& request, const Piece& piece,
                       const SequenceResult& out);
  void Preempt(const std::shared_ptr<Request>& request);
  // Ends a live request: frees its KV, sends its last update, forgets it.
  void FinishRequest(Request& request, std::optional<FinishReason> reason,
                     absl::Status status = absl::OkStatus(),
                     std::optional<int32_t> matched_token_id = std::nullopt);
  void SendUpdate(Request& request);
  // Metrics of the tokens `request` is about to stream (time to first
  // token, or inter-token latency); returns now.
  std::chrono::steady_clock::time_point ObserveNewTokens(Request& request);
  // Static checks of a request against the model and the KV cache size.
  absl::Status ValidateRequest(const RequestSpec& spec) const;

  // How long WaitForWork may sleep before a queued deadline or the next
  // idle-sequence sweep needs the loop; nullopt: until woken.
  std::optional<std::chrono::nanoseconds> TimeUntilTimedWork() const;
  // Calls that would continue a sequence the idle sweep released get a
  // NOT_FOUND saying so, before they run.
  void ExplainExpiredSequences();

  // Queues `entry`, or completes it with the reason it was refused.
  void Enqueue(std::unique_ptr<Entry> entry);
  // Moves `entry` into the queue and returns OK, or leaves it and returns
  // UNAVAILABLE / RESOURCE_EXHAUSTED.
  absl::Status Admit(std::unique_ptr<Entry>& entry);
  // A Forward that would create a sequence (refused while draining).
  static bool StartsSequences(const Entry& entry);
  // Undoes the steps a failed (or dropped) call already ran.
  void RollBack(Entry& entry);
  void FailAll(const absl::Status& status);

  ModelRunner& runner_;
  const EngineOptions options_;
  WorkerMetrics* const metrics_;
  KvLeaseTable* const leases_;
  KvEventListener* const kv_events_;
  std::vector<KvCacheEvent> kv_event_batch_;  // PublishKvEvents' scratch
  // Read-only facts from the runner, for Submit on other threads.
  const int32_t vocab_size_;
  const int32_t max_model_len_;
  std::vector<int32_t> eos_token_ids_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // the engine waits for work
  std::deque<std::unique_ptr<Entry>> incoming_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<EngineRequest>> incoming_requests_
      ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<AbortCall>> incoming_aborts_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<KvReservationCall>> incoming_reservations_
      ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  // Submitted and not yet finished by the engine (what the queue bound,
  // the snapshot and WorkerServer::Drain count). Stop() answers the rest.
  int64_t queued_ ABSL_GUARDED_BY(mu_) = 0;
  // Requests submitted and not yet admitted (the waiting bound).
  int64_t requests_waiting_ ABSL_GUARDED_BY(mu_) = 0;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;

  mutable std::mutex snapshot_mu_;
  EngineSnapshot snapshot_ ABSL_GUARDED_BY(snapshot_mu_);
  // Recorded by the engine thread, read by snapshot() (its own lock).
  LoadTracker load_tracker_;

  // Engine thread only.
  std::deque<std::unique_ptr<Entry>> pending_;
  // Live requests by id; running ones in admission order; waiting ones in
  // queue order (preempted ones in front).
  absl::flat_hash_map<std::string, std::shared_ptr<Request>> requests_;
  std::vector<std::shared_ptr<Request>> running_;
  std::deque<std::shared_ptr<Request>> waiting_;
  int64_t next_request_number_ = 0;  // makes each request's KV id unique
  // Waiting KV reservations, in arrival order.
  std::deque<std::unique_ptr<Reservation>> reservations_;
  // Sequence ids of imports (ImportedAs::kRunningRequest) holding a running
  // seat: running_.size() + their number <= max_num_seqs.
  absl::flat_hash_set<std::string> import_seats_;
  // Arrival order of requests and reservations on the engine thread (a
  // preempted request keeps its number).
  uint64_t next_ticket_ = 0;
  // Counts changes of state (launches, retires, completions, admissions,
  // releases); an iteration that changed nothing leaves the engine stalled:
  // it sleeps until woken instead of planning the same nothing again.
  uint64_t progress_ = 0;
  bool stalled_ = false;
  std::deque<std::unique_ptr<InFlightStep>> in_flight_;  // oldest first
  StepPlanner planner_;
  StepPlan plan_;
  std::vector<const PendingCall*> views_;  // unfinished calls, oldest first
  std::vector<Entry*> active_;             // parallel to views_
  std::vector<PendingRequest> running_views_, waiting_views_;
  std::vector<const PendingRequest*> running_ptrs_, waiting_ptrs_;
  std::vector<SequenceStep> batch_;
  std::vector<int32_t> num_tokens_;  // LaunchPieces: each piece's tokens
  std::vector<StepPiece> group_pieces_;
  std::vector<Request*> updated_;  // requests with tokens to stream
  int64_t steps_ = 0;
  int64_t dropped_deadline_ = 0;
  int64_t dropped_cancelled_ = 0;
  int64_t sequences_expired_ = 0;
  int64_t preemptions_ = 0;
  int64_t finished_requests_ = 0;
  int64_t spec_drafts_ = 0;
  int64_t spec_draft_tokens_ = 0;
  int64_t spec_accepted_tokens_ = 0;
  double device_busy_seconds_ = 0.0;
  double device_idle_seconds_ = 0.0;
  absl::Status device_error_;
  std::chrono::steady_clock::time_point last_step_at_{};
  std::chrono::steady_clock::time_point next_idle_sweep_{};
  // The latest sequences the sweep released (bounded, oldest forgotten
  // first) and how long each had been idle, in seconds; a later step of
  // the same id forgets it.
  absl::flat_hash_map<std::string, double> expired_idle_seconds_;
  std::deque<std::string> expired_order_;

  std::thread thread_;  // last: starts after everything it reads
};

// Sequence ids of step-level calls may not start with this byte: the
// engine's own requests keep their KV under ids that do.
inline constexpr char kEngineSequencePrefix = '\x01';

}  // namespace pdworker

#endif  // PDWORKER_WORKER_ENGINE_ENGINE_H_
