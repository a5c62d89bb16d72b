// The engine's steps: launching a plan on the runner (call by call when the
// merged step is refused), retiring steps in order, and applying each
// step's samples to its calls and requests.
#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "worker/engine/engine.h"
#include "worker/engine/engine_work.h"

namespace pdworker {

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
    dst.num_samples = 1;
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
        // The sampled tokens (num_samples) stay out of the hit.
        absl::StatusOr<int32_t> cached = runner_.StartSequence(
            src.sequence_id,
            absl::MakeConstSpan(src.token_ids)
                .first(src.token_ids.size() - (src.num_samples - 1)));
        if (cached.ok()) {
          e.length_before[s] = 0;
          e.remaining[s] -= *cached;
          e.cached_tokens[s] += *cached;
        }
      }
      num_tokens_[k] = std::min(p.num_tokens, e.remaining[s]);
      // The last chunk samples num_samples rows, so it must hold that many
      // tokens: an earlier chunk leaves them, or (when fewer remain than
      // that) takes them all, a few tokens over the plan; a step that no
      // longer fits is retried call by call, where it does.
      const int32_t left = e.remaining[s] - num_tokens_[k];
      if (left > 0 && left < src.num_samples) {
        num_tokens_[k] = e.remaining[s] > src.num_samples
                             ? e.remaining[s] - src.num_samples
                             : e.remaining[s];
      }
      if (num_tokens_[k] == e.remaining[s]) dst.num_samples = src.num_samples;
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
    dst.sequence_id = r.kv_id;
    dst.sampling = r.call->spec.sampling;
    dst.creation = SequenceCreation::kMustExist;
    // The engine's own request stays here (a prefill leg's KV moves to a
    // lease whole): blocks that left the window go back to the pool. Not
    // with speculation, whose rollback (Truncate) needs every block.
    dst.window_blocks = r.call->spec.handoff == KvHandoff::kNone &&
                                !options_.speculative.enabled()
                            ? WindowBlocks::kFree
                            : WindowBlocks::kKeep;
    if (!r.drafts.empty() && r.num_pending == 0 &&
        r.total() - r.num_computed == 1) {
      // A decode that verifies drafts: its last token, then as many of the
      // drafts as the plan gave it tokens for, a sample (and the raw
      // logprobs asked for) after each. (MayDraft: no bans left.)
      num_tokens_[k] = std::min<int32_t>(
          p.num_tokens, 1 + static_cast<int32_t>(r.drafts.size()));
      dst.token_ids.assign(1, r.tokens.back());
      dst.token_ids.insert(dst.token_ids.end(), r.drafts.begin(),
                           r.drafts.begin() + (num_tokens_[k] - 1));
      dst.num_samples = num_tokens_[k];
      dst.num_top_logprobs = r.call->spec.logprobs;
      continue;
    }
    // The plan counted on the prefix the cache held then; the piece never
    // runs past the request's tokens.
    num_tokens_[k] = std::min(p.num_tokens, r.total() - r.num_computed);
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
    if (batch_[k].num_samples > 1) {
      // The drafts' KV is tentative: AcceptDrafts keeps what is accepted.
      p.drafts.assign(batch_[k].token_ids.begin() + 1,
                      batch_[k].token_ids.end());
      r.num_computed -= static_cast<int32_t>(p.drafts.size());
      r.verifying = true;
    }
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
    // The tokens this step gives the request: its sample after its last
    // token, or, verifying drafts, the accepted drafts and then the
    // target's sample after the last of them (rows 0..accepted).
    int32_t accepted = 0;
    if (!p.drafts.empty()) {
      accepted = AcceptDrafts(r, p, out);
      if (r.state == Request::State::kDone) continue;  // rollback failed
    } else if (r.draft_pause > 0) {
      --r.draft_pause;
    }
    updated_.push_back(&r);
    for (int32_t i = 0; i <= accepted; ++i) {
      const bool last = i == static_cast<int32_t>(out.prior_token_ids.size());
      const int32_t token = last ? out.token_id : out.prior_token_ids[i];
      // Counted before FinishRequest answers: a client that reads GetLoads
      // after its last token sees it.
      load_tracker_.RecordGenerated(1, last_step_at_);
      r.tokens.push_back(token);
      // Its first token: it started here (a decode leg's first token came
      // with its KV and is not a start).
      if (r.num_outputs() == 1) {
        load_tracker_.RecordStart(r.stop.num_prompt_tokens,
                                  r.num_cached_tokens);
      }
      r.new_tokens.push_back(token);
      r.new_logprobs.push_back(last ? out.logprob : out.prior_logprobs[i]);
      if (r.call->spec.logprobs >= 0) {
        r.new_token_logprobs.push_back(
            last ? TokenLogprobs{out.raw_logprob, out.top_logprobs}
                 : TokenLogprobs{out.prior_raw_logprobs[i],
                                 out.prior_top_logprobs[i]});
      }
      // A stop inside an accepted run: the tokens after it are dropped.
      const StopDecision stop = CheckStop(r.stop, token, r.num_outputs());
      if (stop.reason.has_value()) {
        FinishRequest(r, stop.reason, absl::OkStatus(), stop.matched_token_id);
        break;
      }
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
