// Stream: an ordered queue of device work, and the graph-capture backend.
#ifndef PDWORKER_WORKER_RUNTIME_STREAM_H_
#define PDWORKER_WORKER_RUNTIME_STREAM_H_

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "dispatcher/graph_backend.h"
#include "worker/runtime/device.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/host_memory.h"

namespace pdworker {

class Event;

// Native handles an op enqueues its work with. On the CPU backend both are
// null: the op does its work itself, on the stream's thread (the calling
// thread, or the stream's worker thread with CpuStreamExecution::kThreaded).
struct OpContext {
  void* cuda_stream = nullptr;    // cudaStream_t
  void* cublas_handle = nullptr;  // cublasHandle_t bound to cuda_stream,
                                  // with a fixed workspace
};

// One op launch. Everything it uses (buffer pointers, sizes, scalars) must be
// captured *by value* in the closure: while a graph is being captured the
// closure's arguments are frozen into the graph, exactly like the arguments
// of a CUDA kernel launch. An eager op may also run after Launch returned, on
// another thread, so it must not read host state the caller changes next, nor
// call back into the stream.
using Op = std::function<void(const OpContext&)>;

// An in-order stream of device work; the worker has one. Also the
// GraphBackend that GraphWrapper captures with: between BeginCapture and
// EndCapture, work is recorded into a graph instead of being executed.
//
// Work is asynchronous on CUDA and on the threaded CPU stream: Launch,
// CopyToDevice(Async), CopyOnDevice, CopyToHostAsync, RecordEvent and replay
// enqueue and return; the work runs later, in enqueue order. The host sees
// its results only after Synchronize, CopyToHost, or Event::Synchronize of an
// event recorded after it. Errors of work that already ran asynchronously
// (a faulted device) surface at those waits.
//
// What CUDA forbids during stream capture is refused on every backend (so the
// CPU backend catches what would break on a GPU): Synchronize, CopyToHost,
// CopyToHostAsync, CopyToDevice(Async) from host memory, RecordEvent, replaying
// a graph, and the device-wide operations listed in Device. A refused operation
// returns FAILED_PRECONDITION and invalidates the capture: later launches fail
// and EndCapture returns an error naming the first offending operation.
//
// Used by one thread at a time (the worker's engine thread), except that
// InvalidateCapture may be called from any thread.
class Stream : public GraphBackend {
 public:
  ~Stream() override;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  Device& device() const { return device_; }
  DeviceKind kind() const { return device_.kind(); }

  // Enqueues `op` (eager: it runs after all earlier work, possibly after this
  // returns), or records it into the graph being captured. On CUDA `op`
  // enqueues kernels on the OpContext's stream either way and CUDA does the
  // recording; launch errors are reported here. `name` labels the op in
  // errors and recorded graphs.
  absl::Status Launch(absl::string_view name, Op op);

  // Copies `size_bytes` from host memory `src` into `dst`, in stream order.
  // `src` may be reused as soon as this returns (its bytes are staged). Refused
  // during capture: inputs are written into static buffers before capture or
  // replay, never inside one.
  absl::Status CopyToDevice(DeviceBuffer dst, const void* src,
                            size_t size_bytes);
  // Enqueues a copy of the first `size_bytes` of pinned host memory `src`
  // into `dst` and returns without staging: the device reads `src` when the
  // copy runs, so the host must not write `src` until an event recorded
  // after this call has completed. One DMA from page-locked memory, where
  // CopyToDevice from pageable memory costs a host-side staging copy per
  // call. Refused during capture, like CopyToDevice.
  absl::Status CopyToDeviceAsync(DeviceBuffer dst, const HostMemory& src,
                                 size_t size_bytes);
  // Copies `size_bytes` from `src` into host memory `dst` and waits for the
  // copy (and all earlier work) to finish. Refused during capture.
  absl::Status CopyToHost(void* dst, DeviceBuffer src, size_t size_bytes);
  // Enqueues a copy of `size_bytes` from `src` into host memory `dst` and
  // returns without waiting: the bytes are in `dst` once an event recorded
  // after this call has completed (Event::Synchronize or Query). Until then
  // the host must neither read nor free `dst`. On CUDA, `dst` must be pinned
  // (Device::AllocateHost) for the copy to be truly asynchronous; into
  // pageable memory cudaMemcpyAsync may block the host. Refused during
  // capture, like CopyToHost.
  absl::Status CopyToHostAsync(void* dst, DeviceBuffer src, size_t size_bytes);
  // Device-to-device copy; an ordinary op (capturable).
  absl::Status CopyOnDevice(DeviceBuffer dst, DeviceBuffer src,
                            size_t size_bytes);
  // Waits until all work on the stream has finished. Refused during capture.
  absl::Status Synchronize();
  // Marks the current point of the stream in `event`: it completes when all
  // work enqueued so far has finished. Refused during capture.
  absl::Status RecordEvent(Event& event);

