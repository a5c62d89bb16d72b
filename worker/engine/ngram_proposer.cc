#include "worker/engine/ngram_proposer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace pdworker {

absl::Status ValidateNgramParams(const NgramParams& p) {
  if (p.prompt_lookup_min < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("speculative_config.prompt_lookup_min must be at least "
                     "1, got ",
                     p.prompt_lookup_min));
  }
  if (p.prompt_lookup_max < p.prompt_lookup_min) {
    return absl::InvalidArgumentError(absl::StrCat(
        "speculative_config.prompt_lookup_max (", p.prompt_lookup_max,
        ") must be at least prompt_lookup_min (", p.prompt_lookup_min, ")"));
  }
  if (p.num_speculative_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("speculative_config.num_speculative_tokens must be at "
                     "least 1, got ",
                     p.num_speculative_tokens));
  }
  if (p.max_model_len < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_model_len must be at least 1, got ", p.max_model_len));
  }
  return absl::OkStatus();
}

std::vector<int32_t> ProposeNgramDraft(absl::Span<const int32_t> tokens,
                                       const NgramParams& params) {
  const int64_t total = static_cast<int64_t>(tokens.size());
  const int64_t room = int64_t{params.max_model_len} - total;
  const int64_t k = std::min<int64_t>(params.num_speculative_tokens, room);
  if (k <= 0) return {};
  // An occurrence must end before the last token: search [0, total - 1).
  const auto searched_end = tokens.end() - (total > 0 ? 1 : 0);
  for (int64_t n = std::min<int64_t>(params.prompt_lookup_max, total - 1);
       n >= params.prompt_lookup_min; --n) {
    const auto suffix = tokens.end() - n;
    const auto match =
        std::search(tokens.begin(), searched_end, suffix, tokens.end());
    if (match == searched_end) continue;
    const auto draft = match + n;  // never past the last token
    const int64_t available = tokens.end() - draft;
    return std::vector<int32_t>(draft, draft + std::min(k, available));
  }
  return {};
}

}  // namespace pdworker
