// Requests that end early: aborted while queued, prefilling or decoding,
// cancelled by their client, past their deadline, failed by a device error,
// refused at admission, or cut by a drain or a stop. Every one ends with
// exactly one last update and leaves no KV behind.
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dispatcher/compilation_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/engine_test_util.h"
#include "worker/runtime/cpu_stream.h"

namespace pdworker {
namespace {

using engine_testing::Generation;
using engine_testing::PendingGeneration;
using engine_testing::Prompt;
using engine_testing::Spec;
using ::testing::HasSubstr;

class EngineAbortTest : public ::testing::TestWithParam<StepOverlap> {
 protected:
  void Start(ModelRunnerOptions options = engine_testing::SmallOptions(),
             EngineOptions engine_options = {}) {
    engine_options.overlap = GetParam();
    t_ = engine_testing::StartEngine(engine_testing::ModelDir(), options,
                                     engine_options);
  }
  Engine& engine() { return *t_->engine; }
  int UsedBlocks() { return engine().snapshot().kv.used_blocks; }

  template <typename F>
  static bool WaitFor(F done) {
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return true;
  }

  std::unique_ptr<engine_testing::TestEngine> t_;
};

TEST_P(EngineAbortTest, AbortWhileQueuedFreesEverything) {
  Start();
  engine().Pause();
  PendingGeneration p(engine(), Spec("q", Prompt(30, 1), 10));
  ASSERT_TRUE(
      WaitFor([&] { return engine().snapshot().waiting_requests == 1; }));
  absl::StatusOr<AbortOutcome> aborted = engine_testing::Abort(engine(), {"q"});
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  EXPECT_EQ(aborted->freed_blocks, 0);  // it held none yet
  const Generation g = p.Wait();
  EXPECT_TRUE(g.status.ok()) << g.status;
  EXPECT_EQ(g.finish_reason, FinishReason::kAbort);
  EXPECT_TRUE(g.tokens.empty());
  EXPECT_EQ(g.updates, 1);
  engine().Resume();
  const EngineSnapshot s = engine().snapshot();
  EXPECT_EQ(s.waiting_requests + s.running_requests, 0);
  EXPECT_EQ(UsedBlocks(), 0);
}

// What a RunExclusive task changed (an import reserving blocks, or giving
// them back after a failed pull) is in the snapshot, and so in GetStatus,
// by the time RunExclusive returns, even when the same batch of engine
// tasks has slower ones after it: a router reading GetStatus right after a
// failed ImportKv must see nothing held.
TEST_P(EngineAbortTest, ExclusiveTaskChangesShowWhenItReturns) {
  Start();
  ASSERT_EQ(UsedBlocks(), 0);
  SequenceKv kv;
  for (const bool allocate : {true, false}) {
    SCOPED_TRACE(allocate ? "allocate" : "free");
    // Holds the engine thread, so that the exclusive task and the slow one
    // queue up and run as one batch.
    std::atomic<bool> go{false};
    ASSERT_TRUE(engine()
                    .Post([&go](ModelRunner&) {
                      while (!go) {
                        std::this_thread::sleep_for(
                            std::chrono::milliseconds(1));
                      }
                    })
                    .ok());
    std::thread caller([&] {
      const absl::Status s = engine().RunExclusive([&](ModelRunner& r) {
        if (!allocate) {
          r.FreeDetached(kv);
          return absl::OkStatus();
        }
        absl::StatusOr<SequenceKv> blocks = r.AllocateDetached(40);
        if (!blocks.ok()) return blocks.status();
        kv = *std::move(blocks);
        return absl::OkStatus();
      });
      EXPECT_TRUE(s.ok()) << s;
      // The task ran; the slow one after it is still running.
      EXPECT_EQ(UsedBlocks(), allocate ? 10 : 0);  // 40 tokens, blocks of 4
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_TRUE(engine()
                    .Post([](ModelRunner&) {
                      std::this_thread::sleep_for(
                          std::chrono::milliseconds(300));
                    })
                    .ok());
    go = true;
    caller.join();
  }
}

TEST_P(EngineAbortTest, AbortWhilePrefillingFreesItsKvBeforeAnswering) {
  ModelRunnerOptions options = engine_testing::SmallOptions();
  options.max_num_batched_tokens = 4;  // a 120-token prompt: 30 chunks
  auto config = ParseCompilationConfig(
      R"({"cudagraph_mode":"FULL_AND_PIECEWISE",
          "cudagraph_capture_sizes":[1,2,4]})");
  ASSERT_TRUE(config.ok()) << config.status();
  options.compilation = *config;
  Start(options);
  bool caught_prefill = false;
  for (int attempt = 0; attempt < 20 && !caught_prefill; ++attempt) {
    const std::string id = absl::StrCat("p", attempt);
    PendingGeneration p(engine(), Spec(id, Prompt(120, attempt), 4));
    ASSERT_TRUE(
        WaitFor([&] { return engine().snapshot().kv.num_sequences > 0; }));
    absl::StatusOr<AbortOutcome> aborted =
        engine_testing::Abort(engine(), {id});
    const Generation g = p.Wait();
    if (!aborted.ok()) {  // it finished first; try again
      EXPECT_EQ(aborted.status().code(), absl::StatusCode::kNotFound);
      continue;
    }
    EXPECT_EQ(g.finish_reason, FinishReason::kAbort);
    caught_prefill = g.tokens.empty();
    if (caught_prefill) {
      EXPECT_GT(aborted->freed_blocks, 0);
    }
    // Freed before `done` ran: the snapshot published then shows it.
    EXPECT_EQ(UsedBlocks(), 0);
  }
  EXPECT_TRUE(caught_prefill) << "never caught a prompt mid-prefill";
}

TEST_P(EngineAbortTest, AbortWhileDecodingStopsTheStream) {
  Start();
  PendingGeneration p(engine(), Spec("d", Prompt(10, 2), 100));
  PendingGeneration other(engine(), Spec("other", Prompt(12, 3), 20));
  ASSERT_TRUE(WaitFor([&] { return p.TokensSoFar() >= 3; }));
  absl::StatusOr<AbortOutcome> aborted = engine_testing::Abort(engine(), {"d"});
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  EXPECT_GT(aborted->freed_blocks, 0);
  const Generation g = p.Wait();
  EXPECT_EQ(g.finish_reason, FinishReason::kAbort);
  EXPECT_GE(g.tokens.size(), 3u);
  EXPECT_LT(g.tokens.size(), 100u);
  // The other request is untouched.
  const Generation o = other.Wait();
  EXPECT_TRUE(o.status.ok());
  EXPECT_EQ(o.tokens.size(), 20u);
  EXPECT_EQ(UsedBlocks(), 0);
}

TEST_P(EngineAbortTest, AbortOfAnUnknownIdChangesNothing) {
  Start();
  PendingGeneration p(engine(), Spec("live", Prompt(10, 4), 30));
  ASSERT_TRUE(WaitFor([&] { return p.TokensSoFar() >= 1; }));
  absl::StatusOr<AbortOutcome> aborted =
      engine_testing::Abort(engine(), {"live", "nope"});
  ASSERT_FALSE(aborted.ok());
  EXPECT_EQ(aborted.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(aborted.status().message(), HasSubstr("'nope'"));
  const Generation g = p.Wait();  // all or nothing: "live" ran to the end
  EXPECT_EQ(g.finish_reason, FinishReason::kLength);
  EXPECT_EQ(g.tokens.size(), 30u);
}

TEST_P(EngineAbortTest, ClientCancellationAndDeadlineAbort) {
  Start();
  auto cancel = std::make_shared<CallControl>();
  PendingGeneration cancelled(engine(), Spec("c", Prompt(10, 5), 110), cancel);
  ASSERT_TRUE(WaitFor([&] { return cancelled.TokensSoFar() >= 2; }));
  cancel->cancelled.store(true);
  engine().NotifyCancelled();
  Generation g = cancelled.Wait();
  EXPECT_EQ(g.status.code(), absl::StatusCode::kCancelled) << g.status;
  EXPECT_LT(g.tokens.size(), 110u);
  // The deadline passes while the engine holds steps, so the request is
  // live (taken in, KV-less) but cannot finish first: a deadline short
  // enough to pass mid-decode let the 2-layer model finish 118 tokens in
  // time on a fast runner.
  engine().Pause();
  auto late = std::make_shared<CallControl>();
  late->deadline =
      std::chrono::system_clock::now() + std::chrono::milliseconds(30);
  PendingGeneration expired(engine(), Spec("e", Prompt(10, 6), 118), late);
  g = expired.Wait();
  engine().Resume();
  EXPECT_EQ(g.status.code(), absl::StatusCode::kDeadlineExceeded) << g.status;
  EXPECT_TRUE(g.tokens.empty());
  EXPECT_EQ(UsedBlocks(), 0);
  EXPECT_EQ(engine().snapshot().running_requests, 0);
}

TEST_P(EngineAbortTest, ADeviceErrorFailsTheStepsInFlightAndFreesTheirKv) {
  Start();
  std::vector<std::unique_ptr<PendingGeneration>> pending;
  for (int i = 0; i < 4; ++i) {
    pending.push_back(std::make_unique<PendingGeneration>(
        engine(), Spec(absl::StrCat("f", i), Prompt(10 + i, 10 + i), 100)));
  }
  ASSERT_TRUE(WaitFor([&] {
    for (const auto& p : pending) {
      if (p->TokensSoFar() < 2) return false;
    }
    return true;
  }));
  // As an illegal address would on a GPU: the stream faults between steps.
  ASSERT_TRUE(engine()
                  .Post([](ModelRunner& r) {
                    const absl::Status injected =
                        static_cast<CpuStream&>(r.stream())
                            .InjectFault(absl::InternalError("injected"));
                    CHECK(injected.ok()) << injected;
                  })
                  .ok());
  for (const auto& p : pending) {
    const Generation g = p->Wait();
    EXPECT_EQ(g.status.code(), absl::StatusCode::kInternal) << g.status;
    EXPECT_THAT(g.status.message(), HasSubstr("injected"));
    EXPECT_LT(g.tokens.size(), 100u);
  }
  EXPECT_EQ(UsedBlocks(), 0);
  EXPECT_FALSE(engine().snapshot().device_error.ok());
  // Every later step fails the same way, and keeps nothing.
  absl::StatusOr<ForwardOutcome> forward = engine_testing::Forward(
      engine(), "after", {1, 2, 3}, SequenceCreation::kMustBeNew);
  EXPECT_EQ(forward.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(engine().snapshot().kv.num_sequences, 0);
}

TEST_P(EngineAbortTest, BadRequestsAreRefusedNamingTheFieldAndChangeNothing) {
  Start();
  struct Bad {
    std::string name;
    RequestSpec spec;
    std::string field;
  };
  std::vector<Bad> bad;
  auto add = [&](std::string name, std::string field,
                 std::function<void(RequestSpec&)> change) {
    RequestSpec spec = Spec(name, Prompt(8, 1), 4);
    change(spec);
    bad.push_back({std::move(name), std::move(spec), std::move(field)});
  };
  add("empty_id", "request_id", [](RequestSpec& s) { s.request_id.clear(); });
  add("empty_prompt", "prompt", [](RequestSpec& s) { s.prompt.clear(); });
  add("vocab", "prompt[3]", [](RequestSpec& s) { s.prompt[3] = 256; });
  add("negative", "prompt[0]", [](RequestSpec& s) { s.prompt[0] = -1; });
  add("nan_temperature", "temperature", [](RequestSpec& s) {
    s.sampling.temperature = std::numeric_limits<float>::quiet_NaN();
  });
  add("top_p", "top_p", [](RequestSpec& s) { s.sampling.top_p = 1.5f; });
  add("top_k", "top_k", [](RequestSpec& s) { s.sampling.top_k = -2; });
  add("max_tokens", "max_tokens",
      [](RequestSpec& s) { s.stop.max_tokens = -1; });
  add("min_tokens", "min_tokens",
      [](RequestSpec& s) { s.stop.min_tokens = 5; });
  add("stop_ids", "stop_token_ids[1]", [](RequestSpec& s) {
    s.stop.stop_token_ids = {5, 300};
  });
  add("too_long", "maximum length",
      [](RequestSpec& s) { s.stop.max_tokens = 121; });  // 8 + 121 > 128
  for (const Bad& b : bad) {
    PendingGeneration p(engine(), b.spec);
    const Generation g = p.Wait();
    EXPECT_EQ(g.status.code(), absl::StatusCode::kInvalidArgument)
        << b.name << ": " << g.status;
    EXPECT_THAT(g.status.message(), HasSubstr(b.field)) << b.name;
    EXPECT_TRUE(g.tokens.empty()) << b.name;
    EXPECT_EQ(g.updates, 1) << b.name;
  }
  const EngineSnapshot s = engine().snapshot();
  EXPECT_EQ(s.kv.used_blocks, 0);
  EXPECT_EQ(s.waiting_requests + s.running_requests, 0);
  EXPECT_EQ(s.steps, 0);
}

TEST_P(EngineAbortTest, ARequestLongerThanTheModelAllowsIsRefused) {
  // The runner sizes the KV cache for at least one max_model_len sequence,
  // so what fits max_model_len always fits the cache: the length is the
  // limit a request is refused by.
  ModelRunnerOptions options = engine_testing::SmallOptions();
  options.max_model_len = 64;
  options.kv_cache_bytes = 16 * 1024;  // 16 blocks of 4 tokens: 64 tokens
  Start(options);
  PendingGeneration p(engine(), Spec("big", Prompt(40, 1), 30));
  const Generation g = p.Wait();
  EXPECT_EQ(g.status.code(), absl::StatusCode::kInvalidArgument) << g.status;
  EXPECT_THAT(g.status.message(), HasSubstr("maximum length of 64"));
  PendingGeneration whole(engine(), Spec("whole", Prompt(64, 1), 0));
  EXPECT_EQ(whole.Wait().status.code(), absl::StatusCode::kInvalidArgument);
  // Without max_tokens a request runs to the maximum length: 40 + 24.
  PendingGeneration fits(engine(), Spec("fits", Prompt(40, 1), 0));
  const Generation f = fits.Wait();
  EXPECT_TRUE(f.status.ok()) << f.status;
  EXPECT_EQ(f.tokens.size(), 24u);
  EXPECT_EQ(f.finish_reason, FinishReason::kLength);
}

TEST_P(EngineAbortTest, FullQueueAndDuplicateIdsAreRefused) {
  EngineOptions engine_options;
  engine_options.max_waiting_requests = 3;
  Start(engine_testing::SmallOptions(), engine_options);
  engine().Pause();
  PendingGeneration a(engine(), Spec("a", Prompt(5, 1), 3));
  PendingGeneration b(engine(), Spec("b", Prompt(5, 2), 3));
  // "a" is live (waiting): the same id again is refused.
  PendingGeneration duplicate(engine(), Spec("a", Prompt(5, 2), 3));
  const Generation d = duplicate.Wait();
  EXPECT_EQ(d.status.code(), absl::StatusCode::kAlreadyExists) << d.status;
  ASSERT_TRUE(
      WaitFor([&] { return engine().snapshot().waiting_requests == 2; }));
  PendingGeneration c(engine(), Spec("c", Prompt(5, 3), 3));
  PendingGeneration over(engine(), Spec("over", Prompt(5, 4), 3));
  const Generation full = over.Wait();
  EXPECT_EQ(full.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.status.message(), HasSubstr("max_waiting_requests=3"));
  engine().Resume();
  const Generation first = a.Wait();
  EXPECT_TRUE(first.status.ok()) << first.status;
  EXPECT_EQ(first.tokens.size(), 3u);
  EXPECT_TRUE(b.Wait().status.ok());
  EXPECT_TRUE(c.Wait().status.ok());
  // Once "a" has finished its id is free again.
  PendingGeneration again(engine(), Spec("a", Prompt(5, 1), 3));
  EXPECT_EQ(again.Wait().tokens, first.tokens);
}

TEST_P(EngineAbortTest, DrainRefusesNewRequestsAndFinishesLiveOnes) {
  Start();
  PendingGeneration live(engine(), Spec("live", Prompt(10, 1), 40));
  ASSERT_TRUE(WaitFor([&] { return live.TokensSoFar() >= 1; }));
  engine().BeginDrain();
  PendingGeneration refused(engine(), Spec("new", Prompt(10, 2), 4));
  const Generation r = refused.Wait();
  EXPECT_EQ(r.status.code(), absl::StatusCode::kUnavailable);
  const Generation g = live.Wait();
  EXPECT_TRUE(g.status.ok());
  EXPECT_EQ(g.tokens.size(), 40u);
}

TEST_P(EngineAbortTest, StopEndsLiveRequestsWithUnavailable) {
  Start();
  PendingGeneration live(engine(), Spec("live", Prompt(10, 1), 110));
  engine().Pause();
  PendingGeneration queued(engine(), Spec("queued", Prompt(10, 2), 4));
  engine().Stop();
  EXPECT_EQ(live.Wait().status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(queued.Wait().status.code(), absl::StatusCode::kUnavailable);
  PendingGeneration after(engine(), Spec("after", Prompt(10, 3), 4));
  EXPECT_EQ(after.Wait().status.code(), absl::StatusCode::kUnavailable);
}

INSTANTIATE_TEST_SUITE_P(Overlap, EngineAbortTest,
                         ::testing::Values(StepOverlap::kOff, StepOverlap::kOn),
                         [](const ::testing::TestParamInfo<StepOverlap>& i) {
                           return i.param == StepOverlap::kOn ? "overlap"
                                                              : "no_overlap";
                         });

}  // namespace
}  // namespace pdworker
