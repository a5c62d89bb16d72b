#include "worker/engine/engine.h"

#include <algorithm>
#include <chrono>
#include <future>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"

namespace pdworker {

// One queued call and the engine's bookkeeping for it.
struct Engine::Entry {
  // Exactly one of the two is set.
  std::unique_ptr<ForwardCall> forward;
  std::unique_ptr<ReleaseCall> release;
  CallControl* control = nullptr;  // owned by the call

  // The planner's view; its spans point into `ids` and `remaining`, which
  // are sized once and never reallocated.
  std::vector<absl::string_view> ids;
  std::vector<int32_t> remaining;  // Forward: tokens not yet run, per sequence
  PendingCall view;

  // Forward progress: each sequence's length before the call's first piece
  // of it ran (-1: not run yet), for rollback.
  std::vector<int32_t> length_before;
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

Engine::Engine(ModelRunner& runner, const EngineOptions& options,
               WorkerMetrics* metrics, KvLeaseTable* leases)
    : runner_(runner),
      options_(options),
      metrics_(metrics),
      leases_(leases),
      planner_(StepBudget{runner.options().max_num_seqs,
                          runner.options().max_num_batched_tokens}) {
  batch_.reserve(runner.options().max_num_seqs);
  PublishSnapshot();
  thread_ = std::thread([this] { Run(); });
}

Engine::~Engine() { Stop(); }

// ---------------------------------------------------------------------------
// The loop.

void Engine::Run() {
  while (WaitForWork()) {
    DropExpiredCalls();  // deadline passed or cancelled: never run
    if (!Paused()) {
      PlanStep();     // coalesce pending calls into one step
      RunReleases();  // Release calls that wait for nothing
      RunStep();      // ModelRunner::Execute(batch); call by call on failure
    }
    CompleteFinishedCalls();  // roll back or release_after_step; respond
    ReleaseIdleSequences();   // abandoned by their router: free their KV
  }
  FailAll(absl::UnavailableError("the worker stopped before the call ran"));
}

bool Engine::Paused() const {
  std::lock_guard<std::mutex> lock(mu_);
  return paused_;
}

void Engine::PlanStep() {
  views_.clear();
  active_.clear();
  for (const std::unique_ptr<Entry>& e : pending_) {
    if (e->final_status.has_value()) continue;
    views_.push_back(&e->view);
    active_.push_back(e.get());
  }
  planner_.Plan(views_, &plan_);
}

bool Engine::WaitForWork() {
  std::vector<std::function<void()>> tasks;
  {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      while (!incoming_.empty()) {
        pending_.push_back(std::move(incoming_.front()));
        incoming_.pop_front();
      }
      if (stopping_) return false;
      if (!tasks_.empty()) {
        tasks.swap(tasks_);
        break;
      }
      if (wake_) {  // a cancellation to act on
        wake_ = false;
        break;
      }
      if (!pending_.empty() && !paused_) break;
      // Idle or paused: sleep until new work, or until the earliest queued
      // deadline or idle sweep, so an expired call is answered (and an
      // abandoned sequence freed) without waiting for traffic.
      const std::optional<std::chrono::nanoseconds> wake_in =
          TimeUntilTimedWork();
      if (!wake_in.has_value()) {
        work_cv_.wait(lock);
      } else if (work_cv_.wait_for(lock, *wake_in) == std::cv_status::timeout) {
        break;
      }
    }
  }
  for (std::function<void()>& task : tasks) task();
  return true;
}

std::optional<std::chrono::nanoseconds> Engine::TimeUntilTimedWork() const {
  std::optional<std::chrono::nanoseconds> wake_in;
  if (!pending_.empty()) {
    auto earliest = std::chrono::system_clock::time_point::max();
    for (const std::unique_ptr<Entry>& e : pending_) {
      earliest = std::min(earliest, e->control->deadline);
    }
    if (earliest != std::chrono::system_clock::time_point::max()) {
      wake_in = std::max(std::chrono::nanoseconds(0),
                         std::chrono::duration_cast<std::chrono::nanoseconds>(
                             earliest - std::chrono::system_clock::now()));
    }
  }
  if (options_.sequence_idle_timeout.count() > 0 &&
      runner_.kv_cache().Stats().num_sequences > 0) {
    const auto sweep_in =
        std::max(std::chrono::nanoseconds(0),
                 std::chrono::duration_cast<std::chrono::nanoseconds>(
                     next_idle_sweep_ - std::chrono::steady_clock::now()));
    wake_in = wake_in.has_value() ? std::min(*wake_in, sweep_in) : sweep_in;
  }
  return wake_in;
}

void Engine::DropExpiredCalls() {
  const auto now = std::chrono::system_clock::now();
  for (const std::unique_ptr<Entry>& e : pending_) {
    if (e->final_status.has_value()) continue;
    // The deadline first: when it passes, gRPC cancels the call too.
    const absl::string_view when =
        e->started() ? "between its chunks (the chunks that ran were undone)"
                     : "before it ran";
    if (now >= e->control->deadline) {
      e->final_status = absl::DeadlineExceededError(
          absl::StrCat("the call's deadline passed ", when));
      ++dropped_deadline_;
    } else if (e->control->cancelled.load(std::memory_order_acquire)) {
      e->final_status = absl::CancelledError(
          absl::StrCat("the client cancelled the call ", when));
      ++dropped_cancelled_;
    } else {
      continue;
    }
    // Undo its chunks now, not with the other finished calls: from here on
    // it claims no sequence, so this iteration may plan a later call on one
    // of them, which must find the sequence as it was before this call.
    RollBack(*e);
  }
}

void Engine::RunReleases() {
  for (const int i : plan_.releases) {
    Entry& e = *active_[i];
    // All or nothing: an unknown id frees nothing.
    int freed = 0;
    absl::Status status;
    for (const std::string& id : e.release->sequence_ids) {
      const SequenceKv* kv = runner_.kv_cache().Find(id);
      if (kv == nullptr) {
        status = absl::NotFoundError(
            absl::StrCat("unknown sequence '", id, "'; nothing was released"));
        break;
      }
      freed += static_cast<int>(kv->blocks.size());
    }
    if (status.ok()) {
      for (const std::string& id : e.release->sequence_ids) {
        const absl::Status released = runner_.Release(id);
        CHECK(released.ok()) << released;  // checked just above
      }
    }
    e.release_outcome.freed_blocks = freed;
    e.final_status = status;
  }
}

void Engine::RunStep() {
  if (plan_.pieces.empty()) return;
  const int num_calls = static_cast<int>(plan_.forwards.size());
  absl::Status error;
  if (ExecutePieces(plan_.pieces, num_calls, &error)) return;
  if (num_calls == 1) {
    active_[plan_.forwards[0]]->final_status = error;
    return;
  }
  // A failed step changed nothing, and one call's problem (an unknown
  // sequence, a KV demand that only the merged step exceeds) must not fail
  // the others: run each call's pieces alone, oldest first.
  VLOG(1) << "merged step of " << num_calls
          << " calls failed; retrying them one by one: " << error;
  for (const int call : plan_.forwards) {
    solo_pieces_.clear();
    for (const StepPiece& p : plan_.pieces) {
      if (p.call == call) solo_pieces_.push_back(p);
    }
    if (!ExecutePieces(solo_pieces_, 1, &error)) {
      active_[call]->final_status = error;
    }
  }
}

bool Engine::ExecutePieces(absl::Span<const StepPiece> pieces, int num_calls,
                           absl::Status* error) {
  // The batch: each piece's slice of its sequence's tokens. A sequence's
  // first piece creates it as the request asked; later chunks continue it.
  batch_.resize(pieces.size());
  for (size_t k = 0; k < pieces.size(); ++k) {
    const StepPiece& p = pieces[k];
    const Entry& e = *active_[p.call];
    const SequenceStep& src = e.forward->spec.sequences[p.sequence];
    const size_t offset = src.token_ids.size() - e.remaining[p.sequence];
    SequenceStep& dst = batch_[k];
    dst.sequence_id = src.sequence_id;
    dst.token_ids.assign(src.token_ids.begin() + offset,
                         src.token_ids.begin() + offset + p.num_tokens);
    dst.sampling = src.sampling;
    dst.creation = e.length_before[p.sequence] < 0
                       ? src.creation
                       : SequenceCreation::kMustExist;
  }
  absl::StatusOr<StepResult> result = runner_.Execute(batch_);
  if (!result.ok()) {
    *error = result.status();
    return false;
  }

  ++steps_;
  StepSummary summary;
  summary.mode = result->mode;
  summary.fallback_reason = result->fallback_reason;
  summary.unpadded_tokens = result->unpadded_tokens;
  summary.padded_tokens = result->padded_tokens;
  summary.num_sequences = static_cast<int>(pieces.size());
  summary.num_calls = num_calls;
  summary.step_seconds = result->forward_seconds;
  if (metrics_ != nullptr) {
    metrics_->ObserveStep(summary.mode, summary.fallback_reason,
                          summary.unpadded_tokens, summary.padded_tokens,
                          summary.num_sequences, summary.num_calls,
                          summary.step_seconds);
  }

  // Pieces are grouped by call (the planner emits them call by call).
  for (size_t k = 0; k < pieces.size(); ++k) {
    const StepPiece& p = pieces[k];
    Entry& e = *active_[p.call];
    // The id lives again (re-created): a later NOT_FOUND is not the sweep's.
    if (!expired_idle_seconds_.empty()) {
      expired_idle_seconds_.erase(batch_[k].sequence_id);
    }
    const SequenceResult& r = result->sequences[k];
    if (e.length_before[p.sequence] < 0) {
      e.length_before[p.sequence] = r.num_tokens - p.num_tokens;
    }
    e.remaining[p.sequence] -= p.num_tokens;
    // Only the sample after a sequence's last token is an answer; earlier
    // chunks' samples are discarded.
    if (e.remaining[p.sequence] == 0) e.outcome.sequences[p.sequence] = r;
    const bool last_piece_of_call =
        k + 1 == pieces.size() || pieces[k + 1].call != p.call;
    if (!last_piece_of_call) continue;
    ++e.outcome.num_steps;
    e.outcome.last_step = summary;
    bool done = true;
    for (const int32_t left : e.remaining) done = done && left == 0;
    if (done) e.final_status = absl::OkStatus();
  }
  return true;
}

void Engine::CompleteFinishedCalls() {
  // 1. Finish the calls' effects on the KV cache.
  int64_t completed = 0;
  for (const std::unique_ptr<Entry>& e : pending_) {
    if (!e->final_status.has_value()) continue;
    ++completed;
    ExplainExpiredSequence(*e);
    if (e->forward == nullptr) continue;
    if (!e->final_status->ok()) {
      RollBack(*e);
      continue;
    }
    const ForwardCallSpec& spec = e->forward->spec;
    for (size_t s = 0; s < spec.sequences.size(); ++s) {
      const std::string& id = spec.sequences[s].sequence_id;
      if (spec.after_step[s] == AfterStep::kRelease) {
        const absl::Status released = runner_.Release(id);
        LOG_IF(ERROR, !released.ok()) << "release_after_step: " << released;
      } else if (spec.after_step[s] == AfterStep::kHoldForHandoff &&
                 leases_ != nullptr) {
        // The id is free again at once; the blocks live on in the lease.
        absl::StatusOr<SequenceKv> kv = runner_.Detach(id);
        CHECK(kv.ok()) << "hold_for_handoff of '" << id << "': " << kv.status();
        e->outcome.leases.resize(spec.sequences.size());
        e->outcome.leases[s] = leases_->Add(id, std::move(*kv));
      }
    }
  }
  // 2. Publish before answering: a client that reads GetStatus after its
  // response sees its own call's effect, and a finished call no longer
  // counts as queued.
  if (completed > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    queued_ -= completed;
  }
  PublishSnapshot();
  if (completed == 0) return;
  // 3. Answer.
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (!(*it)->final_status.has_value()) {
      ++it;
      continue;
    }
    (*it)->Finish();
    it = pending_.erase(it);
  }
}

