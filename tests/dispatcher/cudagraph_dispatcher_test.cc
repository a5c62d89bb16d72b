#include "dispatcher/cudagraph_dispatcher.h"

#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

constexpr RuntimeMode kN = RuntimeMode::kNone;
constexpr RuntimeMode kP = RuntimeMode::kPiecewise;
constexpr RuntimeMode kF = RuntimeMode::kFull;
constexpr BatchKind kMixed = BatchKind::kMixed;
constexpr BatchKind kUniform = BatchKind::kUniformDecode;
constexpr BatchKind kOneToken = BatchKind::kOneTokenDecode;
constexpr FallbackReason kOk = FallbackReason::kNone;

BatchDescriptor Relaxed(int n) { return BatchDescriptor{n, 0, false}; }
BatchDescriptor Uniform(int n, int reqs) {
  return BatchDescriptor{n, reqs, true};
}

// One dispatch expectation: batch (num_tokens, kind) under `mode` gives
// exactly (expected mode, descriptor, reason).
struct DispatchCase {
  const char* name;
  CudaGraphMode mode;
  int num_tokens;
  BatchKind kind;
  DispatchResult expected;
};

// Capture sizes {1, 2, 4, 8}, max_num_seqs 8, query_len 1: "below" the
// largest size is 5 (pads to 8), "at" is 8, "above" is 9.
class DispatchMatrixTest : public ::testing::TestWithParam<DispatchCase> {};

TEST_P(DispatchMatrixTest, ExactResult) {
  const DispatchCase& c = GetParam();
  CudagraphDispatcher dispatcher;
  ASSERT_TRUE(dispatcher.Initialize(c.mode, {1, 2, 4, 8}, 8, 1).ok());
  const int reqs = c.kind == kUniform ? c.num_tokens : 0;
  EXPECT_EQ(dispatcher.Dispatch(c.num_tokens, c.kind, reqs), c.expected);
}

