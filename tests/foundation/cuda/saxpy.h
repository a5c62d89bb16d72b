// A one-kernel CUDA library that proves the nvcc toolchain (foundation issue).
#ifndef PDWORKER_TESTS_FOUNDATION_CUDA_SAXPY_H_
#define PDWORKER_TESTS_FOUNDATION_CUDA_SAXPY_H_

#include <cstdint>
#include <string>

namespace pdworker::testing {

// Device-side view of y <- a * x + y over n floats.
struct SaxpyParams {
  float a = 0.0f;
  const float* x = nullptr;  // device pointer, [n]
  float* y = nullptr;        // device pointer, [n]
  int64_t n = 0;
};

// Launches on `stream` (a cudaStream_t passed as void* so callers need no
// CUDA headers). Returns an empty string on success, else the CUDA error.
std::string LaunchSaxpy(const SaxpyParams& params, void* stream);

}  // namespace pdworker::testing

#endif  // PDWORKER_TESTS_FOUNDATION_CUDA_SAXPY_H_
