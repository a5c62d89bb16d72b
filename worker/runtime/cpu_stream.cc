#include "worker/runtime/cpu_stream.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/runtime/cpu_event.h"

namespace pdworker {

CpuStream::CpuStream(Device& device, CpuStreamExecution execution)
    : Stream(device), queue_(execution) {}

absl::Status CpuStream::InjectFault(const absl::Status& fault) {
  if (fault.ok()) {
    return absl::InvalidArgumentError("InjectFault: the fault must not be OK");
  }
  if (IsCapturing()) {
    return absl::FailedPreconditionError(
        "InjectFault: not while the stream is capturing a graph");
  }
  queue_.EnqueueFault(absl::Status(
      fault.code(), absl::StrCat("device fault: ", fault.message())));
  return absl::OkStatus();
}

absl::Status CpuStream::FailEnqueue(int calls_to_pass,
                                    const absl::Status& error) {
  if (error.ok() || calls_to_pass < 0) {
    return absl::InvalidArgumentError(
        "FailEnqueue: needs a non-OK error and a count >= 0");
  }
  fail_countdown_ = calls_to_pass;
  fail_error_ = error;
  return absl::OkStatus();
}

absl::Status CpuStream::TakeEnqueueFailure() {
  if (fail_countdown_ < 0 || IsCapturing()) return absl::OkStatus();
  if (fail_countdown_-- > 0) return absl::OkStatus();
  return fail_error_;
}

absl::Status CpuStream::EnqueueReplay(
    std::shared_ptr<const std::vector<RecordedOp>> ops) {
  absl::Status failure = TakeEnqueueFailure();
  if (!failure.ok()) return failure;
  queue_.EnqueueWork([ops = std::move(ops)] {
    const OpContext context;  // CPU ops need no native handles.
    for (const RecordedOp& recorded : *ops) recorded.op(context);
  });
  return absl::OkStatus();
}

absl::Status CpuStream::DoLaunch(absl::string_view name, Op op) {
  absl::Status failure = TakeEnqueueFailure();
  if (!failure.ok()) return failure;
  if (IsCapturing()) {
    recording_.push_back(RecordedOp{std::string(name), std::move(op)});
  } else {
    queue_.EnqueueWork([op = std::move(op)] { op(OpContext{}); });
  }
  return absl::OkStatus();
}

absl::Status CpuStream::DoCopyToDevice(DeviceBuffer dst, const void* src,
                                       size_t size_bytes) {
  absl::Status failure = TakeEnqueueFailure();
  if (!failure.ok()) return failure;
  void* to = dst.data();
  if (queue_.execution() == CpuStreamExecution::kInline) {
    queue_.EnqueueWork(
        [to, src, size_bytes] { std::memcpy(to, src, size_bytes); });
    return absl::OkStatus();
  }
  // The caller may reuse `src` once we return (CUDA's contract for pageable
  // memory): stage the bytes now, copy them in stream order.
  const auto* from = static_cast<const unsigned char*>(src);
  queue_.EnqueueWork(
      [to, staged = std::vector<unsigned char>(from, from + size_bytes)] {
        std::memcpy(to, staged.data(), staged.size());
      });
  return absl::OkStatus();
}

absl::Status CpuStream::DoCopyToDeviceAsync(DeviceBuffer dst, const void* src,
                                            size_t size_bytes) {
  absl::Status failure = TakeEnqueueFailure();
  if (!failure.ok()) return failure;
  // Not staged: with the threaded queue the bytes are read when the copy
  // runs, as a DMA from pinned memory would, so a caller that rewrites
  // `src` too early sees the same corruption on this backend.
  void* to = dst.data();
  queue_.EnqueueWork(
      [to, src, size_bytes] { std::memcpy(to, src, size_bytes); });
  return absl::OkStatus();
}

absl::Status CpuStream::DoCopyToHost(void* dst, DeviceBuffer src,
                                     size_t size_bytes) {
  absl::Status enqueued = DoCopyToHostAsync(dst, src, size_bytes);
  if (!enqueued.ok()) return enqueued;
  return queue_.Drain();
}

absl::Status CpuStream::DoCopyToHostAsync(void* dst, DeviceBuffer src,
                                          size_t size_bytes) {
  absl::Status failure = TakeEnqueueFailure();
  if (!failure.ok()) return failure;
  const void* from = src.data();
  queue_.EnqueueWork(
      [dst, from, size_bytes] { std::memcpy(dst, from, size_bytes); });
  return absl::OkStatus();
}

absl::Status CpuStream::DoCopyOnDevice(DeviceBuffer dst, DeviceBuffer src,
                                       size_t size_bytes) {
  // Counted once, by the launch below.
  void* to = dst.data();
  const void* from = src.data();
  // memmove, so overlapping views at least do not corrupt memory.
  return DoLaunch("copy_on_device", [to, from, size_bytes](const OpContext&) {
    std::memmove(to, from, size_bytes);
  });
}

absl::Status CpuStream::DoRecordEvent(Event& event) {
  absl::Status failure = TakeEnqueueFailure();
  if (!failure.ok()) return failure;
  queue_.EnqueueTask(static_cast<CpuEvent&>(event).Record());
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
