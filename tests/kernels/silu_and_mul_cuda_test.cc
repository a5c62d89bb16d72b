// silu_and_mul on CUDA vs the CPU kernel. Both compute
// gate / (1 + exp(-gate)) * up in fp32 (expf vs glibc expf, ~1 ulp apart);
// the GPU rounds the result to bf16: within 2^-8 · |cpu| + 1e-6.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "tests/kernels/cuda_kernel_test_util.h"
#include "worker/kernels/gelu_tanh_and_mul.h"
#include "worker/kernels/silu_and_mul.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::CudaKernelTest;
using testing::ExpectClose;
using testing::RandomBf16Floats;

class SiluAndMulCudaTest : public CudaKernelTest {};

TEST_F(SiluAndMulCudaTest, MatchesTheCpuKernel) {
  // 128 and 8192: the 16-byte kernel; 300 (not a multiple of 8): the scalar.
  for (const int inter : {128, 8192, 300}) {
    const int tokens = 3;
    std::vector<float> x = RandomBf16Floats(tokens * 2 * inter, inter, -8, 8);
    // Extreme gates: exp overflows; the limits are finite (0 and up).
    x[0] = -1e30f;
    x[1] = 1e30f;
    x = testing::RoundToBf16(x);
    SiluAndMulParams cpu_p{CpuFloats(x), cpu().Alloc(4 * tokens * inter),
                           tokens, inter, DType::kFloat32};
    ASSERT_TRUE(LaunchSiluAndMul(*cpu().stream, cpu_p).ok());
    SiluAndMulParams gpu_p{GpuBf16(x), gpu().Alloc(2 * tokens * inter), tokens,
                           inter, DType::kBFloat16};
    ASSERT_TRUE(LaunchSiluAndMul(*gpu().stream, gpu_p).ok());
    ExpectClose(ReadGpuBf16(gpu_p.output, tokens * inter),
                cpu().Read<float>(cpu_p.output, tokens * inter), 1.0 / 256,
                1e-6, "silu_and_mul, intermediate " + std::to_string(inter));
  }
}

// GeGLU (Gemma's gelu_pytorch_tanh) through the same gated kernel, written
// without a GPU: both paths (16-byte and scalar) against the CPU op, with
// gates where tanh saturates.
TEST_F(SiluAndMulCudaTest, GeluTanhMatchesTheCpuKernel) {
  for (const int inter : {128, 8192, 300}) {
    const int tokens = 3;
    std::vector<float> x = RandomBf16Floats(tokens * 2 * inter, inter, -8, 8);
    x[0] = -1e4f;  // gelu -> -0
    x[1] = 1e4f;   // gelu -> x
    x = testing::RoundToBf16(x);
    GeluTanhAndMulParams cpu_p{CpuFloats(x), cpu().Alloc(4 * tokens * inter),
                               tokens, inter, DType::kFloat32};
    ASSERT_TRUE(LaunchGeluTanhAndMul(*cpu().stream, cpu_p).ok());
    GeluTanhAndMulParams gpu_p{GpuBf16(x), gpu().Alloc(2 * tokens * inter),
                               tokens, inter, DType::kBFloat16};
    ASSERT_TRUE(LaunchGeluTanhAndMul(*gpu().stream, gpu_p).ok());
    const std::vector<float> want =
        cpu().Read<float>(cpu_p.output, tokens * inter);
    ExpectClose(ReadGpuBf16(gpu_p.output, tokens * inter), want, 1.0 / 256,
                1e-6,
                "gelu_tanh_and_mul, intermediate " + std::to_string(inter));
    // SiLU gives other values: the activation was really switched.
    SiluAndMulParams silu_p{GpuBf16(x), gpu().Alloc(2 * tokens * inter), tokens,
                            inter, DType::kBFloat16};
    ASSERT_TRUE(LaunchSiluAndMul(*gpu().stream, silu_p).ok());
    const std::vector<float> silu = ReadGpuBf16(silu_p.output, tokens * inter);
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      worst = std::max(worst, std::abs(double{silu[i]} - want[i]));
    }
    EXPECT_GT(worst, 1e-2);
  }
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
