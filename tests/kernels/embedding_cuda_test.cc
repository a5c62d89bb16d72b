// embedding on CUDA vs the CPU kernel. The lookup is a copy, so the GPU's
// bf16 rows must equal the (bf16-representable) CPU rows exactly.
#include <cmath>
#include <cstdint>
#include <vector>

#include "tests/kernels/cuda_kernel_test_util.h"
#include "worker/kernels/embedding.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::CudaKernelTest;
using testing::RandomBf16Floats;
using testing::SameBits;

constexpr int kVocab = 50;
constexpr int kHidden = 72;

class EmbeddingCudaTest : public CudaKernelTest {};

TEST_F(EmbeddingCudaTest, CopiesTheSameRowsAsTheCpuKernel) {
  const std::vector<float> table = RandomBf16Floats(kVocab * kHidden, 1);
  // In range, the edges, and ids the kernel must turn into zero rows.
  const std::vector<int32_t> ids = {3, 0, kVocab - 1, -1, kVocab, 17, 17, 9};
  const int n = static_cast<int>(ids.size());

  EmbeddingParams cpu_p{cpu().Upload(ids),
                        CpuFloats(table),
                        cpu().Alloc(sizeof(float) * n * kHidden),
                        n,
                        kVocab,
                        kHidden,
                        DType::kFloat32};
  ASSERT_TRUE(LaunchEmbedding(*cpu().stream, cpu_p).ok());
  const std::vector<float> want =
      cpu().Read<float>(cpu_p.output, static_cast<size_t>(n) * kHidden);

  EmbeddingParams gpu_p{gpu().Upload(ids),
                        GpuBf16(table),
                        gpu().Alloc(2 * n * kHidden),
                        n,
                        kVocab,
                        kHidden,
                        DType::kBFloat16};
  ASSERT_TRUE(LaunchEmbedding(*gpu().stream, gpu_p).ok());
  EXPECT_TRUE(SameBits(ReadGpuBf16(gpu_p.output, want.size()), want));
}

// Gemma's embedding multiplier (sqrt(hidden)), written without a GPU: the
// GPU rounds float(row) * scale to bf16 once, so it is the CPU row rounded.
TEST_F(EmbeddingCudaTest, ScaledRowsAreTheCpuRowsRounded) {
  const std::vector<float> table = RandomBf16Floats(kVocab * kHidden, 3);
  const std::vector<int32_t> ids = {3, 0, kVocab - 1, -1, 17};
  const int n = static_cast<int>(ids.size());
  const float scale = std::sqrt(static_cast<float>(kHidden));
  EmbeddingParams cpu_p{cpu().Upload(ids),
                        CpuFloats(table),
                        cpu().Alloc(sizeof(float) * n * kHidden),
                        n,
                        kVocab,
                        kHidden,
                        DType::kFloat32,
                        scale};
  ASSERT_TRUE(LaunchEmbedding(*cpu().stream, cpu_p).ok());
  const std::vector<float> want = testing::RoundToBf16(
      cpu().Read<float>(cpu_p.output, static_cast<size_t>(n) * kHidden));
  EmbeddingParams gpu_p{gpu().Upload(ids),
                        GpuBf16(table),
                        gpu().Alloc(2 * n * kHidden),
                        n,
                        kVocab,
                        kHidden,
                        DType::kBFloat16,
                        scale};
  ASSERT_TRUE(LaunchEmbedding(*gpu().stream, gpu_p).ok());
  EXPECT_TRUE(SameBits(ReadGpuBf16(gpu_p.output, want.size()), want));
}

TEST_F(EmbeddingCudaTest, GraphReplayReadsTheIdsAndMatchesEager) {
  const std::vector<float> table = RandomBf16Floats(kVocab * kHidden, 2);
  const int n = 4;
  EmbeddingParams p{gpu().Upload(std::vector<int32_t>{1, 2, 3, 4}),
                    GpuBf16(table),
                    gpu().Alloc(2 * n * kHidden),
                    n,
                    kVocab,
                    kHidden,
                    DType::kBFloat16};
  Stream& stream = *gpu().stream;
  ASSERT_TRUE(LaunchEmbedding(stream, p).ok());  // warm-up (module load)
  ASSERT_TRUE(stream.BeginCapture().ok());
  ASSERT_TRUE(LaunchEmbedding(stream, p).ok());
  auto graph = stream.EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();

  const std::vector<int32_t> next = {40, -7, 0, 49};
  gpu().Write(p.token_ids, next);
  ASSERT_TRUE((*graph)->Replay().ok());
  const std::vector<float> replayed = ReadGpuBf16(p.output, n * kHidden);
  ASSERT_TRUE(LaunchEmbedding(stream, p).ok());
  EXPECT_TRUE(SameBits(replayed, ReadGpuBf16(p.output, n * kHidden)));
  for (int c = 0; c < kHidden; ++c) {
    EXPECT_EQ(replayed[c], table[40 * kHidden + c]);
    EXPECT_EQ(replayed[kHidden + c], 0.0f);  // id -7
  }
}

TEST_F(EmbeddingCudaTest, RefusesFp32OnCuda) {
  EmbeddingParams p{gpu().Upload(std::vector<int32_t>{1}),
                    gpu().Alloc(4 * kVocab * kHidden),
                    gpu().Alloc(4 * kHidden),
                    1,
                    kVocab,
                    kHidden,
                    DType::kFloat32};
  const absl::Status status = LaunchEmbedding(*gpu().stream, p);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
