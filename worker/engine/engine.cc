#include "worker/engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"

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
  // Prompt, then the outputs the host has read back.
  std::vector<int32_t> tokens;
  // Tokens whose KV is computed or being computed by a step in flight.
  int32_t num_computed = 0;
  // Prefix caching: the hashes of `tokens`' full blocks (extended as
  // outputs arrive), and the prompt tokens its first start found cached.
  std::vector<BlockHash> block_hashes;
  int32_t num_cached_tokens = 0;
  // Outputs sampled by steps in flight, not in `tokens` yet (at most one
  // when a step is planned), and where the latest of them is sampled.
  int32_t num_pending = 0;
  SampleRef pending_from;
  // Outputs not yet streamed.
  std::vector<int32_t> new_tokens;
  std::vector<float> new_logprobs;
  std::vector<TokenLogprobs> new_token_logprobs;
  RequestTimeline times;  // for its latency metrics

  int32_t total() const {
    return static_cast<int32_t>(tokens.size()) + num_pending;
  }
  int32_t num_outputs() const {
    return static_cast<int32_t>(tokens.size()) - stop.num_prompt_tokens;
  }
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
};

// A step on the device.
struct Engine::InFlightStep {
  int slot = -1;
  std::vector<Piece> pieces;  // row order
  int num_calls = 0;
  int num_requests = 0;
};

namespace {

constexpr size_t kMaxRequestIdBytes = 256;

absl::Status CheckTokenIds(absl::string_view field,
                           absl::Span<const int32_t> ids, int32_t vocab_size) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "]=", ids[i],
                       " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

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
          !in_flight_.empty()) {
        break;
      }
      const bool has_steps =
          !pending_.empty() || !running_.empty() || !waiting_.empty();
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
      // The imported KV is this request's to free.
      if (imported.has_value() &&
          runner_.kv_cache().Find(imported->kv_sequence_id) != nullptr) {
        runner_.Release(imported->kv_sequence_id).IgnoreError();
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
    r->call = std::move(call);
    ++progress_;
    if (!imported.has_value()) {
      r->kv_id = absl::StrCat(std::string(1, kEngineSequencePrefix), "request#",
                              next_request_number_++);
      waiting_.push_back(r);
      requests_.emplace(r->call->spec.request_id, std::move(r));
      continue;
    }
    // A decode leg: the prompt's KV is here already; it runs at once and
    // its first output is the token the prefill worker sampled.
    const ImportedPrompt& prompt = *r->call->spec.imported;
    r->kv_id = prompt.kv_sequence_id;
    r->num_computed = r->stop.num_prompt_tokens;
    r->state = Request::State::kRunning;
    r->times.scheduled = std::chrono::steady_clock::now();
    running_.push_back(r);
    {
      std::lock_guard<std::mutex> lock(mu_);
      --requests_waiting_;
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
    // Its cached prefix: computed tokens it will start with, and the held
    // blocks among them (hits on free cached blocks take free blocks, as
    // new ones would). Only the queue's head can be admitted this step.
    if (kv.prefix_caching() == PrefixCaching::kOn &&
        i < static_cast<size_t>(runner_.options().max_num_seqs) &&
        waiting_views_[i].wanted_tokens > 0 && r.num_pending == 0) {
      kv.hasher().HashFullBlocks(r.tokens, &r.block_hashes);
      const PrefixHit hit = kv.Lookup(r.block_hashes, r.total());
      const int32_t cached = hit.num_blocks * kv.block_size();
      waiting_views_[i].wanted_tokens -= cached;
      waiting_views_[i].num_computed = cached;
      waiting_views_[i].num_blocks = hit.num_held_blocks;
    }
    waiting_ptrs_[i] = &waiting_views_[i];
  }
  PlanInput input;
  input.calls = views_;
  input.running = running_ptrs_;
  input.waiting = waiting_ptrs_;
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
    r.tokens.push_back(out.token_id);
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

void Engine::Preempt(const std::shared_ptr<Request>& r) {
  // Recompute: its KV goes, its tokens stay; it waits in front of the
  // queue and later prefills its prompt and outputs again.
  const absl::Status released = runner_.Release(r->kv_id);
  CHECK(released.ok() || r->num_computed == 0) << released;
  r->num_computed = 0;
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
  RequestUpdate update;
  update.new_token_ids = r.new_tokens;
  update.new_logprobs = r.new_logprobs;
  update.new_token_logprobs = r.new_token_logprobs;
  update.num_prompt_tokens = r.stop.num_prompt_tokens;
  update.num_output_tokens = r.num_outputs();
  update.num_cached_tokens = r.num_cached_tokens;
  update.step = steps_;
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
  RequestUpdate update;
  update.new_token_ids = r.new_tokens;
  update.new_logprobs = r.new_logprobs;
  update.new_token_logprobs = r.new_token_logprobs;
  update.num_prompt_tokens = r.stop.num_prompt_tokens;
  update.num_output_tokens = r.num_outputs();
  update.num_cached_tokens = r.num_cached_tokens;
  update.step = steps_;
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    queued = queued_;
    waiting = requests_waiting_;
    if (metrics_ != nullptr) {
      for (const std::unique_ptr<EngineRequest>& r : incoming_requests_) {
        waiting_prompt_tokens += static_cast<int64_t>(r->spec.prompt.size());
      }
      for (const std::unique_ptr<Entry>& e : incoming_) {
        for (const int32_t left : e->remaining) waiting_prompt_tokens += left;
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(snapshot_mu_);
    snapshot_.kv = kv;
    snapshot_.steps = steps_;
    snapshot_.dropped_deadline = dropped_deadline_;
    snapshot_.dropped_cancelled = dropped_cancelled_;
    snapshot_.sequences_expired = sequences_expired_;
    snapshot_.running_requests = static_cast<int64_t>(running_.size());
    snapshot_.waiting_requests = waiting;
    snapshot_.preemptions = preemptions_;
    snapshot_.finished_requests = finished_requests_;
    snapshot_.device_busy_seconds = device_busy_seconds_;
    snapshot_.device_idle_seconds = device_idle_seconds_;
    snapshot_.device_error = device_error_;
    snapshot_.last_step_at = last_step_at_;
  }
  if (metrics_ == nullptr) return;
  EngineLoad load;
  load.running_requests = static_cast<int64_t>(running_.size());
  load.waiting_requests = waiting;
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
  e->kv.assign(n, SequenceKvState{});
  e->length_before.assign(n, -1);
  e->cached_tokens.assign(n, 0);
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

absl::Status Engine::ValidateRequest(const RequestSpec& spec) const {
  if (spec.request_id.empty() || spec.request_id.size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_id must be 1..", kMaxRequestIdBytes,
                     " bytes, got ", spec.request_id.size()));
  }
  const int64_t prompt = static_cast<int64_t>(spec.prompt.size());
  if (prompt == 0) {
    return absl::InvalidArgumentError("prompt has no tokens");
  }
  if (absl::Status s = CheckTokenIds("prompt", spec.prompt, vocab_size_);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ValidateSamplingOptions(spec.sampling); !s.ok()) {
    return s;
  }
  if (spec.imported.has_value()) {
    if (spec.handoff != KvHandoff::kNone) {
      return absl::InvalidArgumentError(
          "a request cannot both import its prompt's KV and hold it for "
          "another worker");
    }
    const int32_t first = spec.imported->first_token_id;
    if (first < 0 || first >= vocab_size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("the imported first token ", first,
                       " is outside the vocabulary [0, ", vocab_size_, ")"));
    }
  }
  const int32_t max_logprobs = std::min<int32_t>(20, vocab_size_);
  if (spec.logprobs < -1 || spec.logprobs > max_logprobs) {
    return absl::InvalidArgumentError(
        absl::StrCat("logprobs=", spec.logprobs, " must be in [-1, ",
                     max_logprobs, "] (-1: none)"));
  }
  const StopConditions& stop = spec.stop;
  if (absl::Status s =
          CheckTokenIds("stop_token_ids", stop.stop_token_ids, vocab_size_);
      !s.ok()) {
    return s;
  }
  if (stop.max_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tokens=", stop.max_tokens, " must be >= 1 (0: unset)"));
  }
  if (stop.min_tokens < 0 ||
      (stop.max_tokens > 0 && stop.min_tokens > stop.max_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_tokens=", stop.min_tokens,
                     " must be in [0, max_tokens=", stop.max_tokens, "]"));
  }
  if (stop.min_tokens > 0) {
    const size_t bans =
        stop.stop_token_ids.size() +
        (stop.eos == EosHandling::kStop ? eos_token_ids_.size() : 0);
    if (bans > 64) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stop_token_ids: with min_tokens, at most 64 stop and EOS ids can "
          "be masked; got ",
          bans));
    }
  }
  // The longest the request can get. The runner sized the KV cache for at
  // least one max_model_len sequence, so this also guarantees it can run.
  const int64_t outputs = stop.max_tokens > 0 ? stop.max_tokens : 1;
  if (prompt + outputs > max_model_len_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the prompt (", prompt, " tokens) plus ",
        stop.max_tokens > 0 ? "max_tokens (" : "one output token (", outputs,
        ") exceeds the model's maximum length of ", max_model_len_,
        " tokens (--max_model_len)"));
  }
  return absl::OkStatus();
}

