// RMSNorm and fused add + RMSNorm on CUDA vs the CPU kernels.
//
// Tolerance: the GPU rounds its output to bf16 (relative error <= 2^-9) and
// takes the statistic in fp32 instead of double (~1e-7 relative), so each
// element is within 2^-8 · |cpu| + 1e-6 (2x headroom on the rounding). The
// fused variant also stores the residual in bf16 and normalizes the rounded
// residual: one more 2^-9 on each element, hence 2^-7 there.
#include <cstdint>
#include <vector>

#include "tests/kernels/cuda_kernel_test_util.h"
#include "worker/kernels/rms_norm.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::CudaKernelTest;
using testing::ExpectClose;
using testing::RandomBf16Floats;
using testing::SameBits;

constexpr double kNormRel = 1.0 / 256;      // 2^-8
constexpr double kFusedRel = 1.0 / 128;     // 2^-7
constexpr double kResidualRel = 1.0 / 256;  // bf16 rounding of the sum
constexpr double kAbs = 1e-6;

class RmsNormCudaTest : public CudaKernelTest,
                        public ::testing::WithParamInterface<int> {};

TEST_P(RmsNormCudaTest, MatchesTheCpuKernel) {
  const int hidden = GetParam();
  const int tokens = 5;
  const std::vector<float> x = RandomBf16Floats(tokens * hidden, 3, -2, 2);
  const std::vector<float> w = RandomBf16Floats(hidden, 4, 0.5f, 1.5f);

  RmsNormParams cpu_p{
      CpuFloats(x),   CpuFloats(w), cpu().Alloc(4 * tokens * hidden),
      tokens,         hidden,       1e-5f,
      DType::kFloat32};
  ASSERT_TRUE(LaunchRmsNorm(*cpu().stream, cpu_p).ok());
  const std::vector<float> want = cpu().Read<float>(cpu_p.output, x.size());

  RmsNormParams gpu_p{GpuBf16(x), GpuBf16(w), gpu().Alloc(2 * x.size()), tokens,
                      hidden,     1e-5f,      DType::kBFloat16};
  ASSERT_TRUE(LaunchRmsNorm(*gpu().stream, gpu_p).ok());
  const std::vector<float> got = ReadGpuBf16(gpu_p.output, x.size());
  ExpectClose(got, want, kNormRel, kAbs, "rms_norm");

  // In place (output == input) gives the same bits.
  gpu_p.output = gpu_p.input;
  ASSERT_TRUE(LaunchRmsNorm(*gpu().stream, gpu_p).ok());
  EXPECT_TRUE(SameBits(ReadGpuBf16(gpu_p.output, x.size()), got));
}

TEST_P(RmsNormCudaTest, FusedAddMatchesTheCpuKernel) {
  const int hidden = GetParam();
  const int tokens = 6;
  const std::vector<float> x = RandomBf16Floats(tokens * hidden, 5, -2, 2);
  const std::vector<float> res = RandomBf16Floats(tokens * hidden, 6, -2, 2);
  const std::vector<float> w = RandomBf16Floats(hidden, 7, 0.5f, 1.5f);

  FusedAddRmsNormParams cpu_p{CpuFloats(x),   CpuFloats(res), CpuFloats(w),
                              DeviceBuffer(), tokens,         hidden,
                              1e-5f,          DType::kFloat32};
  cpu_p.output = cpu_p.input;  // in place, as the forward runs it
  ASSERT_TRUE(LaunchFusedAddRmsNorm(*cpu().stream, cpu_p).ok());
  const std::vector<float> want = cpu().Read<float>(cpu_p.output, x.size());
  const std::vector<float> want_res =
      cpu().Read<float>(cpu_p.residual, x.size());

  FusedAddRmsNormParams gpu_p{GpuBf16(x),     GpuBf16(res),    GpuBf16(w),
                              DeviceBuffer(), tokens,          hidden,
                              1e-5f,          DType::kBFloat16};
  gpu_p.output = gpu_p.input;
  ASSERT_TRUE(LaunchFusedAddRmsNorm(*gpu().stream, gpu_p).ok());
  ExpectClose(ReadGpuBf16(gpu_p.output, x.size()), want, kFusedRel, kAbs,
              "fused_add_rms_norm output");
  ExpectClose(ReadGpuBf16(gpu_p.residual, x.size()), want_res, kResidualRel,
              kAbs, "fused_add_rms_norm residual");
}

