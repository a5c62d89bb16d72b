// --sequence_idle_timeout over real gRPC: a sequence its router abandoned
// (never stepped again, never released) is released and its KV blocks come
// back; a sequence that keeps being stepped, or that a queued call names,
// stays; a late call learns why its sequence is gone.
//
// Only lower bounds on time are asserted (nothing is freed before the
// timeout); upper bounds are WaitFor's 60 s, i.e. "not hung".
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"

namespace pdworker::server_testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using Clock = std::chrono::steady_clock;

std::unique_ptr<TestWorker> StartWithIdleTimeout(
    std::chrono::milliseconds timeout) {
  WorkerServerOptions options;
  options.engine.sequence_idle_timeout = timeout;
  return StartWorker(SmallRunnerOptions(), options);
}

grpc::Status Release(v1::Worker::Stub& stub, const std::string& id,
                     v1::ReleaseResponse* response) {
  grpc::ClientContext context;
  SetGenerousDeadline(&context);
  v1::ReleaseRequest request;
  request.add_sequence_ids(id);
  return stub.Release(&context, request, response);
}

int64_t Expired(TestWorker& w) {
  return w.server->engine().snapshot().sequences_expired;
}

TEST(IdleSequenceTest, AbandonedSequenceIsReleasedAndLateCallsLearnWhy) {
  const auto timeout = std::chrono::milliseconds(300);
  auto w = StartWithIdleTimeout(timeout);
  ASSERT_FALSE(testing::Test::HasFatalFailure());
  const int total = w->Status().kv_blocks_total();

  v1::ForwardResponse response;
  const Clock::time_point stepped = Clock::now();
  ASSERT_TRUE(Forward(*w->stub, Request({Input("a", {1, 2, 3, 4, 5, 6}, true)}),
                      &response)
                  .ok());
  EXPECT_EQ(w->Status().kv_blocks_free(), total - 2);  // 6 tokens, blocks of 4

  // The router "crashes": nothing more for "a". Its blocks come back.
  ASSERT_TRUE(WaitFor([&] { return w->Status().kv_blocks_free() == total; }));
  EXPECT_GE(Clock::now() - stepped, timeout);
  EXPECT_EQ(w->Status().num_sequences(), 0);
  EXPECT_EQ(Expired(*w), 1);

  // A late step and a late Release: NOT_FOUND, saying what happened.
  grpc::Status late =
      Forward(*w->stub,
              Request({Input("a", {response.sequences(0).token_id()}, false)}),
              &response);
  EXPECT_EQ(late.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(late.error_message(), HasSubstr("'a'"));
  EXPECT_THAT(late.error_message(), HasSubstr("without a step"));
  EXPECT_THAT(late.error_message(), HasSubstr("--sequence_idle_timeout=300ms"));
  v1::ReleaseResponse released;
  late = Release(*w->stub, "a", &released);
  EXPECT_EQ(late.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(late.error_message(), HasSubstr("--sequence_idle_timeout"));
  EXPECT_EQ(w->Status().kv_blocks_free(), total);  // the failures took nothing

  // The id may be used again; once it was, an unknown-id error is plain.
  ASSERT_TRUE(
      Forward(*w->stub, Request({Input("a", {7, 8}, true)}), &response).ok());
  ASSERT_TRUE(Release(*w->stub, "a", &released).ok());
  late = Forward(*w->stub, Request({Input("a", {9}, false)}), &response);
  EXPECT_EQ(late.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(late.error_message(), Not(HasSubstr("sequence_idle_timeout")));
  EXPECT_EQ(Expired(*w), 1);
}

TEST(IdleSequenceTest, SteppedSequenceStaysWhileItsIdleNeighbourGoes) {
  const auto timeout = std::chrono::milliseconds(1000);
  auto w = StartWithIdleTimeout(timeout);
  ASSERT_FALSE(testing::Test::HasFatalFailure());

  v1::ForwardResponse response;
  ASSERT_TRUE(Forward(*w->stub,
                      Request({Input("busy", {1, 2, 3}, true),
                               Input("idle", {4, 5, 6}, true)}),
                      &response)
                  .ok());
  int32_t next = response.sequences(0).token_id();
  // Step "busy" every ~20 ms for well past the timeout: it must never go.
  const Clock::time_point start = Clock::now();
  int steps = 0;
  while (Clock::now() - start < 2.5 * timeout || Expired(*w) == 0) {
    grpc::Status s =
        Forward(*w->stub, Request({Input("busy", {next}, false)}), &response);
    ASSERT_TRUE(s.ok()) << "step " << steps << ": " << s.error_message();
    next = response.sequences(0).token_id();
    ++steps;
    ASSERT_LT(Clock::now() - start, std::chrono::seconds(60)) << "hung";
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(Expired(*w), 1);
  EXPECT_EQ(w->Status().num_sequences(), 1);
  grpc::Status gone =
      Forward(*w->stub, Request({Input("idle", {1}, false)}), &response);
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::NOT_FOUND);
  v1::ReleaseResponse released;
  ASSERT_TRUE(Release(*w->stub, "busy", &released).ok());
  EXPECT_EQ(w->Status().kv_blocks_free(), w->Status().kv_blocks_total());
}

TEST(IdleSequenceTest, QueuedCallKeepsItsSequenceWhileTheWorkerIsPaused) {
  auto w = StartWithIdleTimeout(std::chrono::milliseconds(200));
  ASSERT_FALSE(testing::Test::HasFatalFailure());

  v1::ForwardResponse response;
  ASSERT_TRUE(Forward(*w->stub,
                      Request({Input("queued", {1, 2, 3}, true),
                               Input("other", {4, 5}, true)}),
                      &response)
                  .ok());
  const int32_t next = response.sequences(0).token_id();
  w->server->engine().Pause();
  auto pending =
      StartForward(*w->stub, Request({Input("queued", {next}, false)}));
  // The sweep runs while paused ("other" goes) but spares "queued", whose
  // router is visibly still there.
  ASSERT_TRUE(WaitFor([&] { return Expired(*w) == 1; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  EXPECT_EQ(Expired(*w), 1);
  w->server->engine().Resume();
  const grpc::Status s = pending->result.get();
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(pending->response.sequences(0).num_tokens(), 4);

  // Abandoned after its last call, it goes too.
  ASSERT_TRUE(WaitFor([&] { return Expired(*w) == 2; }));
  EXPECT_EQ(w->Status().kv_blocks_free(), w->Status().kv_blocks_total());
}

}  // namespace
}  // namespace pdworker::server_testing
