#include "worker/runtime/stream.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "worker/runtime/event.h"

namespace pdworker {
namespace {

absl::Status CheckCopyRange(absl::string_view operation, size_t size_bytes,
                            const DeviceBuffer& buffer,
                            absl::string_view role) {
  if (size_bytes > buffer.size_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s of %d bytes exceeds the %d-byte %s buffer",
                        operation, size_bytes, buffer.size_bytes(), role));
  }
  if (size_bytes > 0 && buffer.data() == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(operation, ": null ", role, " buffer"));
  }
  return absl::OkStatus();
}

}  // namespace

Stream::Stream(Device& device) : device_(device) {
  device_.capture_registry().Add(this);
}

Stream::~Stream() {
  AbandonCapture();
  device_.capture_registry().Remove(this);
}

void Stream::AbandonCapture() noexcept {
  if (!IsCapturing()) return;
  std::lock_guard<std::mutex> lock(reason_mu_);
  state_.store(CaptureState::kIdle, std::memory_order_release);
  invalid_reason_.clear();
}

void Stream::InvalidateCapture(absl::string_view operation) {
  std::lock_guard<std::mutex> lock(reason_mu_);
  if (state_.load(std::memory_order_acquire) != CaptureState::kCapturing) {
    return;
  }
  invalid_reason_ = std::string(operation);
  state_.store(CaptureState::kInvalidated, std::memory_order_release);
}

absl::Status Stream::RefuseDuringCapture(absl::string_view operation,
                                         absl::string_view why) {
  if (!IsCapturing()) return absl::OkStatus();
  InvalidateCapture(operation);
  return absl::FailedPreconditionError(absl::StrCat(
      operation, " is not allowed while the stream is capturing a graph (", why,
      "). The capture is now invalid."));
}

absl::Status Stream::Launch(absl::string_view name, Op op) {
  if (state_.load(std::memory_order_acquire) == CaptureState::kInvalidated) {
    std::lock_guard<std::mutex> lock(reason_mu_);
    return absl::FailedPreconditionError(
        absl::StrCat("cannot launch '", name,
                     "': the graph capture was "
                     "invalidated by ",
                     invalid_reason_));
  }
  if (op == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("op '", name, "' is empty"));
  }
  return DoLaunch(name, std::move(op));
}

absl::Status Stream::CheckHostToDevice(absl::string_view operation,
                                       DeviceBuffer dst, const void* src,
                                       size_t size_bytes) {
  absl::Status refused = RefuseDuringCapture(
      absl::StrCat("Stream::", operation),
      "a captured copy would freeze the host source pointer; write inputs "
      "into the static buffers before capture or replay");
  if (!refused.ok()) return refused;
  absl::Status range =
      CheckCopyRange(operation, size_bytes, dst, "destination");
  if (!range.ok()) return range;
  if (size_bytes > 0 && src == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(operation, ": null host source"));
  }
  return absl::OkStatus();
}

absl::Status Stream::CopyToDevice(DeviceBuffer dst, const void* src,
                                  size_t size_bytes) {
  absl::Status status = CheckHostToDevice("CopyToDevice", dst, src, size_bytes);
  if (!status.ok() || size_bytes == 0) return status;
  return DoCopyToDevice(dst, src, size_bytes);
}

absl::Status Stream::CopyToDeviceAsync(DeviceBuffer dst, const HostMemory& src,
                                       size_t size_bytes) {
  absl::Status status =
      CheckHostToDevice("CopyToDeviceAsync", dst, src.data(), size_bytes);
  if (!status.ok()) return status;
  if (size_bytes > src.size_bytes()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "CopyToDeviceAsync of %d bytes exceeds the %d-byte host source",
        size_bytes, src.size_bytes()));
  }
  if (size_bytes == 0) return absl::OkStatus();
  return DoCopyToDeviceAsync(dst, src.data(), size_bytes);
}

