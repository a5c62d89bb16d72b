// The KV handoff between TLS workers: pulls use TLS too (mutual TLS when the
// workers require client certificates), certificates are checked against
// the advertised host or --kv_peer_tls_server_name, and a bare advertised
// host gets the bound port.
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"
#include "tests/server/test_certificates.h"
#include "tests/transfer/handoff_test_util.h"

namespace pdworker {
namespace {

using handoff_testing::Import;
using server_testing::Input;
using server_testing::MakeTestCertificates;
using server_testing::Request;
using server_testing::StartWorker;
using server_testing::TestCertificates;
using server_testing::TestWorker;
using server_testing::WaitFor;

const TestCertificates& Certificates() {
  static const TestCertificates* certs = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    auto c = MakeTestCertificates(std::string(tmp ? tmp : "/tmp") +
                                  "/pdworker_kv_tls");
    CHECK(c.ok()) << c.status();
    return new TestCertificates(*std::move(c));
  }();
  return *certs;
}

// A mutual-TLS worker of `role` with the test server certificate.
std::unique_ptr<TestWorker> StartTlsWorker(Role role,
                                           WorkerServerOptions options) {
  const TestCertificates& c = Certificates();
  options.tls.cert_chain_pem = c.server_cert_pem;
  options.tls.private_key_pem = c.server_key_pem;
  options.tls.client_ca_pem = c.ca_pem;
  ModelRunnerOptions o = server_testing::SmallRunnerOptions();
  o.role = role;
  o.compilation = CompilationConfig{};
  o.compilation.cudagraph_capture_sizes = std::vector<int>{1, 2, 4};
  auto w = StartWorker(o, options);
  if (w == nullptr) return nullptr;
  // StartWorker's own channel is plaintext; talk TLS with a client cert.
  grpc::SslCredentialsOptions creds;
  creds.pem_root_certs = c.ca_pem;
  creds.pem_cert_chain = c.client_cert_pem;
  creds.pem_private_key = c.client_key_pem;
  w->channel =
      grpc::CreateChannel("localhost:" + std::to_string(w->server->port()),
                          grpc::SslCredentials(creds));
  w->stub = v1::Worker::NewStub(w->channel);
  return w;
}

bool NothingHeld(TestWorker& w) {
  return handoff_testing::HoldsNothing(w.Status());
}

v1::KvHandle Hold(TestWorker& prefill, const std::string& id) {
  return handoff_testing::HandleOf(
      handoff_testing::Hold(*prefill.stub, id, {5, 6, 7, 8, 9}));
}

TEST(CompleteAdvertiseAddressTest, AddsThePortToABareHost) {
  EXPECT_EQ(CompleteAdvertiseAddress("10.0.0.7", 50051), "10.0.0.7:50051");
  EXPECT_EQ(CompleteAdvertiseAddress("worker-0.pd", 1), "worker-0.pd:1");
  EXPECT_EQ(CompleteAdvertiseAddress("fd00::7", 50051), "[fd00::7]:50051");
  EXPECT_EQ(CompleteAdvertiseAddress("[fd00::7]", 50051), "[fd00::7]:50051");
  EXPECT_EQ(CompleteAdvertiseAddress("[fd00::7]:9", 50051), "[fd00::7]:9");
  EXPECT_EQ(CompleteAdvertiseAddress("10.0.0.7:9", 50051), "10.0.0.7:9");
}

TEST(KvHandoffTlsTest, MutualTlsWorkersHandOffOverTls) {
  WorkerServerOptions prefill_options;
  prefill_options.advertise_address = "127.0.0.1";  // bare: port added
  auto prefill = StartTlsWorker(Role::kPrefill, prefill_options);
  ASSERT_NE(prefill, nullptr);
  auto decode = StartTlsWorker(Role::kDecode, WorkerServerOptions());
  ASSERT_NE(decode, nullptr);

  const v1::KvHandle handle = Hold(*prefill, "t");
  EXPECT_EQ(handle.source_address(),
            "127.0.0.1:" + std::to_string(prefill->server->port()));
  const grpc::Status s = Import(*decode->stub, "t", handle);
  ASSERT_TRUE(s.ok()) << s.error_message();
  v1::SequenceInput step = Input("t", {1}, false);
  step.set_release_after_step(true);
  v1::ForwardResponse response;
  grpc::ClientContext context;
  server_testing::SetGenerousDeadline(&context);
  ASSERT_TRUE(decode->stub->Forward(&context, Request({step}), &response).ok());
  EXPECT_EQ(response.sequences(0).num_tokens(), 6);
  EXPECT_TRUE(WaitFor([&] { return NothingHeld(*prefill); }));
  EXPECT_TRUE(NothingHeld(*decode));
}

// The certificate names localhost and 127.0.0.1: an override to another
// name makes every pull fail the TLS check (UNAVAILABLE, nothing kept),
// proving the override is what the check uses; "localhost" passes.
TEST(KvHandoffTlsTest, PeerServerNameOverrideIsWhatTheCertificateMatches) {
  auto prefill = StartTlsWorker(Role::kPrefill, WorkerServerOptions());
  ASSERT_NE(prefill, nullptr);
  WorkerServerOptions wrong;
  wrong.peer_tls.server_name_override = "prefill.example.com";
  wrong.importer.pull_timeout = std::chrono::milliseconds(3000);
  auto mismatched = StartTlsWorker(Role::kDecode, wrong);
  ASSERT_NE(mismatched, nullptr);
  WorkerServerOptions right;
  right.peer_tls.server_name_override = "localhost";
  auto matched = StartTlsWorker(Role::kDecode, right);
  ASSERT_NE(matched, nullptr);

  const v1::KvHandle handle = Hold(*prefill, "n");
  const grpc::Status refused = Import(*mismatched->stub, "n", handle);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE)
      << refused.error_message();
  EXPECT_TRUE(NothingHeld(*mismatched));
  const grpc::Status ok = Import(*matched->stub, "n", handle);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  v1::ReleaseRequest release;
  release.add_sequence_ids("n");
  v1::ReleaseResponse released;
  grpc::ClientContext context;
  server_testing::SetGenerousDeadline(&context);
  ASSERT_TRUE(matched->stub->Release(&context, release, &released).ok());
  EXPECT_TRUE(WaitFor([&] { return NothingHeld(*prefill); }));
}

}  // namespace
}  // namespace pdworker
