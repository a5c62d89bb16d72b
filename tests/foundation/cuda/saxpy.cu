#include <cuda_runtime.h>

#include "tests/foundation/cuda/saxpy.h"

namespace pdworker::testing {
namespace {

__global__ void SaxpyKernel(float a, const float* __restrict__ x,
                            float* __restrict__ y, int64_t n) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

}  // namespace

std::string LaunchSaxpy(const SaxpyParams& p, void* stream) {
  if (p.n < 0) return "saxpy: negative n";
  if (p.n == 0) return "";
  if (p.x == nullptr || p.y == nullptr) return "saxpy: null pointer";
  constexpr int kThreads = 256;
  const int64_t blocks = (p.n + kThreads - 1) / kThreads;
  SaxpyKernel<<<static_cast<unsigned>(blocks), kThreads, 0,
                static_cast<cudaStream_t>(stream)>>>(p.a, p.x, p.y, p.n);
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? "" : cudaGetErrorString(err);
}

}  // namespace pdworker::testing
