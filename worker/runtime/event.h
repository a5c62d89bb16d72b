// Event: a point in a stream's work, for timing.
#ifndef PDWORKER_WORKER_RUNTIME_EVENT_H_
#define PDWORKER_WORKER_RUNTIME_EVENT_H_

#include "absl/status/statusor.h"
#include "worker/runtime/device.h"

namespace pdworker {

// Created by Device::CreateEvent, recorded with Stream::RecordEvent.
class Event {
 public:
  virtual ~Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  virtual DeviceKind kind() const = 0;

  // Milliseconds of stream time between `start` and this event. Both must be
  // recorded, on the same backend; waits until this event has completed.
  virtual absl::StatusOr<double> ElapsedMillisecondsSince(
      const Event& start) const = 0;

 protected:
  Event() = default;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_EVENT_H_