void Engine::ReleaseIdleSequences() {
  const std::chrono::milliseconds timeout = options_.sequence_idle_timeout;
  if (timeout.count() <= 0) return;
  const auto now = std::chrono::steady_clock::now();
  if (now < next_idle_sweep_) return;
  // Sweep often enough that a sequence is freed within ~1.1x the timeout,
  // and at most once a second: the sweep walks every live sequence.
  next_idle_sweep_ = now + std::clamp<std::chrono::steady_clock::duration>(
                               timeout / 10, std::chrono::milliseconds(1),
                               std::chrono::seconds(1));
  std::vector<std::string> idle = runner_.kv_cache().IdleSince(now - timeout);
  if (idle.empty()) return;
  // A queued call naming the sequence shows its router is still there (the
  // engine may be paused, or the queue long).
  absl::flat_hash_set<absl::string_view> named;
  for (const std::unique_ptr<Entry>& e : pending_) {
    named.insert(e->ids.begin(), e->ids.end());
  }
  bool released_any = false;
  for (const std::string& id : idle) {
    if (named.contains(id)) continue;
    const SequenceKv* kv = runner_.kv_cache().Find(id);
    CHECK(kv != nullptr) << id;
    const double idle_seconds =
        std::chrono::duration<double>(now - kv->last_active).count();
    const size_t blocks = kv->blocks.size();
    const absl::Status released = runner_.Release(id);
    CHECK(released.ok()) << "idle release of '" << id << "': " << released;
    LOG(WARNING) << "released sequence '" << id << "' (" << blocks
                 << " KV blocks) after "
                 << absl::StrFormat("%.1f", idle_seconds)
                 << " s without a step: its router never released it "
                    "(--sequence_idle_timeout="
                 << timeout.count() << "ms)";
    ++sequences_expired_;
    if (metrics_ != nullptr) metrics_->IncrementSequencesExpired();
    released_any = true;
    // Remember it, so a late call learns why it is gone.
    constexpr size_t kRemembered = 4096;
    if (expired_idle_seconds_.insert_or_assign(id, idle_seconds).second) {
      expired_order_.push_back(id);
    }
    while (expired_order_.size() > kRemembered) {
      expired_idle_seconds_.erase(expired_order_.front());
      expired_order_.pop_front();
    }
  }
  if (released_any) PublishSnapshot();
}

