// MetricsServer: the real HTTP exposer serving a WorkerMetrics registry.
// This binary links the CUDA runtime and cuBLAS (through //worker/runtime)
// when CUDA is present, the setting in which prometheus::Exposer (civetweb)
// cannot start threads; see metrics/metrics_server.h.
#include "metrics/metrics_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
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

using Clock = std::chrono::steady_clock;

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

  // The silent connection is still within its 5 s budget; destruction
  // closes it instead of waiting it out.
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
  // 4 clients stay far below the connection cap, so none is shed.
  EXPECT_EQ(ok_scrapes.load(), 40);
}

// Client sockets a test holds open, closed on every exit path.
class HeldSockets {
 public:
  HeldSockets() = default;
  HeldSockets(const HeldSockets&) = delete;
  HeldSockets& operator=(const HeldSockets&) = delete;
  ~HeldSockets() {
    for (int fd : fds_) close(fd);
  }

  // Takes ownership of `fd` (ignored when negative) and returns it.
  int Adopt(int fd) {
    if (fd >= 0) fds_.push_back(fd);
    return fd;
  }

  // Connects one more socket to 127.0.0.1:<port> and sends `prefix`.
  bool Connect(int port, const std::string& prefix = "") {
    const int fd = Adopt(ConnectLoopback(port));
    if (fd < 0) return false;
    return prefix.empty() ||
           send(fd, prefix.data(), prefix.size(), MSG_NOSIGNAL) ==
               static_cast<ssize_t>(prefix.size());
  }

  const std::vector<int>& fds() const { return fds_; }

 private:
  std::vector<int> fds_;
};

// True when the server has closed `fd` (EOF or reset is readable) within
// `wait`.
bool ClosedByServer(int fd, std::chrono::milliseconds wait) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(wait.count())) <= 0) return false;
  char byte;
  return recv(fd, &byte, 1, MSG_DONTWAIT) <= 0;
}

// The raw response to GET /metrics, the whole exchange (connect to the
// server's close) bounded by `budget` the way Prometheus bounds a scrape by
// its scrape_timeout; DEADLINE_EXCEEDED past it.
absl::StatusOr<std::string> ScrapeWithin(int port,
                                         std::chrono::milliseconds budget) {
  const Clock::time_point deadline = Clock::now() + budget;
  HeldSockets sock;
  const int fd = sock.Adopt(socket(AF_INET, SOCK_STREAM, 0));
  if (fd < 0) return absl::UnavailableError(strerror(errno));
  // Also bounds a blocking connect() (a full accept queue drops SYNs).
  const auto us =
      std::chrono::duration_cast<std::chrono::microseconds>(budget).count();
  timeval timeout{us / 1000000, us % 1000000};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
          static_cast<ssize_t>(request.size())) {
    return absl::UnavailableError(
        absl::StrCat("connect/send: ", strerror(errno)));
  }
  std::string raw;
  char buf[4096];
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - Clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) <= 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("no complete response within ", budget.count(),
                       " ms; got: '", raw, "'"));
    }
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0) {
      return absl::UnavailableError(
          absl::StrCat("recv: ", strerror(errno), " after '", raw, "'"));
    }
    if (n == 0) break;
    raw.append(buf, static_cast<size_t>(n));
  }
  if (Clock::now() > deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat("response took over ", budget.count(), " ms"));
  }
  return raw;
}

std::shared_ptr<prometheus::Registry> RegistryWithCounter() {
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter()
      .Name("pdworker_test_events_total")
      .Help("test")
      .Register(*registry)
      .Add({})
      .Increment(3);
  return registry;
}

// A scrape a Prometheus server would count as up: within its 1 s budget,
// 200, and carrying the registry's metric.
void ExpectScrapeSucceeds(int port) {
  absl::StatusOr<std::string> raw =
      ScrapeWithin(port, std::chrono::milliseconds(1000));
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_TRUE(absl::StartsWith(*raw, "HTTP/1.1 200 OK\r\n")) << *raw;
  const size_t header_end = raw->find("\r\n\r\n");
  ASSERT_NE(header_end, std::string::npos) << *raw;
  EXPECT_THAT(
      Samples(raw->substr(header_end + 4), "pdworker_test_events_total"),
      Contains("pdworker_test_events_total 3"));
}

