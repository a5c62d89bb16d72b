#include "dispatcher/role_defaults.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

SchedulerLimits Limits(int seqs, int tokens, int q) {
  SchedulerLimits limits;
  limits.max_num_seqs = seqs;
  limits.max_num_batched_tokens = tokens;
  limits.uniform_decode_query_len = q;
  return limits;
}

TEST(RoleTest, ParsesAndPrints) {
  for (Role role : {Role::kPrefill, Role::kDecode, Role::kBoth}) {
    auto parsed = ParseRole(RoleName(role));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, role);
  }
  EXPECT_EQ(*ParseRole("Decode"), Role::kDecode);
  auto bad = ParseRole("router");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("--role"));
  EXPECT_THAT(bad.status().message(), HasSubstr("router"));
}

TEST(RoleDefaultsTest, DefaultModes) {
  EXPECT_EQ(DefaultModeForRole(Role::kPrefill), CudaGraphMode::Piecewise());
  EXPECT_EQ(DefaultModeForRole(Role::kDecode), CudaGraphMode::FullDecodeOnly());
  EXPECT_EQ(DefaultModeForRole(Role::kBoth), CudaGraphMode::FullAndPiecewise());
}

TEST(RoleDefaultsTest, PrefillUsesSglangPiecewiseScheduleToBudget) {
  auto plan = PlanGraphs(Role::kPrefill, {}, Limits(256, 1024, 1));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->mode, CudaGraphMode::Piecewise());
  EXPECT_FALSE(plan->mode_from_config);
  const std::vector<int> expected = {
      4,   8,   12,  16,  20,  24,  28,  32,  48,  64,  80,  96,  112,
      128, 144, 160, 176, 192, 208, 224, 240, 256, 288, 320, 352, 384,
      416, 448, 480, 512, 576, 640, 704, 768, 832, 896, 960, 1024};
  EXPECT_THAT(plan->capture_sizes, ElementsAreArray(expected));
  EXPECT_THAT(plan->capture_sizes_source, HasSubstr("SGLang piecewise"));
}

TEST(RoleDefaultsTest, DecodeUsesSglangBatchSizesToMaxNumSeqs) {
  auto plan = PlanGraphs(Role::kDecode, {}, Limits(32, 8192, 1));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->mode, CudaGraphMode::FullDecodeOnly());
  EXPECT_THAT(plan->capture_sizes, ElementsAre(1, 2, 4, 8, 12, 16, 24, 32));
}

TEST(RoleDefaultsTest, DecodeWithSpeculationScalesBatchSizesByQueryLength) {
  // Speculative schedule up to 12 requests: 1..8, 10, 12; x2 tokens each.
  auto plan = PlanGraphs(Role::kDecode, {}, Limits(12, 8192, 2));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->capture_sizes,
              ElementsAre(2, 4, 6, 8, 10, 12, 14, 16, 20, 24));
}

TEST(RoleDefaultsTest, DecodeClampedToStepBudget) {
  auto plan = PlanGraphs(Role::kDecode, {}, Limits(256, 20, 1));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->capture_sizes, ElementsAre(1, 2, 4, 8, 12, 16));
}

TEST(RoleDefaultsTest, BothUsesVllmRule) {
  auto plan = PlanGraphs(Role::kBoth, {}, Limits(16, 8192, 1));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->mode, CudaGraphMode::FullAndPiecewise());
  EXPECT_THAT(plan->capture_sizes, ElementsAre(1, 2, 4, 8, 16, 24, 32));
}

TEST(RoleDefaultsTest, ConfigOverridesModeAndSizes) {
  CompilationConfig config;
  config.cudagraph_mode = CudaGraphMode::Full();
  config.cudagraph_capture_sizes = std::vector<int>{1, 3, 9};
  auto plan = PlanGraphs(Role::kPrefill, config, Limits(16, 8192, 1));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->mode, CudaGraphMode::Full());
  EXPECT_TRUE(plan->mode_from_config);
  EXPECT_THAT(plan->capture_sizes, ElementsAre(1, 3, 9));
  EXPECT_THAT(plan->capture_sizes_source, HasSubstr("cudagraph_capture_sizes"));
}

TEST(RoleDefaultsTest, MaxCaptureSizeRegeneratesRoleSchedule) {
  CompilationConfig config;
  config.max_cudagraph_capture_size = 100;
  auto plan = PlanGraphs(Role::kPrefill, config, Limits(16, 8192, 1));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->capture_sizes,
              ElementsAre(4, 8, 12, 16, 20, 24, 28, 32, 48, 64, 80, 96));
  // Decode: max is in tokens; with query_len 2 that is 5 requests.
  auto decode = PlanGraphs(Role::kDecode, config, Limits(16, 8192, 2));
  config.max_cudagraph_capture_size = 10;
  decode = PlanGraphs(Role::kDecode, config, Limits(16, 8192, 2));
  ASSERT_TRUE(decode.ok()) << decode.status();
  EXPECT_THAT(decode->capture_sizes, ElementsAre(2, 4, 6, 8, 10));
}

TEST(RoleDefaultsTest, ModeNoneProducesNoSizes) {
  CompilationConfig config;
  config.cudagraph_mode = CudaGraphMode::None();
  auto plan = PlanGraphs(Role::kBoth, config, Limits(16, 8192, 1));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->mode, CudaGraphMode::None());
  EXPECT_THAT(plan->capture_sizes, IsEmpty());
}

TEST(RoleDefaultsTest, BadLimitsNameTheFlag) {
  struct Case {
    SchedulerLimits limits;
    const char* needle;
  };
  const Case cases[] = {
      {Limits(0, 8192, 1), "--max_num_seqs must be >= 1, got 0"},
      {Limits(8, -1, 1), "--max_num_batched_tokens must be >= 1, got -1"},
      {Limits(8, 8192, 0), "--uniform_decode_query_len must be >= 1, got 0"},
  };
  for (const Case& c : cases) {
    auto plan = PlanGraphs(Role::kBoth, {}, c.limits);
    ASSERT_FALSE(plan.ok());
    EXPECT_THAT(plan.status().message(), HasSubstr(c.needle));
  }
}

TEST(RoleDefaultsTest, BadConfigNamesTheField) {
  CompilationConfig config;
  config.cudagraph_capture_sizes = std::vector<int>{1, 2, 9000};
  auto plan = PlanGraphs(Role::kDecode, config, Limits(16, 8192, 1));
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(),
              HasSubstr("cudagraph_capture_sizes[2] = 9000"));

  CompilationConfig inconsistent;
  inconsistent.cudagraph_capture_sizes = std::vector<int>{1, 2};
  inconsistent.max_cudagraph_capture_size = 4;
  plan = PlanGraphs(Role::kBoth, inconsistent, Limits(16, 8192, 1));
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(), HasSubstr("max_cudagraph_capture_size"));

  // A prefill budget below SGLang's smallest size leaves nothing to capture.
  plan = PlanGraphs(Role::kPrefill, {}, Limits(16, 3, 1));
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(), HasSubstr("empty"));
}

}  // namespace
}  // namespace pdworker
