// GraphWrapper on real backends (CPU here; CUDA in graph_wrapper_gpu_test):
// capture/replay/passthrough, nested FULL and PIECEWISE wrappers, capture
// only while the capture lifecycle is capturing, and the input-address debug
// check. Plus unit tests on a fake backend.
#include "dispatcher/graph_wrapper.h"

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "dispatcher/capture_lifecycle.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/runtime/backend_fixture.h"
#include "worker/runtime/testing/test_ops.h"

namespace pdworker {
namespace {

using ::testing::HasSubstr;

constexpr size_t kN = 64;
const BatchDescriptor kKey8{8, 8, true};
const BatchDescriptor kKey16{16, 0, false};

ForwardContext Full(const BatchDescriptor& key) {
  return ForwardContext{RuntimeMode::kFull, key};
}
ForwardContext Piecewise(const BatchDescriptor& key) {
  return ForwardContext{RuntimeMode::kPiecewise, key};
}
ForwardContext None(const BatchDescriptor& key) {
  return ForwardContext{RuntimeMode::kNone, key};
}

// A two-piece toy model split at "attention", as the worker's model is:
//   piece1:    h = x * w + 1        (PIECEWISE wrapper "piece1")
//   attention: h = 0.5 * x + h      (always eager in PIECEWISE mode)
//   piece2:    y = h * h + 2        (PIECEWISE wrapper "piece2")
// and a FULL wrapper "full_forward" around the whole forward.
class GraphWrapperTest : public BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    x_ = NewFloats(kN, "x");
    w_ = NewFloats(kN, "w");
    h_ = NewFloats(kN, "h");
    y_ = NewFloats(kN, "y");
    moved_x_ = NewFloats(kN, "moved_x");
    input_ = &x_;
    Upload(w_, Ramp(kN, 0.75f));
    piece1_ = MakeWrapper(
        RuntimeMode::kPiecewise, "piece1", [this](const ForwardContext&) {
          return test_ops::MulAdd(stream(), *input_, w_, 1.0f, h_);
        });
    piece2_ = MakeWrapper(RuntimeMode::kPiecewise, "piece2",
                          [this](const ForwardContext&) {
                            return test_ops::MulAdd(stream(), h_, h_, 2.0f, y_);
                          });
    full_ = MakeWrapper(
        RuntimeMode::kFull, "full_forward",
        [this](const ForwardContext& context) { return ModelBody(context); });
  }

  std::unique_ptr<GraphWrapper> MakeWrapper(
      RuntimeMode mode, const std::string& name, GraphWrapper::Runnable body,
      InputAddressCheck check = InputAddressCheck::kOff,
      CapturePolicy policy = CapturePolicy::kCapturePhaseOnly) {
    GraphWrapper::Params params;
    params.runnable = std::move(body);
    params.mode = mode;
    params.backend = &stream();
    params.capture_lifecycle = &lifecycle_;
    params.options.name = name;
    params.options.input_address_check = check;
    params.options.capture_policy = policy;
    return std::make_unique<GraphWrapper>(std::move(params));
  }

  absl::Status ModelBody(const ForwardContext& context) {
    const void* inputs[] = {input_->data(), w_.data()};
    absl::Status st = piece1_->Run(context, inputs);
    if (!st.ok()) return st;
    ++attention_launches_;  // Host-side: counts executions of the body.
    st = test_ops::Axpy(stream(), 0.5f, *input_, h_);
    if (!st.ok()) return st;
    const void* hidden[] = {h_.data()};
    return piece2_->Run(context, hidden);
  }

  absl::Status Forward(const ForwardContext& context) {
    const void* inputs[] = {input_->data(), w_.data()};
    return full_->Run(context, inputs);
  }

  // The eager result for the current contents of x and w.
  std::vector<float> EagerOutput() {
    EXPECT_TRUE(Forward(None(kKey8)).ok());
    return Download(y_);
  }

  DeviceBuffer x_, w_, h_, y_, moved_x_;
  // The buffer the model reads its input from. Deliberately a host-side
  // pointer: it is read when ops are launched, i.e. frozen at capture.
  DeviceBuffer* input_ = nullptr;
  CaptureLifecycle lifecycle_;
  int attention_launches_ = 0;
  std::unique_ptr<GraphWrapper> piece1_, piece2_, full_;
};

