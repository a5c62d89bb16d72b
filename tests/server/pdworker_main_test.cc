// The pdworker binary as an operator runs it: it starts on a tiny model,
// prints "listening on PORT", serves, and drains on SIGTERM with exit code 0;
// bad configuration fails at startup with a message naming the flag.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"
#include "tests/server/subprocess.h"
#include "tests/server/test_certificates.h"
#include "worker/runtime/device_factory.h"

namespace pdworker {
namespace {

using server_testing::Input;
using server_testing::Request;
using server_testing::RunfilePath;
using server_testing::Subprocess;
using server_testing::TinyModelDir;
using ::testing::HasSubstr;
using ::testing::Not;

std::string TmpPath(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/", name);
}

// Flags for a small, quick worker on a kernel-chosen loopback port.
std::vector<std::string> WorkerArgs(std::vector<std::string> extra) {
  std::vector<std::string> args = {
      RunfilePath("worker/pdworker"),
      "--model=" + TinyModelDir(),
      "--role=both",
      "--host=127.0.0.1",
      "--port=0",
      "--metrics_port=0",
      "--max_num_seqs=4",
      "--max_num_batched_tokens=32",
      "--max_model_len=64",
      "--kv_cache_bytes=65536",
      "--block_size=4",
      "--stats_log_interval=1s",
  };
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// GET /metrics from the worker's Prometheus endpoint (HTTP/1.0: the server
// closes the connection after the body).
std::string ScrapeMetrics(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string reply;
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) ==
      0) {
    const std::string request =
        "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(fd, request.data(), request.size()) ==
        static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      ssize_t n;
      while ((n = read(fd, buffer, sizeof(buffer))) > 0)
        reply.append(buffer, n);
    }
  }
  close(fd);
  return reply;
}

// The number after `needle` in `text` ("metrics on port 1234" -> 1234).
int NumberAfter(const std::string& text, const std::string& needle) {
  const size_t at = text.find(needle);
  if (at == std::string::npos) return 0;
  const size_t begin = at + needle.size();
  const size_t end = text.find_first_not_of("0123456789", begin);
  int value = 0;
  if (!absl::SimpleAtoi(text.substr(begin, end - begin), &value)) return 0;
  return value;
}

// Waits for the ready line; returns the port.
int WaitUntilListening(Subprocess& worker) {
  auto output = worker.WaitForOutput("listening on ", absl::Seconds(120));
  EXPECT_TRUE(output.ok()) << output.status();
  if (!output.ok()) return 0;
  const size_t at = output->find("listening on ") + 13;
  int port = 0;
  EXPECT_TRUE(
      absl::SimpleAtoi(output->substr(at, output->find('\n', at) - at), &port));
  return port;
}

