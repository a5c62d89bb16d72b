#include "worker/engine/step_planner.h"

#include <algorithm>

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

void StepPlanner::Plan(absl::Span<const PendingCall* const> queue,
                       StepPlan* plan) {
  plan->releases.clear();
  plan->forwards.clear();
  plan->pieces.clear();
  plan->num_tokens = 0;
  claimed_.clear();
  int seqs_left = budget_.max_num_seqs;
  int tokens_left = budget_.max_num_batched_tokens;

  for (int i = 0; i < static_cast<int>(queue.size()); ++i) {
    const PendingCall& call = *queue[i];
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
    if (call.chunking == Chunking::kWhole) {
      int seqs = 0, tokens = 0;
      for (const int32_t r : call.remaining_tokens) {
        seqs += r > 0 ? 1 : 0;
        tokens += r;
      }
      if (seqs > seqs_left || tokens > tokens_left) continue;  // deferred
      for (int s = 0; s < static_cast<int>(call.remaining_tokens.size()); ++s) {
        if (call.remaining_tokens[s] > 0) {
          plan->pieces.push_back({i, s, call.remaining_tokens[s]});
        }
      }
      seqs_left -= seqs;
      tokens_left -= tokens;
    } else {
      for (int s = 0; s < static_cast<int>(call.remaining_tokens.size()) &&
                      seqs_left > 0 && tokens_left > 0;
           ++s) {
        const int32_t take = std::min(call.remaining_tokens[s], tokens_left);
        if (take <= 0) continue;
        plan->pieces.push_back({i, s, take});
        --seqs_left;
        tokens_left -= take;
      }
    }
    if (plan->pieces.size() > first_piece) plan->forwards.push_back(i);
  }
  plan->num_tokens = budget_.max_num_batched_tokens - tokens_left;
}

}  // namespace pdworker
