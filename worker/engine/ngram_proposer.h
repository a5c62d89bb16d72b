// N-gram prompt lookup, vLLM's "ngram" speculative method (issue 42): the
// draft tokens are what followed an earlier occurrence of the sequence's
// last n tokens. No model, no device work: the engine proposes on the host
// from the tokens it already holds.
#ifndef PDWORKER_WORKER_ENGINE_NGRAM_PROPOSER_H_
#define PDWORKER_WORKER_ENGINE_NGRAM_PROPOSER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace pdworker {

// vLLM's speculative_config fields of the method.
struct NgramParams {
  int prompt_lookup_min = 1;       // shortest n-gram matched
  int prompt_lookup_max = 1;       // longest n-gram matched
  int num_speculative_tokens = 1;  // k: draft tokens at most
  int max_model_len = 0;           // no draft past it
};

// INVALID_ARGUMENT naming the field: 1 <= prompt_lookup_min <=
// prompt_lookup_max, num_speculative_tokens >= 1, max_model_len >= 1.
absl::Status ValidateNgramParams(const NgramParams& params);

// The draft for a sequence of `tokens` (prompt and output so far): the
// longest n in [prompt_lookup_min, prompt_lookup_max] whose last-n tokens
// occur earlier in `tokens` (an occurrence ending before the last token;
// occurrences may overlap the suffix), at the earliest such occurrence, and
// then the up to k tokens that followed it there, fewer where `tokens` ends
// first or max_model_len would be passed. Empty when no n-gram matches.
// vLLM's choice of n and occurrence, so both engines draft the same tokens.
// O(len(tokens) * prompt_lookup_max) per call.
std::vector<int32_t> ProposeNgramDraft(absl::Span<const int32_t> tokens,
                                       const NgramParams& params);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_ENGINE_NGRAM_PROPOSER_H_
