#include "dispatcher/attention_cg_support.h"

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"

namespace pdworker {
namespace {

constexpr AttentionCGSupport kAllSupports[] = {
    AttentionCGSupport::kNever, AttentionCGSupport::kUniformSingleTokenDecode,
    AttentionCGSupport::kUniformBatch, AttentionCGSupport::kAlways};

}  // namespace

absl::string_view AttentionCGSupportName(AttentionCGSupport support) {
  switch (support) {
    case AttentionCGSupport::kNever:
      return "NEVER";
    case AttentionCGSupport::kUniformSingleTokenDecode:
      return "UNIFORM_SINGLE_TOKEN_DECODE";
    case AttentionCGSupport::kUniformBatch:
      return "UNIFORM_BATCH";
    case AttentionCGSupport::kAlways:
      return "ALWAYS";
  }
  return "UNKNOWN";
}

std::ostream& operator<<(std::ostream& os, AttentionCGSupport support) {
  return os << AttentionCGSupportName(support);
}

absl::StatusOr<AttentionCGSupport> ParseAttentionCGSupport(
    absl::string_view name) {
  const std::string upper =
      absl::AsciiStrToUpper(absl::StripAsciiWhitespace(name));
  std::vector<absl::string_view> valid;
  for (AttentionCGSupport support : kAllSupports) {
    if (AttentionCGSupportName(support) == upper) return support;
    valid.push_back(AttentionCGSupportName(support));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown attention CUDA graph support '", name,
                   "'; valid names: ", absl::StrJoin(valid, ", ")));
}

ResolvedMode ResolveMode(CudaGraphMode configured,
                         AttentionCGSupport min_support,
                         PiecewiseCompilation piecewise,
                         int uniform_decode_query_len) {
  const bool has_piecewise = piecewise == PiecewiseCompilation::kAvailable;
  CudaGraphMode mode = configured;
  std::vector<std::string> reasons;
  auto downgrade = [&](CudaGraphMode to, absl::string_view why) {
    reasons.push_back(
        absl::StrCat(mode.ToString(), " ", why, "; using ", to.ToString()));
    mode = to;
  };

  // Rule 0: PIECEWISE graphs need the forward split at attention.
  if (mode.requires_piecewise() && !has_piecewise) {
    downgrade(CudaGraphMode::None(),
              "needs piecewise compilation, which is unavailable");
  }

  // Rule 1: full graphs for mixed batches need ALWAYS. NEVER is left to
  // rule 2, which drops full graphs altogether.
  if (mode.mixed_mode() == RuntimeMode::kFull &&
      min_support != AttentionCGSupport::kAlways &&
      min_support != AttentionCGSupport::kNever) {
    downgrade(has_piecewise ? CudaGraphMode::FullAndPiecewise()
                            : CudaGraphMode::FullDecodeOnly(),
              absl::StrCat("needs ALWAYS attention support for mixed "
                           "batches, but the minimum is ",
                           AttentionCGSupportName(min_support)));
  }

  // Rule 2: no full graphs at all under NEVER.
  if (mode.decode_mode() == RuntimeMode::kFull &&
      min_support == AttentionCGSupport::kNever) {
    downgrade(
        has_piecewise ? CudaGraphMode::Piecewise() : CudaGraphMode::None(),
        "needs full-graph attention support, but the minimum is NEVER");
  }

  // Rule 3: spec-decode verification batches have query_len > 1, which a
  // single-token-decode backend cannot capture.
  if (mode.decode_mode() == RuntimeMode::kFull &&
      uniform_decode_query_len > 1 &&
      min_support < AttentionCGSupport::kUniformBatch) {
    downgrade(
        has_piecewise ? CudaGraphMode::Piecewise() : CudaGraphMode::None(),
        absl::StrCat("with uniform_decode_query_len ", uniform_decode_query_len,
                     " needs UNIFORM_BATCH attention support, but the "
                     "minimum is ",
                     AttentionCGSupportName(min_support)));
  }

  // Invariants the rules above establish (vLLM re-checks the first one and
  // raises; here it would be a bug in this function).
  CHECK(!(mode.has_full_cudagraphs() &&
          min_support == AttentionCGSupport::kNever))
      << mode;
  CHECK(!(mode.requires_piecewise() && !has_piecewise)) << mode;

  return ResolvedMode{mode, absl::StrJoin(reasons, "; ")};
}

}  // namespace pdworker
