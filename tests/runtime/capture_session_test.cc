// The startup capture loop: order, warm-ups, counts, the capture lifecycle's
// window, and the per-mode cost report.
#include "worker/runtime/capture_session.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dispatcher/graph_wrapper.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/runtime/backend_fixture.h"
#include "worker/runtime/testing/test_ops.h"

namespace pdworker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class CaptureSessionTest : public BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    x_ = NewFloats(64, "x");
    GraphWrapper::Params params;
    params.runnable = [this](const ForwardContext& context) {
      ++body_runs_;
      // A key-dependent scalar, so graphs for different keys differ.
      return test_ops::Fill(
          stream(), x_,
          static_cast<float>(context.batch_descriptor.num_tokens));
    };
    params.mode = RuntimeMode::kFull;
    params.backend = &stream();
    params.capture_lifecycle = &lifecycle_;
    params.options.name = "full_forward";
    full_ = std::make_unique<GraphWrapper>(std::move(params));
  }

  CaptureSessionParams Params() {
    CaptureSessionParams params;
    params.device = &device();
    params.stream = &stream();
    params.capture_lifecycle = &lifecycle_;
    params.num_warmups = 2;
    params.prepare_inputs = [this](const BatchDescriptor& key) {
      log_.push_back(absl::StrCat("prepare ", key.num_tokens));
      return absl::OkStatus();
    };
    params.forward = [this](const ForwardContext& context) {
      EXPECT_TRUE(lifecycle_.CaptureAllowed());
      log_.push_back(absl::StrCat(RuntimeModeName(context.runtime_mode), " ",
                                  context.batch_descriptor.num_tokens));
      return full_->Run(context);
    };
    return params;
  }

  DeviceBuffer x_;
  CaptureLifecycle lifecycle_;
  std::unique_ptr<GraphWrapper> full_;
  int body_runs_ = 0;
  std::vector<std::string> log_;
};

TEST_P(CaptureSessionTest, WarmsUpThenCapturesLargestFirst) {
  CaptureSessionParams params = Params();
  params.descs = {{RuntimeMode::kFull,
                   {BatchDescriptor{2, 2, true}, BatchDescriptor{8, 8, true},
                    BatchDescriptor{4, 4, true}}}};
  absl::StatusOr<CaptureSummary> summary = RunCaptureSession(params);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_THAT(log_, ElementsAre("prepare 8", "NONE 8", "NONE 8", "FULL 8",
                                "prepare 4", "NONE 4", "NONE 4", "FULL 4",
                                "prepare 2", "NONE 2", "NONE 2", "FULL 2"));
  // The window closes with the session; readiness is the owner's call.
  EXPECT_EQ(lifecycle_.stage(), CaptureStage::kNotCaptured);
  ASSERT_EQ(summary->modes.size(), 1u);
  const ModeCaptureSummary& full = summary->modes[0];
  EXPECT_EQ(full.mode, RuntimeMode::kFull);
  EXPECT_EQ(full.num_graphs, 3);
  EXPECT_EQ(full.num_warmup_runs, 6);
  EXPECT_GE(full.seconds, 0.0);
  EXPECT_EQ(summary->total_graphs, 3);
  EXPECT_EQ(full_->counters().captures, 3);
  EXPECT_EQ(full_->counters().passthroughs, 6);

  // The graphs are usable on the step path afterwards, one per key.
  ASSERT_TRUE(
      full_
          ->Run(ForwardContext{RuntimeMode::kFull, BatchDescriptor{4, 4, true}})
          .ok());
  EXPECT_EQ(Download(x_)[0], 4.0f);
  ASSERT_TRUE(
      full_
          ->Run(ForwardContext{RuntimeMode::kFull, BatchDescriptor{8, 8, true}})
          .ok());
  EXPECT_EQ(Download(x_)[0], 8.0f);
  EXPECT_EQ(full_->counters().replays, 2);
}

TEST_P(CaptureSessionTest, ReportsEachModeAndItsMemoryDelta) {
  std::vector<DeviceMemory> kept;
  CaptureSessionParams params = Params();
  params.num_warmups = 0;
  // Stand-in for what capture costs on a GPU: 2 MiB of device memory per
  // PIECEWISE key (allocated outside capture, so it is legal). 2 MiB is the
  // CUDA allocation granularity: smaller cudaMallocs may be packed into a
  // page an earlier allocation left partly free, which cudaMemGetInfo would
  // not see.
  params.prepare_inputs = [&](const BatchDescriptor& key) {
    if (key.uniform) return absl::OkStatus();
    absl::StatusOr<DeviceMemory> memory = device().Allocate(size_t{2} << 20);
    if (!memory.ok()) return memory.status();
    kept.push_back(*std::move(memory));
    return absl::OkStatus();
  };
  params.forward = [](const ForwardContext&) { return absl::OkStatus(); };
  params.descs = {
      {RuntimeMode::kFull, {BatchDescriptor{1, 1, true}}},
      {RuntimeMode::kPiecewise,
       {BatchDescriptor{16, 0, false}, BatchDescriptor{32, 0, false}}}};
  absl::StatusOr<CaptureSummary> summary = RunCaptureSession(params);
  ASSERT_TRUE(summary.ok()) << summary.status();
  ASSERT_EQ(summary->modes.size(), 2u);
  EXPECT_EQ(summary->modes[0].mode, RuntimeMode::kFull);
  EXPECT_EQ(summary->modes[1].mode, RuntimeMode::kPiecewise);
  EXPECT_EQ(summary->modes[1].num_graphs, 2);
  EXPECT_GE(summary->modes[1].memory_delta_bytes, int64_t{4} << 20);
  if (kind() == DeviceKind::kCpu) {
    // The CPU backend accounts exactly.
    EXPECT_EQ(summary->modes[0].memory_delta_bytes, 0);
    EXPECT_EQ(summary->modes[1].memory_delta_bytes, int64_t{4} << 20);
    EXPECT_EQ(summary->total_memory_delta_bytes, int64_t{4} << 20);
  }
}

TEST_P(CaptureSessionTest, ErrorsNameTheStageModeAndKey) {
  CaptureSessionParams params = Params();
  params.prepare_inputs = [](const BatchDescriptor& key) {
    if (key.num_tokens == 4) return absl::InternalError("no dummy inputs");
    return absl::OkStatus();
  };
  params.descs = {{RuntimeMode::kFull,
                   {BatchDescriptor{8, 8, true}, BatchDescriptor{4, 4, true}}}};
  absl::StatusOr<CaptureSummary> summary = RunCaptureSession(params);
  ASSERT_FALSE(summary.ok());
  EXPECT_EQ(summary.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(
      std::string(summary.status().message()),
      HasSubstr("preparing inputs for FULL BatchDescriptor(num_tokens=4"));
  EXPECT_FALSE(lifecycle_.CaptureAllowed());
  EXPECT_EQ(full_->num_graphs(), 1u) << "the 8-token graph was captured first";
}

TEST_P(CaptureSessionTest, RejectsIncompleteParams) {
  CaptureSessionParams params = Params();
  params.forward = nullptr;
  EXPECT_EQ(RunCaptureSession(params).status().code(),
            absl::StatusCode::kInvalidArgument);
  params = Params();
  params.descs = {{RuntimeMode::kNone, {BatchDescriptor{1, 1, true}}}};
  EXPECT_EQ(RunCaptureSession(params).status().code(),
            absl::StatusCode::kInvalidArgument);
}

PDW_INSTANTIATE_BACKEND_TESTS_WITH_THREADED_CPU(CaptureSessionTest);

}  // namespace
}  // namespace pdworker
