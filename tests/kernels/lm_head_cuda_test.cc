// gather_rows and the LM head on CUDA vs the CPU kernels. The gather is a
// copy (exact); the logits are an fp32-output GEMM of bf16 operands, so they
// differ from the CPU's fp32 GEMM only by summation order: within
// 1e-5 · max Σ|h|·|w| + 1e-6 · |cpu| (see linear_cuda_test).
#include <cstdint>
#include <vector>

#include "tests/kernels/cuda_kernel_test_util.h"
#include "worker/kernels/lm_head.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::CudaKernelTest;
using testing::ExpectClose;
using testing::RandomBf16Floats;
using testing::SameBits;

constexpr int kTokens = 12;
constexpr int kHidden = 64;
constexpr int kVocab = 1000;

class LmHeadCudaTest : public CudaKernelTest {};

TEST_F(LmHeadCudaTest, GatherRowsCopiesExactly) {
  const std::vector<float> in = RandomBf16Floats(kTokens * kHidden, 31);
  const std::vector<int32_t> indices = {11, 0, -1, kTokens, 5};
  const int n = static_cast<int>(indices.size());
  GatherRowsParams cpu_p{CpuFloats(in),
                         cpu().Upload(indices),
                         cpu().Alloc(4 * n * kHidden),
                         kTokens,
                         n,
                         kHidden};
  ASSERT_TRUE(LaunchGatherRows(*cpu().stream, cpu_p).ok());
  GatherRowsParams gpu_p{GpuBf16(in),
                         gpu().Upload(indices),
                         gpu().Alloc(2 * n * kHidden),
                         kTokens,
                         n,
                         kHidden,
                         DType::kBFloat16};
  ASSERT_TRUE(LaunchGatherRows(*gpu().stream, gpu_p).ok());
  EXPECT_TRUE(SameBits(ReadGpuBf16(gpu_p.output, n * kHidden),
                       cpu().Read<float>(cpu_p.output, n * kHidden)));
}

TEST_F(LmHeadCudaTest, LogitsMatchTheCpuKernelAndPaddingRowsAreZero) {
  const std::vector<float> hidden = RandomBf16Floats(kTokens * kHidden, 32);
  const std::vector<float> weight = RandomBf16Floats(kVocab * kHidden, 33);
  const std::vector<int32_t> indices = {3, 11, 7, -1};  // last: padding
  const int rows = static_cast<int>(indices.size());

  LmHeadParams cpu_p;
  cpu_p.hidden = CpuFloats(hidden);
  cpu_p.logits_indices = cpu().Upload(indices);
  cpu_p.gathered = cpu().Alloc(4 * rows * kHidden);
  cpu_p.weight = CpuFloats(weight);
  cpu_p.logits = cpu().Alloc(4 * rows * kVocab);
  cpu_p.num_tokens = kTokens;
  cpu_p.num_rows = rows;
  cpu_p.hidden_size = kHidden;
  cpu_p.vocab_size = kVocab;
  ASSERT_TRUE(LaunchLmHead(*cpu().stream, cpu_p).ok());
  const std::vector<float> want =
      cpu().Read<float>(cpu_p.logits, rows * kVocab);

  LmHeadParams gpu_p = cpu_p;
  gpu_p.hidden = GpuBf16(hidden);
  gpu_p.logits_indices = gpu().Upload(indices);
  gpu_p.gathered = gpu().Alloc(2 * rows * kHidden);
  gpu_p.weight = GpuBf16(weight);
  gpu_p.logits = gpu().Alloc(4 * rows * kVocab);
  gpu_p.dtype = DType::kBFloat16;
  ASSERT_TRUE(LaunchLmHead(*gpu().stream, gpu_p).ok());
  const std::vector<float> got = gpu().Read<float>(gpu_p.logits, rows * kVocab);
  // |h|, |w| <= 1 and 64 terms: Σ|h||w| <= 64.
  ExpectClose(got, want, 1e-6, 1e-5 * kHidden, "logits");
  for (int v = 0; v < kVocab; ++v) {
    ASSERT_EQ(got[3 * kVocab + v], 0.0f) << "padding row, token " << v;
  }
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
