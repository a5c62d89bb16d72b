// CpuEvent: a host timestamp taken when the CPU stream reaches it.
#ifndef PDWORKER_WORKER_RUNTIME_CPU_EVENT_H_
#define PDWORKER_WORKER_RUNTIME_CPU_EVENT_H_

#include <chrono>
#include <optional>

#include "worker/runtime/event.h"

namespace pdworker {

// CPU work runs synchronously on the launching thread, so the time at which
// the event is recorded is the time all earlier work finished.
class CpuEvent final : public Event {
 public:
  CpuEvent() = default;

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  absl::StatusOr<double> ElapsedMillisecondsSince(
      const Event& start) const override;

  void RecordNow() { recorded_at_ = std::chrono::steady_clock::now(); }

 private:
  std::optional<std::chrono::steady_clock::time_point> recorded_at_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_CPU_EVENT_H_
