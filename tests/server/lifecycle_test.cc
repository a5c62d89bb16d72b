// The worker's lifecycle and flow control over real gRPC: NOT_SERVING until
// graphs are captured; deadlines and cancellations honoured before a call
// runs (and then it changes nothing); a bounded queue; drain (live
// sequences finish, new ones are refused, health NOT_SERVING, bounded by
// the drain timeout); reflection.
//
// "Busy" is made deterministic with Engine::Pause(), never with timing.
#include <grpcpp/generic/generic_stub.h>

#include <atomic>
#include <chrono>
#include <future>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/unknown_field_set.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"

namespace pdworker {
namespace {

using grpc::health::v1::HealthCheckResponse;
using server_testing::Forward;
using server_testing::Input;
using server_testing::Request;
using server_testing::SmallRunnerOptions;
using server_testing::StartForward;
using server_testing::StartWorker;
using server_testing::WaitFor;
using ::testing::HasSubstr;

constexpr char kWorkerService[] = "pdworker.v1.Worker";

TEST(LifecycleTest, NotServingUntilGraphsAreCaptured) {
  auto w = StartWorker(SmallRunnerOptions(), {}, /*capture_and_serve=*/false);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->Health(""), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(w->Health(kWorkerService), HealthCheckResponse::NOT_SERVING);
  v1::WorkerStatus status = w->Status();
  EXPECT_FALSE(status.serving());
  EXPECT_EQ(status.graphs_captured(), 0);
  v1::ForwardResponse response;
  const grpc::Status refused =
      Forward(*w->stub, Request({Input("a", {1}, true)}), &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(refused.error_message(), HasSubstr("starting"));

  ASSERT_TRUE(w->server->CaptureGraphsAndServe().ok());
  EXPECT_EQ(w->Health(""), HealthCheckResponse::SERVING);
  EXPECT_EQ(w->Health(kWorkerService), HealthCheckResponse::SERVING);
  status = w->Status();
  EXPECT_TRUE(status.serving());
  EXPECT_EQ(status.graphs_captured(), w->runner.runner->NumCapturedGraphs());
  EXPECT_GT(status.graphs_captured(), 0);
  EXPECT_TRUE(
      Forward(*w->stub, Request({Input("a", {1}, true)}), &response).ok());
}

TEST(LifecycleTest, ExpiredCallIsDroppedBeforeItRuns) {
  auto w = StartWorker(SmallRunnerOptions());
  ASSERT_NE(w, nullptr);
  const v1::WorkerStatus before = w->Status();
  Engine& engine = w->server->engine();
  engine.Pause();  // the engine is "busy"
  // The deadline only has to be long enough for the call to reach the
  // queue; the paused engine then holds it there until it passes.
  auto late =
      StartForward(*w->stub, Request({Input("late", {1, 2, 3}, true)}),
                   [](grpc::ClientContext* context) {
                     context->set_deadline(std::chrono::system_clock::now() +
                                           std::chrono::seconds(1));
                   });
  ASSERT_TRUE(WaitFor([&] { return engine.snapshot().queued_calls == 1; }));
  EXPECT_EQ(late->result.get().error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  // The engine drops the call on its own, even while paused: at its
  // deadline, or when gRPC cancels the expired call (whichever it sees
  // first).
  ASSERT_TRUE(WaitFor([&] {
    const EngineSnapshot s = engine.snapshot();
    return s.dropped_deadline + s.dropped_cancelled == 1 && s.queued_calls == 0;
  }));
  engine.Resume();

  const v1::WorkerStatus after = w->Status();
  EXPECT_EQ(after.kv_blocks_free(), before.kv_blocks_free());
  EXPECT_EQ(after.num_sequences(), before.num_sequences());
  // It never ran: the id is still free.
  v1::ForwardResponse response;
  EXPECT_TRUE(
      Forward(*w->stub, Request({Input("late", {1, 2, 3}, true)}), &response)
          .ok());
}

TEST(LifecycleTest, CancelledCallIsDroppedBeforeItRuns) {
  auto w = StartWorker(SmallRunnerOptions());
  ASSERT_NE(w, nullptr);
  const v1::WorkerStatus before = w->Status();
  Engine& engine = w->server->engine();
  engine.Pause();
  auto call = StartForward(*w->stub, Request({Input("gone", {4, 5}, true)}));
  ASSERT_TRUE(WaitFor([&] { return engine.snapshot().queued_calls == 1; }));
  call->context.TryCancel();
  EXPECT_EQ(call->result.get().error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(WaitFor([&] {
    return engine.snapshot().dropped_cancelled == 1 &&
           engine.snapshot().queued_calls == 0;
  }));
  engine.Resume();

  const v1::WorkerStatus after = w->Status();
  EXPECT_EQ(after.kv_blocks_free(), before.kv_blocks_free());
  EXPECT_EQ(after.num_sequences(), before.num_sequences());
  v1::ForwardResponse response;
  EXPECT_TRUE(
      Forward(*w->stub, Request({Input("gone", {4, 5}, true)}), &response)
          .ok());
}

TEST(LifecycleTest, FullQueueGetsResourceExhausted) {
  WorkerServerOptions server_options;
  server_options.engine.max_queue = 2;
  auto w = StartWorker(SmallRunnerOptions(), server_options);
  ASSERT_NE(w, nullptr);
  Engine& engine = w->server->engine();
  engine.Pause();
  auto first = StartForward(*w->stub, Request({Input("q1", {1}, true)}));
  auto second = StartForward(*w->stub, Request({Input("q2", {2}, true)}));
  ASSERT_TRUE(WaitFor([&] { return engine.snapshot().queued_calls == 2; }));
  v1::ForwardResponse response;
  const grpc::Status full =
      Forward(*w->stub, Request({Input("q3", {3}, true)}), &response);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(full.error_message(), HasSubstr("max_queue=2"));
  engine.Resume();
  EXPECT_TRUE(first->result.get().ok());
  EXPECT_TRUE(second->result.get().ok());
  EXPECT_EQ(w->Status().num_sequences(), 2);
}

grpc::Status Release(v1::Worker::Stub& stub, const std::string& id) {
  grpc::ClientContext context;
  server_testing::SetGenerousDeadline(&context);
  v1::ReleaseRequest request;
  request.add_sequence_ids(id);
  v1::ReleaseResponse response;
  return stub.Release(&context, request, &response);
}

// A rolling update must not fail running generations: while draining, live
// sequences keep stepping until released; only new sequences are refused.
TEST(LifecycleTest, DrainLetsLiveSequencesFinishAndRefusesNewOnes) {
  auto w = StartWorker(SmallRunnerOptions());
  ASSERT_NE(w, nullptr);
  Engine& engine = w->server->engine();
  v1::ForwardResponse response;
  ASSERT_TRUE(
      Forward(*w->stub, Request({Input("live", {1, 2, 3}, true)}), &response)
          .ok());
  const int32_t live_next = response.sequences(0).token_id();
  engine.Pause();
  auto in_flight =
      StartForward(*w->stub, Request({Input("inflight", {1, 2}, true)}));
  ASSERT_TRUE(WaitFor([&] { return engine.snapshot().queued_calls == 1; }));

  w->server->BeginDrain();
  EXPECT_EQ(w->Health(""), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(w->Health(kWorkerService), HealthCheckResponse::NOT_SERVING);
  EXPECT_FALSE(w->Status().serving());
  const grpc::Status refused =
      Forward(*w->stub, Request({Input("new", {1}, true)}), &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(refused.error_message(), HasSubstr("draining"));
  {
    grpc::ClientContext context;
    v1::ImportKvRequest import;
    import.set_sequence_id("imported");
    v1::ImportKvResponse imported;
    const grpc::Status s = w->stub->ImportKv(&context, import, &imported);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(s.error_message(), HasSubstr("draining"));
  }

  auto drained = std::async(std::launch::async, [&] { w->server->Drain(); });
  engine.Resume();
  const grpc::Status done = in_flight->result.get();
  EXPECT_TRUE(done.ok()) << done.error_message();
  EXPECT_EQ(in_flight->response.sequences(0).num_tokens(), 2);

  // Both sequences keep generating; the drain waits for them.
  ASSERT_TRUE(
      Forward(*w->stub, Request({Input("live", {live_next}, false)}), &response)
          .ok());
  EXPECT_EQ(response.sequences(0).num_tokens(), 4);
  v1::SequenceInput last = Input("inflight", {7}, false);
  last.set_release_after_step(true);
  ASSERT_TRUE(Forward(*w->stub, Request({last}), &response).ok());
  EXPECT_EQ(drained.wait_for(std::chrono::milliseconds(0)),
            std::future_status::timeout);  // "live" is still live
  EXPECT_EQ(w->Status().num_sequences(), 1);
  ASSERT_TRUE(Release(*w->stub, "live").ok());
  drained.get();

  EXPECT_TRUE(server_testing::Gone(*w->stub));  // nothing listens any more
}

// Routers keep sending new sequences to a draining worker until they
// notice (a health check period later). A call that arrives as the last
// live sequence is released must still get UNAVAILABLE, on which routers
// fail over, never CANCELLED, which means "the client cancelled": the worker
// lingers until calls stop arriving before gRPC's shutdown would drop them.
TEST(LifecycleTest, CallsArrivingAsTheDrainEndsGetUnavailableNeverCancelled) {
  constexpr int kTrials = 3;
  constexpr int kClients = 8;
  // How long the routers keep sending after the last release.
  constexpr auto kRouterLag = std::chrono::milliseconds(300);
  int calls = 0;
  int after_release = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    SCOPED_TRACE(trial);
    auto w = StartWorker(SmallRunnerOptions());
    ASSERT_NE(w, nullptr);
    v1::ForwardResponse response;
    ASSERT_TRUE(
        Forward(*w->stub, Request({Input("live", {1, 2, 3}, true)}), &response)
            .ok());
    // Draining before any client sends: no new sequence gets in.
    w->server->BeginDrain();
    auto drained = std::async(std::launch::async, [&] { w->server->Drain(); });

    std::atomic<bool> released{false};
    std::atomic<int64_t> stop_at_ns{std::numeric_limits<int64_t>::max()};
    std::vector<std::vector<std::pair<grpc::StatusCode, bool>>> codes(kClients);
    std::vector<std::thread> clients;
    const std::string target = absl::StrCat("127.0.0.1:", w->server->port());
    for (int c = 0; c < kClients; ++c) {
      clients.emplace_back([&, c] {
        // One connection per router.
        grpc::ChannelArguments args;
        args.SetInt("pdworker.test.router", c);
        auto stub = v1::Worker::NewStub(grpc::CreateCustomChannel(
            target, grpc::InsecureChannelCredentials(), args));
        for (int n = 0;
             std::chrono::steady_clock::now().time_since_epoch().count() <
             stop_at_ns.load();
             ++n) {
          const bool late = released.load();
          v1::ForwardResponse r;
          const grpc::Status s = Forward(
              *stub, Request({Input(absl::StrCat("c", c, "-", n), {1}, true)}),
              &r);
          codes[c].emplace_back(s.error_code(), late);
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    v1::SequenceInput last =
        Input("live", {response.sequences(0).token_id()}, false);
    last.set_release_after_step(true);
    ASSERT_TRUE(Forward(*w->stub, Request({last}), &response).ok());
    released = true;
    stop_at_ns = (std::chrono::steady_clock::now() + kRouterLag)
                     .time_since_epoch()
                     .count();
    for (std::thread& t : clients) t.join();
    drained.get();

    for (const auto& per_client : codes) {
      for (const auto& [code, late] : per_client) {
        ++calls;
        after_release += late ? 1 : 0;
        // UNAVAILABLE from the draining worker, or from a closed port.
        EXPECT_EQ(code, grpc::StatusCode::UNAVAILABLE)
            << (late ? "after" : "before") << " the last release";
      }
    }
    EXPECT_TRUE(server_testing::Gone(*w->stub));
  }
  // The race was exercised (slowly under TSan: a few calls per drain).
  EXPECT_GE(after_release, kTrials);
  RecordProperty("calls", calls);
  RecordProperty("calls_after_the_last_release", after_release);
}

// A sequence whose router never finishes it does not hold the shutdown
// past --drain_timeout.
TEST(LifecycleTest, DrainStopsAfterItsTimeout) {
  WorkerServerOptions options;
  options.drain_timeout = std::chrono::milliseconds(300);
  auto w = StartWorker(SmallRunnerOptions(), options);
  ASSERT_NE(w, nullptr);
  v1::ForwardResponse response;
  ASSERT_TRUE(
      Forward(*w->stub, Request({Input("stuck", {1, 2}, true)}), &response)
          .ok());
  const auto start = std::chrono::steady_clock::now();
  w->server->Drain();
  EXPECT_GE(std::chrono::steady_clock::now() - start, options.drain_timeout);
  EXPECT_TRUE(server_testing::Gone(*w->stub));
}

TEST(LifecycleTest, DestroyingTheServerFailsQueuedCalls) {
  auto w = StartWorker(SmallRunnerOptions());
  ASSERT_NE(w, nullptr);
  w->server->engine().Pause();
  auto queued = StartForward(*w->stub, Request({Input("q", {1}, true)}));
  ASSERT_TRUE(WaitFor(
      [&] { return w->server->engine().snapshot().queued_calls == 1; }));
  w->server.reset();
  EXPECT_EQ(queued->result.get().error_code(), grpc::StatusCode::UNAVAILABLE);
}

// Reads the service names in a ServerReflectionResponse's
// list_services_response (field 6 -> repeated ServiceResponse (1) -> name
// (1)) from raw wire bytes; the test needs no copy of reflection.proto.
std::vector<std::string> ServiceNames(const std::string& wire) {
  std::vector<std::string> names;
  google::protobuf::UnknownFieldSet response;
  if (!response.ParseFromString(wire)) return names;
  for (int i = 0; i < response.field_count(); ++i) {
    if (response.field(i).number() != 6) continue;
    google::protobuf::UnknownFieldSet list;
    list.ParseFromString(response.field(i).length_delimited());
    for (int j = 0; j < list.field_count(); ++j) {
      google::protobuf::UnknownFieldSet service;
      service.ParseFromString(list.field(j).length_delimited());
      for (int k = 0; k < service.field_count(); ++k) {
        if (service.field(k).number() == 1) {
          names.push_back(service.field(k).length_delimited());
        }
      }
    }
  }
  return names;
}

TEST(LifecycleTest, ReflectionListsTheWorkerService) {
  auto w = StartWorker(SmallRunnerOptions());
  ASSERT_NE(w, nullptr);
  grpc::GenericStub stub(w->channel);
  grpc::ClientContext context;
  server_testing::SetGenerousDeadline(&context);
  grpc::CompletionQueue cq;
  void* tag = nullptr;
  bool ok = false;
  auto call = stub.PrepareCall(
      &context,
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  // ServerReflectionRequest{list_services: ""}: field 7, wire type 2, len 0.
  const std::string request("\x3a\x00", 2);
  grpc::Slice slice(request);
  grpc::ByteBuffer out(&slice, 1);
  call->Write(out, reinterpret_cast<void*>(2));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  grpc::ByteBuffer in;
  call->Read(&in, reinterpret_cast<void*>(3));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(in.Dump(&slices).ok());
  std::string wire;
  for (const grpc::Slice& s : slices) wire.append(s.begin(), s.end());
  EXPECT_THAT(ServiceNames(wire),
              ::testing::IsSupersetOf({std::string(kWorkerService),
                                       std::string("grpc.health.v1.Health")}));
  call->WritesDone(reinterpret_cast<void*>(4));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  EXPECT_TRUE(status.ok()) << status.error_message();
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

}  // namespace
}  // namespace pdworker