TEST(PdworkerMainTest, ServesThenDrainsOnSigterm) {
  // The dashed spelling of --compilation_config is accepted.
  auto worker = Subprocess::Start(
      WorkerArgs(
          {"--compilation-config={\"cudagraph_capture_sizes\":[1,2,4]}"}),
      TmpPath("smoke.log"));
  ASSERT_TRUE(worker.ok()) << worker.status();
  const int port = WaitUntilListening(**worker);
  ASSERT_GT(port, 0);

  auto stub = v1::Worker::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext context;
    server_testing::SetGenerousDeadline(&context);
    v1::WorkerStatus status;
    ASSERT_TRUE(
        stub->GetStatus(&context, v1::GetStatusRequest(), &status).ok());
    EXPECT_TRUE(status.serving());
    EXPECT_EQ(status.role(), "both");
    EXPECT_EQ(status.max_num_seqs(), 4);
    EXPECT_THAT(status.capture_sizes(), ::testing::ElementsAre(1, 2, 4));
    EXPECT_EQ(status.kv_blocks_total(), 64);  // 65536 / 1024
    EXPECT_EQ(status.device(), "cpu");
  }
  v1::ForwardResponse response;
  ASSERT_TRUE(server_testing::Forward(
                  *stub, Request({Input("s", {1, 2, 3}, true)}), &response)
                  .ok());
  EXPECT_EQ(response.sequences(0).num_tokens(), 3);
  EXPECT_EQ(server_testing::Forward(*stub, Request({Input("s", {1}, true)}),
                                    &response)
                .error_code(),
            grpc::StatusCode::ALREADY_EXISTS);

  // The engine and the service feed the Prometheus metrics.
  const int metrics_port = NumberAfter((*worker)->Output(), "metrics on port ");
  ASSERT_GT(metrics_port, 0);
  const std::string metrics = ScrapeMetrics(metrics_port);
  EXPECT_THAT(metrics,
              HasSubstr("pdworker_forward_requests_total{code=\"OK\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("pdworker_forward_requests_total{code="
                                 "\"ALREADY_EXISTS\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("pdworker_worker_info{"));
  EXPECT_THAT(metrics, HasSubstr("role=\"both\""));
  EXPECT_THAT(metrics, HasSubstr("pdworker_cudagraph_graphs{"));

  // SIGTERM with "s" still live: it may keep generating, new sequences go
  // elsewhere, and the worker exits once "s" is released.
  (*worker)->Signal(SIGTERM);
  ASSERT_TRUE(server_testing::WaitFor(
      [&] { return !server_testing::StatusOf(*stub).serving(); }));
  EXPECT_EQ(server_testing::Forward(*stub, Request({Input("t", {1}, true)}),
                                    &response)
                .error_code(),
            grpc::StatusCode::UNAVAILABLE);
  v1::SequenceInput last = Input("s", {4}, false);
  last.set_release_after_step(true);
  ASSERT_TRUE(server_testing::Forward(*stub, Request({last}), &response).ok());
  EXPECT_EQ(response.sequences(0).num_tokens(), 4);
  auto code = (*worker)->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << (*worker)->Output();
  const std::string log = (*worker)->Output();
  EXPECT_THAT(log, HasSubstr("draining: waiting up to 30000 ms for 1 live "
                             "sequences"));
  EXPECT_THAT(log, HasSubstr("drained"));
  EXPECT_THAT(log, ::testing::Not(HasSubstr("drain timeout")));
  EXPECT_THAT(log, HasSubstr("metrics on port"));
  // --device=auto takes CUDA where it is usable and says why not otherwise.
  if (CreateDevice(DeviceKind::kCuda).ok()) {
    EXPECT_THAT(log, HasSubstr("--device=auto: using cuda:0"));
  } else {
    EXPECT_THAT(log, HasSubstr("--device=auto: using the CPU backend (CUDA: "));
  }
}

TEST(PdworkerMainTest, ServesMutualTls) {
  auto certs = server_testing::MakeTestCertificates(TmpPath("main_tls"));
  ASSERT_TRUE(certs.ok()) << certs.status();
  auto worker = Subprocess::Start(
      WorkerArgs({"--tls_cert=" + certs->dir + "/server.crt",
                  "--tls_key=" + certs->dir + "/server.key",
                  "--tls_client_ca=" + certs->dir + "/ca.crt"}),
      TmpPath("tls.log"));
  ASSERT_TRUE(worker.ok()) << worker.status();
  const int port = WaitUntilListening(**worker);
  ASSERT_GT(port, 0);
  grpc::SslCredentialsOptions tls;
  tls.pem_root_certs = certs->ca_pem;
  tls.pem_cert_chain = certs->client_cert_pem;
  tls.pem_private_key = certs->client_key_pem;
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", port), grpc::SslCredentials(tls)));
  grpc::ClientContext context;
  server_testing::SetGenerousDeadline(&context);
  v1::WorkerStatus status;
  const grpc::Status s =
      stub->GetStatus(&context, v1::GetStatusRequest(), &status);
  EXPECT_TRUE(s.ok()) << s.error_message();
  (*worker)->Signal(SIGINT);
  auto code = (*worker)->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0) << (*worker)->Output();
}

// No memory flags: the KV cache gets what --gpu_memory_utilization of the
// host's available memory leaves (a small fraction here, to keep the test
// light), and the startup log says where the memory went.
TEST(PdworkerMainTest, SizesTheKvCacheFromTheMemoryFraction) {
  auto worker = Subprocess::Start(
      WorkerArgs({"--kv_cache_bytes=0", "--gpu_memory_utilization=0.02"}),
      TmpPath("fraction.log"));
  ASSERT_TRUE(worker.ok()) << worker.status();
  const int port = WaitUntilListening(**worker);
  ASSERT_GT(port, 0) << (*worker)->Output();
  (*worker)->Signal(SIGINT);
  auto code = (*worker)->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  const std::string output = (*worker)->Output();
  EXPECT_THAT(output, HasSubstr("memory (--gpu_memory_utilization=0.02)"));
  EXPECT_THAT(output, HasSubstr("weights and buffers"));
  EXPECT_THAT(output, HasSubstr("max concurrency"));
  // Far more than the 64 KiB the other tests give it (2% of the host's
  // available memory is tens of MiB at least).
  const std::string marker = " KV blocks of 4 tokens (";
  const size_t at = output.find(marker);
  ASSERT_NE(at, std::string::npos) << output;
  EXPECT_GT(std::stoll(output.substr(at + marker.size())), int64_t{1} << 20);
}

TEST(PdworkerMainTest, BadConfigurationFailsAtStartupNamingTheFlag) {
  struct Case {
    std::vector<std::string> flags;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--role=sideways"}, "--role"},
      {{"--compilation_config={\"cudagraph_mode\": FULL"},
       "--compilation_config"},
      {{"--compilation_config={\"cudagraph_mod\":\"FULL\"}"}, "cudagraph_mod"},
      {{"--kv_cache_bytes=1000"}, "kv_cache_bytes=1000"},
      {{"--kv_cache_bytes=-1"}, "--kv_cache_bytes"},
      {{"--gpu_memory_utilization=1.5"}, "--gpu_memory_utilization"},
      {{"--gpu_memory_utilization=0"}, "--gpu_memory_utilization"},
      // No explicit KV size and a fraction of the host that the weights
      // and buffers alone exceed.
      {{"--kv_cache_bytes=0", "--gpu_memory_utilization=0.0000001"},
       "no memory is left for the KV cache"},
      {{"--model=/nonexistent/model"}, "--model"},
      {{"--device=tpu"}, "unknown device 'tpu'"},
      {{"--max_num_seqs=0"}, "--max_num_seqs"},
      {{"--max_model_len=100000"}, "max_model_len=100000"},
      {{"--tls_cert=/nonexistent.pem", "--tls_key=/nonexistent.key"},
       "--tls_cert"},
      {{"--tls_client_ca=/dev/null"}, "--tls_client_ca"},
      {{"--stats_log_interval=soon"}, "--stats_log_interval"},
      {{"--sequence_idle_timeout=-5s"}, "--sequence_idle_timeout"},
      {{"--drain_timeout=soon"}, "--drain_timeout"},
      {{"--grpc_keepalive_time=0s"}, "--grpc_keepalive_time"},
      {{"--grpc_min_client_ping_interval=often"},
       "--grpc_min_client_ping_interval"},
      {{"--sequence_idle_timeout=forever"}, "'forever' is not a duration"},
      {{"--max-num-seqs=-3"}, "--max_num_seqs"},  // dashed spelling too
      {{"--nccl_max_peers=-1"}, "--nccl_max_peers"},
      {{"--kv_chunk_bytes=0"}, "--kv_chunk_bytes"},
      {{"--max_message_bytes=1048576", "--kv_chunk_bytes=1048576"},
       "--kv_chunk_bytes"},
      {{"--kv_pull_chunks=blocks"}, "--kv_pull_chunks"},
      {{"--kv_events_endpoint=tcp://*:0", "--kv_events_layout=tree"},
       "--kv_events_layout"},
      {{"--kv_events_replay_endpoint=tcp://*:0"}, "--kv_events_endpoint"},
      {{"--no-enable-prefix-caching", "--kv_events_endpoint=tcp://*:0"},
       "needs --enable_prefix_caching"},
      {{"--kv-events-config={\"endpoint\":\"tcp://*:0\",\"bogus\":1}"},
       "bogus"},
      {{"--kv_events_config={}", "--kv_events_endpoint=tcp://*:0"}, "not both"},
      {{"--unverified_cuda_kernels=maybe"}, "--unverified_cuda_kernels"},
      {{"--speculative-config={\"method\":\"eagle3\",\"model\":\"x\","
        "\"num_speculative_tokens\":3}"},
       "method \"eagle3\" is not supported yet"},
      {{"--speculative_config={\"method\":\"ngram\"}"},
       "num_speculative_tokens is required"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].message);
    auto worker = Subprocess::Start(WorkerArgs(cases[i].flags),
                                    TmpPath(absl::StrCat("bad", i, ".log")));
    ASSERT_TRUE(worker.ok());
    auto code = (*worker)->Wait(absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_NE(*code, 0);
    const std::string output = (*worker)->Output();
    EXPECT_THAT(output, HasSubstr(cases[i].message));
    EXPECT_THAT(output, ::testing::Not(HasSubstr("listening on")));
  }
}

// `pdworker --help` lists every flag worker/worker_flags.cc defines, with its
// default, and exits 0 (the README promises it; Abseil's own --help finds
// none of them and exits 1).
TEST(PdworkerMainTest, HelpListsEveryFlagWithItsDefaultAndExitsZero) {
  std::ifstream source(RunfilePath("worker/worker_flags.cc"));
  ASSERT_TRUE(source.good());
  std::stringstream text;
  text << source.rdbuf();
  // ABSL_FLAG(type, name, default, help): the names, read from the source so
  // a flag added later is checked too.
  std::vector<std::string> names;
  const std::regex flag_definition(R"(ABSL_FLAG\(\s*[\w:]+\s*,\s*(\w+)\s*,)");
  const std::string source_text = text.str();
  for (auto it = std::sregex_iterator(source_text.begin(), source_text.end(),
                                      flag_definition);
       it != std::sregex_iterator(); ++it) {
    names.push_back((*it)[1].str());
  }
  ASSERT_GE(names.size(), 30u);

  for (const char* spelling : {"--help", "-h", "--helpfull"}) {
    SCOPED_TRACE(spelling);
    auto help = Subprocess::Start({RunfilePath("worker/pdworker"), spelling},
                                  TmpPath("help.log"));
    ASSERT_TRUE(help.ok()) << help.status();
    auto code = (*help)->Wait(absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0);
    const std::string output = (*help)->Output();
    EXPECT_THAT(output, Not(HasSubstr("No flags matched")));
    EXPECT_THAT(output, Not(HasSubstr("loading")));  // nothing started
    for (const std::string& name : names) {
      EXPECT_THAT(output, HasSubstr(absl::StrCat("--", name, " (default: ")))
          << name;
    }
    // Grouped by subsystem, with the defaults an operator looks for.
    EXPECT_THAT(output, HasSubstr("TLS:\n  --tls_cert (default: \"\")"));
    EXPECT_THAT(output, HasSubstr("--port (default: 50051)"));
  }
}

// Broken TLS material is refused before the model loads, naming the flag,
// the file and what is wrong with it, not as a port that cannot be bound.
TEST(PdworkerMainTest, BadTlsMaterialFailsBeforeLoadingTheModel) {
  auto certs = server_testing::MakeTestCertificates(TmpPath("bad_tls"));
  ASSERT_TRUE(certs.ok()) << certs.status();
  const std::string dir = certs->dir;
  // Not PEM at all, and a PEM block whose body is damaged.
  const std::string garbage = TmpPath("garbage.pem");
  std::ofstream(garbage) << "this is not a certificate\n";
  const std::string damaged = TmpPath("damaged.pem");
  std::ofstream(damaged) << "-----BEGIN CERTIFICATE-----\nAAAA\n"
                            "-----END CERTIFICATE-----\n";
  struct Case {
    std::vector<std::string> flags;
    std::vector<std::string> message;
  };
  const std::vector<Case> cases = {
      // The client's key with the server's certificate.
      {{"--tls_cert=" + dir + "/server.crt",
        "--tls_key=" + dir + "/client.key"},
       {"--tls_key '" + dir + "/client.key'", "is not the private key",
        "--tls_cert '" + dir + "/server.crt'"}},
      {{"--tls_cert=" + garbage, "--tls_key=" + dir + "/server.key"},
       {"--tls_cert '" + garbage + "'", "is not a PEM certificate"}},
      {{"--tls_cert=" + damaged, "--tls_key=" + dir + "/server.key"},
       {"--tls_cert '" + damaged + "'", "is not a PEM certificate"}},
      // A certificate where the key belongs.
      {{"--tls_cert=" + dir + "/server.crt",
        "--tls_key=" + dir + "/server.crt"},
       {"--tls_key '" + dir + "/server.crt'", "is not a PEM private key"}},
      {{"--tls_cert=" + dir + "/server.crt", "--tls_key=" + dir + "/server.key",
        "--tls_client_ca=" + garbage},
       {"--tls_client_ca '" + garbage + "'", "is not a PEM certificate"}},
      {{"--tls_cert=" + dir + "/server.crt", "--tls_key=" + dir + "/server.key",
        "--kv_peer_ca=" + damaged},
       {"--kv_peer_ca '" + damaged + "'", "is not a PEM certificate"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].message[0]);
    auto worker = Subprocess::Start(WorkerArgs(cases[i].flags),
                                    TmpPath(absl::StrCat("tls", i, ".log")));
    ASSERT_TRUE(worker.ok());
    auto code = (*worker)->Wait(absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 2);  // bad flags, not a failed startup
    const std::string output = (*worker)->Output();
    for (const std::string& part : cases[i].message) {
      EXPECT_THAT(output, HasSubstr(part));
    }
    EXPECT_THAT(output, Not(HasSubstr("loading ")));
    EXPECT_THAT(output, Not(HasSubstr("cannot listen")));
  }
}

// --device=cuda without a usable GPU stops at startup with the device's
// error and never serves (it does not fall back to the CPU: the operator
// asked for CUDA). Where a GPU exists, tests/transfer:cuda_worker_gpu_test
// runs the CUDA worker for real.
TEST(PdworkerMainTest, CudaWithoutAGpuFailsAtStartup) {
  if (CreateDevice(DeviceKind::kCuda).ok()) {
    GTEST_SKIP() << "a CUDA device is usable here";
  }
  auto worker = Subprocess::Start(WorkerArgs({"--device=cuda"}),
                                  TmpPath("device_cuda.log"));
  ASSERT_TRUE(worker.ok());
  auto code = (*worker)->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_NE(*code, 0);
  const std::string output = (*worker)->Output();
  EXPECT_THAT(output, ::testing::Not(HasSubstr("listening on")));
  // UNAVAILABLE (no GPU visible) or UNIMPLEMENTED (built without CUDA).
  EXPECT_THAT(output, ::testing::AnyOf(HasSubstr("UNAVAILABLE"),
                                       HasSubstr("UNIMPLEMENTED")));
}

}  // namespace
}  // namespace pdworker
