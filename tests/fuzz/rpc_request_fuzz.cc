// Fuzz target: every RPC of the worker's own services (pdworker.v1.Worker,
// pdworker.v1.KvTransfer, vllm.grpc.engine.VllmEngine) with an arbitrary
// request body, sent as raw bytes over a real gRPC channel (in-process
// transport) to a real serving worker (CPU backend, tiny model, prefix
// caching on). The first byte picks the method, the rest is the body.
//
// What must hold for every input:
//   - the call ends: no hang, no crash, no UNKNOWN status (an exception or
//     a handler that never answered) and no empty error message;
//   - a refused call changes nothing: KV blocks, sequences, requests,
//     leases and cached blocks are as they were before it;
//   - an accepted call leaks nothing: once what it started is released
//     (the sequences it named, the leases it returned), the worker holds
//     no KV, sequence, request or lease.
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/client_unary_call.h>
#include <grpcpp/impl/codegen/sync_stream.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "proto/vllm_engine.pb.h"
#include "proto/worker.grpc.pb.h"
#include "tests/server/server_test_util.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/server/worker_server.h"
#include "worker/transfer/kv_transfer_params.h"

namespace pdworker {
namespace {

using RpcType = grpc::internal::RpcMethod::RpcType;

struct Method {
  const char* name;
  RpcType type;
};

constexpr Method kMethods[] = {
    {"/pdworker.v1.Worker/Forward", RpcType::NORMAL_RPC},
    {"/pdworker.v1.Worker/Release", RpcType::NORMAL_RPC},
    {"/pdworker.v1.Worker/GetStatus", RpcType::NORMAL_RPC},
    {"/pdworker.v1.Worker/GetGraphStats", RpcType::NORMAL_RPC},
    {"/pdworker.v1.Worker/ImportKv", RpcType::NORMAL_RPC},
    {"/pdworker.v1.Worker/FlushCache", RpcType::NORMAL_RPC},
    {"/pdworker.v1.KvTransfer/PullKv", RpcType::SERVER_STREAMING},
    {"/pdworker.v1.KvTransfer/ReleaseKv", RpcType::NORMAL_RPC},
    {"/pdworker.v1.KvTransfer/RenewKv", RpcType::NORMAL_RPC},
    {"/vllm.grpc.engine.VllmEngine/Generate", RpcType::SERVER_STREAMING},
    {"/vllm.grpc.engine.VllmEngine/Embed", RpcType::NORMAL_RPC},
    {"/vllm.grpc.engine.VllmEngine/HealthCheck", RpcType::NORMAL_RPC},
    {"/vllm.grpc.engine.VllmEngine/Abort", RpcType::NORMAL_RPC},
    {"/vllm.grpc.engine.VllmEngine/GetModelInfo", RpcType::NORMAL_RPC},
    {"/vllm.grpc.engine.VllmEngine/GetServerInfo", RpcType::NORMAL_RPC},
    {"/vllm.grpc.engine.VllmEngine/GetLoads", RpcType::NORMAL_RPC},
    {"/vllm.grpc.engine.VllmEngine/GetTokenizer", RpcType::SERVER_STREAMING},
    {"/vllm.grpc.engine.VllmEngine/SubscribeKvEvents",
     RpcType::SERVER_STREAMING},
};
constexpr int kNumMethods = sizeof(kMethods) / sizeof(kMethods[0]);
constexpr int kForward = 0, kImportKv = 4, kGenerate = 9,
              kSubscribeKvEvents = 17;

// What a call may change, read on the engine thread between steps.
struct WorkerState {
  int32_t used_blocks = 0;
  int32_t detached_blocks = 0;
  int32_t sequences = 0;
  int32_t cached_blocks = 0;
  int64_t requests = 0;  // running + waiting
  int64_t leases = 0;