void Engine::Submit(std::unique_ptr<EngineRequest> request) {
  if (request->arrival == std::chrono::steady_clock::time_point{}) {
    request->arrival = std::chrono::steady_clock::now();
  }
  absl::Status refused = ValidateRequest(request->spec);
  if (refused.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      refused = absl::UnavailableError(
          "the worker is shutting down and takes no more requests");
    } else if (draining_) {
      refused = absl::UnavailableError(
          "the worker is draining (shutting down) and takes no new "
          "requests; its live requests run to completion");
    } else if (requests_waiting_ >= options_.max_waiting_requests) {
      refused = absl::ResourceExhaustedError(
          absl::StrCat("request queue full: ", requests_waiting_,
                       " requests wait for room (--max_waiting_requests=",
                       options_.max_waiting_requests, ")"));
    } else {
      incoming_requests_.push_back(std::move(request));
      ++requests_waiting_;
    }
  }
  if (refused.ok()) {
    work_cv_.notify_one();
    return;
  }
  // An imported prompt's KV belongs to the refused request: free it on the
  // engine thread (when the engine has stopped, nothing needs it).
  if (request->spec.imported.has_value()) {
    Post([id = request->spec.imported->kv_sequence_id](ModelRunner& r) {
      if (r.kv_cache().Find(id) != nullptr) r.Release(id).IgnoreError();
    }).IgnoreError();
  }
  RequestUpdate update;
  update.num_prompt_tokens = static_cast<int32_t>(request->spec.prompt.size());
  update.status = refused;
  request->on_update(update);
}

void Engine::Submit(std::unique_ptr<AbortCall> call) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      incoming_aborts_.push_back(std::move(call));
    }
  }
  if (call == nullptr) {
    work_cv_.notify_one();
    return;
  }
  call->done(absl::UnavailableError("the worker stopped"));
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
      const absl::Status status = task(runner_);
      // Before the caller wakes: it answers its client next (a failed
      // import's ImportKv), and a GetStatus right after must show what the
      // task changed, not wait for the batch's other tasks.
      PublishSnapshot();
      promise->set_value(status);
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