const DispatchCase kMatrix[] = {
    // NONE: always eager, reason mode_none.
    {"None_Mixed_Below",
     CudaGraphMode::None(),
     5,
     kMixed,
     {kN, Relaxed(5), FallbackReason::kModeNone}},
    {"None_Mixed_At",
     CudaGraphMode::None(),
     8,
     kMixed,
     {kN, Relaxed(8), FallbackReason::kModeNone}},
    {"None_Mixed_Above",
     CudaGraphMode::None(),
     9,
     kMixed,
     {kN, Relaxed(9), FallbackReason::kModeNone}},
    {"None_Uniform_Below",
     CudaGraphMode::None(),
     5,
     kUniform,
     {kN, Relaxed(5), FallbackReason::kModeNone}},
    {"None_Uniform_At",
     CudaGraphMode::None(),
     8,
     kUniform,
     {kN, Relaxed(8), FallbackReason::kModeNone}},
    {"None_Uniform_Above",
     CudaGraphMode::None(),
     9,
     kUniform,
     {kN, Relaxed(9), FallbackReason::kModeNone}},
    // PIECEWISE: relaxed keys for both kinds.
    {"Piecewise_Mixed_Below",
     CudaGraphMode::Piecewise(),
     5,
     kMixed,
     {kP, Relaxed(8), kOk}},
    {"Piecewise_Mixed_At",
     CudaGraphMode::Piecewise(),
     8,
     kMixed,
     {kP, Relaxed(8), kOk}},
    {"Piecewise_Mixed_Above",
     CudaGraphMode::Piecewise(),
     9,
     kMixed,
     {kN, Relaxed(9), FallbackReason::kAboveMaxCaptureSize}},
    {"Piecewise_Uniform_Below",
     CudaGraphMode::Piecewise(),
     5,
     kUniform,
     {kP, Relaxed(8), kOk}},
    {"Piecewise_Uniform_At",
     CudaGraphMode::Piecewise(),
     8,
     kUniform,
     {kP, Relaxed(8), kOk}},
    {"Piecewise_Uniform_Above",
     CudaGraphMode::Piecewise(),
     9,
     kUniform,
     {kN, Relaxed(9), FallbackReason::kAboveMaxCaptureSize}},
    // FULL: relaxed FULL for mixed, exact uniform FULL for decodes.
    {"Full_Mixed_Below",
     CudaGraphMode::Full(),
     5,
     kMixed,
     {kF, Relaxed(8), kOk}},
    {"Full_Mixed_At", CudaGraphMode::Full(), 8, kMixed, {kF, Relaxed(8), kOk}},
    {"Full_Mixed_Above",
     CudaGraphMode::Full(),
     9,
     kMixed,
     {kN, Relaxed(9), FallbackReason::kAboveMaxCaptureSize}},
    {"Full_Uniform_Below",
     CudaGraphMode::Full(),
     5,
     kUniform,
     {kF, Uniform(8, 8), kOk}},
    {"Full_Uniform_At",
     CudaGraphMode::Full(),
     8,
     kUniform,
     {kF, Uniform(8, 8), kOk}},
    {"Full_Uniform_Above",
     CudaGraphMode::Full(),
     9,
     kUniform,
     {kN, Relaxed(9), FallbackReason::kAboveMaxCaptureSize}},
    // FULL_DECODE_ONLY: mixed batches have no key.
    {"FullDecodeOnly_Mixed_Below",
     CudaGraphMode::FullDecodeOnly(),
     5,
     kMixed,
     {kN, Relaxed(5), FallbackReason::kNoKeyForBatchShape}},
    {"FullDecodeOnly_Mixed_At",
     CudaGraphMode::FullDecodeOnly(),
     8,
     kMixed,
     {kN, Relaxed(8), FallbackReason::kNoKeyForBatchShape}},
    {"FullDecodeOnly_Mixed_Above",
     CudaGraphMode::FullDecodeOnly(),
     9,
     kMixed,
     {kN, Relaxed(9), FallbackReason::kAboveMaxCaptureSize}},
    {"FullDecodeOnly_Uniform_Below",
     CudaGraphMode::FullDecodeOnly(),
     5,
     kUniform,
     {kF, Uniform(8, 8), kOk}},
    {"FullDecodeOnly_Uniform_At",
     CudaGraphMode::FullDecodeOnly(),
     8,
     kUniform,
     {kF, Uniform(8, 8), kOk}},
    {"FullDecodeOnly_Uniform_Above",
     CudaGraphMode::FullDecodeOnly(),
     9,
     kUniform,
     {kN, Relaxed(9), FallbackReason::kAboveMaxCaptureSize}},
    // FULL_AND_PIECEWISE: PIECEWISE for mixed, FULL for decodes.
    {"FullAndPiecewise_Mixed_Below",
     CudaGraphMode::FullAndPiecewise(),
     5,
     kMixed,
     {kP, Relaxed(8), kOk}},
    {"FullAndPiecewise_Mixed_At",
     CudaGraphMode::FullAndPiecewise(),
     8,
     kMixed,
     {kP, Relaxed(8), kOk}},
    {"FullAndPiecewise_Mixed_Above",
     CudaGraphMode::FullAndPiecewise(),
     9,
     kMixed,
     {kN, Relaxed(9), FallbackReason::kAboveMaxCaptureSize}},
    {"FullAndPiecewise_Uniform_Below",
     CudaGraphMode::FullAndPiecewise(),
     5,
     kUniform,
     {kF, Uniform(8, 8), kOk}},
    {"FullAndPiecewise_Uniform_At",
     CudaGraphMode::FullAndPiecewise(),
     8,
     kUniform,
     {kF, Uniform(8, 8), kOk}},
    {"FullAndPiecewise_Uniform_Above",
     CudaGraphMode::FullAndPiecewise(),
     9,
     kUniform,
     {kN, Relaxed(9), FallbackReason::kAboveMaxCaptureSize}},
};

INSTANTIATE_TEST_SUITE_P(
    AllModes, DispatchMatrixTest, ::testing::ValuesIn(kMatrix),
    [](const ::testing::TestParamInfo<DispatchCase>& info) {
      return std::string(info.param.name);
    });

