// --speculative_config in vLLM's JSON form (issue 42, item 1): which
// proposer drafts tokens for the engine's own requests, and how many per
// step. Only vLLM's "ngram" method runs today; the others are refused by
// name (UNIMPLEMENTED), every key we do not read by name (INVALID_ARGUMENT).
#ifndef PDWORKER_WORKER_ENGINE_SPECULATIVE_CONFIG_H_
#define PDWORKER_WORKER_ENGINE_SPECULATIVE_CONFIG_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pdworker {

enum class SpeculativeMethod { kNone, kNgram };

struct SpeculativeConfig {
  SpeculativeMethod method = SpeculativeMethod::kNone;
  // k: draft tokens per request and step; a verify step has 1 + k tokens
  // per request (ModelRunnerOptions::uniform_decode_query_len).
  int num_speculative_tokens = 0;
  // ngram: the n-gram lengths matched (vLLM's defaults: 5 and 5 when
  // neither is given, the other one's value when one is).
  int prompt_lookup_min = 0;
  int prompt_lookup_max = 0;
  // vLLM's disable_by_batch_size: no drafts in a step while this many
  // requests or more run (0: always draft).
  int disable_by_batch_size = 0;

  bool enabled() const { return method != SpeculativeMethod::kNone; }
};

// Parses vLLM's JSON object, e.g. {"method": "ngram",
// "num_speculative_tokens": 3, "prompt_lookup_max": 4}. An empty string is
// speculation off. `"model": "ngram"` (or "[ngram]") without a method is
// the ngram method, as in vLLM. Errors name the key:
// INVALID_ARGUMENT for bad JSON, a missing or non-positive
// num_speculative_tokens, bad lookup bounds or an unknown key;
// UNIMPLEMENTED for a method we do not run yet (draft_model, eagle, eagle3,
// medusa, mlp_speculator, mtp, ...) or a draft model path.
absl::StatusOr<SpeculativeConfig> ParseSpeculativeConfig(
    absl::string_view json);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_ENGINE_SPECULATIVE_CONFIG_H_
