#include "dispatcher/role_defaults.h"

#include <algorithm>
#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "dispatcher/capture_sizes.h"

namespace pdworker {
namespace {

constexpr Role kAllRoles[] = {Role::kPrefill, Role::kDecode, Role::kBoth};

absl::Status CheckPositive(int value, absl::string_view flag) {
  if (value >= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be >= 1, got ", value));
}

// The role's default schedule as a function of its largest token count, and
// that largest count when nothing overrides it.
struct RoleSchedule {
  ScheduleUpTo schedule;
  int default_max = 0;
  std::string description;
};

RoleSchedule ScheduleForRole(Role role, const SchedulerLimits& limits) {
  const int q = limits.uniform_decode_query_len;
  switch (role) {
    case Role::kPrefill:
      return {SglangPiecewiseTokenSizes, limits.max_num_batched_tokens,
              "SGLang piecewise token schedule"};
    case Role::kDecode: {
      const SglangDecodeSchedule kind = q > 1
                                            ? SglangDecodeSchedule::kSpeculative
                                            : SglangDecodeSchedule::kNormal;
      auto schedule = [q, kind](int max_tokens) {
        std::vector<int> sizes = SglangDecodeBatchSizes(max_tokens / q, kind);
        for (int& size : sizes) size *= q;
        return sizes;
      };
      const int64_t max_tokens = static_cast<int64_t>(limits.max_num_seqs) * q;
      return {
          schedule,
          static_cast<int>(
              std::min<int64_t>(max_tokens, std::numeric_limits<int>::max())),
          absl::StrCat(
              "SGLang ",
              kind == SglangDecodeSchedule::kSpeculative ? "speculative " : "",
              "decode batch sizes x query_len ", q)};
    }
    case Role::kBoth:
      return {VllmCaptureSizesUpTo,
              VllmDefaultMaxCaptureSize(limits.max_num_seqs, q,
                                        limits.max_num_batched_tokens),
              "vLLM default capture sizes"};
  }
  return {};
}

}  // namespace

absl::string_view RoleName(Role role) {
  switch (role) {
    case Role::kPrefill:
      return "prefill";
    case Role::kDecode:
      return "decode";
    case Role::kBoth:
      return "both";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& os, Role role) {
  return os << RoleName(role);
}

absl::StatusOr<Role> ParseRole(absl::string_view name) {
  const std::string lower =
      absl::AsciiStrToLower(absl::StripAsciiWhitespace(name));
  for (Role role : kAllRoles) {
    if (RoleName(role) == lower) return role;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--role must be one of prefill, decode, both; got '", name, "'"));
}

CudaGraphMode DefaultModeForRole(Role role) {
  switch (role) {
    case Role::kPrefill:
      return CudaGraphMode::Piecewise();
    case Role::kDecode:
      return CudaGraphMode::FullDecodeOnly();
    case Role::kBoth:
      return CudaGraphMode::FullAndPiecewise();
  }
  return CudaGraphMode::None();
}

absl::StatusOr<GraphPlan> PlanGraphs(Role role, const CompilationConfig& config,
                                     const SchedulerLimits& limits) {
  for (auto [value, flag] :
       {std::pair<int, absl::string_view>{limits.max_num_seqs, "max_num_seqs"},
        {limits.max_num_batched_tokens, "max_num_batched_tokens"},
        {limits.uniform_decode_query_len, "uniform_decode_query_len"}}) {
    absl::Status status = CheckPositive(value, flag);
    if (!status.ok()) return status;
  }

  GraphPlan plan;
  plan.mode = config.cudagraph_mode.value_or(DefaultModeForRole(role));
  plan.mode_from_config = config.cudagraph_mode.has_value();
  if (plan.mode == CudaGraphMode::None() &&
      !config.cudagraph_capture_sizes.has_value()) {
    plan.capture_sizes_source = "none (cudagraph_mode NONE)";
    return plan;
  }

  RoleSchedule role_schedule = ScheduleForRole(role, limits);
  CaptureSizeRequest request{config.cudagraph_capture_sizes,
                             config.max_cudagraph_capture_size};
  absl::StatusOr<std::vector<int>> sizes = ResolveCaptureSizes(
      request, role_schedule.schedule, role_schedule.default_max,
      limits.max_num_batched_tokens);
  if (!sizes.ok()) return sizes.status();
  plan.capture_sizes = *std::move(sizes);
  if (config.cudagraph_capture_sizes.has_value()) {
    plan.capture_sizes_source = "compilation_config.cudagraph_capture_sizes";
  } else {
    plan.capture_sizes_source = absl::StrCat(
        role_schedule.description, " up to ", plan.capture_sizes.back(),
        config.max_cudagraph_capture_size.has_value()
            ? " (max_cudagraph_capture_size)"
            : "");
  }
  return plan;
}

}  // namespace pdworker
