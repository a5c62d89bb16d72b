#include "worker/runtime/cpu_stream.h"

#include <cstring>
#include <utility>

#include "worker/runtime/cpu_event.h"

namespace pdworker {

absl::Status CpuStream::DoLaunch(absl::string_view name, Op op) {
  if (IsCapturing()) {
    recording_.push_back(RecordedOp{std::string(name), std::move(op)});
  } else {
    op(OpContext{});
  }
  return absl::OkStatus();
}

absl::Status CpuStream::DoCopyToDevice(DeviceBuffer dst, const void* src,
                                       size_t size_bytes) {
  std::memcpy(dst.data(), src, size_bytes);
  return absl::OkStatus();
}

absl::Status CpuStream::DoCopyToHost(void* dst, DeviceBuffer src,
                                     size_t size_bytes) {
  std::memcpy(dst, src.data(), size_bytes);
  return absl::OkStatus();
}

absl::Status CpuStream::DoCopyOnDevice(DeviceBuffer dst, DeviceBuffer src,
                                       size_t size_bytes) {
  void* to = dst.data();
  const void* from = src.data();
  // memmove, so overlapping views at least do not corrupt memory.
  return DoLaunch("copy_on_device", [to, from, size_bytes](const OpContext&) {
    std::memmove(to, from, size_bytes);
  });
}

absl::Status CpuStream::DoRecordEvent(Event& event) {
  static_cast<CpuEvent&>(event).RecordNow();
  return absl::OkStatus();
}

absl::Status CpuStream::DoBeginCapture() {
  recording_.clear();
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CapturedGraph>> CpuStream::DoEndCapture(
    CaptureEnd end) {
  std::vector<RecordedOp> ops = std::move(recording_);
  recording_.clear();
  if (end == CaptureEnd::kDiscard) return nullptr;
  return std::unique_ptr<CapturedGraph>(new CpuGraph(*this, std::move(ops)));
}

}  // namespace pdworker
