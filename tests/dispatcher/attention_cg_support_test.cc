#include "dispatcher/attention_cg_support.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

using ::testing::HasSubstr;

constexpr AttentionCGSupport kNever = AttentionCGSupport::kNever;
constexpr AttentionCGSupport kUstd =
    AttentionCGSupport::kUniformSingleTokenDecode;
constexpr AttentionCGSupport kUb = AttentionCGSupport::kUniformBatch;
constexpr AttentionCGSupport kAlways = AttentionCGSupport::kAlways;
constexpr PiecewiseCompilation kPw = PiecewiseCompilation::kAvailable;
constexpr PiecewiseCompilation kNoPw = PiecewiseCompilation::kUnavailable;

const CudaGraphMode N = CudaGraphMode::None();
const CudaGraphMode P = CudaGraphMode::Piecewise();
const CudaGraphMode F = CudaGraphMode::Full();
const CudaGraphMode FDO = CudaGraphMode::FullDecodeOnly();
const CudaGraphMode FAP = CudaGraphMode::FullAndPiecewise();

struct ResolveCase {
  CudaGraphMode configured;
  AttentionCGSupport support;
  PiecewiseCompilation piecewise;
  int query_len;
  CudaGraphMode expected;
};

std::string CaseName(const ResolveCase& c) {
  std::string name = c.configured.ToString() + "_" +
                     std::string(AttentionCGSupportName(c.support)) + "_" +
                     (c.piecewise == kPw ? "pw" : "nopw") + "_q" +
                     std::to_string(c.query_len);
  return name;
}

class ResolveModeTest : public ::testing::TestWithParam<ResolveCase> {};

TEST_P(ResolveModeTest, ResolvesAsVllm) {
  const ResolveCase& c = GetParam();
  const ResolvedMode r =
      ResolveMode(c.configured, c.support, c.piecewise, c.query_len);
  EXPECT_EQ(r.mode, c.expected) << r.reason;
  // A reason is given exactly when the mode changed, and it names the
  // outcome.
  EXPECT_EQ(r.reason.empty(), c.expected == c.configured) << r.reason;
  if (!r.reason.empty()) {
    EXPECT_THAT(r.reason, HasSubstr(c.configured.ToString()));
    EXPECT_THAT(r.reason, HasSubstr("using " + c.expected.ToString()));
  }
  // Invariants of any resolution.
  if (c.support == kNever) {
    EXPECT_FALSE(r.mode.has_full_cudagraphs());
  }
  if (c.piecewise == kNoPw) {
    EXPECT_FALSE(r.mode.requires_piecewise());
  }
  if (c.query_len > 1 && c.support < kUb) {
    EXPECT_NE(r.mode.decode_mode(), RuntimeMode::kFull);
  }
  if (c.support != kAlways) {
    EXPECT_NE(r.mode.mixed_mode(), RuntimeMode::kFull);
  }
}

