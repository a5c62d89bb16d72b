// TLS and mutual TLS with certificates openssl makes at test time: TLS
// clients that trust the CA are served, plaintext clients are not; with a
// client CA, only clients presenting a certificate it signed get through.
#include <cstdlib>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"
#include "tests/server/test_certificates.h"

namespace pdworker {
namespace {

using server_testing::Input;
using server_testing::MakeTestCertificates;
using server_testing::Request;
using server_testing::SmallRunnerOptions;
using server_testing::StartWorker;
using server_testing::TestCertificates;

const TestCertificates& Certificates() {
  static const TestCertificates* certificates = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    auto made =
        MakeTestCertificates(std::string(tmp ? tmp : "/tmp") + "/pdworker_tls");
    CHECK(made.ok()) << made.status();
    return new TestCertificates(*std::move(made));
  }();
  return *certificates;
}

grpc::Status GetStatus(const std::shared_ptr<grpc::ChannelCredentials>& creds,
                       int port) {
  auto stub = v1::Worker::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), creds));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(20));
  v1::WorkerStatus status;
  return stub->GetStatus(&context, v1::GetStatusRequest(), &status);
}

std::shared_ptr<grpc::ChannelCredentials> TlsClient(bool with_certificate) {
  const TestCertificates& c = Certificates();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = c.ca_pem;
  if (with_certificate) {
    options.pem_cert_chain = c.client_cert_pem;
    options.pem_private_key = c.client_key_pem;
  }
  return grpc::SslCredentials(options);
}

TEST(TlsTest, ServesTlsClientsAndRefusesPlaintext) {
  const TestCertificates& c = Certificates();
  WorkerServerOptions options;
  options.tls.cert_chain_pem = c.server_cert_pem;
  options.tls.private_key_pem = c.server_key_pem;
  auto w = StartWorker(SmallRunnerOptions(), options);
  ASSERT_NE(w, nullptr);
  const int port = w->server->port();
  const grpc::Status tls = GetStatus(TlsClient(false), port);
  EXPECT_TRUE(tls.ok()) << tls.error_message();
  EXPECT_FALSE(GetStatus(grpc::InsecureChannelCredentials(), port).ok());
}

TEST(TlsTest, MutualTlsRequiresAClientCertificateFromTheCa) {
  const TestCertificates& c = Certificates();
  WorkerServerOptions options;
  options.tls.cert_chain_pem = c.server_cert_pem;
  options.tls.private_key_pem = c.server_key_pem;
  options.tls.client_ca_pem = c.ca_pem;
  auto w = StartWorker(SmallRunnerOptions(), options);
  ASSERT_NE(w, nullptr);
  const int port = w->server->port();
  EXPECT_FALSE(GetStatus(TlsClient(false), port).ok());
  EXPECT_FALSE(GetStatus(grpc::InsecureChannelCredentials(), port).ok());

  auto stub = v1::Worker::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(port), TlsClient(true)));
  grpc::ClientContext context;
  server_testing::SetGenerousDeadline(&context);
  v1::ForwardResponse response;
  const grpc::Status forward = stub->Forward(
      &context, Request({Input("secure", {1, 2, 3}, true)}), &response);
  ASSERT_TRUE(forward.ok()) << forward.error_message();
  EXPECT_EQ(response.sequences(0).num_tokens(), 3);
}

TEST(TlsTest, InconsistentTlsOptionsAreRefused) {
  const TestCertificates& c = Certificates();
  server_testing::InProcessRunner r =
      server_testing::MakeRunner(SmallRunnerOptions());
  WorkerServerOptions only_ca;
  only_ca.tls.client_ca_pem = c.ca_pem;
  EXPECT_EQ(WorkerServer::Start(*r.runner, only_ca, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  WorkerServerOptions only_cert;
  only_cert.tls.cert_chain_pem = c.server_cert_pem;
  EXPECT_EQ(WorkerServer::Start(*r.runner, only_cert, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdworker
