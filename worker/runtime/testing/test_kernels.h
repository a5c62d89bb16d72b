// Tiny CUDA kernels for runtime tests and benchmarks (float32, elementwise).
// Each enqueues one kernel on `cuda_stream` (a cudaStream_t) and returns;
// Stream::Launch checks the launch.
#ifndef PDWORKER_WORKER_RUNTIME_TESTING_TEST_KERNELS_H_
#define PDWORKER_WORKER_RUNTIME_TESTING_TEST_KERNELS_H_

#include <cstddef>

namespace pdworker {
namespace test_ops {

// data[i] = value
void LaunchFillKernel(void* cuda_stream, float* data, size_t n, float value);
// y[i] = a * x[i] + y[i]
void LaunchAxpyKernel(void* cuda_stream, float a, const float* x, float* y,
                      size_t n);
// out[i] = a[i] * b[i] + c
void LaunchMulAddKernel(void* cuda_stream, const float* a, const float* b,
                        float c, float* out, size_t n);

}  // namespace test_ops
}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_TESTING_TEST_KERNELS_H_
