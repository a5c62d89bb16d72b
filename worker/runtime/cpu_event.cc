#include "worker/runtime/cpu_event.h"

namespace pdworker {

absl::StatusOr<double> CpuEvent::ElapsedMillisecondsSince(
    const Event& start) const {
  const auto* cpu_start = dynamic_cast<const CpuEvent*>(&start);
  if (cpu_start == nullptr) {
    return absl::InvalidArgumentError(
        "ElapsedMillisecondsSince: start is not a cpu event");
  }
  if (!recorded_at_.has_value() || !cpu_start->recorded_at_.has_value()) {
    return absl::FailedPreconditionError(
        "ElapsedMillisecondsSince: both events must be recorded");
  }
  return std::chrono::duration<double, std::milli>(*recorded_at_ -
                                                   *cpu_start->recorded_at_)
      .count();
}

}  // namespace pdworker
