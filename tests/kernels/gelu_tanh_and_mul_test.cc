#include "worker/kernels/gelu_tanh_and_mul.h"

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

class GeluTanhAndMulTest : public KernelTest {};

// torch's gelu(approximate="tanh") in double, times up.
TEST_F(GeluTanhAndMulTest, MatchesReference) {
  constexpr int kRows = 5, kInter = 36;
  const std::vector<float> in = RandomFloats(kRows * 2 * kInter, 71, -6, 6);
  std::vector<double> expected(kRows * kInter);
  for (int t = 0; t < kRows; ++t) {
    for (int i = 0; i < kInter; ++i) {
      const double x = in[t * 2 * kInter + i];
      const double up = in[t * 2 * kInter + kInter + i];
      const double gelu =
          0.5 * x *
          (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
      expected[t * kInter + i] = gelu * up;
    }
  }
  GeluTanhAndMulParams p;
  p.input = Upload(in);
  p.output = AllocElements<float>(kRows * kInter);
  p.num_tokens = kRows;
  p.intermediate_size = kInter;
  ASSERT_TRUE(LaunchGeluTanhAndMul(stream(), p).ok());
  // |out| <= 36; a few fp32 ulps of that.
  EXPECT_LE(MaxAbsDiff(Read<float>(p.output), expected), 2e-5);
}

TEST_F(GeluTanhAndMulTest, RejectsBadBuffers) {
  GeluTanhAndMulParams p;
  p.input = AllocElements<float>(2 * 2 * 8);
  p.output = AllocElements<float>(2 * 8);
  p.num_tokens = 2;
  p.intermediate_size = 8;
  ASSERT_TRUE(LaunchGeluTanhAndMul(stream(), p).ok());
  GeluTanhAndMulParams bad = p;
  bad.input = AllocElements<float>(2 * 2 * 8 - 1);
  EXPECT_THAT(LaunchGeluTanhAndMul(stream(), bad),
              IsInvalidArgumentMentioning("'input'"));
  bad = p;
  bad.output = p.input;  // overlaps
  EXPECT_THAT(LaunchGeluTanhAndMul(stream(), bad),
              IsInvalidArgumentMentioning("output"));
  bad = p;
  bad.num_tokens = 0;
  EXPECT_THAT(LaunchGeluTanhAndMul(stream(), bad),
              IsInvalidArgumentMentioning("num_tokens"));
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