TEST(CudagraphDispatcherTest, PadsToSmallestCaptureSize) {
  CudagraphDispatcher d;
  ASSERT_TRUE(
      d.Initialize(CudaGraphMode::Piecewise(), {1, 2, 4, 8}, 8, 1).ok());
  const int expected_padded[] = {0, 1, 2, 4, 4, 8, 8, 8, 8};
  for (int n = 1; n <= 8; ++n) {
    EXPECT_EQ(d.Dispatch(n, kMixed),
              (DispatchResult{kP, Relaxed(expected_padded[n]), kOk}))
        << n;
  }
}

TEST(CudagraphDispatcherTest, KeySetsFullAndPiecewise) {
  CudagraphDispatcher d;
  ASSERT_TRUE(
      d.Initialize(CudaGraphMode::FullAndPiecewise(), {1, 2, 4, 8}, 8, 1).ok());
  EXPECT_THAT(d.keys(kP), UnorderedElementsAre(Relaxed(1), Relaxed(2),
                                               Relaxed(4), Relaxed(8)));
  EXPECT_THAT(d.keys(kF), UnorderedElementsAre(Uniform(1, 1), Uniform(2, 2),
                                               Uniform(4, 4), Uniform(8, 8)));
  EXPECT_THAT(d.keys(kN), IsEmpty());
}

TEST(CudagraphDispatcherTest, KeySetsFull) {
  CudagraphDispatcher d;
  ASSERT_TRUE(d.Initialize(CudaGraphMode::Full(), {2, 4}, 8, 1).ok());
  EXPECT_THAT(d.keys(kP), IsEmpty());
  EXPECT_THAT(d.keys(kF), UnorderedElementsAre(Relaxed(2), Relaxed(4),
                                               Uniform(2, 2), Uniform(4, 4)));
}

TEST(CudagraphDispatcherTest, KeySetsNoneAndDecodeOnly) {
  CudagraphDispatcher none;
  ASSERT_TRUE(none.Initialize(CudaGraphMode::None(), {1, 2}, 8, 1).ok());
  EXPECT_THAT(none.keys(kP), IsEmpty());
  EXPECT_THAT(none.keys(kF), IsEmpty());
  CudagraphDispatcher decode;
  ASSERT_TRUE(
      decode.Initialize(CudaGraphMode::FullDecodeOnly(), {1, 2}, 8, 1).ok());
  EXPECT_THAT(decode.keys(kP), IsEmpty());
  EXPECT_THAT(decode.keys(kF),
              UnorderedElementsAre(Uniform(1, 1), Uniform(2, 2)));
}

TEST(CudagraphDispatcherTest, UniformKeysLimitedByMaxNumSeqs) {
  // A uniform batch never has more than max_num_seqs * query_len tokens.
  CudagraphDispatcher d;
  ASSERT_TRUE(
      d.Initialize(CudaGraphMode::FullAndPiecewise(), {1, 2, 4, 8, 16}, 4, 1)
          .ok());
  EXPECT_THAT(d.keys(kF), UnorderedElementsAre(Uniform(1, 1), Uniform(2, 2),
                                               Uniform(4, 4)));
  EXPECT_EQ(d.Dispatch(3, kUniform, 3),
            (DispatchResult{kF, Uniform(4, 4), kOk}));
  // 6 "uniform" tokens exceed the FULL keys: relaxed PIECEWISE takes over.
  EXPECT_EQ(d.Dispatch(6, kUniform, 6), (DispatchResult{kP, Relaxed(8), kOk}));

  CudagraphDispatcher decode_only;
  ASSERT_TRUE(
      decode_only
          .Initialize(CudaGraphMode::FullDecodeOnly(), {1, 2, 4, 8, 16}, 4, 1)
          .ok());
  EXPECT_EQ(
      decode_only.Dispatch(6, kUniform, 6),
      (DispatchResult{kN, Relaxed(6), FallbackReason::kNoKeyForBatchShape}));
}

