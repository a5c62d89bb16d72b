// CpuStream: runs ops on the calling thread, or records them while capturing.
#ifndef PDWORKER_WORKER_RUNTIME_CPU_STREAM_H_
#define PDWORKER_WORKER_RUNTIME_CPU_STREAM_H_

#include <memory>
#include <vector>

#include "worker/runtime/cpu_graph.h"
#include "worker/runtime/stream.h"

namespace pdworker {

// Eager: every op runs inside Launch, so the stream is always "synchronized".
// Capturing: every op is appended to a list with its closure (and thus its
// arguments) frozen; EndCapture turns the list into a CpuGraph.
class CpuStream final : public Stream {
 public:
  explicit CpuStream(Device& device) : Stream(device) {}
  ~CpuStream() override { AbandonCapture(); }

 protected:
  absl::Status DoLaunch(absl::string_view name, Op op) override;
  absl::Status DoCopyToDevice(DeviceBuffer dst, const void* src,
                              size_t size_bytes) override;
  absl::Status DoCopyToHost(void* dst, DeviceBuffer src,
                            size_t size_bytes) override;
  absl::Status DoCopyOnDevice(DeviceBuffer dst, DeviceBuffer src,
                              size_t size_bytes) override;
  absl::Status DoSynchronize() override { return absl::OkStatus(); }
  absl::Status DoRecordEvent(Event& event) override;
  absl::Status DoBeginCapture() override;
  absl::StatusOr<std::unique_ptr<CapturedGraph>> DoEndCapture(
      CaptureEnd end) override;

 private:
  std::vector<RecordedOp> recording_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_CPU_STREAM_H_
