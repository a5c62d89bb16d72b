// CaptureRegistry: the streams of a device, for refusals that name none.
#ifndef PDWORKER_WORKER_RUNTIME_CAPTURE_REGISTRY_H_
#define PDWORKER_WORKER_RUNTIME_CAPTURE_REGISTRY_H_

#include <mutex>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace pdworker {

class Stream;

// Device-wide operations (allocation, creating streams/events, arena
// allocation) do not name a stream, yet CUDA refuses them while a capture is
// in progress and invalidates that capture. The registry lets the device find
// its streams and do the same on every backend. Whether a stream captures is
// its own fact (Stream::IsCapturing); the registry only lists the streams
// (each adds itself when constructed and removes itself when destroyed).
class CaptureRegistry {
 public:
  CaptureRegistry() = default;
  CaptureRegistry(const CaptureRegistry&) = delete;
  CaptureRegistry& operator=(const CaptureRegistry&) = delete;

  void Add(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_);
  void Remove(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether any of the device's streams is capturing now.
  bool AnyCapturing() const ABSL_LOCKS_EXCLUDED(mu_);

  // OK when no stream is capturing. Otherwise invalidates every active
  // capture (its EndCapture will fail, naming `operation`) and returns
  // FAILED_PRECONDITION.
  absl::Status RefuseDuringCapture(absl::string_view operation)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable std::mutex mu_;
  std::vector<Stream*> streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_CAPTURE_REGISTRY_H_