  std::string ToString() const {
    return absl::StrCat(
        "used_blocks=", used_blocks, " detached_blocks=", detached_blocks,
        " sequences=", sequences, " cached_blocks=", cached_blocks,
        " requests=", requests, " leases=", leases);
  }
};

struct Worker {
  std::unique_ptr<server_testing::TestWorker> w;
  std::shared_ptr<grpc::Channel> channel;

  WorkerState State() {
    WorkerState state;
    // On the engine thread, after everything queued before now (tasks run
    // in order: a released lease's blocks are freed by then).
    CHECK(w->server->engine()
              .RunExclusive([&state](ModelRunner& r) {
                const KvCacheStats kv = r.kv_cache().Stats();
                state.used_blocks = kv.used_blocks;
                state.detached_blocks = kv.detached_blocks;
                state.sequences = kv.num_sequences;
                state.cached_blocks = kv.cached_blocks;
                return absl::OkStatus();
              })
              .ok());
    // Published before a request's last message.
    const EngineSnapshot s = w->server->engine().snapshot();
    state.requests = s.running_requests + s.waiting_requests;
    state.leases = w->server->leases().size();
    return state;
  }
};

Worker& TheWorker() {
  static Worker* worker = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    const std::string dir =
        std::string(tmp != nullptr ? tmp : "/tmp") + "/rpc_request_fuzz_model";
    TinyModelOptions tiny;
    tiny.shape = TinyShape::kGqa;
    tiny.seed = 7;
    const absl::Status written = WriteTinyModel(tiny, dir);
    CHECK(written.ok()) << written;
    std::ofstream(dir + "/tokenizer.json") << R"({"version": "1.0"})";

    ModelRunnerOptions options = server_testing::SmallRunnerOptions();
    options.prefix_caching = PrefixCaching::kOn;
    WorkerServerOptions server_options;
    server_options.model_dir = dir;
    server_options.served_model_name = "tiny";
    // Bounded waits for handles that name unreachable sources.
    server_options.importer.pull_timeout = std::chrono::milliseconds(500);
    auto* w = new Worker;
    w->w = server_testing::StartWorker(options, server_options, true, dir);
    CHECK(w->w != nullptr);
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);
    w->channel = w->w->server->grpc_server().InProcessChannel(args);
    return w;
  }();
  return *worker;
}

struct CallResult {
  grpc::Status status;
  std::vector<std::string> responses;  // serialized messages
};

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  CHECK(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) {
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

CallResult Call(grpc::Channel& channel, int method, const std::string& body) {
  grpc::Slice slice(body);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ClientContext context;
  // An infinite stream (KV events) ends at its deadline; every other call
  // must end well before its own (a hang is a bug libFuzzer reports).
  context.set_deadline(std::chrono::system_clock::now() +
                       (method == kSubscribeKvEvents
                            ? std::chrono::milliseconds(100)
                            : std::chrono::milliseconds(20000)));
  const grpc::internal::RpcMethod rpc(kMethods[method].name,
                                      kMethods[method].type);
  CallResult result;
  if (kMethods[method].type == RpcType::NORMAL_RPC) {
    grpc::ByteBuffer response;
    result.status =
        grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
            &channel, rpc, &context, request, &response);
    if (result.status.ok()) result.responses.push_back(Flatten(response));
    return result;
  }
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
          &channel, rpc, &context, request));
  grpc::ByteBuffer response;
  while (reader->Read(&response)) result.responses.push_back(Flatten(response));
  result.status = reader->Finish();
  return result;
}

