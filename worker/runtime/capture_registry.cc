#include "worker/runtime/capture_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "worker/runtime/stream.h"

namespace pdworker {

void CaptureRegistry::Add(Stream* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.push_back(stream);
}

void CaptureRegistry::Remove(Stream* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.erase(std::remove(streams_.begin(), streams_.end(), stream),
                 streams_.end());
}

bool CaptureRegistry::AnyCapturing() const {
  std::lock_guard<std::mutex> lock(mu_);
  return std::any_of(streams_.begin(), streams_.end(),
                     [](const Stream* s) { return s->IsCapturing(); });
}

absl::Status CaptureRegistry::RefuseDuringCapture(absl::string_view operation) {
  std::lock_guard<std::mutex> lock(mu_);
  bool refused = false;
  for (Stream* stream : streams_) {
    if (!stream->IsCapturing()) continue;
    stream->InvalidateCapture(operation);
    refused = true;
  }
  if (!refused) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      operation,
      " is not allowed while a stream of this device is capturing a graph "
      "(CUDA forbids allocation and resource creation during stream capture; "
      "allocate everything at startup). The capture is now invalid."));
}

}  // namespace pdworker