// Every configured mode x support level x query length (1, 2) x piecewise
// availability, expected values worked out by hand from vLLM's policy.
const ResolveCase kCases[] = {
    // ---- piecewise available, query_len 1 ----
    {N, kAlways, kPw, 1, N},
    {N, kUb, kPw, 1, N},
    {N, kUstd, kPw, 1, N},
    {N, kNever, kPw, 1, N},
    {P, kAlways, kPw, 1, P},
    {P, kUb, kPw, 1, P},
    {P, kUstd, kPw, 1, P},
    {P, kNever, kPw, 1, P},
    {F, kAlways, kPw, 1, F},
    {F, kUb, kPw, 1, FAP},
    {F, kUstd, kPw, 1, FAP},
    {F, kNever, kPw, 1, P},
    {FDO, kAlways, kPw, 1, FDO},
    {FDO, kUb, kPw, 1, FDO},
    {FDO, kUstd, kPw, 1, FDO},
    {FDO, kNever, kPw, 1, P},
    {FAP, kAlways, kPw, 1, FAP},
    {FAP, kUb, kPw, 1, FAP},
    {FAP, kUstd, kPw, 1, FAP},
    {FAP, kNever, kPw, 1, P},
    // ---- piecewise available, query_len 2 (spec decode) ----
    {N, kAlways, kPw, 2, N},
    {N, kUb, kPw, 2, N},
    {N, kUstd, kPw, 2, N},
    {N, kNever, kPw, 2, N},
    {P, kAlways, kPw, 2, P},
    {P, kUb, kPw, 2, P},
    {P, kUstd, kPw, 2, P},
    {P, kNever, kPw, 2, P},
    {F, kAlways, kPw, 2, F},
    {F, kUb, kPw, 2, FAP},
    {F, kUstd, kPw, 2, P},
    {F, kNever, kPw, 2, P},
    {FDO, kAlways, kPw, 2, FDO},
    {FDO, kUb, kPw, 2, FDO},
    {FDO, kUstd, kPw, 2, P},
    {FDO, kNever, kPw, 2, P},
    {FAP, kAlways, kPw, 2, FAP},
    {FAP, kUb, kPw, 2, FAP},
    {FAP, kUstd, kPw, 2, P},
    {FAP, kNever, kPw, 2, P},
    // ---- no piecewise compilation, query_len 1 ----
    {N, kAlways, kNoPw, 1, N},
    {N, kUb, kNoPw, 1, N},
    {N, kUstd, kNoPw, 1, N},
    {N, kNever, kNoPw, 1, N},
    {P, kAlways, kNoPw, 1, N},
    {P, kUb, kNoPw, 1, N},
    {P, kUstd, kNoPw, 1, N},
    {P, kNever, kNoPw, 1, N},
    {F, kAlways, kNoPw, 1, F},
    {F, kUb, kNoPw, 1, FDO},
    {F, kUstd, kNoPw, 1, FDO},
    {F, kNever, kNoPw, 1, N},
    {FDO, kAlways, kNoPw, 1, FDO},
    {FDO, kUb, kNoPw, 1, FDO},
    {FDO, kUstd, kNoPw, 1, FDO},
    {FDO, kNever, kNoPw, 1, N},
    {FAP, kAlways, kNoPw, 1, N},
    {FAP, kUb, kNoPw, 1, N},
    {FAP, kUstd, kNoPw, 1, N},
    {FAP, kNever, kNoPw, 1, N},
    // ---- no piecewise compilation, query_len 2 ----
    {N, kAlways, kNoPw, 2, N},
    {N, kUb, kNoPw, 2, N},
    {N, kUstd, kNoPw, 2, N},
    {N, kNever, kNoPw, 2, N},
    {P, kAlways, kNoPw, 2, N},
    {P, kUb, kNoPw, 2, N},
    {P, kUstd, kNoPw, 2, N},
    {P, kNever, kNoPw, 2, N},
    {F, kAlways, kNoPw, 2, F},
    {F, kUb, kNoPw, 2, FDO},
    {F, kUstd, kNoPw, 2, N},
    {F, kNever, kNoPw, 2, N},
    {FDO, kAlways, kNoPw, 2, FDO},
    {FDO, kUb, kNoPw, 2, FDO},
    {FDO, kUstd, kNoPw, 2, N},
    {FDO, kNever, kNoPw, 2, N},
    {FAP, kAlways, kNoPw, 2, N},
    {FAP, kUb, kNoPw, 2, N},
    {FAP, kUstd, kNoPw, 2, N},
    {FAP, kNever, kNoPw, 2, N},
};

INSTANTIATE_TEST_SUITE_P(AllCombinations, ResolveModeTest,
                         ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<ResolveCase>& info) {
                           return CaseName(info.param);
                         });

TEST(ResolveModeReasonTest, NamesTheLimitingSupportLevel) {
  ResolvedMode r = ResolveMode(F, kUb, kPw, 1);
  EXPECT_THAT(r.reason, HasSubstr("ALWAYS"));
  EXPECT_THAT(r.reason, HasSubstr("UNIFORM_BATCH"));

  r = ResolveMode(FDO, kUstd, kPw, 3);
  EXPECT_THAT(r.reason, HasSubstr("uniform_decode_query_len 3"));
  EXPECT_THAT(r.reason, HasSubstr("UNIFORM_SINGLE_TOKEN_DECODE"));

  r = ResolveMode(FAP, kNever, kPw, 1);
  EXPECT_THAT(r.reason, HasSubstr("NEVER"));

  r = ResolveMode(P, kAlways, kNoPw, 1);
  EXPECT_THAT(r.reason, HasSubstr("piecewise compilation"));
}

TEST(ResolveModeReasonTest, ChainedDowngradesListEveryStep) {
  // FULL -> FULL_AND_PIECEWISE (rule 1) -> PIECEWISE (rule 3).
  const ResolvedMode r = ResolveMode(F, kUstd, kPw, 2);
  EXPECT_EQ(r.mode, P);
  EXPECT_THAT(r.reason, HasSubstr("using FULL_AND_PIECEWISE; "
                                  "FULL_AND_PIECEWISE with"));
}

TEST(AttentionCGSupportTest, OrderedByCapability) {
  EXPECT_LT(kNever, kUstd);
  EXPECT_LT(kUstd, kUb);
  EXPECT_LT(kUb, kAlways);
}

TEST(AttentionCGSupportTest, ParsesNames) {
  for (auto s : {kNever, kUstd, kUb, kAlways}) {
    auto parsed = ParseAttentionCGSupport(AttentionCGSupportName(s));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, s);
  }
  auto lower = ParseAttentionCGSupport("uniform_batch");
  ASSERT_TRUE(lower.ok());
  EXPECT_EQ(*lower, kUb);
  auto bad = ParseAttentionCGSupport("SOMETIMES");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("SOMETIMES"));
  EXPECT_THAT(bad.status().message(), HasSubstr("UNIFORM_SINGLE_TOKEN_DECODE"));
}

}  // namespace
}  // namespace pdworker
