// Stop conditions of engine-owned requests, evaluated in the worker as vLLM
// does: min_tokens first (EOS and stop ids are masked out of the logits
// until then), then EOS, then stop token ids, then length.
#ifndef PDWORKER_WORKER_ENGINE_STOP_CONDITIONS_H_
#define PDWORKER_WORKER_ENGINE_STOP_CONDITIONS_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace pdworker {

// Whether the model's end-of-sequence ids end a request.
enum class EosHandling {
  kStop,    // default
  kIgnore,  // ignore_eos: generate through EOS (benchmarks)
};

struct StopConditions {
  // Output tokens at most; 0: until the request's length limit.
  int32_t max_tokens = 0;
  // EOS and stop_token_ids cannot end the request before this many output
  // tokens: they are masked out of the logits until then (a sampler change,
  // as vLLM does it, not only a later check).
  int32_t min_tokens = 0;
  std::vector<int32_t> stop_token_ids;
  EosHandling eos = EosHandling::kStop;
};

enum class FinishReason {
  kStop,    // an EOS id or a stop token id was sampled
  kLength,  // max_tokens, or the length limit
  kAbort,   // aborted (Abort, cancellation, deadline, shutdown)
};
// "stop", "length", "abort" (vLLM's finish_reason strings).
absl::string_view FinishReasonName(FinishReason reason);

// A request's stop conditions resolved against the model at admission.
struct StopRule {
  StopConditions conditions;
  std::vector<int32_t> eos_token_ids;  // the model's; empty with kIgnore
  int32_t num_prompt_tokens = 0;
  // Output tokens at most: max_tokens, or what the length limit leaves
  // after the prompt.
  int32_t max_output_tokens = 0;
};

struct StopDecision {
  std::optional<FinishReason> reason;  // nullopt: keep going
  // A stop_token_ids entry that ended the request (vLLM's stop_reason);
  // nullopt for EOS.
  std::optional<int32_t> matched_token_id;
};

// After `token` became output token number `num_output_tokens` (1-based).
StopDecision CheckStop(const StopRule& rule, int32_t token,
                       int32_t num_output_tokens);

// The ids the sampler must not pick for output token number
// `num_output_tokens + 1`: EOS (unless ignored) and stop ids while fewer
// than min_tokens outputs exist; empty otherwise. Appends to `out`.
void AppendBannedTokens(const StopRule& rule, int32_t num_output_tokens,
                        std::vector<int32_t>* out);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_ENGINE_STOP_CONDITIONS_H_
