#include "worker/engine/engine.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"
#include "worker/engine/engine_work.h"

namespace pdworker {

namespace {

// NOT_FOUND for a sequence the KV cache does not know; when the idle sweep
// released it, the message says so (built from the sweep's record).
absl::Status UnknownSequenceError(
    const absl::flat_hash_map<std::string, double>& expired,
    std::chrono::milliseconds timeout, absl::string_view id,
    absl::string_view what) {
  std::string message = absl::StrCat("unknown sequence '", id, "'", what);
  auto it = expired.find(id);
  if (it != expired.end()) {
    absl::StrAppend(
        &message, ": the worker released it after ",
        absl::StrFormat("%.1f", it->second),
        " s without a step (--sequence_idle_timeout=", timeout.count(),
        "ms); a router must step or release its sequences within that time");
  }
  return absl::NotFoundError(message);
}

}  // namespace

Engine::Engine(ModelRunner& runner, const EngineOptions& options,
               WorkerMetrics* metrics, KvLeaseTable* leases,
               KvEventListener* kv_events)
    : runner_(runner),
      options_(options),
      metrics_(metrics),
      leases_(leases),
      kv_events_(kv_events),
      vocab_size_(static_cast<int32_t>(runner.model_config().vocab_size)),
      max_model_len_(runner.max_model_len()),
      planner_(StepBudget{runner.options().max_num_seqs,
                          runner.options().max_num_batched_tokens,
                          runner.kv_cache().block_size()}) {
  for (const int64_t id : runner.model_config().eos_token_ids) {
    eos_token_ids_.push_back(static_cast<int32_t>(id));
  }
  batch_.reserve(runner.options().max_num_seqs);
  PublishSnapshot();
  thread_ = std::thread([this] { Run(); });
}

Engine::~Engine() { Stop(); }

// ---------------------------------------------------------------------------
// The loop.

void Engine::Run() {
  while (WaitForWork()) {
    const uint64_t progress_before = progress_;
    AdmitIncomingRequests();  // new requests join the waiting queue
    RunAborts();              // aborted requests give their KV back
    DropExpiredWork();        // deadline passed or cancelled: never run
    ServeKvReservations();    // imports take the room they waited for
    bool launched = false;
    if (!Paused() && !WaitsForDraftSamples()) {
      ExplainExpiredSequences();
      PlanStep();               // merge calls and requests into one step
      RunReleases();            // Release calls that wait for nothing
      launched = LaunchStep();  // ModelRunner::Launch; call by call on failure
    }
    // With overlap the step just launched stays on the device while the
    // previous one is read back; otherwise every step is read back now.
    RetireSteps(options_.overlap == StepOverlap::kOn && launched ? 1 : 0);
    CompleteFinishedCalls();  // roll back or release_after_step; respond
    ReleaseIdleSequences();   // abandoned by their router: free their KV
    PublishKvEvents();        // what the prefix cache stored and evicted
    // Nothing changed (requests waiting for KV that step-level sequences
    // hold): sleep until something does instead of spinning.
    stalled_ = progress_ == progress_before;
  }
  RetireSteps(0);
  FailAll(absl::UnavailableError("the worker stopped before the call ran"));
  PublishKvEvents();
}

bool Engine::Paused() const {
  std::lock_guard<std::mutex> lock(mu_);
  return paused_;
}

bool Engine::WaitForWork() {
  std::vector<std::function<void()>> tasks;
  {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (!incoming_.empty()) stalled_ = false;
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
      if (!incoming_requests_.empty() || !incoming_aborts_.empty() ||
          !incoming_reservations_.empty() || !in_flight_.empty()) {
        break;
      }
      const bool has_steps = !pending_.empty() || !running_.empty() ||
                             !waiting_.empty() || !reservations_.empty();
      if (has_steps && !paused_ && !stalled_) break;
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
      stalled_ = false;  // woken: something may have changed
    }
  }
  if (!tasks.empty()) {
    // Tasks touch the KV cache from off the stream (imports) or capture
    // graphs: nothing may be on the device meanwhile.
    RetireSteps(0);
    CompleteFinishedCalls();
    for (std::function<void()>& task : tasks) task();
    // What they changed (freed lease blocks, a flushed prefix cache) shows
    // in GetStatus now, not at the next step.
    PublishSnapshot();
  }
  return true;
}