TEST(CudagraphDispatcherTest, SpeculativeDecodeQueryLengthTwo) {
  // Uniform sizes: 1 -> 0 (dropped), 2, 4, 8 (<= 2 * 4).
  CudagraphDispatcher d;
  ASSERT_TRUE(
      d.Initialize(CudaGraphMode::FullAndPiecewise(), {1, 2, 4, 8}, 4, 2).ok());
  EXPECT_THAT(d.uniform_sizes(), ElementsAre(2, 4, 8));
  // One-token decode keys (steps without drafts): sizes up to 4 sequences.
  EXPECT_THAT(d.one_token_sizes(), ElementsAre(1, 2, 4));
  EXPECT_THAT(d.keys(kF), UnorderedElementsAre(Uniform(2, 1), Uniform(4, 2),
                                               Uniform(8, 4), Uniform(1, 1),
                                               Uniform(2, 2), Uniform(4, 4)));
  EXPECT_EQ(d.Dispatch(3, kOneToken, 3),
            (DispatchResult{kF, Uniform(4, 4), kOk}));
  EXPECT_EQ(d.Dispatch(2, kOneToken, 2),
            (DispatchResult{kF, Uniform(2, 2), kOk}));
  // More one-token requests than max_num_seqs cannot happen; above the
  // one-token sizes the relaxed keys serve.
  EXPECT_EQ(d.Dispatch(8, kOneToken), (DispatchResult{kP, Relaxed(8), kOk}));
  EXPECT_EQ(d.Dispatch(2, kUniform, 1),
            (DispatchResult{kF, Uniform(2, 1), kOk}));
  EXPECT_EQ(d.Dispatch(6, kUniform, 3),
            (DispatchResult{kF, Uniform(8, 4), kOk}));
  EXPECT_EQ(d.Dispatch(3, kMixed), (DispatchResult{kP, Relaxed(4), kOk}));
  EXPECT_EQ(d.Dispatch(1, kMixed), (DispatchResult{kP, Relaxed(1), kOk}));
}

TEST(CudagraphDispatcherTest, SpeculativeDecodeQueryLengthThree) {
  // Uniform sizes: 4 -> 3, 8 -> 6, 16 -> 15 (1 and 2 round to 0).
  CudagraphDispatcher d;
  ASSERT_TRUE(d.Initialize(CudaGraphMode::Full(), {1, 2, 4, 8, 16}, 8, 3).ok());
  EXPECT_THAT(d.uniform_sizes(), ElementsAre(3, 6, 15));
  EXPECT_EQ(d.Dispatch(3, kUniform, 1),
            (DispatchResult{kF, Uniform(3, 1), kOk}));
  EXPECT_EQ(d.Dispatch(9, kUniform, 3),
            (DispatchResult{kF, Uniform(15, 5), kOk}));
  // Uniform key missing above 15: the relaxed FULL key of size 16 serves it.
  // (num_tokens 16 is not a multiple of 3, so no real uniform batch has it;
  // this pins the fall-through order.)
  EXPECT_EQ(d.Dispatch(16, kUniform), (DispatchResult{kF, Relaxed(16), kOk}));
  EXPECT_EQ(
      d.Dispatch(18, kUniform, 6),
      (DispatchResult{kN, Relaxed(18), FallbackReason::kAboveMaxCaptureSize}));
  EXPECT_EQ(d.Dispatch(5, kMixed), (DispatchResult{kF, Relaxed(8), kOk}));
  // One-token decode steps (no drafts) keep FULL graphs of their own.
  EXPECT_THAT(d.one_token_sizes(), ElementsAre(1, 2, 4, 8));
  EXPECT_EQ(d.Dispatch(5, kOneToken, 5),
            (DispatchResult{kF, Uniform(8, 8), kOk}));
}

