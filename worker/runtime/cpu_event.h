// CpuEvent: a host timestamp taken when the CPU stream reaches it, and a
// point the host can wait for.
#ifndef PDWORKER_WORKER_RUNTIME_CPU_EVENT_H_
#define PDWORKER_WORKER_RUNTIME_CPU_EVENT_H_

#include <memory>

#include "worker/runtime/cpu_work_queue.h"
#include "worker/runtime/event.h"

namespace pdworker {

// Recording enqueues a marker task on the stream; the marker completes the
// event, with the time and the stream's status (OK or its fault), when the
// stream reaches it: at RecordEvent with kInline, later on the worker thread
// with kThreaded. So ElapsedMillisecondsSince measures stream time, as on
// CUDA. The completion state is shared with pending markers, so an event may
// be destroyed before its stream reaches it.
class CpuEvent final : public Event {
 public:
  CpuEvent();

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  absl::StatusOr<double> ElapsedMillisecondsSince(
      const Event& start) const override;
  absl::Status Synchronize() override;
  absl::StatusOr<bool> Query() override;

  // For CpuStream::RecordEvent, on the recording thread: moves the event to a
  // new point and returns the marker the stream runs when it gets there.
  CpuWorkQueue::Task Record();

 private:
  class State;

  std::shared_ptr<State> state_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_CPU_EVENT_H_