std::optional<std::chrono::nanoseconds> Engine::TimeUntilTimedWork() const {
  std::optional<std::chrono::nanoseconds> wake_in;
  auto earliest = std::chrono::system_clock::time_point::max();
  for (const std::unique_ptr<Entry>& e : pending_) {
    earliest = std::min(earliest, e->control->deadline);
  }
  for (const auto& [id, request] : requests_) {
    if (request->call->control != nullptr) {
      earliest = std::min(earliest, request->call->control->deadline);
    }
  }
  for (const std::unique_ptr<Reservation>& r : reservations_) {
    earliest = std::min(earliest, r->call->wait_deadline);
    if (r->call->control != nullptr) {
      earliest = std::min(earliest, r->call->control->deadline);
    }
  }
  if (earliest != std::chrono::system_clock::time_point::max()) {
    wake_in = std::max(std::chrono::nanoseconds(0),
                       std::chrono::duration_cast<std::chrono::nanoseconds>(
                           earliest - std::chrono::system_clock::now()));
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

void Engine::AdmitIncomingRequests() {
  std::deque<std::unique_ptr<EngineRequest>> incoming;
  {
    std::lock_guard<std::mutex> lock(mu_);
    incoming.swap(incoming_requests_);
  }
  for (std::unique_ptr<EngineRequest>& call : incoming) {
    const std::string& id = call->spec.request_id;
    const std::optional<ImportedPrompt>& imported = call->spec.imported;
    absl::Status refused;
    if (requests_.contains(id)) {
      refused = absl::AlreadyExistsError(
          absl::StrCat("request '", id, "' is already live"));
    } else if (imported.has_value()) {
      const SequenceKv* kv = runner_.kv_cache().Find(imported->kv_sequence_id);
      if (kv == nullptr ||
          kv->num_tokens != static_cast<int32_t>(call->spec.prompt.size())) {
        refused = absl::InternalError(absl::StrCat(
            "request '", id, "': its imported KV is missing or not ",
            call->spec.prompt.size(), " tokens long"));
      }
    }
    if (!refused.ok()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        --requests_waiting_;
      }
      // The imported KV (and its running seat) is this request's to free.
      if (imported.has_value()) {
        import_seats_.erase(imported->kv_sequence_id);
        if (runner_.kv_cache().Find(imported->kv_sequence_id) != nullptr) {
          runner_.Release(imported->kv_sequence_id).IgnoreError();
        }
      }
      RequestUpdate update;
      update.num_prompt_tokens = static_cast<int32_t>(call->spec.prompt.size());
      update.status = refused;
      call->on_update(update);
      continue;
    }
    auto r = std::make_shared<Request>();
    r->stop.conditions = call->spec.stop;
    if (r->stop.conditions.eos == EosHandling::kStop) {
      r->stop.eos_token_ids = eos_token_ids_;
    }
    r->stop.num_prompt_tokens = static_cast<int32_t>(call->spec.prompt.size());
    r->stop.max_output_tokens =
        call->spec.stop.max_tokens > 0
            ? call->spec.stop.max_tokens
            : max_model_len_ - r->stop.num_prompt_tokens;
    // A prefill leg ends with its first token; its KV goes to a lease.
    if (call->spec.handoff == KvHandoff::kHoldForDecode) {
      r->stop.max_output_tokens = 1;
    }
    r->tokens = call->spec.prompt;
    r->times.arrival = call->arrival;
    r->ticket = next_ticket_++;
    r->call = std::move(call);
    ++progress_;
    if (!imported.has_value()) {
      r->kv_id = absl::StrCat(std::string(1, kEngineSequencePrefix), "request#",
                              next_request_number_++);
      // What the cache holds for it now, for GetLoads until PlanStep looks
      // again (the hashes are kept for that lookup).
      const KvCacheManager& kv = runner_.kv_cache();
      if (kv.prefix_caching() == PrefixCaching::kOn) {
        kv.hasher().HashFullBlocks(r->tokens, &r->block_hashes);
        r->waiting_cached_tokens =
            kv.Lookup(r->block_hashes, r->total()).num_blocks * kv.block_size();
      }
      waiting_.push_back(r);
      requests_.emplace(r->call->spec.request_id, std::move(r));
      continue;
    }
    // A decode leg: the prompt's KV is here already and its first output
    // is the token the prefill worker sampled. It runs at once in the seat
    // its reservation took; without one (its KV did not come through
    // ServeKvReservations) it runs when a seat is free, and waits holding
    // its KV until then.
    const ImportedPrompt& prompt = *r->call->spec.imported;
    r->kv_id = prompt.kv_sequence_id;
    r->num_computed = r->stop.num_prompt_tokens;
    const bool seated = import_seats_.erase(r->kv_id) > 0;
    if (seated || running_.size() + import_seats_.size() <
                      static_cast<size_t>(runner_.options().max_num_seqs)) {
      r->state = Request::State::kRunning;
      r->times.scheduled = std::chrono::steady_clock::now();
      running_.push_back(r);
      std::lock_guard<std::mutex> lock(mu_);
      --requests_waiting_;
    } else {
      waiting_.push_back(r);
    }
    requests_.emplace(r->call->spec.request_id, r);
    r->tokens.push_back(prompt.first_token_id);
    r->new_tokens.push_back(prompt.first_token_id);
    r->new_logprobs.push_back(prompt.first_logprob);
    if (r->call->spec.logprobs >= 0) {
      r->new_token_logprobs.push_back(prompt.first_token_logprobs);
    }
    const StopDecision stop =
        CheckStop(r->stop, prompt.first_token_id, r->num_outputs());
    if (stop.reason.has_value()) {
      FinishRequest(*r, stop.reason, absl::OkStatus(), stop.matched_token_id);
    } else {
      SendUpdate(*r);
    }
  }
}

void Engine::RunAborts() {
  std::deque<std::unique_ptr<AbortCall>> aborts;
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborts.swap(incoming_aborts_);
  }
  for (std::unique_ptr<AbortCall>& call : aborts) {
    absl::Status missing;
    AbortOutcome outcome;
    for (const std::string& id : call->request_ids) {
      auto it = requests_.find(id);
      if (it == requests_.end()) {
        missing = absl::NotFoundError(absl::StrCat(
            "request '", id,
            "' is not live (unknown, finished or aborted); nothing was "
            "aborted"));
        break;
      }
      if (const SequenceKv* kv = runner_.kv_cache().Find(it->second->kv_id)) {
        outcome.freed_blocks += static_cast<int>(kv->blocks.size());
      }
    }
    if (!missing.ok()) {
      call->done(missing);
      continue;
    }
    for (const std::string& id : call->request_ids) {
      // Kept alive by the local reference while FinishRequest forgets it.
      std::shared_ptr<Request> r = requests_.at(id);
      FinishRequest(*r, FinishReason::kAbort);
    }
    PublishSnapshot();
    call->done(outcome);
  }
}

