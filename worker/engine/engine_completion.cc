// The engine's completions: preempting and finishing requests, streaming
// their tokens, answering step-level calls, the idle sweep, rollbacks, and
// what the loop publishes after each turn (KV events, the snapshot and its
// metrics). Engine-thread only, like the loop (engine.cc).
#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"
#include "worker/engine/engine.h"
#include "worker/engine/engine_work.h"

namespace pdworker {

void Engine::Preempt(const std::shared_ptr<Request>& r) {
  // Recompute: its KV goes, its tokens stay; it waits in front of the
  // queue and later prefills its prompt and outputs again.
  const absl::Status released = runner_.Release(r->kv_id);
  CHECK(released.ok() || r->num_computed == 0) << released;
  r->num_computed = 0;
  r->drafts.clear();
  r->state = Request::State::kWaiting;
  running_.erase(std::find(running_.begin(), running_.end(), r));
  waiting_.push_front(r);
  ++preemptions_;
  ++progress_;
  std::lock_guard<std::mutex> lock(mu_);
  ++requests_waiting_;
}

void Engine::FinishRequest(Request& r, std::optional<FinishReason> reason,
                           absl::Status status,
                           std::optional<int32_t> matched_token_id) {
  if (r.state == Request::State::kDone) return;
  if (r.state == Request::State::kRunning) {
    running_.erase(std::find_if(
        running_.begin(), running_.end(),
        [&r](const std::shared_ptr<Request>& p) { return p.get() == &r; }));
  } else {
    waiting_.erase(std::find_if(
        waiting_.begin(), waiting_.end(),
        [&r](const std::shared_ptr<Request>& p) { return p.get() == &r; }));
    std::lock_guard<std::mutex> lock(mu_);
    --requests_waiting_;
  }
  std::optional<KvLeaseInfo> lease;
  if (runner_.kv_cache().Find(r.kv_id) != nullptr) {
    if (reason.has_value() && reason != FinishReason::kAbort &&
        r.call->spec.handoff == KvHandoff::kHoldForDecode &&
        leases_ != nullptr) {
      // A prefill leg: no step will touch the prompt's blocks again (its
      // only sample is read); the lease keeps them for the decode worker.
      absl::StatusOr<SequenceKv> kv = runner_.Detach(r.kv_id);
      CHECK(kv.ok()) << kv.status();
      lease = leases_->Add(r.call->spec.request_id, *std::move(kv));
    } else {
      // Steps still in flight may write these blocks; no later step can
      // touch them before those (one in-order stream), so they are free
      // now.
      const absl::Status released = runner_.Release(r.kv_id);
      CHECK(released.ok()) << released;
    }
  }
  r.state = Request::State::kDone;
  ++finished_requests_;
  ++progress_;
  if (metrics_ != nullptr) {
    const auto now = ObserveNewTokens(r);
    RequestEnd end = RequestEnd::kError;
    if (reason.has_value()) {
      end = *reason == FinishReason::kStop     ? RequestEnd::kStop
            : *reason == FinishReason::kLength ? RequestEnd::kLength
                                               : RequestEnd::kAbort;
    } else if (absl::IsCancelled(status) || absl::IsDeadlineExceeded(status)) {
      end = RequestEnd::kAbort;  // its client went away or gave up
    }
    metrics_->ObserveRequestEnd(r.times, end, now);
  }
  RequestUpdate update = r.Update(steps_);
  update.finish_reason = reason;
  update.matched_token_id = matched_token_id;
  update.lease = std::move(lease);
  update.status = status.ok() && !reason.has_value()
                      ? absl::InternalError("request ended without a reason")
                      : status;
  // Keeps the request alive through the callback and the erase below.
  std::shared_ptr<Request> self = requests_.at(r.call->spec.request_id);
  requests_.erase(r.call->spec.request_id);
  // Publish before answering: a client that reads the worker's state after
  // its request ended sees its KV freed.
  PublishSnapshot();
  r.call->on_update(update);
  r.new_tokens.clear();
  r.new_logprobs.clear();
  r.new_token_logprobs.clear();
}

std::chrono::steady_clock::time_point Engine::ObserveNewTokens(Request& r) {
  const auto now = std::chrono::steady_clock::now();
  if (r.new_tokens.empty()) return now;
  const int32_t n = static_cast<int32_t>(r.new_tokens.size());
  if (r.times.first_token == std::chrono::steady_clock::time_point{}) {
    r.times.first_token = now;
    // A decode leg's prompt was prefilled by the prefill worker.
    const int32_t prefilled =
        r.call->spec.imported.has_value() ? 0 : r.stop.num_prompt_tokens;
    metrics_->ObserveFirstToken(r.times, prefilled, n);
  } else {
    metrics_->ObserveNextTokens(
        std::chrono::duration<double>(now - r.times.last_token).count(), n);
  }
  r.times.last_token = now;
  return now;
}

void Engine::SendUpdate(Request& r) {
  if (r.new_tokens.empty()) return;
  if (metrics_ != nullptr) ObserveNewTokens(r);
  RequestUpdate update = r.Update(steps_);
  r.call->on_update(update);
  r.new_tokens.clear();
  r.new_logprobs.clear();
  r.new_token_logprobs.clear();
}

void Engine::CompleteFinishedCalls() {
  // 1. Finish the calls' effects on the KV cache.
  int64_t completed = 0;
  for (const std::unique_ptr<Entry>& e : pending_) {
    if (!e->final_status.has_value() || e->steps_in_flight > 0) continue;
    ++completed;
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
  ++progress_;
  // 3. Answer.
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (!(*it)->final_status.has_value() || (*it)->steps_in_flight > 0) {
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
    // The engine's own requests are stepped or waiting for room, never
    // abandoned.
    if (named.contains(id) || id[0] == kEngineSequencePrefix) continue;
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
    ++progress_;
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
  AdmitIncomingRequests();
  std::vector<std::shared_ptr<Request>> live;
  for (const auto& [id, r] : requests_) live.push_back(r);
  for (const std::shared_ptr<Request>& r : live) {
    FinishRequest(*r, std::nullopt,
                  absl::UnavailableError(
                      "the worker stopped before the request finished"));
  }
  std::deque<std::unique_ptr<AbortCall>> aborts;
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborts.swap(incoming_aborts_);
  }
  for (std::unique_ptr<AbortCall>& call : aborts) {
    call->done(absl::UnavailableError("the worker stopped"));
  }
  std::deque<std::unique_ptr<KvReservationCall>> reservations;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reservations.swap(incoming_reservations_);
  }
  for (std::unique_ptr<Reservation>& r : reservations_) {
    reservations.push_back(std::move(r->call));
  }
  reservations_.clear();
  for (std::unique_ptr<KvReservationCall>& call : reservations) {
    call->done(absl::UnavailableError(
        "the worker stopped before the import found room"));
  }
  for (const std::unique_ptr<Entry>& e : pending_) {
    if (!e->final_status.has_value()) e->final_status = status;
  }
  CompleteFinishedCalls();
}

void Engine::PublishKvEvents() {
  // Dropped when nobody listens, so they never pile up.
  kv_event_batch_.clear();
  runner_.TakeKvEvents(&kv_event_batch_);
  if (kv_events_ != nullptr) kv_events_->Publish(kv_event_batch_);
}

void Engine::PublishSnapshot() {
  const KvCacheStats kv = runner_.kv_cache().Stats();
  int64_t queued, waiting;
  // Prompt tokens accepted and not computed yet (pdworker_waiting_prompt_
  // tokens): what a prefill autoscaler scales on.
  int64_t waiting_prompt_tokens = 0;
  // Of those, the ones the prefix cache does not hold (GetLoads).
  int64_t waiting_uncached_tokens = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queued = queued_;
    waiting = requests_waiting_;
    for (const std::unique_ptr<EngineRequest>& r : incoming_requests_) {
      waiting_prompt_tokens += static_cast<int64_t>(r->spec.prompt.size());
    }
    for (const std::unique_ptr<Entry>& e : incoming_) {
      for (const int32_t left : e->remaining) waiting_prompt_tokens += left;
    }
  }
  // Not looked up yet: all of them.
  waiting_uncached_tokens = waiting_prompt_tokens;
  for (const std::shared_ptr<Request>& r : running_) {
    waiting_uncached_tokens +=
        std::max(0, r->stop.num_prompt_tokens - r->num_computed);
  }
  for (const std::shared_ptr<Request>& r : waiting_) {
    waiting_uncached_tokens +=
        std::max(0, r->total() - r->num_computed - r->waiting_cached_tokens);
  }
  for (const std::unique_ptr<Entry>& e : pending_) {
    for (const int32_t left : e->remaining) waiting_uncached_tokens += left;
  }
  {
    std::lock_guard<std::mutex> lock(snapshot_mu_);
    snapshot_.kv = kv;
    snapshot_.steps = steps_;
    snapshot_.dropped_deadline = dropped_deadline_;
    snapshot_.dropped_cancelled = dropped_cancelled_;
    snapshot_.sequences_expired = sequences_expired_;
    snapshot_.running_requests = static_cast<int64_t>(running_.size());
    snapshot_.waiting_imports = static_cast<int64_t>(reservations_.size());
    snapshot_.waiting_requests = waiting;
    snapshot_.preemptions = preemptions_;
    snapshot_.finished_requests = finished_requests_;
    snapshot_.device_busy_seconds = device_busy_seconds_;
    snapshot_.device_idle_seconds = device_idle_seconds_;
    snapshot_.spec_drafts = spec_drafts_;
    snapshot_.spec_draft_tokens = spec_draft_tokens_;
    snapshot_.spec_accepted_tokens = spec_accepted_tokens_;
    snapshot_.device_error = device_error_;
    snapshot_.last_step_at = last_step_at_;
    snapshot_.waiting_uncached_tokens = waiting_uncached_tokens;
  }
  if (metrics_ == nullptr) return;
  EngineLoad load;
  load.running_requests = static_cast<int64_t>(running_.size());
  load.waiting_requests = waiting;
  load.kv_imports_waiting = static_cast<int64_t>(reservations_.size());
  load.queued_calls = queued;
  int64_t request_sequences = 0;
  for (const std::shared_ptr<Request>& r : running_) {
    if (runner_.kv_cache().Find(r->kv_id) != nullptr) ++request_sequences;
    waiting_prompt_tokens +=
        std::max(0, r->stop.num_prompt_tokens - r->num_computed);
  }
  for (const std::shared_ptr<Request>& r : waiting_) {
    waiting_prompt_tokens += r->total() - r->num_computed;
  }
  for (const std::unique_ptr<Entry>& e : pending_) {
    for (const int32_t left : e->remaining) waiting_prompt_tokens += left;
  }
  load.step_level_sequences =
      std::max<int64_t>(0, kv.num_sequences - request_sequences);
  load.waiting_prompt_tokens = waiting_prompt_tokens;
  load.used_blocks = kv.used_blocks;
  load.free_blocks = kv.free_blocks;
  load.used_tokens = kv.used_tokens;
  load.preemptions = preemptions_;
  metrics_->SetEngineLoad(load);
  metrics_->SetPrefixCache(kv.query_tokens, kv.hit_tokens, kv.evictions,
                           kv.cached_blocks);
}

}  // namespace pdworker
