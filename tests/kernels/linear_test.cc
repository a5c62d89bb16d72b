#include "worker/kernels/linear.h"

#include <cstring>
#include <tuple>
#include <vector>

#include "tests/kernels/kernel_test_util.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::IsInvalidArgumentMentioning;
using testing::KernelTest;
using testing::MaxAbsDiff;
using testing::RandomFloats;

// y[t][o] = sum_i x[t][i] * w[o][i] (+ b[o]), accumulated in double.
std::vector<double> ReferenceLinear(const std::vector<float>& x,
                                    const std::vector<float>& w,
                                    const std::vector<float>& b, int rows,
                                    int in, int out) {
  std::vector<double> y(static_cast<size_t>(rows) * out);
  for (int t = 0; t < rows; ++t) {
    for (int o = 0; o < out; ++o) {
      double acc = b.empty() ? 0.0 : b[o];
      for (int i = 0; i < in; ++i) {
        acc += static_cast<double>(x[t * in + i]) * w[o * in + i];
      }
      y[t * out + o] = acc;
    }
  }
  return y;
}

// (rows, in_features, out_features, with bias)
class LinearTest
    : public KernelTest,
      public ::testing::WithParamInterface<std::tuple<int, int, int, bool>> {};

TEST_P(LinearTest, MatchesReference) {
  const auto [rows, in, out, with_bias] = GetParam();
  const std::vector<float> x = RandomFloats(rows * in, 21);
  const std::vector<float> w = RandomFloats(out * in, 22);
  const std::vector<float> b =
      with_bias ? RandomFloats(out, 23) : std::vector<float>();
  LinearParams p;
  p.input = Upload(x);
  p.weight = Upload(w);
  if (with_bias) p.bias = Upload(b);
  p.output = AllocElements<float>(rows * out);  // poisoned (NaN) on purpose
  p.num_tokens = rows;
  p.in_features = in;
  p.out_features = out;
  ASSERT_TRUE(LaunchLinear(stream(), p).ok());
  // |x|, |w| < 1: the fp32 accumulation error grows like sqrt(in) * 2^-24 *
  // |y|; 1e-5 * (1 + in / 64) is far above it for these sizes.
  EXPECT_LE(MaxAbsDiff(Read<float>(p.output),
                       ReferenceLinear(x, w, b, rows, in, out)),
            1e-5 * (1.0 + in / 64.0));
}

INSTANTIATE_TEST_SUITE_P(Shapes, LinearTest,
                         ::testing::Values(std::make_tuple(1, 16, 8, false),
                                           std::make_tuple(1, 16, 8, true),
                                           std::make_tuple(7, 33, 19, false),
                                           std::make_tuple(7, 33, 19, true),
                                           std::make_tuple(64, 256, 96, true),
                                           std::make_tuple(128, 512, 384,
                                                           false)));

// Row t's result must not depend on how many rows are computed with it: a
// graph replays at the padded token count, eager runs at the real one, and
// their outputs must agree bit for bit (OpenBLAS sgemm does not give this).
TEST_F(KernelTest, RowsAreBitIdenticalForEveryRowCount) {
  constexpr int kMaxRows = 70, kIn = 67, kOut = 33;  // odd sizes: all tails
  const std::vector<float> x = RandomFloats(kMaxRows * kIn, 31);
  const std::vector<float> w = RandomFloats(kOut * kIn, 32);
  const std::vector<float> b = RandomFloats(kOut, 33);
  LinearParams p;
  p.input = Upload(x);
  p.weight = Upload(w);
  p.bias = Upload(b);
  p.output = AllocElements<float>(kMaxRows * kOut);
  p.in_features = kIn;
  p.out_features = kOut;
  p.num_tokens = kMaxRows;
  ASSERT_TRUE(LaunchLinear(stream(), p).ok());
  const std::vector<float> all = Read<float>(p.output);
  for (int rows = 1; rows < kMaxRows; ++rows) {
    p.num_tokens = rows;
    ASSERT_TRUE(LaunchLinear(stream(), p).ok());
    const std::vector<float> some = Read<float>(p.output);
    for (int i = 0; i < rows * kOut; ++i) {
      ASSERT_EQ(std::memcmp(&some[i], &all[i], sizeof(float)), 0)
          << "row " << i / kOut << " col " << i % kOut << " with " << rows
          << " rows";
    }
  }
}

