// MetricsServer: the real HTTP exposer serving a WorkerMetrics registry.
// This binary links the CUDA runtime and cuBLAS (through //worker/runtime)
// when CUDA is present, the setting in which prometheus::Exposer (civetweb)
// cannot start threads; see metrics/metrics_server.h.
#include "metrics/metrics_server.h"

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "dispatcher/cudagraph_mode.h"
#include "dispatcher/graph_stats.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "metrics/worker_metrics.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"
#include "tests/metrics/metrics_test_util.h"

namespace pdworker {
namespace {

using ::pdworker::testing::ConnectLoopback;
using ::pdworker::testing::HttpExchange;
using ::pdworker::testing::HttpGet;
using ::pdworker::testing::HttpResponse;
using ::pdworker::testing::Samples;
using ::testing::Contains;
using ::testing::HasSubstr;

WorkerInfo Info() {
  return {"prefill", "PIECEWISE", "PIECEWISE", "tiny", "fp", "cpu"};
}

HttpResponse Scrape(int port) {
  absl::StatusOr<HttpResponse> response = HttpGet(port, "/metrics");
  EXPECT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response.ok() ? response->status : 0, 200);
  return response.ok() ? *response : HttpResponse();
}

TEST(MetricsServerTest, ServesTheWorkerRegistryOnAnEphemeralPort) {
  GraphStats stats;
  WorkerMetrics metrics(Info(), &stats, {CudaGraphMode::Piecewise(), {8}});
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", metrics.registry());
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);

  stats.Record(5, 8, RuntimeMode::kPiecewise);
  std::string body = Scrape((*server)->port()).body;
  EXPECT_THAT(Samples(body, "pdworker_cudagraph_steps_total"),
              Contains("pdworker_cudagraph_steps_total{mode=\"PIECEWISE\","
                       "padded_tokens=\"8\",unpadded_tokens=\"5\"} 1"));
  EXPECT_THAT(body, HasSubstr("pdworker_worker_info{"));

  // Each scrape reads the table afresh.
  stats.Record(5, 8, RuntimeMode::kPiecewise);
  body = Scrape((*server)->port()).body;
  EXPECT_THAT(Samples(body, "pdworker_cudagraph_steps_total"),
              Contains("pdworker_cudagraph_steps_total{mode=\"PIECEWISE\","
                       "padded_tokens=\"8\",unpadded_tokens=\"5\"} 2"));
}

TEST(MetricsServerTest, KeepsTheRegistryAlive) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server;
  {
    auto registry = std::make_shared<prometheus::Registry>();
    prometheus::BuildCounter()
        .Name("pdworker_test_events_total")
        .Help("test")
        .Register(*registry)
        .Add({})
        .Increment(3);
    server = MetricsServer::Start("127.0.0.1:0", registry);
    ASSERT_TRUE(server.ok()) << server.status();
  }
  EXPECT_THAT(
      Samples(Scrape((*server)->port()).body, "pdworker_test_events_total"),
      Contains("pdworker_test_events_total 3"));
}

TEST(MetricsServerTest, PortInUseIsUnavailable) {
  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<std::unique_ptr<MetricsServer>> first =
      MetricsServer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*first)->port());
  absl::StatusOr<std::unique_ptr<MetricsServer>> second =
      MetricsServer::Start(address, registry);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr(address));
}

TEST(MetricsServerTest, RejectsBadArguments) {
  auto registry = std::make_shared<prometheus::Registry>();
  EXPECT_EQ(MetricsServer::Start("127.0.0.1:0", nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (const char* address : {"", "9090", ":9090", "127.0.0.1:"}) {
    EXPECT_EQ(MetricsServer::Start(address, registry).status().code(),
              absl::StatusCode::kInvalidArgument)
        << "'" << address << "'";
  }
}

TEST(MetricsServerTest, StopsListeningWhenDestroyed) {
  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_TRUE(HttpGet(port, "/metrics").ok());
  server->reset();
  EXPECT_FALSE(HttpGet(port, "/metrics").ok());
}

TEST(MetricsServerTest, AnswersOtherRequestsWithHttpErrors) {
  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();

  absl::StatusOr<HttpResponse> response = HttpGet(port, "/nope");
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->status, 404);

  response = HttpExchange(port, "POST /metrics HTTP/1.0\r\n\r\n");
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->status, 405);

  response = HttpExchange(port, "garbage\r\n\r\n");
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->status, 400);

  // Query strings are ignored; HEAD has headers only.
  response = HttpGet(port, "/metrics?x=1");
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->status, 200);
  response = HttpExchange(port, "HEAD /metrics HTTP/1.0\r\n\r\n");
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->status, 200);
  EXPECT_EQ(response->body, "");
}

TEST(MetricsServerTest, ExpositionContentType) {
  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(server.ok()) << server.status();
  const int fd = ConnectLoopback((*server)->port());
  ASSERT_GE(fd, 0);
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(send(fd, request.data(), request.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(request.size()));
  std::string raw;
  char buf[1024];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) raw.append(buf, n);
  close(fd);
  EXPECT_THAT(raw, HasSubstr("Content-Type: text/plain; version=0.0.4"));
  EXPECT_THAT(raw, HasSubstr("Connection: close"));
}

// A client that connects and never sends must not block scrapes, nor the
// server's shutdown.
TEST(MetricsServerTest, SilentClientBlocksNeitherScrapesNorShutdown) {
  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(server.ok()) << server.status();
  const int silent = ConnectLoopback((*server)->port());
  ASSERT_GE(silent, 0);
  absl::StatusOr<HttpResponse> response =
      HttpGet((*server)->port(), "/metrics");
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->status, 200);

  // The silent connection still holds a worker in its 5 s request budget;
  // destruction aborts it instead of waiting it out.
  const auto start = std::chrono::steady_clock::now();
  server->reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
  close(silent);
}

// Many concurrent scrapes while the table changes (TSan checks the server's
// and the collector's locking).
TEST(MetricsServerTest, ConcurrentScrapes) {
  GraphStats stats;
  WorkerMetrics metrics(Info(), &stats, {CudaGraphMode::Piecewise(), {8}});
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", metrics.registry());
  ASSERT_TRUE(server.ok()) << server.status();
  std::atomic<int> ok_scrapes{0};
  std::vector<std::thread> clients;
  clients.reserve(4);
  for (int c = 0; c < 4; ++c) {
    clients.emplace_back([&] {
      for (int i = 0; i < 10; ++i) {
        absl::StatusOr<HttpResponse> r = HttpGet((*server)->port(), "/metrics");
        if (r.ok() && r->status == 200) ++ok_scrapes;
      }
    });
  }
  for (int i = 0; i < 1000; ++i)
    stats.Record(1 + i % 8, 8, RuntimeMode::kPiecewise);
  for (std::thread& t : clients) t.join();
  // Up to 16 connections queue while 2 workers serve; 4 clients never
  // exceed that, so none is shed.
  EXPECT_EQ(ok_scrapes.load(), 40);
}

}  // namespace
}  // namespace pdworker
