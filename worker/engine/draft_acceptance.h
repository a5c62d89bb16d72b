// Which draft tokens a verify step accepts (speculative decoding, issue 42).
#ifndef PDWORKER_WORKER_ENGINE_DRAFT_ACCEPTANCE_H_
#define PDWORKER_WORKER_ENGINE_DRAFT_ACCEPTANCE_H_

#include <cstdint>

#include "absl/types/span.h"

namespace pdworker {

// The number of `drafts` accepted: the longest prefix whose every token
// equals the target's own sample at its position. `samples` are the verify
// step's rows: samples[i] was drawn after the token before drafts[i] (the
// last known token for i = 0), at that position's RNG counter, from the
// request's sampling options; at least drafts.size() of them (the row
// after the last draft is never compared). The request then emits rows
// 0 .. accepted (the accepted drafts, and the target's token where the
// first rejected draft stood, or after the last).
//
// For a deterministic proposer (the draft distribution q is one token with
// probability 1, as n-gram lookup) this is rejection sampling exactly:
// draft d is accepted with probability p(d) = min(1, p(d) / q(d)), and a
// rejection emits a draw from p conditioned on not d, which is the
// normalized residual max(0, p - q). So every emitted token has the
// target's distribution, and with the same seeds the same tokens as one
// token per step.
inline int32_t AcceptedDrafts(absl::Span<const int32_t> drafts,
                              absl::Span<const int32_t> samples) {
  int32_t accepted = 0;
  while (static_cast<size_t>(accepted) < drafts.size() &&
         static_cast<size_t>(accepted) < samples.size() &&
         samples[accepted] == drafts[accepted]) {
    ++accepted;
  }
  return accepted;
}

}  // namespace pdworker

#endif  // PDWORKER_WORKER_ENGINE_DRAFT_ACCEPTANCE_H_