absl::Status Stream::CopyToHost(void* dst, DeviceBuffer src,
                                size_t size_bytes) {
  absl::Status refused = RefuseDuringCapture(
      "Stream::CopyToHost",
      "reading device memory on the host needs the work to have run, and "
      "captured work does not run until replay");
  if (!refused.ok()) return refused;
  absl::Status range = CheckCopyRange("CopyToHost", size_bytes, src, "source");
  if (!range.ok()) return range;
  if (size_bytes == 0) return absl::OkStatus();
  if (dst == nullptr) {
    return absl::InvalidArgumentError("CopyToHost: null host destination");
  }
  return DoCopyToHost(dst, src, size_bytes);
}

absl::Status Stream::CopyToHostAsync(void* dst, DeviceBuffer src,
                                     size_t size_bytes) {
  absl::Status refused = RefuseDuringCapture(
      "Stream::CopyToHostAsync",
      "reading device memory on the host needs the work to have run, and "
      "captured work does not run until replay; copy results out after the "
      "replay");
  if (!refused.ok()) return refused;
  absl::Status range =
      CheckCopyRange("CopyToHostAsync", size_bytes, src, "source");
  if (!range.ok()) return range;
  if (size_bytes == 0) return absl::OkStatus();
  if (dst == nullptr) {
    return absl::InvalidArgumentError("CopyToHostAsync: null host destination");
  }
  return DoCopyToHostAsync(dst, src, size_bytes);
}

absl::Status Stream::CopyOnDevice(DeviceBuffer dst, DeviceBuffer src,
                                  size_t size_bytes) {
  absl::Status range =
      CheckCopyRange("CopyOnDevice", size_bytes, dst, "destination");
  if (!range.ok()) return range;
  range = CheckCopyRange("CopyOnDevice", size_bytes, src, "source");
  if (!range.ok()) return range;
  if (size_bytes == 0) return absl::OkStatus();
  return DoCopyOnDevice(dst, src, size_bytes);
}

absl::Status Stream::Synchronize() {
  absl::Status refused = RefuseDuringCapture(
      "Stream::Synchronize",
      "captured work does not run until replay, so there is nothing to wait "
      "for; CUDA invalidates the capture");
  if (!refused.ok()) return refused;
  return DoSynchronize();
}

absl::Status Stream::RecordEvent(Event& event) {
  absl::Status refused = RefuseDuringCapture(
      "Stream::RecordEvent", "timing events cannot be read inside a graph");
  if (!refused.ok()) return refused;
  if (event.kind() != kind()) {
    return absl::InvalidArgumentError(
        absl::StrCat("RecordEvent: a ", DeviceKindName(event.kind()),
                     " event on a ", DeviceKindName(kind()), " stream"));
  }
  return DoRecordEvent(event);
}

absl::Status Stream::CheckReplayAllowed() {
  return RefuseDuringCapture(
      "CapturedGraph::Replay",
      "replaying a graph inside another capture is not supported; nested "
      "wrappers must not both be active for one runtime mode");
}

absl::Status Stream::BeginCapture() {
  if (IsCapturing()) {
    return absl::FailedPreconditionError(
        "BeginCapture: the stream is already capturing a graph (nested "
        "capture is not supported)");
  }
  absl::Status begun = DoBeginCapture();
  if (!begun.ok()) return begun;
  {
    std::lock_guard<std::mutex> lock(reason_mu_);
    invalid_reason_.clear();
    state_.store(CaptureState::kCapturing, std::memory_order_release);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CapturedGraph>> Stream::EndCapture() {
  if (!IsCapturing()) {
    return absl::FailedPreconditionError(
        "EndCapture: the stream is not capturing (no BeginCapture)");
  }
  std::string invalid_reason;
  bool invalid = false;
  {
    std::lock_guard<std::mutex> lock(reason_mu_);
    invalid =
        state_.load(std::memory_order_acquire) == CaptureState::kInvalidated;
    invalid_reason = std::move(invalid_reason_);
    invalid_reason_.clear();
    state_.store(CaptureState::kIdle, std::memory_order_release);
  }
  absl::StatusOr<std::unique_ptr<CapturedGraph>> graph =
      DoEndCapture(invalid ? CaptureEnd::kDiscard : CaptureEnd::kInstantiate);
  if (invalid) {
    return absl::FailedPreconditionError(
        absl::StrCat("graph capture was invalidated by ", invalid_reason,
                     " during capture; no graph was produced"));
  }
  return graph;
}

}  // namespace pdworker
