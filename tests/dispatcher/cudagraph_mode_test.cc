#include "dispatcher/cudagraph_mode.h"

#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

using ::testing::HasSubstr;

struct ModeCase {
  CudaGraphMode mode;
  const char* name;
  RuntimeMode decode;
  RuntimeMode mixed;
  bool separate;
  bool full;
  bool piecewise;
};

class CudaGraphModeTest : public ::testing::TestWithParam<ModeCase> {};

TEST_P(CudaGraphModeTest, RoutinesAndPredicates) {
  const ModeCase& c = GetParam();
  EXPECT_EQ(c.mode.decode_mode(), c.decode);
  EXPECT_EQ(c.mode.mixed_mode(), c.mixed);
  EXPECT_EQ(c.mode.separate_routine(), c.separate);
  EXPECT_EQ(c.mode.has_full_cudagraphs(), c.full);
  EXPECT_EQ(c.mode.requires_piecewise(), c.piecewise);
  EXPECT_EQ(c.mode.has_mode(RuntimeMode::kFull), c.full);
  EXPECT_EQ(c.mode.has_mode(RuntimeMode::kPiecewise), c.piecewise);
  EXPECT_EQ(c.mode.has_mode(RuntimeMode::kNone),
            c.decode == RuntimeMode::kNone || c.mixed == RuntimeMode::kNone);
}

TEST_P(CudaGraphModeTest, PrintsAndParsesItsName) {
  const ModeCase& c = GetParam();
  EXPECT_EQ(c.mode.ToString(), c.name);
  EXPECT_EQ(ToString(c.mode), c.name);
  std::ostringstream os;
  os << c.mode;
  EXPECT_EQ(os.str(), c.name);
  absl::StatusOr<CudaGraphMode> parsed = ParseCudaGraphMode(c.name);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, c.mode);
}

constexpr RuntimeMode kN = RuntimeMode::kNone;
constexpr RuntimeMode kP = RuntimeMode::kPiecewise;
constexpr RuntimeMode kF = RuntimeMode::kFull;

INSTANTIATE_TEST_SUITE_P(
    AllModes, CudaGraphModeTest,
    ::testing::Values(
        ModeCase{CudaGraphMode::None(), "NONE", kN, kN, false, false, false},
        ModeCase{CudaGraphMode::Piecewise(), "PIECEWISE", kP, kP, false, false,
                 true},
        ModeCase{CudaGraphMode::Full(), "FULL", kF, kF, false, true, false},
        ModeCase{CudaGraphMode::FullDecodeOnly(), "FULL_DECODE_ONLY", kF, kN,
                 true, true, false},
        ModeCase{CudaGraphMode::FullAndPiecewise(), "FULL_AND_PIECEWISE", kF,
                 kP, true, true, true}),
    [](const ::testing::TestParamInfo<ModeCase>& info) {
      return std::string(info.param.name);
    });

TEST(CudaGraphModeParseTest, IsCaseInsensitiveAndTrimsWhitespace) {
  absl::StatusOr<CudaGraphMode> parsed =
      ParseCudaGraphMode(" full_and_piecewise ");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, CudaGraphMode::FullAndPiecewise());
}

TEST(CudaGraphModeParseTest, UnknownNameListsValidNames) {
  absl::StatusOr<CudaGraphMode> parsed = ParseCudaGraphMode("FULL_PIECEWISE");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(parsed.status().message(), HasSubstr("FULL_PIECEWISE"));
  for (const char* name : {"NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY",
                           "FULL_AND_PIECEWISE"}) {
    EXPECT_THAT(parsed.status().message(), HasSubstr(name));
  }
}

TEST(CudaGraphModeTest, DefaultIsNoneAndModesAreDistinct) {
  EXPECT_EQ(CudaGraphMode(), CudaGraphMode::None());
  const auto all = CudaGraphMode::All();
  for (size_t i = 0; i < all.size(); ++i) {
    for (size_t j = 0; j < all.size(); ++j) {
      EXPECT_EQ(all[i] == all[j], i == j) << i << " vs " << j;
    }
  }
}

TEST(RuntimeModeTest, Names) {
  EXPECT_EQ(RuntimeModeName(RuntimeMode::kNone), "NONE");
  EXPECT_EQ(RuntimeModeName(RuntimeMode::kPiecewise), "PIECEWISE");
  EXPECT_EQ(RuntimeModeName(RuntimeMode::kFull), "FULL");
  std::ostringstream os;
  os << RuntimeMode::kPiecewise;
  EXPECT_EQ(os.str(), "PIECEWISE");
}

}  // namespace
}  // namespace pdworker
