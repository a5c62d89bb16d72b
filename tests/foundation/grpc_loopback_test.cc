// Proves gRPC++ with health checking and reflection over real loopback TCP.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <memory>
#include <string>
#include <vector>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/unknown_field_set.h"
#include "gtest/gtest.h"
#include "third_party/grpc_health/health.grpc.pb.h"

namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

class GrpcLoopbackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    // Port 0: the kernel picks a free port, so parallel tests never collide.
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(port_),
                                   grpc::InsecureChannelCredentials());
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
  }

  grpc::Status Check(const std::string& service, HealthCheckResponse* out) {
    auto stub = Health::NewStub(channel_);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    HealthCheckRequest req;
    req.set_service(service);
    return stub->Check(&ctx, req, out);
  }

  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(GrpcLoopbackTest, HealthCheckRoundTrip) {
  HealthCheckResponse resp;
  ASSERT_TRUE(Check("", &resp).ok());
  EXPECT_EQ(resp.status(), HealthCheckResponse::SERVING);

  grpc::Status unknown = Check("no.such.Service", &resp);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND);

  server_->GetHealthCheckService()->SetServingStatus("pdworker.v1.Worker",
                                                     false);
  ASSERT_TRUE(Check("pdworker.v1.Worker", &resp).ok());
  EXPECT_EQ(resp.status(), HealthCheckResponse::NOT_SERVING);
}

// Reads the names in a ServerReflectionResponse.list_services_response
// (field 6 -> repeated ServiceResponse (field 1) -> name (field 1)) from raw
// wire bytes, so the test needs no second copy of reflection.proto.
std::vector<std::string> ServiceNames(const std::string& wire) {
  std::vector<std::string> names;
  google::protobuf::UnknownFieldSet response;
  if (!response.ParseFromString(wire)) return names;
  for (int i = 0; i < response.field_count(); ++i) {
    const auto& f = response.field(i);
    if (f.number() != 6) continue;
    google::protobuf::UnknownFieldSet list;
    list.ParseFromString(f.length_delimited());
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

TEST_F(GrpcLoopbackTest, ReflectionListsServices) {
  grpc::GenericStub stub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::CompletionQueue cq;
  void* tag = nullptr;
  bool ok = false;
  auto call = stub.PrepareCall(
      &ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      &cq);
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
  for (const auto& s : slices) wire.append(s.begin(), s.end());
  std::vector<std::string> names = ServiceNames(wire);
  {
    bool has_health = false, has_reflection = false;
    for (const auto& n : names) {
      has_health |= n == "grpc.health.v1.Health";
      has_reflection |= n == "grpc.reflection.v1alpha.ServerReflection";
    }
    EXPECT_TRUE(has_health) << "services: " << names.size();
    EXPECT_TRUE(has_reflection);
  }

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
