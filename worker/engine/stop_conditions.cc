#include "worker/engine/stop_conditions.h"

#include <algorithm>

namespace pdworker {

absl::string_view FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAbort:
      return "abort";
  }
  return "unknown";
}

StopDecision CheckStop(const StopRule& rule, int32_t token,
                       int32_t num_output_tokens) {
  StopDecision d;
  const auto contains = [token](const std::vector<int32_t>& ids) {
    return std::find(ids.begin(), ids.end(), token) != ids.end();
  };
  if (num_output_tokens >= rule.conditions.min_tokens) {
    if (rule.conditions.eos == EosHandling::kStop &&
        contains(rule.eos_token_ids)) {
      // vLLM reports no stop_reason for EOS, only for stop_token_ids.
      d.reason = FinishReason::kStop;
      return d;
    }
    if (contains(rule.conditions.stop_token_ids)) {
      d.reason = FinishReason::kStop;
      d.matched_token_id = token;
      return d;
    }
  }
  if (num_output_tokens >= rule.max_output_tokens) {
    d.reason = FinishReason::kLength;
  }
  return d;
}

void AppendBannedTokens(const StopRule& rule, int32_t num_output_tokens,
                        std::vector<int32_t>* out) {
  if (num_output_tokens >= rule.conditions.min_tokens) return;
  if (rule.conditions.eos == EosHandling::kStop) {
    out->insert(out->end(), rule.eos_token_ids.begin(),
                rule.eos_token_ids.end());
  }
  out->insert(out->end(), rule.conditions.stop_token_ids.begin(),
              rule.conditions.stop_token_ids.end());
}

}  // namespace pdworker
