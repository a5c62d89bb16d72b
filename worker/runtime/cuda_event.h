// CudaEvent: a timing cudaEvent_t.
#ifndef PDWORKER_WORKER_RUNTIME_CUDA_EVENT_H_
#define PDWORKER_WORKER_RUNTIME_CUDA_EVENT_H_

#include <cuda_runtime_api.h>

#include <memory>

#include "absl/status/statusor.h"
#include "worker/runtime/cuda_handles.h"
#include "worker/runtime/event.h"

namespace pdworker {

// Created with default flags: timing enabled, and host waits follow the
// device's scheduling flags (cudaDeviceScheduleAuto).
class CudaEvent final : public Event {
 public:
  static absl::StatusOr<std::unique_ptr<CudaEvent>> Create();

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  absl::StatusOr<double> ElapsedMillisecondsSince(
      const Event& start) const override;
  // cudaEventSynchronize / cudaEventQuery (cudaErrorNotReady: false).
  absl::Status Synchronize() override;
  absl::StatusOr<bool> Query() override;

  cudaEvent_t native() const { return event_.get(); }
  // Called by CudaStream after cudaEventRecord succeeded.
  void MarkRecorded() { recorded_ = true; }

 private:
  explicit CudaEvent(UniqueCudaEvent event) : event_(std::move(event)) {}

  UniqueCudaEvent event_;
  bool recorded_ = false;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_CUDA_EVENT_H_
