#include "worker/kernels/rms_norm.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "tests/kernels/kernel_test_util.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::IsInvalidArgumentMentioning;
using testing::KernelTest;
using testing::MaxAbsDiff;
using testing::RandomFloats;

// Relative error of an fp32 row-normalization is a few ulps; values here are
// O(1)..O(3), so 1e-5 absolute leaves margin without hiding real bugs (a
// wrong eps, mean or weight shows up at 1e-2 or more).
constexpr double kTolerance = 1e-5;

std::vector<double> ReferenceRmsNorm(const std::vector<double>& x,
                                     const std::vector<float>& w, int rows,
                                     int hidden, double eps) {
  std::vector<double> out(x.size());
  for (int t = 0; t < rows; ++t) {
    double mean_square = 0.0;
    for (int i = 0; i < hidden; ++i) {
      mean_square += x[t * hidden + i] * x[t * hidden + i] / hidden;
    }
    const double rms = std::sqrt(mean_square + eps);
    for (int i = 0; i < hidden; ++i) {
      out[t * hidden + i] = x[t * hidden + i] / rms * w[i];
    }
  }
  return out;
}

std::vector<double> ToDouble(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

class RmsNormTest : public KernelTest {};

TEST_F(RmsNormTest, MatchesReference) {
  constexpr int kRows = 7, kHidden = 96;
  constexpr float kEps = 1e-5f;
  const std::vector<float> x = RandomFloats(kRows * kHidden, 11, -3.0f, 3.0f);
  const std::vector<float> w = RandomFloats(kHidden, 12, 0.5f, 1.5f);
  RmsNormParams p;
  p.input = Upload(x);
  p.weight = Upload(w);
  p.output = AllocElements<float>(kRows * kHidden);
  p.num_tokens = kRows;
  p.hidden_size = kHidden;
  p.epsilon = kEps;
  ASSERT_TRUE(LaunchRmsNorm(stream(), p).ok());
  EXPECT_LE(MaxAbsDiff(Read<float>(p.output),
                       ReferenceRmsNorm(ToDouble(x), w, kRows, kHidden, kEps)),
            kTolerance);
  EXPECT_EQ(Read<float>(p.input), x);  // input untouched
}

TEST_F(RmsNormTest, InPlaceGivesTheSameResult) {
  constexpr int kRows = 3, kHidden = 64;
  const std::vector<float> x = RandomFloats(kRows * kHidden, 13);
  const std::vector<float> w = RandomFloats(kHidden, 14);
  RmsNormParams p;
  p.input = Upload(x);
  p.weight = Upload(w);
  p.output = p.input;
  p.num_tokens = kRows;
  p.hidden_size = kHidden;
  ASSERT_TRUE(LaunchRmsNorm(stream(), p).ok());
  EXPECT_LE(MaxAbsDiff(Read<float>(p.output),
                       ReferenceRmsNorm(ToDouble(x), w, kRows, kHidden, 1e-6)),
            kTolerance);
}

TEST_F(RmsNormTest, FusedAddUpdatesResidualAndNormalizesTheSum) {
  constexpr int kRows = 5, kHidden = 128;
  constexpr float kEps = 1e-6f;
  const std::vector<float> x = RandomFloats(kRows * kHidden, 15);
  const std::vector<float> residual = RandomFloats(kRows * kHidden, 16);
  const std::vector<float> w = RandomFloats(kHidden, 17);
  std::vector<double> sum(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    sum[i] = static_cast<double>(x[i]) + residual[i];
  }
  const std::vector<double> expected =
      ReferenceRmsNorm(sum, w, kRows, kHidden, kEps);

  for (bool in_place : {false, true}) {
    SCOPED_TRACE(in_place ? "output = input" : "separate output");
    FusedAddRmsNormParams p;
    p.input = Upload(x);
    p.residual = Upload(residual);
    p.weight = Upload(w);
    p.output = in_place ? p.input : AllocElements<float>(kRows * kHidden);
    p.num_tokens = kRows;
    p.hidden_size = kHidden;
    p.epsilon = kEps;
    ASSERT_TRUE(LaunchFusedAddRmsNorm(stream(), p).ok());
    EXPECT_LE(MaxAbsDiff(Read<float>(p.residual), sum), 1e-6);
    EXPECT_LE(MaxAbsDiff(Read<float>(p.output), expected), kTolerance);
  }
}

// The gather of the LM head's rows: output row t is the norm of input row
// indices[t], bit for bit what the norm without a gather writes for that
// row; -1 and out-of-range indices give zero rows.
TEST_F(RmsNormTest, GatherNormalizesTheIndexedRowsBitForBit) {
  constexpr int kRows = 6, kHidden = 40;
  const std::vector<float> x = RandomFloats(kRows * kHidden, 21, -3.0f, 3.0f);
  const std::vector<float> w = RandomFloats(kHidden, 22, 0.5f, 1.5f);
  RmsNormParams all;
  all.input = Upload(x);
  all.weight = Upload(w);
  all.output = AllocElements<float>(kRows * kHidden);
  all.num_tokens = kRows;
  all.hidden_size = kHidden;
  ASSERT_TRUE(LaunchRmsNorm(stream(), all).ok());
  const std::vector<float> every = Read<float>(all.output);

  const std::vector<int32_t> indices = {4, -1, 0, kRows, 4};
  RmsNormParams g = all;
  g.output = AllocElements<float>(indices.size() * kHidden);
  g.num_tokens = static_cast<int>(indices.size());
  g.row_indices = Upload(indices);
  g.num_input_rows = kRows;
  ASSERT_TRUE(LaunchRmsNorm(stream(), g).ok());
  const std::vector<float> got = Read<float>(g.output);
  for (size_t t = 0; t < indices.size(); ++t) {
    const bool valid = indices[t] >= 0 && indices[t] < kRows;
    for (int i = 0; i < kHidden; ++i) {
      ASSERT_EQ(got[t * kHidden + i],
                valid ? every[indices[t] * kHidden + i] : 0.0f)
          << "row " << t << " element " << i;
    }
  }
  EXPECT_EQ(Read<float>(g.input), x);
}

// The fused add's gather: the same output rows as the fused add over every
// row followed by a gather, and the residual is left alone.
TEST_F(RmsNormTest, FusedAddGatherMatchesTheFullAddAndLeavesTheResidual) {
  constexpr int kRows = 5, kHidden = 24;
  const std::vector<float> x = RandomFloats(kRows * kHidden, 23);
  const std::vector<float> r = RandomFloats(kRows * kHidden, 24);
  const std::vector<float> w = RandomFloats(kHidden, 25, 0.5f, 1.5f);
  FusedAddRmsNormParams all;
  all.input = Upload(x);
  all.residual = Upload(r);
  all.weight = Upload(w);
  all.output = AllocElements<float>(kRows * kHidden);
  all.num_tokens = kRows;
  all.hidden_size = kHidden;
  ASSERT_TRUE(LaunchFusedAddRmsNorm(stream(), all).ok());
  const std::vector<float> every = Read<float>(all.output);

  const std::vector<int32_t> indices = {2, 2, -7, 0};
  FusedAddRmsNormParams g = all;
  g.residual = Upload(r);
  g.output = AllocElements<float>(indices.size() * kHidden);
  g.num_tokens = static_cast<int>(indices.size());
  g.row_indices = Upload(indices);
  g.num_input_rows = kRows;
  ASSERT_TRUE(LaunchFusedAddRmsNorm(stream(), g).ok());
  const std::vector<float> got = Read<float>(g.output);
  for (size_t t = 0; t < indices.size(); ++t) {
    for (int i = 0; i < kHidden; ++i) {
      ASSERT_EQ(got[t * kHidden + i],
                indices[t] >= 0 ? every[indices[t] * kHidden + i] : 0.0f)
          << "row " << t << " element " << i;
    }
  }
  EXPECT_EQ(Read<float>(g.residual), r);
}

TEST_F(RmsNormTest, GatherNeedsItsIndicesAndADisjointOutput) {
  constexpr int kRows = 4, kHidden = 16;
  RmsNormParams p;
  p.input = Upload(RandomFloats(kRows * kHidden, 26));
  p.weight = Upload(RandomFloats(kHidden, 27));
  p.output = AllocElements<float>(kRows * kHidden);
  p.num_tokens = 3;
  p.hidden_size = kHidden;
  p.row_indices = Upload(std::vector<int32_t>{0, 1});  // 2 < num_tokens
  p.num_input_rows = kRows;
  EXPECT_THAT(LaunchRmsNorm(stream(), p),
              IsInvalidArgumentMentioning("row_indices"));
  p.row_indices = Upload(std::vector<int32_t>{0, 1, 2});
  p.num_input_rows = 0;
  EXPECT_THAT(LaunchRmsNorm(stream(), p),
              IsInvalidArgumentMentioning("num_input_rows"));
  p.num_input_rows = kRows;
  p.output = p.input;  // in place is fine without a gather, not with one
  EXPECT_THAT(LaunchRmsNorm(stream(), p),
              IsInvalidArgumentMentioning("output"));
}

TEST_F(RmsNormTest, RejectsBadBuffers) {
  constexpr int kRows = 4, kHidden = 16;
  RmsNormParams p;
  p.input = AllocElements<float>(kRows * kHidden);
  p.weight = AllocElements<float>(kHidden);
  p.output = AllocElements<float>(kRows * kHidden);
  p.num_tokens = kRows;
  p.hidden_size = kHidden;
  ASSERT_TRUE(LaunchRmsNorm(stream(), p).ok());
  RmsNormParams bad = p;
  bad.weight = AllocElements<float>(kHidden - 1);
  EXPECT_THAT(LaunchRmsNorm(stream(), bad),
              IsInvalidArgumentMentioning("'weight'"));
  bad = p;
  bad.input = AllocElements<float>(kRows * kHidden - 1);
  EXPECT_THAT(LaunchRmsNorm(stream(), bad),
              IsInvalidArgumentMentioning("'input'"));
  bad = p;
  bad.output = AllocElements<float>(kHidden);
  EXPECT_THAT(LaunchRmsNorm(stream(), bad),
              IsInvalidArgumentMentioning("'output'"));
  bad = p;  // shifted by one row: would read rows it already overwrote
  bad.output = p.input.Slice(0, p.input.size_bytes());
  bad.input = DeviceBuffer(p.input.as<float>() + kHidden,
                           (kRows - 1) * kHidden * sizeof(float));
  bad.num_tokens = kRows - 1;
  EXPECT_THAT(LaunchRmsNorm(stream(), bad),
              IsInvalidArgumentMentioning("overlap"));

  FusedAddRmsNormParams fused;
  fused.input = AllocElements<float>(kRows * kHidden);
  fused.residual = AllocElements<float>(kRows * kHidden);
  fused.weight = AllocElements<float>(kHidden);
  fused.output = fused.input;
  fused.num_tokens = kRows;
  fused.hidden_size = kHidden;
  ASSERT_TRUE(LaunchFusedAddRmsNorm(stream(), fused).ok());
  FusedAddRmsNormParams bad_fused = fused;
  bad_fused.residual = AllocElements<float>(kRows * kHidden - 1);
  EXPECT_THAT(LaunchFusedAddRmsNorm(stream(), bad_fused),
              IsInvalidArgumentMentioning("'residual'"));
  bad_fused = fused;
  bad_fused.output = fused.residual;
  EXPECT_THAT(LaunchFusedAddRmsNorm(stream(), bad_fused),
              IsInvalidArgumentMentioning("overlap"));
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
