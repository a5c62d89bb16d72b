// Speculative decoding of engine-owned requests (issue 42): the proposer
// drafts on the host before a step, the step verifies the drafts after the
// request's last token (one sample per row, ModelRunner's num_samples), and
// the request keeps the drafts up to the first one the target's own sample
// disagrees with, plus that sample.
//
// Why this is exact: row i is the target's sample at the position of draft
// i + 1, drawn with the request's options and the position as RNG counter,
// from logits that see exactly the tokens a one-token step there would.
// While the drafts agree, the rows are the tokens one-token steps would
// have sampled; the first disagreeing row is that step's sample too. So
// greedy outputs are bit-identical to speculation off, and seeded sampling
// draws the same tokens. For a deterministic proposer (n-gram: q is one
// draft token with probability 1) this is rejection sampling exactly:
// accept with probability p(draft) and, on rejection, draw from p without
// the draft, renormalized (the residual max(0, p - q)).
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "worker/engine/draft_acceptance.h"
#include "worker/engine/engine.h"
#include "worker/engine/engine_work.h"
#include "worker/engine/ngram_proposer.h"

namespace pdworker {
namespace {

// Drafting pauses while a request's recent acceptance is below this: a
// verify step costs about 1 + k tokens' compute on the CPU backend (nearly
// nothing more than one token on a GPU, where decode reads weights), so
// drafts that mostly fail make a CPU worker slower.
constexpr float kMinDraftAcceptance = 0.5f;
// Decodes without drafting after drafts that failed, at most: a request
// whose text stops repeating checks again at most every 64 tokens.
constexpr int32_t kMaxDraftPause = 64;

void PauseDrafting(int32_t* pause, int32_t* next) {
  *pause = *next;
  *next = std::min(2 * *next, kMaxDraftPause);
}

}  // namespace

bool Engine::MayDraft(const Request& r) const {
  const SpeculativeConfig& spec = options_.speculative;
  if (!spec.enabled() || r.state != Request::State::kRunning ||
      r.draft_pause > 0) {
    return false;
  }
  // Bans (min_tokens) change with the output count inside a verify step.
  const int32_t outputs = r.total() - r.stop.num_prompt_tokens;
  if (outputs < r.stop.conditions.min_tokens) return false;
  // Room for one draft and the target's next token.
  if (outputs + 2 > r.stop.max_output_tokens) return false;
  return spec.disable_by_batch_size == 0 ||
         static_cast<int>(running_.size()) < spec.disable_by_batch_size;
}

bool Engine::WaitsForDraftSamples() const {
  if (!options_.speculative.enabled() || in_flight_.empty()) return false;
  for (const std::shared_ptr<Request>& r : running_) {
    if (r->num_pending == 1 && (r->verifying || MayDraft(*r))) return true;
  }
  return false;
}

void Engine::ProposeDrafts(Request& r) {
  r.drafts.clear();
  if (r.num_pending != 0 || r.total() - r.num_computed != 1 || !MayDraft(r)) {
    return;
  }
  const SpeculativeConfig& spec = options_.speculative;
  const int32_t outputs = r.total() - r.stop.num_prompt_tokens;
  // The drafts, the target's next token and the KV of the step (the last
  // token and every draft) must fit the request's limits.
  const int32_t k = std::min({spec.num_speculative_tokens,
                              runner_.options().uniform_decode_query_len - 1,
                              r.stop.max_output_tokens - outputs - 1,
                              max_model_len_ - r.total()});
  if (k <= 0) return;
  NgramParams params;
  params.prompt_lookup_min = spec.prompt_lookup_min;
  params.prompt_lookup_max = spec.prompt_lookup_max;
  params.num_speculative_tokens = k;
  params.max_model_len = max_model_len_;
  r.drafts = ProposeNgramDraft(r.tokens, params);
  if (r.drafts.empty()) {
    // Nothing to verify: the request decodes one token at a time (with
    // host/device overlap) for a while before it looks again.
    PauseDrafting(&r.draft_pause, &r.next_draft_pause);
  }
}

int32_t Engine::AcceptDrafts(Request& r, const Piece& p,
                             const SequenceResult& out) {
  const int32_t m = static_cast<int32_t>(p.drafts.size());
  CHECK_EQ(static_cast<int32_t>(out.prior_token_ids.size()), m)
      << r.call->spec.request_id;
  r.verifying = false;
  // Draft i is compared with row i (prior_token_ids); the row after the
  // last draft (token_id) is emitted whatever happens.
  const int32_t accepted = AcceptedDrafts(p.drafts, out.prior_token_ids);
  ++spec_drafts_;
  spec_draft_tokens_ += m;
  spec_accepted_tokens_ += accepted;
  if (metrics_ != nullptr) metrics_->ObserveSpeculation(m, accepted);
  r.draft_acceptance =
      0.5f * r.draft_acceptance + 0.5f * static_cast<float>(accepted) / m;
  if (r.draft_acceptance < kMinDraftAcceptance) {
    PauseDrafting(&r.draft_pause, &r.next_draft_pause);
  } else {
    r.next_draft_pause = 1;
  }
  // The step wrote KV for the last token and every draft; keep the
  // accepted drafts' (a preempted request has none left to trim). The
  // request is in no later step in flight: it waited for this sample.
  if (r.state == Request::State::kRunning) {
    const absl::Status truncated =
        runner_.Truncate(r.kv_id, r.num_computed + accepted);
    if (absl::IsResourceExhausted(truncated)) {
      // The cut falls in a block a newer sequence shares (a prompt that
      // holds these drafts hit the prefix cache) and no block is free for
      // this one's copy: recompute it later, as the planner would.
      Preempt(p.request);
      return accepted;
    }
    if (!truncated.ok()) {
      LOG(ERROR) << "rolling back rejected drafts failed: " << truncated;
      FinishRequest(r, std::nullopt,
                    absl::InternalError(absl::StrCat(
                        "rolling back rejected draft tokens failed: ",
                        truncated.message())));
      return 0;
    }
    r.num_computed += accepted;
  }
  return accepted;
}

}  // namespace pdworker
