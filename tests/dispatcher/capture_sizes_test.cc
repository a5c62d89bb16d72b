// Expected schedules are written out literally from the published rules
// (vLLM's _set_cudagraph_sizes, SGLang's server_args.py), not computed.
#include "dispatcher/capture_sizes.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

TEST(VllmDefaultCaptureSizesTest, FullDefaultUpTo512) {
  // max_num_seqs 256: min(2 * 256, 512) = 512.
  const std::vector<int> expected = {
      1,   2,   4,   8,   16,  24,  32,  40,  48,  56,  64,  72,  80,
      88,  96,  104, 112, 120, 128, 136, 144, 152, 160, 168, 176, 184,
      192, 200, 208, 216, 224, 232, 240, 248, 256, 272, 288, 304, 320,
      336, 352, 368, 384, 400, 416, 432, 448, 464, 480, 496, 512};
  EXPECT_THAT(VllmDefaultCaptureSizes(256, 1, 8192),
              ElementsAreArray(expected));
  EXPECT_EQ(VllmDefaultMaxCaptureSize(256, 1, 8192), 512);
}

TEST(VllmDefaultCaptureSizesTest, SmallMaxNumSeqs) {
  EXPECT_THAT(VllmDefaultCaptureSizes(4, 1, 8192), ElementsAre(1, 2, 4, 8));
  EXPECT_THAT(VllmDefaultCaptureSizes(16, 1, 8192),
              ElementsAre(1, 2, 4, 8, 16, 24, 32));
  EXPECT_THAT(VllmDefaultCaptureSizes(1, 1, 8192), ElementsAre(1, 2));
}

TEST(VllmDefaultCaptureSizesTest, QueryLengthScalesTheMax) {
  // 2 * 8 * 2 = 32.
  EXPECT_EQ(VllmDefaultMaxCaptureSize(8, 2, 8192), 32);
  EXPECT_THAT(VllmDefaultCaptureSizes(8, 2, 8192),
              ElementsAre(1, 2, 4, 8, 16, 24, 32));
}

TEST(VllmDefaultCaptureSizesTest, MaxBetween256And512) {
  // 2 * 200 = 400: multiples of 16 from 256 stop at 400.
  const std::vector<int> expected = {
      1,   2,   4,   8,   16,  24,  32,  40,  48,  56,  64,  72,  80,  88,  96,
      104, 112, 120, 128, 136, 144, 152, 160, 168, 176, 184, 192, 200, 208, 216,
      224, 232, 240, 248, 256, 272, 288, 304, 320, 336, 352, 368, 384, 400};
  EXPECT_THAT(VllmDefaultCaptureSizes(200, 1, 8192),
              ElementsAreArray(expected));
}

TEST(VllmDefaultCaptureSizesTest, ClampedToStepBudget) {
  EXPECT_EQ(VllmDefaultMaxCaptureSize(256, 1, 100), 100);
  EXPECT_THAT(
      VllmDefaultCaptureSizes(256, 1, 100),
      ElementsAre(1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96));
  EXPECT_THAT(VllmDefaultCaptureSizes(256, 1, 3), ElementsAre(1, 2));
}

TEST(VllmCaptureSizesUpToTest, NonMultipleMax) {
  EXPECT_THAT(VllmCaptureSizesUpTo(20), ElementsAre(1, 2, 4, 8, 16));
  EXPECT_THAT(VllmCaptureSizesUpTo(270), testing::Contains(256));
  EXPECT_EQ(VllmCaptureSizesUpTo(270).back(), 256);
}

TEST(SglangDecodeBatchSizesTest, NormalUpTo160) {
  const std::vector<int> expected = {1,   2,   4,   8,   12,  16,  24,  32,
                                     40,  48,  56,  64,  72,  80,  88,  96,
                                     104, 112, 120, 128, 136, 144, 152, 160};
  EXPECT_THAT(SglangDecodeBatchSizes(160, SglangDecodeSchedule::kNormal),
              ElementsAreArray(expected));
}

TEST(SglangDecodeBatchSizesTest, NormalUpTo600) {
  const std::vector<int> expected = {
      1,   2,   4,   8,   12,  16,  24,  32,  40,  48,  56,  64,  72,  80,
      88,  96,  104, 112, 120, 128, 136, 144, 152, 160, 168, 176, 184, 192,
      200, 208, 216, 224, 232, 240, 248, 256, 272, 288, 304, 320, 336, 352,
      368, 384, 400, 416, 432, 448, 464, 480, 496, 512, 544, 576};
  EXPECT_THAT(SglangDecodeBatchSizes(600, SglangDecodeSchedule::kNormal),
              ElementsAreArray(expected));
}