void Engine::ExplainExpiredSequence(Entry& e) const {
  if (expired_idle_seconds_.empty() || e.final_status->ok() ||
      !absl::IsNotFound(*e.final_status)) {
    return;
  }
  const absl::string_view message = e.final_status->message();
  for (const absl::string_view id : e.ids) {
    auto it = expired_idle_seconds_.find(id);
    if (it == expired_idle_seconds_.end() ||
        !absl::StrContains(message, absl::StrCat("'", id, "'"))) {
      continue;
    }
    e.final_status = absl::NotFoundError(absl::StrCat(
        message, ": the worker released it after ",
        absl::StrFormat("%.1f", it->second),
        " s without a step (--sequence_idle_timeout=",
        options_.sequence_idle_timeout.count(),
        "ms); a router must step or release its sequences within that time"));
    return;
  }
}

void Engine::RollBack(Entry& e) {
  if (e.forward == nullptr) return;
  for (size_t s = 0; s < e.length_before.size(); ++s) {
    if (e.length_before[s] < 0) continue;
    const SequenceStep& seq = e.forward->spec.sequences[s];
    // The planner kept every other call off this sequence meanwhile, so the
    // undo cannot fail unless the bookkeeping is broken.
    const absl::Status undone =
        seq.creation == SequenceCreation::kMustBeNew
            ? runner_.Release(seq.sequence_id)
            : runner_.Truncate(seq.sequence_id, e.length_before[s]);
    CHECK(undone.ok()) << "rollback of '" << seq.sequence_id << "': " << undone;
    e.length_before[s] = -1;
  }
}

