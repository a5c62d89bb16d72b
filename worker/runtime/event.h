// Event: a point in a stream's work, for timing and for host waits.
#ifndef PDWORKER_WORKER_RUNTIME_EVENT_H_
#define PDWORKER_WORKER_RUNTIME_EVENT_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/runtime/device.h"

namespace pdworker {

// Created by Device::CreateEvent, recorded with Stream::RecordEvent. The event
// completes when the stream has finished all work enqueued before the record
// (on CUDA and the threaded CPU stream that is later than RecordEvent
// returns). Recording it again moves it to the new point: waits then refer to
// the latest record. Used by one thread at a time.
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

  // Blocks until the work recorded before this event has finished, e.g. a
  // Stream::CopyToHostAsync whose bytes the host wants to read. Returns the
  // stream's error if that work failed (a faulted device: every later wait
  // fails too). FAILED_PRECONDITION when the event was never recorded.
  virtual absl::Status Synchronize() = 0;
  // Whether the event has completed, without blocking: false while the stream
  // has not reached it yet. Errors as Synchronize.
  virtual absl::StatusOr<bool> Query() = 0;

 protected:
  Event() = default;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_EVENT_H_
