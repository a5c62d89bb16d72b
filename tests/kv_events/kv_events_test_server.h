// A gRPC server on 127.0.0.1 serving vllm.grpc.engine.VllmEngine with only
// SubscribeKvEvents, handed to a KvEventStream as VllmEngineService hands
// it (a raw method), and a stub for it.
#ifndef PDWORKER_TESTS_KV_EVENTS_KV_EVENTS_TEST_SERVER_H_
#define PDWORKER_TESTS_KV_EVENTS_KV_EVENTS_TEST_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "proto/vllm_engine.grpc.pb.h"
#include "worker/server/kv_event_stream.h"

namespace pdworker::kv_events_testing {

class KvEventsOnlyService final
    : public vllm::grpc::engine::VllmEngine::
          WithRawCallbackMethod_SubscribeKvEvents<
              vllm::grpc::engine::VllmEngine::Service> {
 public:
  explicit KvEventsOnlyService(KvEventStream* stream) : stream_(stream) {}
  grpc::ServerWriteReactor<grpc::ByteBuffer>* SubscribeKvEvents(
      grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request) override {
    return stream_->Subscribe(context, request);
  }

 private:
  KvEventStream* const stream_;
};

struct KvEventsTestServer {
  explicit KvEventsTestServer(KvEventStream* stream) : service(stream) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    // No BDP probing: a subscriber that does not read holds the server's
    // writes at HTTP/2's initial window, as a slow router would.
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetMaxReceiveMessageSize(64 << 20);
    channel =
        grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                  grpc::InsecureChannelCredentials(), args);
    stub = vllm::grpc::engine::VllmEngine::NewStub(channel);
  }
  ~KvEventsTestServer() { server->Shutdown(); }

  KvEventsOnlyService service;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<vllm::grpc::engine::VllmEngine::Stub> stub;
};

}  // namespace pdworker::kv_events_testing

#endif  // PDWORKER_TESTS_KV_EVENTS_KV_EVENTS_TEST_SERVER_H_
