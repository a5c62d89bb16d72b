#include "dispatcher/capture_lifecycle.h"

namespace pdworker {

absl::string_view CaptureStageName(CaptureStage stage) {
  switch (stage) {
    case CaptureStage::kNotCaptured:
      return "not_captured";
    case CaptureStage::kCapturing:
      return "capturing";
    case CaptureStage::kReady:
      return "ready";
    case CaptureStage::kDisabled:
      return "disabled";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& os, CaptureStage stage) {
  return os << CaptureStageName(stage);
}

}  // namespace pdworker