using LinearErrorsTest = KernelTest;

TEST_F(LinearErrorsTest, RejectsBadBuffers) {
  LinearParams p;
  p.num_tokens = 4;
  p.in_features = 8;
  p.out_features = 6;
  p.input = AllocElements<float>(4 * 8);
  p.weight = AllocElements<float>(6 * 8);
  p.bias = AllocElements<float>(6);
  p.output = AllocElements<float>(4 * 6);
  ASSERT_TRUE(LaunchLinear(stream(), p).ok());

  LinearParams bad = p;
  bad.input = AllocElements<float>(4 * 8 - 1);
  EXPECT_THAT(LaunchLinear(stream(), bad),
              IsInvalidArgumentMentioning("'input'"));
  bad = p;
  bad.weight = AllocElements<float>(5 * 8);
  EXPECT_THAT(LaunchLinear(stream(), bad),
              IsInvalidArgumentMentioning("'weight'"));
  bad = p;
  bad.bias = AllocElements<float>(5);
  EXPECT_THAT(LaunchLinear(stream(), bad),
              IsInvalidArgumentMentioning("'bias'"));
  bad = p;
  bad.output = AllocElements<float>(4 * 6 - 1);
  EXPECT_THAT(LaunchLinear(stream(), bad),
              IsInvalidArgumentMentioning("'output'"));
  bad = p;
  bad.output = p.input;  // sgemm cannot run in place
  bad.out_features = 8;
  bad.weight = AllocElements<float>(8 * 8);
  bad.bias = DeviceBuffer();
  EXPECT_THAT(LaunchLinear(stream(), bad),
              IsInvalidArgumentMentioning("overlap"));
  bad = p;
  bad.kernel = LinearKernel::kSkinnyGemm;  // the CPU backend has one GEMM
  EXPECT_THAT(LaunchLinear(stream(), bad),
              IsInvalidArgumentMentioning("kernel must be auto"));
  bad.kernel = LinearKernel::kCublas;
  EXPECT_THAT(LaunchLinear(stream(), bad),
              IsInvalidArgumentMentioning("kernel must be auto"));
  bad = p;
  bad.epilogue = LinearEpilogue::kSiluAndMul;  // fused only on CUDA
  EXPECT_FALSE(LinearCanFuse(stream(), bad));
  bad.output = AllocElements<float>(4 * 3);
  EXPECT_THAT(
      LaunchLinear(stream(), bad),
      IsInvalidArgumentMentioning("epilogue and prologue must be none"));
  bad = p;
  bad.epilogue = LinearEpilogue::kAddResidual;
  EXPECT_FALSE(LinearCanFuse(stream(), bad));
  EXPECT_THAT(
      LaunchLinear(stream(), bad),
      IsInvalidArgumentMentioning("epilogue and prologue must be none"));
  bad = p;
  bad.prologue = LinearPrologue::kRmsNorm;
  bad.norm_weight = AllocElements<float>(p.in_features);
  EXPECT_FALSE(LinearCanFuse(stream(), bad));
  EXPECT_THAT(
      LaunchLinear(stream(), bad),
      IsInvalidArgumentMentioning("epilogue and prologue must be none"));
  bad.norm_weight = AllocElements<float>(p.in_features - 1);
  EXPECT_THAT(LaunchLinear(stream(), bad),
              IsInvalidArgumentMentioning("'norm_weight'"));
  bad = p;
  bad.epilogue = LinearEpilogue::kRopeKvCache;  // rope left empty
  EXPECT_FALSE(LinearCanFuse(stream(), bad));
  EXPECT_THAT(LaunchLinear(stream(), bad),
              IsInvalidArgumentMentioning("rope_kv_cache"));
  EXPECT_TRUE(LinearCanFuse(stream(), p));  // nothing to fuse
  bad = p;
  bad.in_features = -1;
  EXPECT_THAT(LaunchLinear(stream(), bad),
              IsInvalidArgumentMentioning("in_features"));
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