void Engine::FailAll(const absl::Status& status) {
  std::vector<std::function<void()>> tasks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (!incoming_.empty()) {
      pending_.push_back(std::move(incoming_.front()));
      incoming_.pop_front();
    }
    tasks.swap(tasks_);
  }
  for (std::function<void()>& task : tasks) task();
  for (const std::unique_ptr<Entry>& e : pending_) {
    if (!e->final_status.has_value()) e->final_status = status;
  }
  CompleteFinishedCalls();
}

void Engine::PublishSnapshot() {
  const KvCacheStats kv = runner_.kv_cache().Stats();
  int64_t queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queued = queued_;
  }
  {
    std::lock_guard<std::mutex> lock(snapshot_mu_);
    snapshot_.kv = kv;
    snapshot_.steps = steps_;
    snapshot_.dropped_deadline = dropped_deadline_;
    snapshot_.dropped_cancelled = dropped_cancelled_;
    snapshot_.sequences_expired = sequences_expired_;
  }
  if (metrics_ != nullptr) {
    metrics_->SetKvBlocks(kv.used_blocks, kv.free_blocks);
    metrics_->SetQueueDepth(queued);
  }
}

// ---------------------------------------------------------------------------
// Other threads.

bool Engine::StartsSequences(const Entry& entry) {
  if (entry.forward == nullptr) return false;
  for (const SequenceStep& s : entry.forward->spec.sequences) {
    if (s.creation != SequenceCreation::kMustExist) return true;
  }
  return false;
}

