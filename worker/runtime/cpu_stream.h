// CpuStream: runs ops in order (inline or on its own thread), or records them
// while capturing.
#ifndef PDWORKER_WORKER_RUNTIME_CPU_STREAM_H_
#define PDWORKER_WORKER_RUNTIME_CPU_STREAM_H_

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "worker/runtime/cpu_graph.h"
#include "worker/runtime/cpu_work_queue.h"
#include "worker/runtime/stream.h"

namespace pdworker {

// Eager: every op, copy, event marker and graph replay goes through one
// CpuWorkQueue, in order. With CpuStreamExecution::kInline it runs inside the
// call, so the stream is always synchronized; with kThreaded it runs on the
// stream's worker thread, and the host waits with Synchronize, CopyToHost or
// an event, as on CUDA. Ops must not call back into the stream (with
// kThreaded that would deadlock, as a kernel cannot wait for its own stream).
// Capturing: every op is appended, on the calling thread, to a list with its
// closure (and thus its arguments) frozen; EndCapture turns the list into a
// CpuGraph. Destruction finishes queued work, then joins the worker thread.
class CpuStream final : public Stream {
 public:
  explicit CpuStream(Device& device, CpuStreamExecution execution =
                                         CpuStreamExecution::kInline);
  ~CpuStream() override { AbandonCapture(); }

  CpuStreamExecution execution() const { return queue_.execution(); }

  // Test hook for the engine's error path: a device fault, as a CUDA
  // illegal-address error. Enqueued like an op (applied now with kInline):
  // once the stream reaches it, every later op, copy and replay is skipped
  // (its outputs stay unchanged), and Synchronize, CopyToHost, and
  // Event::Synchronize/Query of events recorded after it return `fault`
  // with its message prefixed by "device fault: " (same code). Enqueueing
  // calls keep returning OK: the fault surfaces at the waits. There is no
  // way to clear it (a faulted CUDA context is dead too); the first fault
  // is kept. Only this stream faults, where CUDA would fault every stream of
  // the context. INVALID_ARGUMENT for an OK `fault`; FAILED_PRECONDITION
  // while capturing (nothing is recorded, the capture stays valid).
  absl::Status InjectFault(const absl::Status& fault);

  // Test hook for error paths that fail after work was queued: the eager
  // enqueueing call (launch, copy, event record or graph replay) that comes
  // `calls_to_pass` such calls from now returns `error` and enqueues
  // nothing; the calls before it, and after it, are unaffected. Unlike
  // InjectFault this fails the caller at once (as a CUDA launch error
  // would), with everything it queued before still queued. One armed
  // failure at a time (arming again replaces it); DisarmEnqueueFailure
  // drops it. Calls while capturing are not counted. INVALID_ARGUMENT for
  // an OK `error` or a negative count.
  absl::Status FailEnqueue(int calls_to_pass, const absl::Status& error);
  void DisarmEnqueueFailure() { fail_countdown_ = -1; }
  // Whether the armed failure has not fired yet.
  bool EnqueueFailureArmed() const { return fail_countdown_ >= 0; }

  // For CpuGraph::Replay: runs `ops` in stream order as one task.
  absl::Status EnqueueReplay(
      std::shared_ptr<const std::vector<RecordedOp>> ops);

 protected:
  absl::Status DoLaunch(absl::string_view name, Op op) override;
  absl::Status DoCopyToDevice(DeviceBuffer dst, const void* src,
                              size_t size_bytes) override;
  absl::Status DoCopyToDeviceAsync(DeviceBuffer dst, const void* src,
                                   size_t size_bytes) override;
  absl::Status DoCopyToHost(void* dst, DeviceBuffer src,
                            size_t size_bytes) override;
  absl::Status DoCopyToHostAsync(void* dst, DeviceBuffer src,
                                 size_t size_bytes) override;
  absl::Status DoCopyOnDevice(DeviceBuffer dst, DeviceBuffer src,
                              size_t size_bytes) override;
  absl::Status DoSynchronize() override { return queue_.Drain(); }
  absl::Status DoRecordEvent(Event& event) override;
  absl::Status DoBeginCapture() override;
  absl::StatusOr<std::unique_ptr<CapturedGraph>> DoEndCapture(
      CaptureEnd end) override;

 private:
  // FailEnqueue's countdown: called by every eager enqueueing call.
  absl::Status TakeEnqueueFailure();

  // Touched only by the thread using the stream (capture is host-side).
  std::vector<RecordedOp> recording_;
  int fail_countdown_ = -1;  // -1: nothing armed
  absl::Status fail_error_;
  // Last member: destroyed first, so queued work finishes while the rest of
  // the stream still exists.
  CpuWorkQueue queue_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_CPU_STREAM_H_
