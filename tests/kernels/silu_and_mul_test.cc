#include "worker/kernels/silu_and_mul.h"

#include <cmath>
#include <vector>

#include "tests/kernels/kernel_test_util.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::IsInvalidArgumentMentioning;
using testing::KernelTest;
using testing::MaxAbsDiff;
using testing::RandomFloats;

class SiluAndMulTest : public KernelTest {};

TEST_F(SiluAndMulTest, MatchesReference) {
  constexpr int kRows = 6, kInter = 40;
  const std::vector<float> in = RandomFloats(kRows * 2 * kInter, 31, -6, 6);
  std::vector<double> expected(kRows * kInter);
  for (int t = 0; t < kRows; ++t) {
    for (int i = 0; i < kInter; ++i) {
      const double gate = in[t * 2 * kInter + i];
      const double up = in[t * 2 * kInter + kInter + i];
      const double sigmoid = 1.0 / (1.0 + std::exp(-gate));
      expected[t * kInter + i] = gate * sigmoid * up;
    }
  }
  SiluAndMulParams p;
  p.input = Upload(in);
  p.output = AllocElements<float>(kRows * kInter);
  p.num_tokens = kRows;
  p.intermediate_size = kInter;
  ASSERT_TRUE(LaunchSiluAndMul(stream(), p).ok());
  // |out| <= 36; a few fp32 ulps of that.
  EXPECT_LE(MaxAbsDiff(Read<float>(p.output), expected), 2e-5);
}

TEST_F(SiluAndMulTest, ExtremeGatesGiveFiniteLimits) {
  // gate -> -inf: silu -> 0 (exp overflows, no NaN); gate -> +inf: gate.
  const std::vector<float> in = {-1e30f, 1e30f, -100.0f, 2.0f, 3.0f, 4.0f};
  SiluAndMulParams p;
  p.input = Upload(in);
  p.output = AllocElements<float>(3);
  p.num_tokens = 1;
  p.intermediate_size = 3;
  ASSERT_TRUE(LaunchSiluAndMul(stream(), p).ok());
  const std::vector<float> out = Read<float>(p.output);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_FLOAT_EQ(out[1], 1e30f * 3.0f);
  EXPECT_NEAR(out[2], 0.0f, 1e-30);
}

TEST_F(SiluAndMulTest, RejectsBadBuffers) {
  SiluAndMulParams p;
  p.input = AllocElements<float>(2 * 2 * 8);
  p.output = AllocElements<float>(2 * 8);
  p.num_tokens = 2;
  p.intermediate_size = 8;
  ASSERT_TRUE(LaunchSiluAndMul(stream(), p).ok());
  SiluAndMulParams bad = p;
  bad.input = AllocElements<float>(2 * 2 * 8 - 1);
  EXPECT_THAT(LaunchSiluAndMul(stream(), bad),
              IsInvalidArgumentMentioning("'input'"));
  bad = p;
  bad.output = AllocElements<float>(2 * 8 - 1);
  EXPECT_THAT(LaunchSiluAndMul(stream(), bad),
              IsInvalidArgumentMentioning("'output'"));
  bad = p;
  bad.output = p.input;
  EXPECT_THAT(LaunchSiluAndMul(stream(), bad),
              IsInvalidArgumentMentioning("overlap"));
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
