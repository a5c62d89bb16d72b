// The engine's entry points for other threads: submitting calls and
// requests (validated here, so that bad input changes nothing), exclusive
// runner tasks, drain, pause, resume, stop, and the snapshot.
#include <chrono>
#include <future>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/token_ids.h"
#include "worker/engine/engine.h"
#include "worker/engine/engine_work.h"
#include "worker/kernels/logprobs.h"

namespace pdworker {
namespace {

constexpr size_t kMaxRequestIdBytes = 256;

}  // namespace

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
    PDW_RETURN_IF_ERROR(CheckTokenIds(
        "imported first_token_id",
        absl::MakeConstSpan(&spec.imported->first_token_id, 1), vocab_size_));
  }
  const int32_t max_logprobs =
      std::min<int32_t>(kernels::kMaxTopLogprobs, vocab_size_);
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
  // An imported prompt's KV and running seat belong to the refused request:
  // free them on the engine thread (when the engine has stopped, nothing
  // needs them).
  if (request->spec.imported.has_value()) {
    Post([this, id = request->spec.imported->kv_sequence_id](ModelRunner& r) {
      import_seats_.erase(id);
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    draining_ = true;
  }
  // Imports waiting for room end at once (ServeKvReservations).
  work_cv_.notify_one();
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
  const LoadTracker::Reading rates =
      load_tracker_.Read(std::chrono::steady_clock::now());
  s.prefix_cache_hit_rate = rates.cache_hit_rate;
  s.generation_tokens_per_second = rates.gen_throughput;
  std::lock_guard<std::mutex> lock(mu_);
  s.queued_calls = queued_;
  return s;
}

}  // namespace pdworker
