// Engine: the one thread that owns the ModelRunner (DESIGN.md, "One
// step"). gRPC handlers validate and Submit; the engine merges pending
// calls into model steps and completes them:
//
//   Submit ──▶ queue ──coalesce──▶ ModelRunner::Execute(batch) ──▶ done()
//
// Guarantees:
//  - A call fails or succeeds as a whole, and a failed call changes nothing:
//    a merged step that fails is retried call by call (so one bad call never
//    fails innocent ones), and a chunked call whose later chunk fails rolls
//    its earlier chunks back (created sequences are released, continued ones
//    truncated to their old length).
//  - Calls whose deadline passed or whose client cancelled are dropped
//    before they run (DEADLINE_EXCEEDED / CANCELLED), even while a step
//    runs for others or the engine is paused.
//  - Per sequence, calls run in arrival order (see StepPlanner).
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
#include "absl/status/status.h"
#include "metrics/worker_metrics.h"
#include "worker/engine/step_calls.h"
#include "worker/engine/step_planner.h"
#include "worker/kv_cache/kv_cache_manager.h"
#include "worker/runner/model_runner.h"
#include "worker/transfer/kv_lease_table.h"

namespace pdworker {

struct EngineOptions {
  // Calls queued or running (Forward and Release); beyond it Submit answers
  // RESOURCE_EXHAUSTED at once instead of letting latency grow unbounded.
  int max_queue = 1024;
  // A live sequence that no step has appended to for this long, and that no
  // queued call names, is released: its router went away without Release
  // (crashed, restarted, lost track of it) and nothing else would ever free
  // its KV. Later calls naming it get NOT_FOUND saying why. Zero: never.
  std::chrono::milliseconds sequence_idle_timeout{0};
};

// What other threads may read, published after every loop iteration.
struct EngineSnapshot {
  KvCacheStats kv;
  int64_t queued_calls = 0;       // submitted, not yet finished by the engine
  int64_t steps = 0;              // model steps run (retries included)
  int64_t dropped_deadline = 0;   // calls dropped: deadline passed
  int64_t dropped_cancelled = 0;  // calls dropped: client cancelled
  int64_t sequences_expired = 0;  // released by the idle-sequence sweep
};

class Engine {
 public:
  // Starts the thread. `runner` and `metrics` (may be null) must outlive
  // the engine; from now on only the engine thread touches `runner`.
  // `leases` (may be null: hold_for_handoff calls then just keep their
  // sequence) receives the sequences of hold_for_handoff calls.
  Engine(ModelRunner& runner, const EngineOptions& options,
         WorkerMetrics* metrics, KvLeaseTable* leases = nullptr);
  // Stop(), then joins.
  ~Engine();

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues the call, or completes it at once (call->done, on this thread)
  // with UNAVAILABLE (stopped, or draining and the call starts a sequence)
  // or RESOURCE_EXHAUSTED (queue full). Never blocks on a step.
  void Submit(std::unique_ptr<ForwardCall> call);
  void Submit(std::unique_ptr<ReleaseCall> call);

  // Runs `task` on the engine thread between steps (e.g. graph capture)
  // and returns its status; blocks the caller until then.
  absl::Status RunExclusive(std::function<absl::Status(ModelRunner&)> task);
  // Queues `task` to run between steps and returns at once; UNAVAILABLE
  // (and the task never runs) once the engine has stopped.
  absl::Status Post(std::function<void(ModelRunner&)> task);

  // A queued call's CallControl changed (cancelled): look at it now rather
  // than at the next step. Cheap; called from gRPC threads.
  void NotifyCancelled();

  // From now on Submit refuses calls that would create a sequence (start)
  // with UNAVAILABLE; steps and releases of live sequences, and queued
  // calls, still run.
  void BeginDrain();

  // Holds steps (queued calls wait; cancellations and deadlines are still
  // honoured) until Resume(). For tests that need a busy worker without
  // timing, and for operators.
  void Pause();
  void Resume();

  // Completes every queued call with UNAVAILABLE (a running step finishes
  // first) and joins the thread. Idempotent.
  void Stop();

  EngineSnapshot snapshot() const;

 private:
  struct Entry;

  // The loop and its stages, in the order of DESIGN.md's diagram.
  void Run();
  bool WaitForWork();  // false when stopping
  void DropExpiredCalls();
  bool Paused() const;
  void PlanStep();
  void RunReleases();
  void RunStep();
  bool ExecutePieces(absl::Span<const StepPiece> pieces, int num_calls,
                     absl::Status* error);
  void CompleteFinishedCalls();
  void ReleaseIdleSequences();
  void PublishSnapshot();

  // How long WaitForWork may sleep before a queued call's deadline or the
  // next idle-sequence sweep needs the loop; nullopt: until woken.
  std::optional<std::chrono::nanoseconds> TimeUntilTimedWork() const;
  // A NOT_FOUND that names a sequence the idle sweep released says so.
  void ExplainExpiredSequence(Entry& entry) const;

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

  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // the engine waits for work
  std::deque<std::unique_ptr<Entry>> incoming_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  // Submitted and not yet finished by the engine (what the queue bound,
  // the snapshot and WorkerServer::Drain count). Stop() answers the rest.
  int64_t queued_ ABSL_GUARDED_BY(mu_) = 0;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;

  mutable std::mutex snapshot_mu_;
  EngineSnapshot snapshot_ ABSL_GUARDED_BY(snapshot_mu_);

  // Engine thread only.
  std::deque<std::unique_ptr<Entry>> pending_;
  StepPlanner planner_;
  StepPlan plan_;
  std::vector<const PendingCall*> views_;  // unfinished calls, oldest first
  std::vector<Entry*> active_;             // parallel to views_
  std::vector<SequenceStep> batch_;
  std::vector<StepPiece> solo_pieces_;
  int64_t steps_ = 0;
  int64_t dropped_deadline_ = 0;
  int64_t dropped_cancelled_ = 0;
  int64_t sequences_expired_ = 0;
  std::chrono::steady_clock::time_point next_idle_sweep_{};
  // The latest sequences the sweep released (bounded, oldest forgotten
  // first) and how long each had been idle, in seconds; a later step of
  // the same id forgets it.
  absl::flat_hash_map<std::string, double> expired_idle_seconds_;
  std::deque<std::string> expired_order_;

  std::thread thread_;  // last: starts after everything it reads
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_ENGINE_ENGINE_H_
