#include <cuda_runtime.h>

#include "worker/runtime/testing/test_kernels.h"

namespace pdworker {
namespace test_ops {
namespace {

constexpr int kThreads = 256;

unsigned int NumBlocks(size_t n) {
  return static_cast<unsigned int>((n + kThreads - 1) / kThreads);
}

__global__ void FillKernel(float* data, size_t n, float value) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) data[i] = value;
}

__global__ void AxpyKernel(float a, const float* x, float* y, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

__global__ void MulAddKernel(const float* a, const float* b, float c,
                             float* out, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = a[i] * b[i] + c;
}

}  // namespace

void LaunchFillKernel(void* cuda_stream, float* data, size_t n, float value) {
  if (n == 0) return;
  FillKernel<<<NumBlocks(n), kThreads, 0,
               static_cast<cudaStream_t>(cuda_stream)>>>(data, n, value);
}

void LaunchAxpyKernel(void* cuda_stream, float a, const float* x, float* y,
                      size_t n) {
  if (n == 0) return;
  AxpyKernel<<<NumBlocks(n), kThreads, 0,
               static_cast<cudaStream_t>(cuda_stream)>>>(a, x, y, n);
}

void LaunchMulAddKernel(void* cuda_stream, const float* a, const float* b,
                        float c, float* out, size_t n) {
  if (n == 0) return;
  MulAddKernel<<<NumBlocks(n), kThreads, 0,
                 static_cast<cudaStream_t>(cuda_stream)>>>(a, b, c, out, n);
}

}  // namespace test_ops
}  // namespace pdworker
