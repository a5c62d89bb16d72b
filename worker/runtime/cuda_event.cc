#include "worker/runtime/cuda_event.h"

#include "worker/runtime/cuda_status.h"

namespace pdworker {

absl::StatusOr<std::unique_ptr<CudaEvent>> CudaEvent::Create() {
  cudaEvent_t raw = nullptr;
  // Default flags: timing enabled (the point of this type).
  absl::Status status = CudaStatus(cudaEventCreate(&raw), "cudaEventCreate");
  if (!status.ok()) return status;
  return std::unique_ptr<CudaEvent>(new CudaEvent(UniqueCudaEvent(raw)));
}

absl::Status CudaEvent::Synchronize() {
  if (!recorded_) {
    return absl::FailedPreconditionError(
        "Event::Synchronize: the event was never recorded");
  }
  return CudaStatus(cudaEventSynchronize(event_.get()), "cudaEventSynchronize");
}

absl::StatusOr<bool> CudaEvent::Query() {
  if (!recorded_) {
    return absl::FailedPreconditionError(
        "Event::Query: the event was never recorded");
  }
  const cudaError_t error = cudaEventQuery(event_.get());
  if (error == cudaErrorNotReady) {
    // Not an error, but the runtime may leave it as the thread's last error,
    // where the next Launch's cudaGetLastError would report it.
    if (cudaPeekAtLastError() == cudaErrorNotReady) cudaGetLastError();
    return false;
  }
  absl::Status status = CudaStatus(error, "cudaEventQuery");
  if (!status.ok()) return status;
  return true;
}

absl::StatusOr<double> CudaEvent::ElapsedMillisecondsSince(
    const Event& start) const {
  const auto* cuda_start = dynamic_cast<const CudaEvent*>(&start);
  if (cuda_start == nullptr) {
    return absl::InvalidArgumentError(
        "ElapsedMillisecondsSince: start is not a cuda event");
  }
  if (!recorded_ || !cuda_start->recorded_) {
    return absl::FailedPreconditionError(
        "ElapsedMillisecondsSince: both events must be recorded");
  }
  absl::Status status =
      CudaStatus(cudaEventSynchronize(event_.get()), "cudaEventSynchronize");
  if (!status.ok()) return status;
  float milliseconds = 0.0f;
  status = CudaStatus(
      cudaEventElapsedTime(&milliseconds, cuda_start->native(), event_.get()),
      "cudaEventElapsedTime");
  if (!status.ok()) return status;
  return static_cast<double>(milliseconds);
}

}  // namespace pdworker
