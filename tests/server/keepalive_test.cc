// HTTP/2 keepalive between routers and a worker, over real gRPC: a router
// that pings its idle connections (grpc-go and tonic routers usually do, every
// 10-30 s) must keep them, not be answered with GOAWAY "too_many_pings" and
// reconnect. gRPC's own server default accepts one ping per 5 minutes and
// none without a call in flight; a worker must accept pings as often as
// --grpc_min_client_ping_interval.
//
// The client pings every 300 ms; the test worker accepts one per 200 ms (the
// shipped default is 5 s, tested by the flag tests). The control worker keeps
// gRPC's default policy and must drop the connection: that proves the probe
// sees a GOAWAY at all.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <string>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"

namespace pdworker::server_testing {
namespace {

using Clock = std::chrono::steady_clock;

// A channel that pings every `ping_every`, also with no call in flight, with
// no cap on pings between data frames (as grpc-go's keepalive does).
std::shared_ptr<grpc::Channel> PingingChannel(int port,
                                              std::chrono::milliseconds every) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(every.count()));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // A fresh connection of its own, not one shared with another channel.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                   grpc::InsecureChannelCredentials(), args);
}

// Makes one call (so the connection is up and has carried data), then
// watches the idle connection for `watch`: true if it stayed READY
// throughout, false as soon as the server closed it.
bool IdleConnectionSurvives(int port, std::chrono::milliseconds ping_every,
                            std::chrono::milliseconds watch) {
  std::shared_ptr<grpc::Channel> channel = PingingChannel(port, ping_every);
  auto stub = v1::Worker::NewStub(channel);
  EXPECT_TRUE(StatusOf(*stub).serving());
  EXPECT_EQ(channel->GetState(false), GRPC_CHANNEL_READY);
  const Clock::time_point end = Clock::now() + watch;
  while (Clock::now() < end) {
    if (channel->GetState(false) != GRPC_CHANNEL_READY) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

TEST(KeepaliveTest, RouterPingsKeepTheirIdleConnection) {
  WorkerServerOptions options;
  options.keepalive.min_client_ping_interval = std::chrono::milliseconds(200);
  auto w = StartWorker(SmallRunnerOptions(), options);
  ASSERT_FALSE(testing::Test::HasFatalFailure());
  // ~25 pings; under gRPC's default policy the connection goes in ~3 s.
  EXPECT_TRUE(IdleConnectionSurvives(w->server->port(),
                                     std::chrono::milliseconds(300),
                                     std::chrono::seconds(8)));
}

TEST(KeepaliveTest, GrpcDefaultPolicyWouldDropThem) {
  WorkerServerOptions options;
  options.keepalive.min_client_ping_interval = std::chrono::minutes(5);
  options.keepalive.permit_pings_without_calls =
      KeepalivePolicy::PingsWithoutCalls::kRefuse;
  auto w = StartWorker(SmallRunnerOptions(), options);
  ASSERT_FALSE(testing::Test::HasFatalFailure());
  EXPECT_FALSE(IdleConnectionSurvives(w->server->port(),
                                      std::chrono::milliseconds(300),
                                      std::chrono::seconds(15)));
}

}  // namespace
}  // namespace pdworker::server_testing