// The final norm's gather of the LM head's rows (every kernel variant, by
// width): output row t has the bits the ungathered norm writes for input row
// indices[t] (the fused add: without storing the residual, which stays as
// it was), and -1 / out-of-range indices give +0 rows.
TEST_P(RmsNormCudaTest, GatherGivesTheUngatheredBits) {
  const int hidden = GetParam();
  const int tokens = 7;
  const std::vector<float> x = RandomBf16Floats(tokens * hidden, 15, -2, 2);
  const std::vector<float> res = RandomBf16Floats(tokens * hidden, 16, -2, 2);
  const std::vector<float> w = RandomBf16Floats(hidden, 17, 0.5f, 1.5f);
  const std::vector<int32_t> indices = {6, -1, 0, 3, tokens, 6};
  const int rows = static_cast<int>(indices.size());
  const std::vector<float> zero_row(hidden, 0.0f);
  auto expect_gathered = [&](const std::vector<float>& got,
                             const std::vector<float>& every,
                             const char* what) {
    for (int t = 0; t < rows; ++t) {
      const bool valid = indices[t] >= 0 && indices[t] < tokens;
      const std::vector<float> row(got.begin() + t * hidden,
                                   got.begin() + (t + 1) * hidden);
      const std::vector<float> want =
          valid ? std::vector<float>(every.begin() + indices[t] * hidden,
                                     every.begin() + (indices[t] + 1) * hidden)
                : zero_row;
      EXPECT_TRUE(SameBits(row, want)) << what << " row " << t;
    }
  };

  RmsNormParams all{GpuBf16(x), GpuBf16(w), gpu().Alloc(2 * x.size()), tokens,
                    hidden,     1e-5f,      DType::kBFloat16};
  ASSERT_TRUE(LaunchRmsNorm(*gpu().stream, all).ok());
  RmsNormParams g = all;
  g.output = gpu().Alloc(2 * rows * hidden);  // 0xFF poison
  g.num_tokens = rows;
  g.row_indices = gpu().Upload(indices);
  g.num_input_rows = tokens;
  ASSERT_TRUE(LaunchRmsNorm(*gpu().stream, g).ok());
  expect_gathered(ReadGpuBf16(g.output, rows * hidden),
                  ReadGpuBf16(all.output, x.size()), "rms_norm");

  FusedAddRmsNormParams fall{GpuBf16(x),     GpuBf16(res),    GpuBf16(w),
                             DeviceBuffer(), tokens,          hidden,
                             1e-5f,          DType::kBFloat16};
  fall.output = gpu().Alloc(2 * x.size());
  ASSERT_TRUE(LaunchFusedAddRmsNorm(*gpu().stream, fall).ok());
  FusedAddRmsNormParams fg = fall;
  fg.residual = GpuBf16(res);
  fg.output = gpu().Alloc(2 * rows * hidden);
  fg.num_tokens = rows;
  fg.row_indices = gpu().Upload(indices);
  fg.num_input_rows = tokens;
  ASSERT_TRUE(LaunchFusedAddRmsNorm(*gpu().stream, fg).ok());
  expect_gathered(ReadGpuBf16(fg.output, rows * hidden),
                  ReadGpuBf16(fall.output, x.size()), "fused_add_rms_norm");
  EXPECT_TRUE(SameBits(ReadGpuBf16(fg.residual, x.size()),
                       ReadGpuBf16(GpuBf16(res), x.size())))
      << "the gathering fused add must not store the residual";
}

// Tiny-model width, Llama-1B width, and a width that is no multiple of the
// block size.
// 64 and 2048: the one-pass kernel with one 16-byte vector per thread (or
// fewer threads than vectors); 3072: two per thread; 5120: four; 100 (not a
// multiple of 8): the two-pass kernel.
INSTANTIATE_TEST_SUITE_P(Widths, RmsNormCudaTest,
                         ::testing::Values(64, 2048, 100, 3072, 5120));

TEST_F(CudaKernelTest, RmsNormGraphReplayMatchesEager) {
  const int hidden = 256, tokens = 8;
  const std::vector<float> x = RandomBf16Floats(tokens * hidden, 8);
  RmsNormParams p{GpuBf16(x),
                  GpuBf16(RandomBf16Floats(hidden, 9)),
                  gpu().Alloc(2 * x.size()),
                  tokens,
                  hidden,
                  1e-6f,
                  DType::kBFloat16};
  Stream& stream = *gpu().stream;
  ASSERT_TRUE(LaunchRmsNorm(stream, p).ok());
  const std::vector<float> eager = ReadGpuBf16(p.output, x.size());
  ASSERT_TRUE(stream.BeginCapture().ok());
  ASSERT_TRUE(LaunchRmsNorm(stream, p).ok());
  auto graph = stream.EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();
  gpu().Write(p.output, std::vector<uint16_t>(x.size(), 0));
  ASSERT_TRUE((*graph)->Replay().ok());
  EXPECT_TRUE(SameBits(ReadGpuBf16(p.output, x.size()), eager));
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