TEST(CudagraphDispatcherTest, CaptureStagesForceEager) {
  CaptureLifecycle lifecycle;
  CudagraphDispatcher d(lifecycle);
  ASSERT_TRUE(
      d.Initialize(CudaGraphMode::FullAndPiecewise(), {1, 2, 4, 8}, 8, 1).ok());
  // Nothing captured yet, and while the capture session runs: eager.
  EXPECT_EQ(lifecycle.stage(), CaptureStage::kNotCaptured);
  EXPECT_EQ(d.Dispatch(4, kUniform, 4),
            (DispatchResult{kN, Relaxed(4), FallbackReason::kStillCapturing}));
  {
    CaptureLifecycle::CaptureWindow capturing(lifecycle);
    EXPECT_EQ(
        d.Dispatch(4, kUniform, 4),
        (DispatchResult{kN, Relaxed(4), FallbackReason::kStillCapturing}));
    EXPECT_EQ(
        d.Dispatch(100, kMixed),
        (DispatchResult{kN, Relaxed(100), FallbackReason::kStillCapturing}));
  }
  // A session that ended without being marked ready still serves eagerly.
  EXPECT_EQ(d.Dispatch(4, kMixed),
            (DispatchResult{kN, Relaxed(4), FallbackReason::kStillCapturing}));
  lifecycle.Disable();
  EXPECT_EQ(d.Dispatch(4, kMixed),
            (DispatchResult{kN, Relaxed(4), FallbackReason::kCaptureDisabled}));
  lifecycle.MarkReady();
  EXPECT_EQ(d.Dispatch(4, kMixed), (DispatchResult{kP, Relaxed(4), kOk}));
  EXPECT_EQ(d.Dispatch(4, kUniform, 4),
            (DispatchResult{kF, Uniform(4, 4), kOk}));
  // Re-initializing reads the same lifecycle; it does not reset it.
  lifecycle.Disable();
  ASSERT_TRUE(d.Initialize(CudaGraphMode::Piecewise(), {4}, 8, 1).ok());
  EXPECT_EQ(lifecycle.stage(), CaptureStage::kDisabled);
  EXPECT_EQ(d.Dispatch(3, kMixed),
            (DispatchResult{kN, Relaxed(3), FallbackReason::kCaptureDisabled}));
  lifecycle.MarkReady();
  EXPECT_THAT(d.keys(kF), IsEmpty());
  EXPECT_EQ(d.Dispatch(3, kMixed), (DispatchResult{kP, Relaxed(4), kOk}));
}

TEST(CudagraphDispatcherTest, WithoutALifecycleKeysAreReady) {
  // Tools and tests: decisions straight from the key sets.
  CudagraphDispatcher d;
  ASSERT_TRUE(
      d.Initialize(CudaGraphMode::FullAndPiecewise(), {1, 2, 4, 8}, 8, 1).ok());
  EXPECT_EQ(d.Dispatch(4, kMixed), (DispatchResult{kP, Relaxed(4), kOk}));
  EXPECT_EQ(d.Dispatch(4, kUniform, 4),
            (DispatchResult{kF, Uniform(4, 4), kOk}));
}

TEST(CudagraphDispatcherTest, ModeNoneWinsOverCaptureStage) {
  CaptureLifecycle lifecycle;
  CudagraphDispatcher d(lifecycle);
  ASSERT_TRUE(d.Initialize(CudaGraphMode::None(), {}, 8, 1).ok());
  EXPECT_EQ(d.Dispatch(4, kMixed),
            (DispatchResult{kN, Relaxed(4), FallbackReason::kModeNone}));
  lifecycle.Disable();
  EXPECT_EQ(d.Dispatch(4, kMixed),
            (DispatchResult{kN, Relaxed(4), FallbackReason::kModeNone}));
}

TEST(CudagraphDispatcherTest, AboveMaxCaptureSizeOnlyOnceReady) {
  // The capture stage is checked before the size: a step above the largest
  // size reports still_capturing until graphs exist, as it always has.
  CaptureLifecycle lifecycle;
  CudagraphDispatcher d(lifecycle);
  ASSERT_TRUE(d.Initialize(CudaGraphMode::Full(), {1, 2, 4}, 8, 1).ok());
  EXPECT_EQ(d.Dispatch(9, kMixed).reason, FallbackReason::kStillCapturing);
  lifecycle.MarkReady();
  EXPECT_EQ(d.Dispatch(9, kMixed).reason, FallbackReason::kAboveMaxCaptureSize);
}

TEST(CudagraphDispatcherTest, UninitializedIsEager) {
  CudagraphDispatcher d;
  EXPECT_FALSE(d.initialized());
  EXPECT_EQ(d.Dispatch(1, kMixed),
            (DispatchResult{kN, Relaxed(1), FallbackReason::kModeNone}));
}

TEST(CudagraphDispatcherTest, EmptyBatchHasNoKey) {
  CudagraphDispatcher d;
  ASSERT_TRUE(d.Initialize(CudaGraphMode::Full(), {1, 2}, 8, 1).ok());
  EXPECT_EQ(
      d.Dispatch(0, kMixed),
      (DispatchResult{kN, Relaxed(0), FallbackReason::kNoKeyForBatchShape}));
}

