#include "worker/runtime/capture_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "worker/runtime/stream.h"

namespace pdworker {

void CaptureRegistry::Add(Stream* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  capturing_.push_back(stream);
}

void CaptureRegistry::Remove(Stream* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  capturing_.erase(std::remove(capturing_.begin(), capturing_.end(), stream),
                   capturing_.end());
}

bool CaptureRegistry::AnyCapturing() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !capturing_.empty();
}

absl::Status CaptureRegistry::RefuseDuringCapture(absl::string_view operation) {
  std::lock_guard<std::mutex> lock(mu_);
  if (capturing_.empty()) return absl::OkStatus();
  for (Stream* stream : capturing_) stream->InvalidateCapture(operation);
  return absl::FailedPreconditionError(absl::StrCat(
      operation,
      " is not allowed while a stream of this device is capturing a graph "
      "(CUDA forbids allocation and resource creation during stream capture; "
      "allocate everything at startup). The capture is now invalid."));
}

}  // namespace pdworker
