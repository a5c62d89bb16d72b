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
    if (!Paused()) {
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
  const int32_t outputs = r.total() - r.stop.num_prompt_tokens;
  if (outputs >= r.stop.max_output_tokens) return 0;  // its last is sampled
  return r.total() - r.num_computed;
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
    const Request& r = *running_[i];
    const SequenceKv* kv = runner_.kv_cache().Find(r.kv_id);
    running_views_[i] = {
        WantedTokens(r), r.num_computed,
        kv == nullptr ? 0 : static_cast<int32_t>(kv->blocks.size()), true};
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

bool Engine::LaunchStep() {
  if (plan_.pieces.empty() && plan_.preempted.empty()) return false;
  // Resolve the plan's indices before the queues change.
  std::vector<Piece> pieces;
  pieces.reserve(plan_.pieces.size());
  for (const StepPiece& p : plan_.pieces) {
    Piece piece;
    piece.num_tokens = p.num_tokens;
    switch (p.source) {
      case PieceSource::kCall:
        piece.call = active_[p.index];
        piece.sequence = p.sequence;
        break;
      case PieceSource::kRunningRequest:
        piece.request = running_[p.index];
        break;
      case PieceSource::kAdmittedRequest:
        piece.request = waiting_[p.index];
        break;
    }
    pieces.push_back(std::move(piece));
  }
  std::vector<std::shared_ptr<Request>> preempted;
  for (const int i : plan_.preempted) preempted.push_back(running_[i]);
  std::vector<std::shared_ptr<Request>> admitted;
  for (const int i : plan_.admitted) admitted.push_back(waiting_[i]);
  for (const std::shared_ptr<Request>& r : preempted) Preempt(r);
  if (!admitted.empty()) {
    const auto now = std::chrono::steady_clock::now();
    for (const std::shared_ptr<Request>& r : admitted) {
      waiting_.erase(std::find(waiting_.begin(), waiting_.end(), r));
      r->state = Request::State::kRunning;
      // A preempted request's queue time ended at its first admission.
      if (r->times.scheduled == std::chrono::steady_clock::time_point{}) {
        r->times.scheduled = now;
      }
      running_.push_back(r);
    }
    ++progress_;
    std::lock_guard<std::mutex> lock(mu_);
    requests_waiting_ -= static_cast<int64_t>(admitted.size());
  }
  if (pieces.empty()) return false;

  absl::Status error;
  if (LaunchPieces(pieces, &error)) return true;
  // A failed launch changed nothing, and one call's problem (an unknown
  // sequence, a KV demand only the merged step exceeds) must not fail the
  // others: launch each call's pieces alone, oldest first, then the
  // requests' together.
  VLOG(1) << "merged step failed; retrying its calls one by one: " << error;
  bool launched = false;
  std::vector<Piece> group;
  for (size_t k = 0; k < pieces.size();) {
    // A group: one call's pieces, or all the requests' (the plan puts the
    // calls first, then the requests).
    group.clear();
    size_t end = k;
    while (end < pieces.size() && pieces[end].call == pieces[k].call) {
      group.push_back(pieces[end++]);
    }
    k = end;
    if (runner_.steps_in_flight() >= ModelRunner::kMaxStepsInFlight) {
      RetireSteps(ModelRunner::kMaxStepsInFlight - 1);
    }
    // Retiring may have finished requests (a stop token): they run no more.
    group.erase(std::remove_if(group.begin(), group.end(),
                               [](const Piece& p) {
                                 return p.request != nullptr &&
                                        p.request->state ==
                                            Request::State::kDone;
                               }),
                group.end());
    if (group.empty()) continue;
    if (LaunchPieces(group, &error)) {
      launched = true;
      continue;
    }
    if (group[0].call != nullptr) {
      group[0].call->final_status = error;
      continue;
    }
    // A call that ran alone took blocks the plan gave the requests: they
    // wait for the next step, unchanged.
    if (absl::IsResourceExhausted(error)) continue;
    // The engine built these steps itself: a refusal is a bug, not the
    // requests' fault, but they cannot go on.
    LOG(ERROR) << "a step of engine-owned requests was refused: " << error;
    for (Piece& p : group) {
      FinishRequest(
          *p.request, std::nullopt,
          absl::InternalError(absl::StrCat(
              "the engine could not run the request: ", error.message())));
    }
  }
  return launched;
}

bool Engine::LaunchPieces(absl::Span<const Piece> pieces, absl::Status* error) {
  // The batch: each piece's slice of its sequence's tokens.
  batch_.resize(pieces.size());
  num_tokens_.resize(pieces.size());
  for (size_t k = 0; k < pieces.size(); ++k) {
    const Piece& p = pieces[k];
    SequenceStep& dst = batch_[k];
    dst.banned_token_ids.clear();
    dst.last_token_from.reset();
    // A router's sequence may be held for a handoff or rolled back at any
    // call: it keeps every block.
    dst.window_blocks = WindowBlocks::kKeep;
    if (p.call != nullptr) {
      // A sequence's first piece creates it as the request asked; later
      // chunks continue it.
      Entry& e = *p.call;
      const SequenceStep& src = e.forward->spec.sequences[p.sequence];
      const int s = p.sequence;
      if (e.length_before[s] < 0 && e.remaining[s] > p.num_tokens &&
          src.creation != SequenceCreation::kMustExist &&
          runner_.kv_cache().prefix_caching() == PrefixCaching::kOn &&
          runner_.kv_cache().Find(src.sequence_id) == nullptr) {
        // A prompt chunked over several steps: its cached prefix is looked
        // up over the whole prompt, not only the first chunk (whose cap
        // would stop it early). On error the step's own checks answer.
        absl::StatusOr<int32_t> cached =
            runner_.StartSequence(src.sequence_id, src.token_ids);
        if (cached.ok()) {
          e.length_before[s] = 0;
          e.remaining[s] -= *cached;
          e.cached_tokens[s] += *cached;
        }
      }
      num_tokens_[k] = std::min(p.num_tokens, e.remaining[s]);
      const size_t offset = src.token_ids.size() - e.remaining[s];
      dst.sequence_id = src.sequence_id;
      dst.token_ids.assign(src.token_ids.begin() + offset,
                           src.token_ids.begin() + offset + num_tokens_[k]);
      dst.sampling = src.sampling;
      dst.creation = e.length_before[p.sequence] < 0
                         ? src.creation
                         : SequenceCreation::kMustExist;
      dst.num_top_logprobs = -1;
      continue;
    }
    Request& r = *p.request;
    if (runner_.kv_cache().Find(r.kv_id) == nullptr) {
      // Its first piece: the sequence starts holding the request's cached
      // prefix (none without prefix caching), and the piece computes from
      // there. Checked at Submit: cannot fail.
      CHECK_EQ(r.num_computed, 0) << r.call->spec.request_id;
      absl::StatusOr<int32_t> cached = runner_.StartSequence(r.kv_id, r.tokens);
      CHECK(cached.ok()) << cached.status();
      r.num_computed = *cached;
      if (r.num_outputs() == 0) r.num_cached_tokens = *cached;
    }
    // The plan counted on the prefix the cache held then; the piece never
    // runs past the request's tokens.
    num_tokens_[k] = std::min(p.num_tokens, r.total() - r.num_computed);
    dst.sequence_id = r.kv_id;
    dst.sampling = r.call->spec.sampling;
    dst.creation = SequenceCreation::kMustExist;
    // The engine's own request stays here (a prefill leg's KV moves to a
    // lease whole): blocks that left the window go back to the pool.
    dst.window_blocks = r.call->spec.handoff == KvHandoff::kNone
                            ? WindowBlocks::kFree
                            : WindowBlocks::kKeep;
    const int32_t end = r.num_computed + num_tokens_[k];
    const int32_t known = std::min<int32_t>(end, r.tokens.size());
    dst.token_ids.assign(r.tokens.begin() + r.num_computed,
                         r.tokens.begin() + known);
    if (end > known) {
      // The last token is still being sampled by the step before: the
      // runner copies it on the device.
      CHECK_EQ(end - known, 1) << r.call->spec.request_id;
      CHECK_GT(r.num_pending, 0) << r.call->spec.request_id;
      dst.token_ids.push_back(0);
      dst.last_token_from = r.pending_from;
    }
    dst.num_top_logprobs = -1;
    if (end == r.total()) {
      AppendBannedTokens(r.stop, r.total() - r.stop.num_prompt_tokens,
                         &dst.banned_token_ids);
      dst.num_top_logprobs = r.call->spec.logprobs;
    }
  }
  absl::StatusOr<int> slot = runner_.Launch(batch_);
  if (!slot.ok()) {
    *error = slot.status();
    return false;
  }

  auto step = std::make_unique<InFlightStep>();
  step->slot = *slot;
  step->pieces.assign(pieces.begin(), pieces.end());
  for (size_t k = 0; k < step->pieces.size(); ++k) {
    step->pieces[k].num_tokens = num_tokens_[k];
  }
  for (size_t k = 0; k < step->pieces.size(); ++k) {
    Piece& p = step->pieces[k];
    if (p.call != nullptr) {
      Entry& e = *p.call;
      const bool first_piece_of_call =
          k == 0 || step->pieces[k - 1].call != p.call;
      if (first_piece_of_call) {
        ++e.steps_in_flight;
        ++step->num_calls;
      }
      // The id lives again (re-created): a later NOT_FOUND is not the
      // sweep's.
      if (!expired_idle_seconds_.empty()) {
        expired_idle_seconds_.erase(batch_[k].sequence_id);
      }
      if (e.length_before[p.sequence] < 0) {
        const SequenceKv* kv = runner_.kv_cache().Find(batch_[k].sequence_id);
        CHECK(kv != nullptr) << batch_[k].sequence_id;
        e.length_before[p.sequence] = kv->num_tokens - p.num_tokens;
      }
      e.remaining[p.sequence] -= p.num_tokens;
      // Only the sample after a sequence's last token is an answer;
      // earlier chunks' samples are discarded.
      p.samples = e.remaining[p.sequence] == 0;
      continue;
    }
    Request& r = *p.request;
    ++step->num_requests;
    r.num_computed += p.num_tokens;
    p.samples = r.num_computed == r.total();
    if (p.samples) {
      ++r.num_pending;
      r.pending_from = SampleRef{*slot, static_cast<int>(k)};
    }
  }
  in_flight_.push_back(std::move(step));
  ++progress_;
  return true;
}

void Engine::RetireSteps(int keep_in_flight) {
  while (static_cast<int>(in_flight_.size()) > keep_in_flight) {
    InFlightStep& step = *in_flight_.front();
    absl::StatusOr<StepResult> result = runner_.Retire(step.slot);
    if (!result.ok()) {
      FailStepsInFlight(result.status());
      return;
    }
    ApplyStep(step, *result);
    in_flight_.pop_front();
  }
}

void Engine::ApplyStep(InFlightStep& step, const StepResult& result) {
  ++steps_;
  ++progress_;
  last_step_at_ = std::chrono::steady_clock::now();
  StepInfo info = result.info;
  info.num_calls = step.num_calls;
  info.num_requests = step.num_requests;
  device_busy_seconds_ += info.device_seconds;
  device_idle_seconds_ += info.idle_before_seconds;
  if (metrics_ != nullptr) metrics_->ObserveStep(info);

  updated_.clear();
  for (size_t k = 0; k < step.pieces.size(); ++k) {
    const Piece& p = step.pieces[k];
    const SequenceResult& out = result.sequences[k];
    if (p.call != nullptr) {
      Entry& e = *p.call;
      e.cached_tokens[p.sequence] += out.cached_tokens;
      if (p.samples) {
        load_tracker_.RecordGenerated(1, last_step_at_);
        e.outcome.sequences[p.sequence] = out;
        e.outcome.sequences[p.sequence].cached_tokens =
            e.cached_tokens[p.sequence];
      }
      const bool last_piece_of_call =
          k + 1 == step.pieces.size() || step.pieces[k + 1].call != p.call;
      if (!last_piece_of_call) continue;
      --e.steps_in_flight;
      ++e.outcome.num_steps;
      e.outcome.last_step = info;
      if (!e.final_status.has_value() && e.steps_in_flight == 0 &&
          e.all_tokens_launched()) {
        e.final_status = absl::OkStatus();
      }
      continue;
    }
    Request& r = *p.request;
    if (!p.samples || r.state == Request::State::kDone) continue;
    // A preempted request's sample is still right: the step computed it
    // before the request's KV was freed.
    --r.num_pending;
    // Counted before FinishRequest answers: a client that reads GetLoads
    // after its last token sees it.
    load_tracker_.RecordGenerated(1, last_step_at_);
    r.tokens.push_back(out.token_id);
    // Its first token: it started here (a decode leg's first token came
    // with its KV and is not a start).
    if (r.num_outputs() == 1) {
      load_tracker_.RecordStart(r.stop.num_prompt_tokens, r.num_cached_tokens);
    }
    r.new_tokens.push_back(out.token_id);
    r.new_logprobs.push_back(out.logprob);
    if (r.call->spec.logprobs >= 0) {
      r.new_token_logprobs.push_back({out.raw_logprob, out.top_logprobs});
    }
    updated_.push_back(&r);
    const StopDecision stop = CheckStop(r.stop, out.token_id, r.num_outputs());
    if (stop.reason.has_value()) {
      FinishRequest(r, stop.reason, absl::OkStatus(), stop.matched_token_id);
    }
  }
  for (Request* r : updated_) {
    if (r->state != Request::State::kDone) SendUpdate(*r);
  }
}

void Engine::FailStepsInFlight(const absl::Status& error) {
  LOG(ERROR) << "device error; failing the " << in_flight_.size()
             << " steps in flight: " << error;
  if (device_error_.ok()) device_error_ = error;
  ++progress_;
  for (size_t i = 0; i < in_flight_.size(); ++i) {
    InFlightStep& step = *in_flight_[i];
    if (i > 0) runner_.Retire(step.slot).IgnoreError();  // fails too
    for (size_t k = 0; k < step.pieces.size(); ++k) {
      Piece& p = step.pieces[k];
      if (p.call != nullptr) {
        Entry& e = *p.call;
        if (k == 0 || step.pieces[k - 1].call != p.call) --e.steps_in_flight;
        if (!e.final_status.has_value()) e.final_status = error;
        continue;
      }
      FinishRequest(
          *p.request, std::nullopt,
          absl::Status(error.code(), absl::StrCat("a device error failed the "
                                                  "request's step: ",
                                                  error.message())));
    }
  }
  in_flight_.clear();
}

}  // namespace pdworker