TEST(CudagraphDispatcherTest, CaptureDescsPiecewiseFirstLargestFirst) {
  CudagraphDispatcher d;
  ASSERT_TRUE(
      d.Initialize(CudaGraphMode::FullAndPiecewise(), {1, 2, 4, 8}, 8, 1).ok());
  const auto descs = d.GetCaptureDescs();
  ASSERT_EQ(descs.size(), 2u);
  EXPECT_EQ(descs[0].first, kP);
  EXPECT_THAT(descs[0].second,
              ElementsAre(Relaxed(8), Relaxed(4), Relaxed(2), Relaxed(1)));
  EXPECT_EQ(descs[1].first, kF);
  EXPECT_THAT(descs[1].second, ElementsAre(Uniform(8, 8), Uniform(4, 4),
                                           Uniform(2, 2), Uniform(1, 1)));
}

TEST(CudagraphDispatcherTest, CaptureDescsFullMixesUniformAndRelaxed) {
  CudagraphDispatcher d;
  ASSERT_TRUE(d.Initialize(CudaGraphMode::Full(), {2, 4}, 8, 1).ok());
  const auto descs = d.GetCaptureDescs();
  ASSERT_EQ(descs.size(), 1u);
  EXPECT_EQ(descs[0].first, kF);
  EXPECT_THAT(descs[0].second, ElementsAre(Uniform(4, 4), Relaxed(4),
                                           Uniform(2, 2), Relaxed(2)));
}

TEST(CudagraphDispatcherTest, CaptureDescsEmptyForNone) {
  CudagraphDispatcher d;
  ASSERT_TRUE(d.Initialize(CudaGraphMode::None(), {1, 2}, 8, 1).ok());
  EXPECT_THAT(d.GetCaptureDescs(), IsEmpty());
}

TEST(CudagraphDispatcherInitTest, RejectsBadArgumentsNamingThem) {
  struct Case {
    CudaGraphMode mode;
    std::vector<int> sizes;
    int max_num_seqs;
    int query_len;
    const char* needle;
  };
  const Case cases[] = {
      {CudaGraphMode::Full(), {}, 8, 1, "capture_sizes is empty"},
      {CudaGraphMode::Piecewise(), {0, 4}, 8, 1, "capture_sizes[0] = 0"},
      {CudaGraphMode::FullAndPiecewise(), {4, 2}, 8, 1, "sorted ascending"},
      {CudaGraphMode::FullDecodeOnly(), {2, 2}, 8, 1, "without duplicates"},
      {CudaGraphMode::Full(), {1, 2}, 0, 1, "max_num_seqs"},
      {CudaGraphMode::Full(), {1, 2}, 8, 0, "uniform_decode_query_len"},
  };
  for (const Case& c : cases) {
    CudagraphDispatcher d;
    absl::Status status =
        d.Initialize(c.mode, c.sizes, c.max_num_seqs, c.query_len);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.needle;
    EXPECT_THAT(status.message(), HasSubstr(c.needle));
    EXPECT_FALSE(d.initialized());
  }
}

TEST(FallbackReasonTest, StableSnakeCaseNames) {
  EXPECT_EQ(FallbackReasonName(FallbackReason::kNone), "none");
  EXPECT_EQ(FallbackReasonName(FallbackReason::kModeNone), "mode_none");
  EXPECT_EQ(FallbackReasonName(FallbackReason::kAboveMaxCaptureSize),
            "above_max_capture_size");
  EXPECT_EQ(FallbackReasonName(FallbackReason::kNoKeyForBatchShape),
            "no_key_for_batch_shape");
  EXPECT_EQ(FallbackReasonName(FallbackReason::kCaptureDisabled),
            "capture_disabled");
  EXPECT_EQ(FallbackReasonName(FallbackReason::kStillCapturing),
            "still_capturing");
  std::ostringstream os;
  os << DispatchResult{kF, Uniform(8, 8), kOk};
  EXPECT_EQ(os.str(),
            "{FULL, BatchDescriptor(num_tokens=8, num_reqs=8, uniform=true), "
            "none}");
}

}  // namespace
}  // namespace pdworker