void Engine::DropExpiredWork() {
  const auto now = std::chrono::system_clock::now();
  for (const std::unique_ptr<Entry>& e : pending_) {
    // A call with a step on the device is running: it finishes.
    if (e->final_status.has_value() || e->steps_in_flight > 0) continue;
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
  std::vector<std::shared_ptr<Request>> expired;
  for (const auto& [id, r] : requests_) {
    const CallControl* control = r->call->control.get();
    if (control == nullptr) continue;
    if (now >= control->deadline ||
        control->cancelled.load(std::memory_order_acquire)) {
      expired.push_back(r);
    }
  }
  for (const std::shared_ptr<Request>& r : expired) {
    const CallControl& control = *r->call->control;
    FinishRequest(
        *r, std::nullopt,
        now >= control.deadline
            ? absl::DeadlineExceededError(
                  "the request's deadline passed; it was aborted "
                  "and its KV freed")
            : absl::CancelledError("the client cancelled the request; it was "
                                   "aborted and its KV freed"));
  }
}

void Engine::ExplainExpiredSequences() {
  if (expired_idle_seconds_.empty()) return;
  for (const std::unique_ptr<Entry>& e : pending_) {
    if (e->forward == nullptr || e->final_status.has_value() || e->started()) {
      continue;
    }
    for (const SequenceStep& s : e->forward->spec.sequences) {
      if (s.creation != SequenceCreation::kMustExist ||
          !expired_idle_seconds_.contains(s.sequence_id) ||
          runner_.kv_cache().Find(s.sequence_id) != nullptr) {
        continue;
      }
      e->final_status = UnknownSequenceError(expired_idle_seconds_,
                                             options_.sequence_idle_timeout,
                                             s.sequence_id, "");
      break;
    }
  }
}

int32_t Engine::WantedTokens(const Request& r) const {
  if (r.num_pending > 1) return 0;  // cannot feed two unknown tokens
  // Drafts continue the sample in flight, and a verify step's next token
  // is known only once the host compares its rows: read it first.
  if (r.num_pending == 1 && (r.verifying || MayDraft(r))) return 0;
  const int32_t outputs = r.total() - r.stop.num_prompt_tokens;
  if (outputs >= r.stop.max_output_tokens) return 0;  // its last is sampled
  return r.total() - r.num_computed + static_cast<int32_t>(r.drafts.size());
}

void Engine::PlanStep() {
  views_.clear();
  active_.clear();
  // The calls' KV is counted only when requests compete for it (the
  // planner then preempts requests, never calls, for room).
  const bool with_requests = !running_.empty() || !waiting_.empty();
  for (const std::unique_ptr<Entry>& e : pending_) {
    if (e->final_status.has_value()) continue;
    if (e->forward != nullptr) {
      if (with_requests) {
        for (size_t s = 0; s < e->ids.size(); ++s) {
          const SequenceKv* kv = runner_.kv_cache().Find(e->ids[s]);
          e->kv[s] =
              kv == nullptr
                  ? SequenceKvState{}
                  : SequenceKvState{kv->num_tokens,
                                    static_cast<int32_t>(kv->blocks.size())};
        }
        e->view.kv = e->kv;
      } else {
        e->view.kv = {};
      }
    }
    views_.push_back(&e->view);
    active_.push_back(e.get());
  }
  running_views_.resize(running_.size());
  running_ptrs_.resize(running_.size());
  for (size_t i = 0; i < running_.size(); ++i) {
    Request& r = *running_[i];
    ProposeDrafts(r);
    const SequenceKv* kv = runner_.kv_cache().Find(r.kv_id);
    running_views_[i] = {
        WantedTokens(r), r.num_computed,
        kv == nullptr ? 0 : static_cast<int32_t>(kv->blocks.size()), true,
        static_cast<int32_t>(r.drafts.size())};
    running_ptrs_[i] = &running_views_[i];
  }
  waiting_views_.resize(waiting_.size());
  waiting_ptrs_.resize(waiting_.size());
  const KvCacheManager& kv = runner_.kv_cache();
  for (size_t i = 0; i < waiting_.size(); ++i) {
    Request& r = *waiting_[i];
    waiting_views_[i] = {WantedTokens(r), 0, 0, r.num_pending == 0};
    if (const SequenceKv* held = kv.Find(r.kv_id)) {
      // A decode leg that waits for a seat holding its imported KV.
      waiting_views_[i].num_computed = r.num_computed;
      waiting_views_[i].num_blocks = static_cast<int32_t>(held->blocks.size());
      waiting_ptrs_[i] = &waiting_views_[i];
      continue;
    }
    // Its cached prefix: computed tokens it will start with, and the held
    // blocks among them (hits on free cached blocks take free blocks, as
    // new ones would). Only the queue's head can be admitted this step.
    if (kv.prefix_caching() == PrefixCaching::kOn &&
        i < static_cast<size_t>(runner_.options().max_num_seqs) &&
        waiting_views_[i].wanted_tokens > 0 && r.num_pending == 0) {
      kv.hasher().HashFullBlocks(r.tokens, &r.block_hashes);
      const PrefixHit hit = kv.Lookup(r.block_hashes, r.total());
      const int32_t cached = hit.num_blocks * kv.block_size();
      r.waiting_cached_tokens = cached;
      waiting_views_[i].wanted_tokens -= cached;
      waiting_views_[i].num_computed = cached;
      waiting_views_[i].num_blocks = hit.num_held_blocks;
    }
    waiting_ptrs_[i] = &waiting_views_[i];
  }
  PlanInput input;
  input.calls = views_;
  input.running = running_ptrs_;
  // Requests that arrived after a waiting KV import are not admitted before
  // it (as no request is admitted while a call waits for room).
  input.waiting =
      absl::MakeConstSpan(waiting_ptrs_).first(AdmissibleBeforeReservations());
  input.reserved_seats = static_cast<int32_t>(import_seats_.size());
  input.free_kv_blocks = runner_.kv_cache().Stats().free_blocks;
  planner_.Plan(input, &plan_);
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
        status = UnknownSequenceError(expired_idle_seconds_,
                                      options_.sequence_idle_timeout, id,
                                      "; nothing was released");
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
    ++progress_;
  }
}

}  // namespace pdworker
