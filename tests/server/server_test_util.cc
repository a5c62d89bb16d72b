#include "tests/server/server_test_util.h"

#include <cstdlib>
#include <mutex>
#include <thread>
#include <utility>

#include "dispatcher/compilation_config.h"
#include "gtest/gtest.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/server/request_validation.h"

namespace pdworker::server_testing {

std::string TinyModelDir() {
  static std::once_flag once;
  static std::string* dir = new std::string;
  std::call_once(once, [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    *dir = std::string(tmp ? tmp : "/tmp") + "/tiny_gqa_server";
    TinyModelOptions options;
    options.shape = TinyShape::kGqa;
    options.seed = 7;
    const absl::Status written = WriteTinyModel(options, *dir);
    CHECK(written.ok()) << written;
  });
  return *dir;
}

ModelRunnerOptions SmallRunnerOptions() {
  ModelRunnerOptions o;
  o.role = Role::kBoth;
  o.max_num_seqs = 8;
  o.max_num_batched_tokens = 64;
  o.kv_cache_bytes = int64_t{1} << 20;  // 1024 blocks
  o.block_size = 4;
  o.max_model_len = 128;
  auto config = ParseCompilationConfig(
      R"({"cudagraph_mode":"FULL_AND_PIECEWISE",
          "cudagraph_capture_sizes":[1,2,4,8,16]})");
  CHECK(config.ok()) << config.status();
  o.compilation = *config;
  return o;
}

InProcessRunner MakeRunner(const ModelRunnerOptions& options) {
  InProcessRunner r;
  r.device = std::make_unique<CpuDevice>();
  auto runner = ModelRunner::Create(*r.device, TinyModelDir(), options);
  CHECK(runner.ok()) << runner.status();
  r.runner = *std::move(runner);
  auto captured = r.runner->CaptureGraphs();
  CHECK(captured.ok()) << captured.status();
  return r;
}

v1::WorkerStatus StatusOf(v1::Worker::Stub& stub) {
  grpc::ClientContext context;
  SetGenerousDeadline(&context);
  v1::WorkerStatus status;
  const grpc::Status s =
      stub.GetStatus(&context, v1::GetStatusRequest(), &status);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return status;
}

v1::WorkerStatus TestWorker::Status() { return StatusOf(*stub); }

bool Gone(v1::Worker::Stub& stub) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  v1::WorkerStatus status;
  return stub.GetStatus(&context, v1::GetStatusRequest(), &status)
             .error_code() == grpc::StatusCode::UNAVAILABLE;
}

grpc::health::v1::HealthCheckResponse::ServingStatus TestWorker::Health(
    const std::string& service) {
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  SetGenerousDeadline(&context);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status s = health->Check(&context, request, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return response.status();
}

std::unique_ptr<TestWorker> StartWorker(
    const ModelRunnerOptions& options,
    const WorkerServerOptions& server_options, bool capture_and_serve,
    const std::string& model_dir) {
  auto w = std::make_unique<TestWorker>();
  w->runner.device = std::make_unique<CpuDevice>();
  auto runner = ModelRunner::Create(
      *w->runner.device, model_dir.empty() ? TinyModelDir() : model_dir,
      options);
  EXPECT_TRUE(runner.ok()) << runner.status();
  if (!runner.ok()) return nullptr;
  w->runner.runner = *std::move(runner);
  auto server = WorkerServer::Start(*w->runner.runner, server_options, nullptr);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  w->server = *std::move(server);
  if (capture_and_serve) {
    auto captured = w->server->CaptureGraphsAndServe();
    EXPECT_TRUE(captured.ok()) << captured.status();
  }
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  w->channel = grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(w->server->port()),
      grpc::InsecureChannelCredentials(), args);
  w->stub = v1::Worker::NewStub(w->channel);
  return w;
}

v1::SequenceInput Input(const std::string& id,
                        const std::vector<int32_t>& tokens, bool start) {
  v1::SequenceInput in;
  in.set_sequence_id(id);
  for (const int32_t t : tokens) in.add_token_ids(t);
  in.set_start(start);
  return in;
}

v1::ForwardRequest Request(std::vector<v1::SequenceInput> sequences) {
  v1::ForwardRequest request;
  for (v1::SequenceInput& s : sequences)
    *request.add_sequences() = std::move(s);
  return request;
}

void SetGenerousDeadline(grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::seconds(120));
}

grpc::Status Forward(v1::Worker::Stub& stub, const v1::ForwardRequest& request,
                     v1::ForwardResponse* response) {
  grpc::ClientContext context;
  SetGenerousDeadline(&context);
  return stub.Forward(&context, request, response);
}

std::unique_ptr<PendingForward> StartForward(
    v1::Worker::Stub& stub, const v1::ForwardRequest& request,
    const std::function<void(grpc::ClientContext*)>& configure) {
  auto call = std::make_unique<PendingForward>();
  call->request = request;
  if (configure) {
    configure(&call->context);
  } else {
    SetGenerousDeadline(&call->context);
  }
  PendingForward* raw = call.get();
  stub.async()->Forward(&raw->context, &raw->request, &raw->response,
                        [promise = raw->promise](grpc::Status status) {
                          promise->set_value(std::move(status));
                        });
  return call;
}

bool WaitFor(const std::function<bool()>& condition) {
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!condition()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

std::vector<SequenceStep> Steps(const v1::ForwardRequest& request) {
  RequestLimits limits{1 << 20, 1 << 30, 1 << 30};
  auto spec = ValidateForwardRequest(request, limits);
  CHECK(spec.ok()) << spec.status();
  return spec->sequences;
}

}  // namespace pdworker::server_testing