TEST_P(GraphWrapperTest, FullModeOnlyTheOuterWrapperCapturesAndReplays) {
  Upload(x_, Ramp(kN, -1.0f));
  {
    CaptureLifecycle::CaptureWindow capturing(lifecycle_);
    ASSERT_TRUE(Forward(Full(kKey8)).ok());
  }
  const std::vector<float> captured_call_output = Download(y_);
  EXPECT_EQ(full_->counters().captures, 1);
  EXPECT_EQ(piece1_->counters().passthroughs, 1);
  EXPECT_EQ(piece2_->counters().passthroughs, 1);
  EXPECT_EQ(piece1_->num_graphs() + piece2_->num_graphs(), 0u);
  EXPECT_EQ(attention_launches_, 1);
  // The capturing call's outputs are valid, like an eager run's.
  EXPECT_TRUE(BitIdentical(captured_call_output, EagerOutput()));

  Upload(x_, Ramp(kN, 3.0f));
  const int launches_before = attention_launches_;
  ASSERT_TRUE(Forward(Full(kKey8)).ok());
  const std::vector<float> replayed = Download(y_);
  EXPECT_EQ(full_->counters().replays, 1);
  // Replay never ran the body: the inner wrappers were not even called.
  EXPECT_EQ(attention_launches_, launches_before);
  EXPECT_EQ(piece1_->counters().replays + piece1_->counters().captures, 0);
  EXPECT_TRUE(BitIdentical(replayed, EagerOutput()));
}

TEST_P(GraphWrapperTest, PiecewiseModeOnlyTheInnerWrappersCaptureAndReplay) {
  Upload(x_, Ramp(kN, -1.0f));
  {
    CaptureLifecycle::CaptureWindow capturing(lifecycle_);
    ASSERT_TRUE(Forward(Piecewise(kKey16)).ok());
  }
  const std::vector<float> captured_call_output = Download(y_);
  EXPECT_EQ(full_->counters().passthroughs, 1);
  EXPECT_EQ(full_->num_graphs(), 0u);
  EXPECT_EQ(piece1_->counters().captures, 1);
  EXPECT_EQ(piece2_->counters().captures, 1);
  EXPECT_TRUE(BitIdentical(captured_call_output, EagerOutput()));

  Upload(x_, Ramp(kN, 3.0f));
  const int launches_before = attention_launches_;
  ASSERT_TRUE(Forward(Piecewise(kKey16)).ok());
  const std::vector<float> replayed = Download(y_);
  EXPECT_EQ(piece1_->counters().replays, 1);
  EXPECT_EQ(piece2_->counters().replays, 1);
  // Attention ran eagerly between the two piece replays.
  EXPECT_EQ(attention_launches_, launches_before + 1);
  EXPECT_TRUE(BitIdentical(replayed, EagerOutput()));
}

TEST_P(GraphWrapperTest, NoneModeActivatesNeitherLevel) {
  Upload(x_, Ramp(kN, 1.0f));
  CaptureLifecycle::CaptureWindow capturing(
      lifecycle_);  // Even while capture is allowed.
  ASSERT_TRUE(Forward(None(kKey8)).ok());
  ASSERT_TRUE(Forward(None(kKey16)).ok());
  EXPECT_EQ(full_->counters().passthroughs, 2);
  EXPECT_EQ(piece1_->counters().passthroughs, 2);
  EXPECT_EQ(piece2_->counters().passthroughs, 2);
  EXPECT_EQ(full_->num_graphs() + piece1_->num_graphs() + piece2_->num_graphs(),
            0u);
}

TEST_P(GraphWrapperTest, FullAndPiecewiseGraphsCoexistInTheSameWrappers) {
  {
    CaptureLifecycle::CaptureWindow capturing(lifecycle_);
    ASSERT_TRUE(Forward(Full(kKey8)).ok());
    ASSERT_TRUE(Forward(Piecewise(kKey16)).ok());
  }
  EXPECT_TRUE(full_->HasGraph(kKey8));
  EXPECT_FALSE(full_->HasGraph(kKey16));
  EXPECT_TRUE(piece1_->HasGraph(kKey16));
  EXPECT_FALSE(piece1_->HasGraph(kKey8));

  Upload(x_, Ramp(kN, 2.0f));
  ASSERT_TRUE(Forward(Full(kKey8)).ok());
  const std::vector<float> full_out = Download(y_);
  ASSERT_TRUE(Forward(Piecewise(kKey16)).ok());
  const std::vector<float> piecewise_out = Download(y_);
  const std::vector<float> eager = EagerOutput();
  EXPECT_TRUE(BitIdentical(full_out, eager));
  EXPECT_TRUE(BitIdentical(piecewise_out, eager));
}

