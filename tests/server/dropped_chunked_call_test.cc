// A deterministic regression test, first found by random_calls_test: a
// chunked call dropped between its chunks by its deadline must be undone
// before a later call on the same sequence runs, so that the later call
// never sees the half-run state (fixed in worker/engine/engine.cc,
// DropExpiredCalls).
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"

namespace pdworker {
namespace {

using server_testing::Input;
using server_testing::Request;
using server_testing::SmallRunnerOptions;
using server_testing::StartForward;
using server_testing::StartWorker;
using server_testing::WaitFor;

constexpr int kVocab = 256;  // SmallRunnerOptions' vocabulary

// A chunked call whose deadline passes between its chunks is dropped and its
// chunks are undone, and a later call on the same sequence (queued behind it:
// per-sequence arrival order) must see it undone, never the half-run state.
// Made deterministic with tasks posted to the engine: it runs the first
// chunk, pauses, and is held until the deadline has passed while the later
// call waits in its queue; then it resumes, and the same loop iteration drops
// the chunked call and plans the later one.
TEST(DroppedChunkedCallTest, LaterCallsSeeADroppedChunkedCallUndone) {
  enum class Later { kContinue, kRelease };
  struct Case {
    const char* name;
    bool
        live_before;  // the chunked call continues "x" (10 tokens) or starts it
    Later later;
  };
  const Case cases[] = {
      {"new sequence, then a step", false, Later::kContinue},
      {"new sequence, then Release", false, Later::kRelease},
      {"live sequence, then a step", true, Later::kContinue},
  };
  std::vector<int32_t> prompt(100);
  for (int i = 0; i < 100; ++i) prompt[i] = (7 * i + 1) % kVocab;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto w = StartWorker(SmallRunnerOptions());
    ASSERT_NE(w, nullptr);
    // Opened on every way out, before the worker (declared earlier) stops.
    struct Gate {
      std::promise<void> promise;
      std::shared_future<void> future = promise.get_future().share();
      bool open = false;
      void Open() {
        if (!open) promise.set_value();
        open = true;
      }
      ~Gate() { Open(); }
    } gate;
    Engine& engine = w->server->engine();
    v1::ForwardResponse response;
    if (c.live_before) {
      ASSERT_TRUE(server_testing::Forward(
                      *w->stub,
                      Request({Input("x", {prompt.begin(), prompt.begin() + 10},
                                     true)}),
                      &response)
                      .ok());
    }
    const v1::WorkerStatus before = w->Status();
    const int64_t steps_before = engine.snapshot().steps;

    // 100 tokens: two steps, 64 + 36.
    engine.Pause();
    const auto sent = std::chrono::system_clock::now();
    const auto timeout = std::chrono::seconds(1);
    auto chunked =
        StartForward(*w->stub, Request({Input("x", prompt, !c.live_before)}),
                     [&](grpc::ClientContext* context) {
                       context->set_deadline(sent + timeout);
                     });
    ASSERT_TRUE(WaitFor([&] { return engine.snapshot().queued_calls == 1; }));
    // The server's deadline for the call is the timeout from when it read
    // the call (gRPC sends a timeout, not a time): no later than now.
    const auto server_deadline = std::chrono::system_clock::now() + timeout;
    // This loop iteration resumes and runs the first chunk; the next one
    // pauses before the second.
    ASSERT_TRUE(engine
                    .Post([&engine](ModelRunner&) {
                      engine.Resume();
                      engine.Post([&engine](ModelRunner&) { engine.Pause(); })
                          .IgnoreError();
                    })
                    .ok());
    ASSERT_TRUE(
        WaitFor([&] { return engine.snapshot().steps > steps_before; }));

    // The later call on "x" waits behind the chunked one.
    std::unique_ptr<server_testing::PendingForward> step;
    grpc::ClientContext release_context;
    server_testing::SetGenerousDeadline(&release_context);
    v1::ReleaseRequest release;
    release.add_sequence_ids("x");
    v1::ReleaseResponse released;
    auto release_done = std::make_shared<std::promise<grpc::Status>>();
    if (c.later == Later::kContinue) {
      step = StartForward(*w->stub, Request({Input("x", {3}, false)}));
    } else {
      w->stub->async()->Release(&release_context, &release, &released,
                                [release_done](const grpc::Status& s) {
                                  release_done->set_value(s);
                                });
    }
    ASSERT_TRUE(WaitFor([&] { return engine.snapshot().queued_calls == 2; }));
    // Hold the engine (both calls now in its queue) past the deadline,
    // then resume in the same iteration.
    std::shared_future<void> held = gate.future;
    ASSERT_TRUE(engine
                    .Post([&engine, held](ModelRunner&) {
                      held.wait();
                      engine.Resume();
                    })
                    .ok());
    std::this_thread::sleep_until(server_deadline +
                                  std::chrono::milliseconds(10));
    gate.Open();

    EXPECT_EQ(chunked->result.get().error_code(),
              grpc::StatusCode::DEADLINE_EXCEEDED);
    const grpc::Status later = c.later == Later::kContinue
                                   ? step->result.get()
                                   : release_done->get_future().get();
    if (c.live_before) {
      ASSERT_TRUE(later.ok()) << later.error_message();
      EXPECT_EQ(step->response.sequences(0).num_tokens(), 11);
    } else {
      EXPECT_EQ(later.error_code(), grpc::StatusCode::NOT_FOUND)
          << (c.later == Later::kContinue && later.ok()
                  ? "num_tokens " +
                        std::to_string(step->response.sequences(0).num_tokens())
                  : later.error_message());
    }
    const v1::WorkerStatus after = w->Status();
    EXPECT_EQ(after.num_sequences(), before.num_sequences());
    EXPECT_EQ(after.kv_blocks_free(), before.kv_blocks_free());  // 10, 11: 3
  }
}

}  // namespace
}  // namespace pdworker