TEST(SglangDecodeBatchSizesTest, NormalSmall) {
  EXPECT_THAT(SglangDecodeBatchSizes(10, SglangDecodeSchedule::kNormal),
              ElementsAre(1, 2, 4, 8));
}

TEST(SglangDecodeBatchSizesTest, SpeculativeUpTo100) {
  const std::vector<int> expected = {1,  2,  3,  4,  5,  6,  7,  8,  10, 12, 14,
                                     16, 18, 20, 22, 24, 26, 28, 30, 32, 40, 44,
                                     48, 52, 56, 60, 64, 72, 80, 88, 96};
  EXPECT_THAT(SglangDecodeBatchSizes(100, SglangDecodeSchedule::kSpeculative),
              ElementsAreArray(expected));
}

TEST(SglangDecodeBatchSizesTest, SpeculativeAbove256) {
  const std::vector<int> sizes =
      SglangDecodeBatchSizes(320, SglangDecodeSchedule::kSpeculative);
  EXPECT_THAT(std::vector<int>(sizes.end() - 6, sizes.end()),
              ElementsAre(248, 256, 272, 288, 304, 320));
}

TEST(SglangPiecewiseTokenSizesTest, UpTo8192) {
  const std::vector<int> expected = {
      4,    8,    12,   16,   20,   24,   28,   32,   48,   64,   80,   96,
      112,  128,  144,  160,  176,  192,  208,  224,  240,  256,  288,  320,
      352,  384,  416,  448,  480,  512,  576,  640,  704,  768,  832,  896,
      960,  1024, 1280, 1536, 1792, 2048, 2304, 2560, 2816, 3072, 3328, 3584,
      3840, 4096, 4608, 5120, 5632, 6144, 6656, 7168, 7680, 8192};
  EXPECT_THAT(SglangPiecewiseTokenSizes(8192), ElementsAreArray(expected));
}

TEST(SglangPiecewiseTokenSizesTest, TruncatedAtMax) {
  EXPECT_THAT(SglangPiecewiseTokenSizes(50),
              ElementsAre(4, 8, 12, 16, 20, 24, 28, 32, 48));
  EXPECT_THAT(SglangPiecewiseTokenSizes(3), ElementsAre());
  const std::vector<int> sizes = SglangPiecewiseTokenSizes(1000);
  EXPECT_EQ(sizes.back(), 960);
}

TEST(ValidateCaptureSizesTest, AcceptsValidList) {
  EXPECT_TRUE(ValidateCaptureSizes({1, 2, 4, 8}, 8, "f").ok());
}

TEST(ValidateCaptureSizesTest, RejectsWithFieldAndEntry) {
  struct Case {
    std::vector<int> sizes;
    const char* needle;
  };
  const Case cases[] = {
      {{}, "is empty"},
      {{0, 1}, "f[0] = 0 is not positive"},
      {{1, -4}, "f[1] = -4 is not positive"},
      {{1, 4, 2}, "f[2] = 2 follows 4"},
      {{1, 2, 2}, "without duplicates"},
      {{1, 2, 16}, "f[2] = 16 exceeds max_num_batched_tokens = 8"},
  };
  for (const Case& c : cases) {
    absl::Status status = ValidateCaptureSizes(c.sizes, 8, "f");
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr(c.needle));
    EXPECT_THAT(status.message(), HasSubstr("f"));
  }
}

ScheduleUpTo Vllm() { return VllmCaptureSizesUpTo; }

TEST(ResolveCaptureSizesTest, DefaultScheduleClampedToBudget) {
  auto sizes = ResolveCaptureSizes({}, Vllm(), 512, 32);
  ASSERT_TRUE(sizes.ok()) << sizes.status();
  EXPECT_THAT(*sizes, ElementsAre(1, 2, 4, 8, 16, 24, 32));
}

TEST(ResolveCaptureSizesTest, ExplicitListUsedAsIs) {
  CaptureSizeRequest request;
  request.explicit_sizes = std::vector<int>{3, 5, 7};
  auto sizes = ResolveCaptureSizes(request, Vllm(), 512, 8192);
  ASSERT_TRUE(sizes.ok()) << sizes.status();
  EXPECT_THAT(*sizes, ElementsAre(3, 5, 7));
}

TEST(ResolveCaptureSizesTest, ConsistentMaxAndList) {
  CaptureSizeRequest request{std::vector<int>{1, 2, 4}, 4};
  auto sizes = ResolveCaptureSizes(request, Vllm(), 512, 8192);
  ASSERT_TRUE(sizes.ok()) << sizes.status();
  EXPECT_THAT(*sizes, ElementsAre(1, 2, 4));
}