TEST_P(GraphWrapperTest, DistinctKeysGetDistinctGraphs) {
  {
    CaptureLifecycle::CaptureWindow capturing(lifecycle_);
    ASSERT_TRUE(Forward(Full(kKey8)).ok());
    ASSERT_TRUE(Forward(Full(kKey16)).ok());
  }
  EXPECT_EQ(full_->counters().captures, 2);
  EXPECT_EQ(full_->num_graphs(), 2u);
  ASSERT_TRUE(Forward(Full(kKey16)).ok());
  ASSERT_TRUE(Forward(Full(kKey8)).ok());
  EXPECT_EQ(full_->counters().replays, 2);
  EXPECT_EQ(full_->counters().captures, 2);
}

TEST_P(GraphWrapperTest, CaptureOutsideTheCapturePhaseFailsClearly) {
  // Before the session, after it (not yet marked ready), once ready and once
  // disabled: capture is refused in every stage but kCapturing.
  { CaptureLifecycle::CaptureWindow capturing(lifecycle_); }
  ASSERT_EQ(lifecycle_.stage(), CaptureStage::kNotCaptured);
  const absl::Status full = Forward(Full(kKey8));
  EXPECT_EQ(full.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(full.message()), HasSubstr("'full_forward' (FULL"));
  EXPECT_THAT(std::string(full.message()), HasSubstr(kKey8.ToString()));
  EXPECT_THAT(std::string(full.message()), HasSubstr("capture phase"));
  EXPECT_EQ(full_->num_graphs(), 0u);
  EXPECT_EQ(full_->counters().captures, 0);
  EXPECT_FALSE(stream().IsCapturing());

  const absl::Status piecewise = Forward(Piecewise(kKey16));
  EXPECT_EQ(piecewise.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(piecewise.message()), HasSubstr("'piece1'"));
  EXPECT_FALSE(stream().IsCapturing());

  lifecycle_.MarkReady();
  EXPECT_EQ(Forward(Full(kKey8)).code(), absl::StatusCode::kFailedPrecondition);
  lifecycle_.Disable();
  EXPECT_EQ(Forward(Piecewise(kKey16)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(full_->num_graphs() + piece1_->num_graphs() + piece2_->num_graphs(),
            0u);
}

TEST_P(GraphWrapperTest, LazyPolicyCapturesOnFirstUse) {
  auto lazy = MakeWrapper(
      RuntimeMode::kFull, "lazy",
      [this](const ForwardContext& c) { return ModelBody(c); },
      InputAddressCheck::kOff, CapturePolicy::kLazy);
  Upload(x_, Ramp(kN, 0.5f));
  ASSERT_TRUE(lazy->Run(Full(kKey8)).ok());
  const std::vector<float> first = Download(y_);
  ASSERT_TRUE(lazy->Run(Full(kKey8)).ok());
  EXPECT_EQ(lazy->counters().captures, 1);
  EXPECT_EQ(lazy->counters().replays, 1);
  EXPECT_TRUE(BitIdentical(first, EagerOutput()));
}

TEST_P(GraphWrapperTest, DebugCheckCatchesAnInputThatMoved) {
  auto checked = MakeWrapper(
      RuntimeMode::kFull, "checked",
      [this](const ForwardContext& c) { return ModelBody(c); },
      InputAddressCheck::kOn);
  auto unchecked =
      MakeWrapper(RuntimeMode::kFull, "unchecked",
                  [this](const ForwardContext& c) { return ModelBody(c); });
  Upload(x_, Ramp(kN, 1.0f));
  Upload(moved_x_, Ramp(kN, 8.0f));
  {
    CaptureLifecycle::CaptureWindow capturing(lifecycle_);
    const void* inputs[] = {x_.data(), w_.data()};
    ASSERT_TRUE(checked->Run(Full(kKey8), inputs).ok());
    ASSERT_TRUE(unchecked->Run(Full(kKey8), inputs).ok());
  }
  const std::vector<float> from_x = EagerOutput();

  // The runner (wrongly) puts the next step's input in another buffer.
  input_ = &moved_x_;
  const void* moved[] = {moved_x_.data(), w_.data()};
  const absl::Status caught = checked->Run(Full(kKey8), moved);
  EXPECT_EQ(caught.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(caught.message()), HasSubstr("input 0 moved"));
  EXPECT_THAT(std::string(caught.message()), HasSubstr("'checked'"));
  EXPECT_EQ(checked->counters().replays, 0);

  // Without the check the replay silently reads the captured buffer.
  ASSERT_TRUE(unchecked->Run(Full(kKey8), moved).ok());
  const std::vector<float> stale = Download(y_);
  EXPECT_TRUE(BitIdentical(stale, from_x));
  EXPECT_FALSE(BitIdentical(stale, EagerOutput()));

  // Inputs with a different count are caught too.
  input_ = &x_;
  const void* one[] = {x_.data()};
  EXPECT_THAT(std::string(checked->Run(Full(kKey8), one).message()),
              HasSubstr("replay got 1 input buffers, capture recorded 2"));
  const void* same[] = {x_.data(), w_.data()};
  EXPECT_TRUE(checked->Run(Full(kKey8), same).ok());
}

TEST_P(GraphWrapperTest, FailedCaptureCachesNothingAndTheNextCallRetries) {
  bool misbehave = true;
  auto wrapper =
      MakeWrapper(RuntimeMode::kFull, "flaky", [&](const ForwardContext& c) {
        absl::Status st = ModelBody(c);
        // A host read of device memory inside the graph: forbidden.
        if (st.ok() && misbehave) st = stream().Synchronize();
        return st;
      });
  CaptureLifecycle::CaptureWindow capturing(lifecycle_);
  const absl::Status failed = wrapper->Run(Full(kKey8));
  EXPECT_EQ(failed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(failed.message()), HasSubstr("Stream::Synchronize"));
  EXPECT_THAT(std::string(failed.message()), HasSubstr("'flaky'"));
  EXPECT_EQ(wrapper->num_graphs(), 0u);
  EXPECT_EQ(wrapper->counters().captures, 0);
  EXPECT_FALSE(stream().IsCapturing());

  misbehave = false;
  ASSERT_TRUE(wrapper->Run(Full(kKey8)).ok());
  EXPECT_EQ(wrapper->counters().captures, 1);
}

PDW_INSTANTIATE_BACKEND_TESTS(GraphWrapperTest);

// --- The wrapper's own logic, against a fake backend. ---

class FakeGraph : public CapturedGraph {
 public:
  explicit FakeGraph(int* replays) : replays_(replays) {}
  absl::Status Replay() override {
    ++*replays_;
    return replay_status;
  }
  size_t num_nodes() const override { return 1; }
  absl::Status replay_status;

 private:
  int* replays_;
};

class FakeBackend : public GraphBackend {
 public:
  absl::Status BeginCapture() override {
    ++begins;
    return begin_status;
  }
  absl::StatusOr<std::unique_ptr<CapturedGraph>> EndCapture() override {
    ++ends;
    if (!end_status.ok()) return end_status;
    return std::unique_ptr<CapturedGraph>(new FakeGraph(&graph_replays));
  }
  absl::Status begin_status;
  absl::Status end_status;
  int begins = 0, ends = 0, graph_replays = 0;
};

class GraphWrapperLogicTest : public ::testing::Test {
 protected:
  std::unique_ptr<GraphWrapper> Make(RuntimeMode mode) {
    GraphWrapper::Params params;
    params.runnable = [this](const ForwardContext&) {
      ++body_runs_;
      return body_status_;
    };
    params.mode = mode;
    params.backend = &backend_;
    params.capture_lifecycle = &lifecycle_;
    params.options.name = "logic";
    params.options.capture_policy = CapturePolicy::kLazy;
    return std::make_unique<GraphWrapper>(std::move(params));
  }

  FakeBackend backend_;
  CaptureLifecycle lifecycle_;
  int body_runs_ = 0;
  absl::Status body_status_;
};

TEST_F(GraphWrapperLogicTest, CaptureRecordsOnceThenLaunchesTheNewGraph) {
  auto wrapper = Make(RuntimeMode::kFull);
  ASSERT_TRUE(wrapper->Run(Full(kKey8)).ok());
  EXPECT_EQ(backend_.begins, 1);
  EXPECT_EQ(backend_.ends, 1);
  EXPECT_EQ(body_runs_, 1);
  // Stream capture records without executing, so the capture call launches
  // the graph once itself; that launch is not counted as a replay.
  EXPECT_EQ(backend_.graph_replays, 1);
  EXPECT_EQ(wrapper->counters().replays, 0);
  ASSERT_TRUE(wrapper->Run(Full(kKey8)).ok());
  EXPECT_EQ(body_runs_, 1);
  EXPECT_EQ(backend_.graph_replays, 2);
  EXPECT_EQ(wrapper->counters().replays, 1);
}

// Replay(key) launches the cached graph as it is (benchmarks time the
// forward alone with it): no body run, no counter moved; NOT_FOUND before
// the key is captured. NumNodes reports the graph's node count.
TEST_F(GraphWrapperLogicTest, ReplayOfAKeyLaunchesItsGraphAndNothingElse) {
  auto wrapper = Make(RuntimeMode::kFull);
  EXPECT_EQ(wrapper->Replay(kKey8).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(wrapper->NumNodes(kKey8), 0u);
  ASSERT_TRUE(wrapper->Run(Full(kKey8)).ok());
  const int replays_before = backend_.graph_replays;
  ASSERT_TRUE(wrapper->Replay(kKey8).ok());
  EXPECT_EQ(backend_.graph_replays, replays_before + 1);
  EXPECT_EQ(body_runs_, 1);
  EXPECT_EQ(wrapper->counters().replays, 0);
  EXPECT_EQ(wrapper->NumNodes(kKey8), 1u);
}

TEST_F(GraphWrapperLogicTest, OtherModesPassThrough) {
  auto piecewise = Make(RuntimeMode::kPiecewise);
  ASSERT_TRUE(piecewise->Run(Full(kKey8)).ok());
  ASSERT_TRUE(piecewise->Run(None(kKey8)).ok());
  EXPECT_EQ(piecewise->counters().passthroughs, 2);
  EXPECT_EQ(backend_.begins, 0);
  EXPECT_EQ(body_runs_, 2);
}

TEST_F(GraphWrapperLogicTest, BackendFailuresAreAnnotatedAndNothingIsCached) {
  auto wrapper = Make(RuntimeMode::kFull);
  backend_.begin_status = absl::InternalError("no capture for you");
  absl::Status status = wrapper->Run(Full(kKey8));
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("GraphWrapper 'logic' (FULL, BatchDescriptor("));
  EXPECT_THAT(std::string(status.message()), HasSubstr("no capture for you"));
  EXPECT_EQ(body_runs_, 0);

  backend_.begin_status = absl::OkStatus();
  backend_.end_status = absl::FailedPreconditionError("invalidated");
  status = wrapper->Run(Full(kKey8));
  EXPECT_THAT(std::string(status.message()), HasSubstr("invalidated"));
  EXPECT_EQ(wrapper->num_graphs(), 0u);

  // A failing body still ends the capture, and its error wins.
  backend_.end_status = absl::OkStatus();
  body_status_ = absl::InvalidArgumentError("bad body");
  const int ends = backend_.ends;
  status = wrapper->Run(Full(kKey8));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_.ends, ends + 1);
  EXPECT_EQ(wrapper->num_graphs(), 0u);

  body_status_ = absl::OkStatus();
  EXPECT_TRUE(wrapper->Run(Full(kKey8)).ok());
  EXPECT_EQ(wrapper->num_graphs(), 1u);
}

TEST_F(GraphWrapperLogicTest, WrapperMustBeBoundToAGraphMode) {
  EXPECT_DEATH(Make(RuntimeMode::kNone), "FULL or PIECEWISE");
}

}  // namespace
}  // namespace pdworker
