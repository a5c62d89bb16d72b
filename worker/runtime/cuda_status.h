// Conversions from CUDA runtime and cuBLAS error codes to absl::Status.
#ifndef PDWORKER_WORKER_RUNTIME_CUDA_STATUS_H_
#define PDWORKER_WORKER_RUNTIME_CUDA_STATUS_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace pdworker {

// OK for cudaSuccess; otherwise a status naming `operation` and the CUDA
// error: RESOURCE_EXHAUSTED for out-of-memory, FAILED_PRECONDITION for
// stream-capture violations, UNAVAILABLE for a missing device, INTERNAL else.
absl::Status CudaStatus(cudaError_t error, absl::string_view operation);

// Same for cuBLAS.
absl::Status CublasStatus(cublasStatus_t status, absl::string_view operation);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_CUDA_STATUS_H_
