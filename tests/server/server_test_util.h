// Shared helpers for the gRPC worker tests: a tiny model, an in-process
// WorkerServer on 127.0.0.1:0 with a real channel to it, a reference
// ModelRunner for the same options, and request builders.
#ifndef PDWORKER_TESTS_SERVER_SERVER_TEST_UTIL_H_
#define PDWORKER_TESTS_SERVER_SERVER_TEST_UTIL_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/worker.grpc.pb.h"
#include "third_party/grpc_health/health.grpc.pb.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/cpu_device.h"
#include "worker/server/worker_server.h"

namespace pdworker::server_testing {

// The gqa tiny checkpoint (vocab 256, 2 layers, 2 KV heads of 8: one KV
// block of 4 tokens is 1024 bytes) under $TEST_TMPDIR, written once.
std::string TinyModelDir();

// Small limits for fast CPU tests: 8 sequences and 64 tokens per step,
// blocks of 4 tokens, max_model_len 128, capture sizes 1..16.
ModelRunnerOptions SmallRunnerOptions();

// A device and a runner (graphs captured), for reference results.
struct InProcessRunner {
  std::unique_ptr<CpuDevice> device;
  std::unique_ptr<ModelRunner> runner;
};
InProcessRunner MakeRunner(const ModelRunnerOptions& options);

// GetStatus with a generous deadline (EXPECTs it to succeed).
v1::WorkerStatus StatusOf(v1::Worker::Stub& stub);

// True when nothing answers GetStatus at the stub's worker any more
// (UNAVAILABLE within 10 s): it drained or stopped.
bool Gone(v1::Worker::Stub& stub);

// A serving worker and a client channel to it.
struct TestWorker {
  InProcessRunner runner;
  std::unique_ptr<WorkerServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Worker::Stub> stub;

  v1::WorkerStatus Status();
  grpc::health::v1::HealthCheckResponse::ServingStatus Health(
      const std::string& service);
};
// ASSERTs inside; check HasFatalFailure() after.
// `model_dir` empty: TinyModelDir().
std::unique_ptr<TestWorker> StartWorker(
    const ModelRunnerOptions& options,
    const WorkerServerOptions& server_options = {},
    bool capture_and_serve = true, const std::string& model_dir = "");

// Request builders.
v1::SequenceInput Input(const std::string& id,
                        const std::vector<int32_t>& tokens, bool start);
v1::ForwardRequest Request(std::vector<v1::SequenceInput> sequences);

// A deadline far enough away that only a hung worker hits it.
void SetGenerousDeadline(grpc::ClientContext* context);

// Synchronous Forward with a generous deadline.
grpc::Status Forward(v1::Worker::Stub& stub, const v1::ForwardRequest& request,
                     v1::ForwardResponse* response);

// An asynchronous Forward (callback API); get() waits for it.
struct PendingForward {
  grpc::ClientContext context;
  v1::ForwardRequest request;
  v1::ForwardResponse response;
  // Shared with the completion callback, which may still be returning from
  // set_value when the waiter wakes up and destroys this object.
  std::shared_ptr<std::promise<grpc::Status>> promise =
      std::make_shared<std::promise<grpc::Status>>();
  std::future<grpc::Status> result = promise->get_future();
};
// `configure` may set the context's deadline; by default it is generous.
std::unique_ptr<PendingForward> StartForward(
    v1::Worker::Stub& stub, const v1::ForwardRequest& request,
    const std::function<void(grpc::ClientContext*)>& configure = nullptr);

// Polls `condition` every millisecond until true; false after 60 s (a hung
// worker, not a timing assertion).
bool WaitFor(const std::function<bool()>& condition);

// The equivalent in-process step: SequenceSteps as the worker builds them
// (start -> kMustBeNew, default seed from the id).
std::vector<SequenceStep> Steps(const v1::ForwardRequest& request);

}  // namespace pdworker::server_testing

#endif  // PDWORKER_TESTS_SERVER_SERVER_TEST_UTIL_H_