// Idle clients (connect, send nothing) and slow-loris clients (a request
// line, then one header byte every 200 ms, never finishing) must not starve
// a scrape, nor be shed while under the cap, nor delay shutdown.
TEST(MetricsServerTest, ScrapesWhileIdleAndSlowClientsHoldConnections) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", RegistryWithCounter());
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();

  HeldSockets idle;
  HeldSockets slow;
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(idle.Connect(port)) << strerror(errno);
    ASSERT_TRUE(slow.Connect(port, "GET /metrics HTTP/1.1\r\n"))
        << strerror(errno);
  }
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    while (!stop.load()) {
      for (int fd : slow.fds()) send(fd, "X", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  });

  for (int i = 0; i < 5; ++i) {
    ExpectScrapeSucceeds(port);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  stop.store(true);
  trickle.join();

  // Well under the cap and within their 5 s budget: nobody was shed.
  for (const HeldSockets* held : {&idle, &slow}) {
    for (int fd : held->fds()) {
      EXPECT_FALSE(ClosedByServer(fd, std::chrono::milliseconds(0)));
    }
  }
  const Clock::time_point start = Clock::now();
  server->reset();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(1));
  EXPECT_TRUE(ClosedByServer(idle.fds()[0], std::chrono::milliseconds(1000)));
}

// Twice the cap in idle plus twice in slow-loris connections: each newcomer
// evicts the oldest connection without a complete request, so the scrape
// (the newest connection) is always served.
TEST(MetricsServerTest, ScrapesWhenIdleConnectionsExceedTheCap) {
  MetricsServerOptions options;
  options.max_connections = 64;  // the default (1024) needs 2k+ fds
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", RegistryWithCounter(), options);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();

  HeldSockets idle;
  HeldSockets slow;
  for (size_t i = 0; i < 2 * options.max_connections; ++i) {
    ASSERT_TRUE(idle.Connect(port)) << strerror(errno);
    ASSERT_TRUE(slow.Connect(port, "GET /metrics HTTP/1.1\r\nX-a: "))
        << strerror(errno);
  }
  for (int i = 0; i < 5; ++i) ExpectScrapeSucceeds(port);

  // The oldest went to make room; the newest is still held.
  EXPECT_TRUE(ClosedByServer(idle.fds().front(), std::chrono::seconds(1)));
  EXPECT_FALSE(ClosedByServer(slow.fds().back(), std::chrono::milliseconds(0)));
}

// A client that never finishes its request is closed at its deadline, so it
// holds a slot for a bounded time.
TEST(MetricsServerTest, ClosesConnectionsPastTheirDeadline) {
  MetricsServerOptions options;
  options.connection_timeout = std::chrono::milliseconds(200);
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", RegistryWithCounter(), options);
  ASSERT_TRUE(server.ok()) << server.status();
  HeldSockets slow;
  ASSERT_TRUE(slow.Connect((*server)->port(), "GET /metrics HTTP/1.1\r\n"));
  const Clock::time_point start = Clock::now();
  EXPECT_TRUE(ClosedByServer(slow.fds()[0], std::chrono::seconds(2)));
  EXPECT_GE(Clock::now() - start, std::chrono::milliseconds(150));
  ExpectScrapeSucceeds((*server)->port());
}

TEST(MetricsServerTest, RejectsNonPositiveOptions) {
  MetricsServerOptions no_connections;
  no_connections.max_connections = 0;
  EXPECT_EQ(
      MetricsServer::Start("127.0.0.1:0", RegistryWithCounter(), no_connections)
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  MetricsServerOptions no_time;
  no_time.connection_timeout = std::chrono::milliseconds(0);
  EXPECT_EQ(MetricsServer::Start("127.0.0.1:0", RegistryWithCounter(), no_time)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdworker
