#include "worker/engine/step_planner.h"

#include <algorithm>
#include <limits>

namespace pdworker {
namespace {

bool ConflictsWith(const absl::flat_hash_set<absl::string_view>& claimed,
                   const PendingCall& call) {
  for (const absl::string_view id : call.sequence_ids) {
    if (claimed.contains(id)) return true;
  }
  return false;
}

}  // namespace

void StepPlanner::Plan(absl::Span<const PendingCall* const> calls,
                       StepPlan* plan) {
  PlanInput input;
  input.calls = calls;
  input.free_kv_blocks = std::numeric_limits<int32_t>::max();
  Plan(input, plan);
}

void StepPlanner::Plan(const PlanInput& in, StepPlan* plan) {
  plan->releases.clear();
  plan->forwards.clear();
  plan->preempted.clear();
  plan->admitted.clear();
  plan->pieces.clear();
  plan->num_tokens = 0;
  plan->call_deferred = false;
  seats_left_ = budget_.max_num_seqs;
  tokens_left_ = budget_.max_num_batched_tokens;
  blocks_left_ = in.free_kv_blocks;
  const int num_running = static_cast<int>(in.running.size());
  gone_.assign(num_running, false);
  scheduled_.assign(num_running, false);
  reserved_.assign(num_running, 0);
  tail_ = num_running;

  // 1. Decodes first: set their seats and tokens aside (a decode that
  // verifies drafts takes as many of them as the tokens left allow).
  for (int r = 0; r < num_running; ++r) {
    const PendingRequest& req = *in.running[r];
    if (req.wanted_tokens - req.num_draft_tokens != 1) continue;
    if (seats_left_ == 0 || tokens_left_ == 0) break;
    reserved_[r] = std::min(req.wanted_tokens, tokens_left_);
    --seats_left_;
    tokens_left_ -= reserved_[r];
  }

  // 2. Step-level calls with what is left.
  PlanCalls(in, plan);

  // 3. KV: the calls' blocks first. When they overdraw the pool, preempt
  // requests, but only if that covers the deficit (otherwise the call fails
  // with RESOURCE_EXHAUSTED and preempting would be for nothing).
  if (blocks_left_ < 0) {
    int64_t held = 0;
    for (int r = 0; r < num_running; ++r) held += in.running[r]->num_blocks;
    if (blocks_left_ + held >= 0) {
      MakeRoom(in, 0, -1, plan);
    } else {
      // Some call cannot fit even so: it fails with RESOURCE_EXHAUSTED and
      // runs nothing, and the requests plan as if the calls took nothing
      // (the engine retries the calls one by one and requests whose room a
      // succeeding call took wait for the next step).
      blocks_left_ = in.free_kv_blocks;
    }
  }
  for (int r = 0; r < num_running; ++r) {
    if (reserved_[r] == 0 || gone_[r]) continue;
    // Drafts are optional: never preempt for their blocks.
    const PendingRequest& req = *in.running[r];
    int32_t take = reserved_[r];
    while (take > 1 &&
           BlocksFor(req.num_computed + take) - req.num_blocks > blocks_left_) {
      --take;
    }
    tokens_left_ += reserved_[r] - take;
    reserved_[r] = take;
    ScheduleRunning(in, r, take, plan);
  }
  for (int r = 0; r < num_running; ++r) {
    if (gone_[r] || scheduled_[r] || reserved_[r]) continue;
    const int32_t wanted = in.running[r]->wanted_tokens;
    if (wanted <= 0) continue;
    if (seats_left_ == 0 || tokens_left_ == 0) break;
    const int32_t take = std::min(wanted, tokens_left_);
    if (ScheduleRunning(in, r, take, plan)) {
      --seats_left_;
      tokens_left_ -= take;
    }
  }

  // 4. Admissions, in queue order, unless room was short this step.
  if (plan->preempted.empty() && !plan->call_deferred) {
    int running_after = in.reserved_seats;
    for (int r = 0; r < num_running; ++r) running_after += gone_[r] ? 0 : 1;
    for (int w = 0; w < static_cast<int>(in.waiting.size()); ++w) {
      const PendingRequest& req = *in.waiting[w];
      if (!req.admissible || req.wanted_tokens <= 0) break;
      if (seats_left_ == 0 || tokens_left_ == 0 ||
          running_after >= budget_.max_num_seqs) {
        break;
      }
      const int32_t take = std::min(req.wanted_tokens, tokens_left_);
      const int32_t need = BlocksFor(req.num_computed + take) - req.num_blocks;
      if (need > blocks_left_) break;
      blocks_left_ -= need;
      --seats_left_;
      tokens_left_ -= take;
      ++running_after;
      plan->admitted.push_back(w);
      plan->pieces.push_back({PieceSource::kAdmittedRequest, w, 0, take});
    }
  }
  plan->num_tokens = budget_.max_num_batched_tokens - tokens_left_;
}

void StepPlanner::PlanCalls(const PlanInput& in, StepPlan* plan) {
  claimed_.clear();
  bool forward_planned = false;
  for (int i = 0; i < static_cast<int>(in.calls.size()); ++i) {
    const PendingCall& call = *in.calls[i];
    const bool conflict = ConflictsWith(claimed_, call);
    // Claimed whether or not the call runs now: a younger call on the same
    // sequence must wait for this one.
    claimed_.insert(call.sequence_ids.begin(), call.sequence_ids.end());
    if (conflict) continue;

    if (call.kind == PendingKind::kRelease) {
      plan->releases.push_back(i);
      continue;
    }
    const size_t first_piece = plan->pieces.size();
    bool chunked = call.chunking == Chunking::kChunked;
    if (!chunked) {
      int seqs = 0, tokens = 0;
      for (const int32_t r : call.remaining_tokens) {
        seqs += r > 0 ? 1 : 0;
        tokens += r;
      }
      if (seqs <= seats_left_ && tokens <= tokens_left_) {
        for (int s = 0; s < static_cast<int>(call.remaining_tokens.size());
             ++s) {
          if (call.remaining_tokens[s] > 0) {
            plan->pieces.push_back(
                {PieceSource::kCall, i, s, call.remaining_tokens[s]});
          }
        }
        seats_left_ -= seqs;
        tokens_left_ -= tokens;
      } else if (!forward_planned && seats_left_ > 0 && tokens_left_ > 0) {
        // The oldest call, squeezed by the running requests' decodes: it
        // progresses in chunks rather than waiting for them to finish.
        chunked = true;
      } else {
        plan->call_deferred = true;
      }
    }
    if (chunked) {
      for (int s = 0; s < static_cast<int>(call.remaining_tokens.size()) &&
                      seats_left_ > 0 && tokens_left_ > 0;
           ++s) {
        const int32_t take = std::min(call.remaining_tokens[s], tokens_left_);
        if (take <= 0) continue;
        plan->pieces.push_back({PieceSource::kCall, i, s, take});
        --seats_left_;
        tokens_left_ -= take;
      }
    }
    if (plan->pieces.size() == first_piece) continue;
    plan->forwards.push_back(i);
    forward_planned = true;
    if (call.kv.empty()) continue;
    for (size_t k = first_piece; k < plan->pieces.size(); ++k) {
      const SequenceKvState& kv = call.kv[plan->pieces[k].sequence];
      const int32_t need =
          BlocksFor(kv.num_tokens + plan->pieces[k].num_tokens) - kv.num_blocks;
      blocks_left_ -= std::max(need, 0);
    }
  }
}

bool StepPlanner::ScheduleRunning(const PlanInput& in, int r,
                                  int32_t num_tokens, StepPlan* plan) {
  const PendingRequest& req = *in.running[r];
  const int32_t need =
      std::max(BlocksFor(req.num_computed + num_tokens) - req.num_blocks, 0);
  switch (MakeRoom(in, need, r, plan)) {
    case RoomResult::kFits:
      blocks_left_ -= need;
      reserved_[r] = 0;
      scheduled_[r] = true;
      plan->pieces.push_back({PieceSource::kRunningRequest, r, 0, num_tokens});
      return true;
    case RoomResult::kRequesterIsLast:
      // Preempting itself gives its blocks to the requests before it.
      Preempt(in, r, plan);
      return false;
    case RoomResult::kBlocked:
      // Waits for the next step with the blocks it holds.
      return false;
  }
  return false;
}

StepPlanner::RoomResult StepPlanner::MakeRoom(const PlanInput& in,
                                              int64_t blocks, int requester,
                                              StepPlan* plan) {
  while (blocks > blocks_left_) {
    while (tail_ > 0 && gone_[tail_ - 1]) --tail_;
    const int victim = tail_ - 1;
    if (victim < 0 || victim == requester) {
      return requester >= 0 ? RoomResult::kRequesterIsLast
                            : RoomResult::kBlocked;
    }
    if (scheduled_[victim]) return RoomResult::kBlocked;
    Preempt(in, victim, plan);
  }
  return RoomResult::kFits;
}

void StepPlanner::Preempt(const PlanInput& in, int r, StepPlan* plan) {
  gone_[r] = true;
  blocks_left_ += in.running[r]->num_blocks;
  if (reserved_[r] > 0) {
    ++seats_left_;
    tokens_left_ += reserved_[r];
    reserved_[r] = 0;
  }
  plan->preempted.push_back(r);
}

}  // namespace pdworker