  // GraphBackend.
  absl::Status BeginCapture() final;
  absl::StatusOr<std::unique_ptr<CapturedGraph>> EndCapture() final;

  // True between BeginCapture and EndCapture (also when invalidated).
  bool IsCapturing() const {
    return state_.load(std::memory_order_acquire) != CaptureState::kIdle;
  }
  // Marks the running capture invalid because of `operation`; no-op when not
  // capturing or already invalid (the first reason is kept).
  void InvalidateCapture(absl::string_view operation);

  // OK when not capturing. Otherwise invalidates the capture and returns
  // FAILED_PRECONDITION explaining why `operation` is not allowed during
  // capture: the stream's own waits and copies, and every op that reads a
  // host value when it is launched (a graph would bake the value in).
  absl::Status RefuseDuringCapture(absl::string_view operation,
                                   absl::string_view why);

  // For CapturedGraph implementations, before replaying on this stream:
  // refuses (and invalidates the capture) while this stream is capturing.
  absl::Status CheckReplayAllowed();

 protected:
  enum class CaptureEnd { kInstantiate, kDiscard };

  explicit Stream(Device& device);

  // For derived destructors: leaves capture mode without a graph, so the
  // derived class can release its native capture state.
  void AbandonCapture() noexcept;

  // Backend hooks. Arguments are validated by the public methods.
  virtual absl::Status DoLaunch(absl::string_view name, Op op) = 0;
  virtual absl::Status DoCopyToDevice(DeviceBuffer dst, const void* src,
                                      size_t size_bytes) = 0;
  // `src` is pinned and stays unchanged until the copy has run.
  virtual absl::Status DoCopyToDeviceAsync(DeviceBuffer dst, const void* src,
                                           size_t size_bytes) = 0;
  virtual absl::Status DoCopyToHost(void* dst, DeviceBuffer src,
                                    size_t size_bytes) = 0;
  virtual absl::Status DoCopyToHostAsync(void* dst, DeviceBuffer src,
                                         size_t size_bytes) = 0;
  virtual absl::Status DoCopyOnDevice(DeviceBuffer dst, DeviceBuffer src,
                                      size_t size_bytes) = 0;
  virtual absl::Status DoSynchronize() = 0;
  virtual absl::Status DoRecordEvent(Event& event) = 0;
  virtual absl::Status DoBeginCapture() = 0;
  // Always leaves native capture mode. With kDiscard returns nullptr.
  virtual absl::StatusOr<std::unique_ptr<CapturedGraph>> DoEndCapture(
      CaptureEnd end) = 0;

 private:
  enum class CaptureState { kIdle, kCapturing, kInvalidated };

  // CopyToDevice's and CopyToDeviceAsync's checks: refused during capture,
  // `dst` holds `size_bytes`, a non-null source when there is anything to
  // copy.
  absl::Status CheckHostToDevice(absl::string_view operation, DeviceBuffer dst,
                                 const void* src, size_t size_bytes);

  Device& device_;
  std::atomic<CaptureState> state_{CaptureState::kIdle};
  std::mutex reason_mu_;
  std::string invalid_reason_ ABSL_GUARDED_BY(reason_mu_);
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_STREAM_H_