void Engine::Submit(std::unique_ptr<ForwardCall> call) {
  auto e = std::make_unique<Entry>();
  const ForwardCallSpec& spec = call->spec;
  const size_t n = spec.sequences.size();
  e->control = call->control.get();
  e->ids.reserve(n);
  e->remaining.reserve(n);
  for (const SequenceStep& s : spec.sequences) {
    e->ids.push_back(s.sequence_id);
    e->remaining.push_back(static_cast<int32_t>(s.token_ids.size()));
  }
  e->length_before.assign(n, -1);
  e->outcome.sequences.resize(n);
  e->view.kind = PendingKind::kForward;
  e->view.chunking =
      spec.total_tokens > planner_.budget().max_num_batched_tokens
          ? Chunking::kChunked
          : Chunking::kWhole;
  e->view.sequence_ids = e->ids;
  e->view.remaining_tokens = e->remaining;
  e->forward = std::move(call);
  Enqueue(std::move(e));
}

void Engine::Submit(std::unique_ptr<ReleaseCall> call) {
  auto e = std::make_unique<Entry>();
  e->control = call->control.get();
  for (const std::string& id : call->sequence_ids) e->ids.push_back(id);
  e->view.kind = PendingKind::kRelease;
  e->view.sequence_ids = e->ids;
  e->release = std::move(call);
  Enqueue(std::move(e));
}

void Engine::Enqueue(std::unique_ptr<Entry> entry) {
  const absl::Status refused = Admit(entry);
  if (refused.ok()) {
    work_cv_.notify_one();
    return;
  }
  entry->final_status = refused;
  entry->Finish();
}

absl::Status Engine::Admit(std::unique_ptr<Entry>& entry) {
  absl::Status refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      refused = absl::UnavailableError(
          "the worker is shutting down and takes no more calls");
    } else if (draining_ && StartsSequences(*entry)) {
      refused = absl::UnavailableError(
          "the worker is draining (shutting down) and takes no new "
          "sequences; its live sequences may step until released");
    } else if (queued_ >= options_.max_queue) {
      refused = absl::ResourceExhaustedError(
          absl::StrCat("request queue full: ", queued_,
                       " calls queued (--max_queue=", options_.max_queue, ")"));
    } else {
      incoming_.push_back(std::move(entry));
      ++queued_;
    }
  }
  return refused;
}

absl::Status Engine::RunExclusive(
    std::function<absl::Status(ModelRunner&)> task) {
  // Shared with the task so the promise outlives set_value even when the
  // caller wakes up and returns first.
  auto promise = std::make_shared<std::promise<absl::Status>>();
  std::future<absl::Status> result = promise->get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("the engine has stopped");
    tasks_.push_back([this, task = std::move(task), promise] {
      promise->set_value(task(runner_));
    });
  }
  work_cv_.notify_one();
  return result.get();
}

absl::Status Engine::Post(std::function<void(ModelRunner&)> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("the engine has stopped");
    tasks_.push_back(
        [this, task = std::move(task)]() mutable { task(runner_); });
  }
  work_cv_.notify_one();
  return absl::OkStatus();
}

void Engine::NotifyCancelled() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    wake_ = true;
  }
  work_cv_.notify_one();
}

void Engine::BeginDrain() {
  std::lock_guard<std::mutex> lock(mu_);
  draining_ = true;
}

void Engine::Pause() {
  std::lock_guard<std::mutex> lock(mu_);
  paused_ = true;
}

void Engine::Resume() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    paused_ = false;
  }
  work_cv_.notify_one();
}

void Engine::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

EngineSnapshot Engine::snapshot() const {
  EngineSnapshot s;
  {
    std::lock_guard<std::mutex> lock(snapshot_mu_);
    s = snapshot_;
  }
  std::lock_guard<std::mutex> lock(mu_);
  s.queued_calls = queued_;
  return s;
}

}  // namespace pdworker