// Releases what an accepted call started: the sequences it named and the
// leases it handed out.
void CleanUp(Worker& worker, int method, const std::string& body,
             const CallResult& result) {
  std::vector<std::string> sequences;
  std::vector<std::string> leases;
  if (method == kForward) {
    v1::ForwardRequest request;
    if (request.ParseFromString(body)) {
      for (const auto& s : request.sequences()) {
        sequences.push_back(s.sequence_id());
      }
    }
    v1::ForwardResponse response;
    if (!result.responses.empty() &&
        response.ParseFromString(result.responses[0])) {
      for (const auto& s : response.sequences()) {
        if (!s.kv_handle().lease_id().empty()) {
          leases.push_back(s.kv_handle().lease_id());
        }
      }
    }
  } else if (method == kImportKv) {
    v1::ImportKvRequest request;
    if (request.ParseFromString(body))
      sequences.push_back(request.sequence_id());
  } else if (method == kGenerate) {
    for (const std::string& bytes : result.responses) {
      vllm::grpc::engine::GenerateResponse response;
      if (!response.ParseFromString(bytes) || !response.has_complete() ||
          !response.complete().has_kv_transfer_params_json()) {
        continue;
      }
      auto params = ParseKvTransferParamsJson(
          response.complete().kv_transfer_params_json());
      CHECK(params.ok()) << "the worker's own kv_transfer_params_json: "
                         << params.status();
      leases.push_back(params->handle.lease_id());
    }
  }
  auto worker_stub = v1::Worker::NewStub(worker.channel);
  for (const std::string& id : sequences) {
    grpc::ClientContext context;
    v1::ReleaseRequest request;
    request.add_sequence_ids(id);
    v1::ReleaseResponse response;
    worker_stub->Release(&context, request, &response);  // gone already: fine
  }
  auto transfer_stub = v1::KvTransfer::NewStub(worker.channel);
  for (const std::string& id : leases) {
    grpc::ClientContext context;
    v1::ReleaseKvRequest request;
    request.set_lease_id(id);
    v1::ReleaseKvResponse response;
    transfer_stub->ReleaseKv(&context, request, &response);
  }
}

}  // namespace
}  // namespace pdworker

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pdworker;
  if (size == 0) return 0;
  Worker& worker = TheWorker();
  const int method = data[0] % kNumMethods;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);

  const WorkerState before = worker.State();
  const CallResult result = Call(*worker.channel, method, body);
  const grpc::StatusCode code = result.status.error_code();
  // PDW_FUZZ_VERBOSE=1: what each input got (to see which seeds pass).
  static const bool verbose = std::getenv("PDW_FUZZ_VERBOSE") != nullptr;
  if (verbose) {
    LOG(INFO) << kMethods[method].name << " -> " << code << " "
              << result.status.error_message() << " ("
              << result.responses.size() << " responses)";
  }
  CHECK(code != grpc::StatusCode::UNKNOWN)
      << kMethods[method].name << ": " << result.status.error_message();
  if (!result.status.ok()) {
    CHECK(!result.status.error_message().empty())
        << kMethods[method].name << " answered " << code
        << " without a message";
  }
  // A call that ran past its deadline was accepted (an endless event stream,
  // or a long generation on a loaded machine): the worker learns of the
  // cancellation on its own time, so what it held is checked below, once
  // released, not compared at once.
  const bool client_gave_up = code == grpc::StatusCode::DEADLINE_EXCEEDED;
  if (!result.status.ok() && !client_gave_up) {
    const WorkerState after = worker.State();
    CHECK_EQ(after.ToString(), before.ToString())
        << kMethods[method].name << " was refused (" << code << ": "
        << result.status.error_message() << ") but changed the worker";
    return 0;
  }
  CleanUp(worker, method, body, result);
  // Freed within a few engine iterations (a cancelled request's KV is
  // freed when the engine sees the cancellation); 60 s is a hang, not a
  // timing assertion.
  const WorkerState empty;
  WorkerState after;
  const auto give_up = std::chrono::steady_clock::now() +
                       std::chrono::seconds(client_gave_up ? 60 : 0);
  do {
    after = worker.State();
    after.cached_blocks = 0;  // the prefix cache may keep what it computed
    if (after.ToString() == empty.ToString()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  } while (std::chrono::steady_clock::now() < give_up);
  CHECK_EQ(after.ToString(), empty.ToString())
      << kMethods[method].name << " left this behind after its release ("
      << code << ")";
  return 0;
}
