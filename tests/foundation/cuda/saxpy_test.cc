// Runs a real kernel on a GPU; skips cleanly without CUDA or without a GPU.
#include "tests/foundation/cuda/saxpy.h"

#include <vector>

#include "gtest/gtest.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL

#if PDW_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace pdworker::testing {
namespace {

TEST(CudaToolchainTest, SaxpyOnDevice) {
#if !PDW_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA (no toolkit at build time)";
#else
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    GTEST_SKIP() << "no CUDA device on this machine";
  }
  constexpr int kN = 1000;
  std::vector<float> x(kN), y(kN);
  for (int i = 0; i < kN; ++i) {
    x[i] = static_cast<float>(i);
    y[i] = 1.0f;
  }
  float *dx = nullptr, *dy = nullptr;
  ASSERT_EQ(cudaMalloc(&dx, kN * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dy, kN * sizeof(float)), cudaSuccess);
  cudaMemcpy(dx, x.data(), kN * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(dy, y.data(), kN * sizeof(float), cudaMemcpyHostToDevice);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  EXPECT_EQ(LaunchSaxpy({2.0f, dx, dy, kN}, stream), "");
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaMemcpy(y.data(), dy, kN * sizeof(float), cudaMemcpyDeviceToHost);
  for (int i = 0; i < kN; ++i) ASSERT_EQ(y[i], 2.0f * i + 1.0f) << i;
  EXPECT_EQ(LaunchSaxpy({2.0f, nullptr, dy, kN}, stream),
            "saxpy: null pointer");
  cudaStreamDestroy(stream);
  cudaFree(dx);
  cudaFree(dy);
#endif
}

}  // namespace
}  // namespace pdworker::testing