TEST(ResolveCaptureSizesTest, InconsistentMaxAndListNamesBothFields) {
  CaptureSizeRequest request{std::vector<int>{1, 2, 4}, 8};
  auto sizes = ResolveCaptureSizes(request, Vllm(), 512, 8192);
  ASSERT_FALSE(sizes.ok());
  EXPECT_EQ(sizes.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(sizes.status().message(),
              HasSubstr("max_cudagraph_capture_size = 8"));
  EXPECT_THAT(sizes.status().message(), HasSubstr("cudagraph_capture_sizes"));
}

TEST(ResolveCaptureSizesTest, InvalidExplicitListNamesField) {
  CaptureSizeRequest request;
  request.explicit_sizes = std::vector<int>{1, 4096};
  auto sizes = ResolveCaptureSizes(request, Vllm(), 512, 2048);
  ASSERT_FALSE(sizes.ok());
  EXPECT_THAT(sizes.status().message(),
              HasSubstr("cudagraph_capture_sizes[1] = 4096 exceeds "
                        "max_num_batched_tokens = 2048"));
}

TEST(ResolveCaptureSizesTest, MaxOnlyRegeneratesSchedule) {
  CaptureSizeRequest request;
  request.max_capture_size = 20;
  auto sizes = ResolveCaptureSizes(request, Vllm(), 512, 8192);
  ASSERT_TRUE(sizes.ok()) << sizes.status();
  EXPECT_THAT(*sizes, ElementsAre(1, 2, 4, 8, 16));
}

TEST(ResolveCaptureSizesTest, MaxAboveBudgetIsTruncated) {
  CaptureSizeRequest request;
  request.max_capture_size = 4096;
  auto sizes = ResolveCaptureSizes(request, Vllm(), 512, 24);
  ASSERT_TRUE(sizes.ok()) << sizes.status();
  EXPECT_THAT(*sizes, ElementsAre(1, 2, 4, 8, 16, 24));
}

TEST(ResolveCaptureSizesTest, NonPositiveMaxNamesField) {
  CaptureSizeRequest request;
  request.max_capture_size = 0;
  auto sizes = ResolveCaptureSizes(request, Vllm(), 512, 8192);
  ASSERT_FALSE(sizes.ok());
  EXPECT_THAT(sizes.status().message(),
              HasSubstr("max_cudagraph_capture_size must be >= 1"));
}

TEST(ResolveCaptureSizesTest, EmptyScheduleIsAnError) {
  auto sizes = ResolveCaptureSizes({}, SglangPiecewiseTokenSizes, 8192, 3);
  ASSERT_FALSE(sizes.ok());
  EXPECT_THAT(sizes.status().message(), HasSubstr("empty"));
  EXPECT_THAT(sizes.status().message(),
              HasSubstr("max_num_batched_tokens = 3"));
}

TEST(ResolveCaptureSizesTest, NonPositiveBudgetNamesFlag) {
  auto sizes = ResolveCaptureSizes({}, Vllm(), 512, 0);
  ASSERT_FALSE(sizes.ok());
  EXPECT_THAT(sizes.status().message(), HasSubstr("max_num_batched_tokens"));
}

TEST(UniformDecodeSizesTest, QueryLengthOneKeepsSizesUpToLimit) {
  EXPECT_THAT(UniformDecodeSizes({1, 2, 4, 8, 16}, 1, 4), ElementsAre(1, 2, 4));
  EXPECT_THAT(UniformDecodeSizes({1, 2, 4, 8, 16}, 1, 5), ElementsAre(1, 2, 4));
}

TEST(UniformDecodeSizesTest, RoundsDownToMultiplesAndDeduplicates) {
  // 1, 2 -> 0 (dropped); 4 -> 3; 8 -> 6; 16 -> 15.
  EXPECT_THAT(UniformDecodeSizes({1, 2, 4, 8, 16}, 3, 24),
              ElementsAre(3, 6, 15));
  // 8 and 10 both round to 8.
  EXPECT_THAT(UniformDecodeSizes({1, 2, 4, 8, 10, 12}, 4, 100),
              ElementsAre(4, 8, 12));
  // Limit applies after rounding: 16 -> 15 > 12.
  EXPECT_THAT(UniformDecodeSizes({4, 8, 16}, 3, 12), ElementsAre(3, 6));
}

}  // namespace
}  // namespace pdworker
