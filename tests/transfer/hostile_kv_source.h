// HostileKvSource: a KvTransfer service whose PullKv answers with whatever
// messages (not necessarily KvChunks) and final status it is told to, for
// tests and fuzzers of the pullers: a broken or malicious prefill worker.
#ifndef PDWORKER_TESTS_TRANSFER_HOSTILE_KV_SOURCE_H_
#define PDWORKER_TESTS_TRANSFER_HOSTILE_KV_SOURCE_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "proto/worker.grpc.pb.h"
#include "worker/rpc/parsed_call.h"

namespace pdworker::testing {

// What every PullKv gets: the serialized messages in order, then `status`.
struct KvSourceScript {
  std::vector<std::string> messages;
  grpc::Status status;
};

class HostileKvSource final
    : public v1::KvTransfer::WithRawCallbackMethod_PullKv<
          v1::KvTransfer::Service> {
 public:
  void Set(KvSourceScript script) {
    std::lock_guard<std::mutex> lock(mu_);
    script_ = std::move(script);
  }
  grpc::ServerWriteReactor<grpc::ByteBuffer>* PullKv(
      grpc::CallbackServerContext*, const grpc::ByteBuffer*) override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<grpc::ByteBuffer> out;
    for (const std::string& m : script_.messages) {
      grpc::Slice slice(m);
      out.emplace_back(&slice, 1);
    }
    return new ListWriter(std::move(out), script_.status);
  }

 private:
  std::mutex mu_;
  KvSourceScript script_;
};

// A HostileKvSource serving on a free loopback port.
struct HostileKvServer {
  HostileKvSource source;
  std::unique_ptr<grpc::Server> server;  // null when it could not start
  std::string address;                   // 127.0.0.1:port
};

inline std::unique_ptr<HostileKvServer> StartHostileKvServer() {
  auto s = std::make_unique<HostileKvServer>();
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&s->source);
  s->server = builder.BuildAndStart();
  if (s->server == nullptr || port <= 0) s->server.reset();
  s->address = "127.0.0.1:" + std::to_string(port);
  return s;
}

}  // namespace pdworker::testing

#endif  // PDWORKER_TESTS_TRANSFER_HOSTILE_KV_SOURCE_H_
