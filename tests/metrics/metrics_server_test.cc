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
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "dispatcher/cudagraph_mode.h"
#include "dispatcher/graph_stats.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "metrics/worker_metrics.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"
#include "tests/metrics/metrics_test_util.h"
#include "tests/metrics/subprocess.h"

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
  const std::string request =
      "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
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
  // Read to the server's close: one request per connection.
  const std::string request =
      "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
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

// One response read off a persistent connection.
struct RawResponse {
  int status = 0;
  std::string head;  // status line and headers
  std::string body;
  bool says_close() const {
    return absl::StrContains(head, "\r\nConnection: close\r\n");
  }
  bool says_keep_alive() const {
    return absl::StrContains(head, "\r\nConnection: keep-alive\r\n");
  }
};

// A client that frames responses by their Content-Length, so it can send
// several requests over one socket (and pipeline them).
class KeepAliveClient {
 public:
  explicit KeepAliveClient(int port) : fd_(ConnectLoopback(port)) {
    // Bounded: a server that never answers fails the test, not hangs it.
    timeval timeout{10, 0};
    if (fd_ >= 0) {
      setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    }
  }
  ~KeepAliveClient() {
    if (fd_ >= 0) close(fd_);
  }
  KeepAliveClient(const KeepAliveClient&) = delete;
  KeepAliveClient& operator=(const KeepAliveClient&) = delete;

  int fd() const { return fd_; }

  bool Send(const std::string& raw) {
    return fd_ >= 0 && send(fd_, raw.data(), raw.size(), MSG_NOSIGNAL) ==
                           static_cast<ssize_t>(raw.size());
  }

  // The next response; a response to HEAD has no body whatever its
  // Content-Length says.
  absl::StatusOr<RawResponse> Read(bool to_head = false) {
    size_t head_end;
    while ((head_end = buffered_.find("\r\n\r\n")) == std::string::npos) {
      PDW_RETURN_IF_ERROR(Receive());
    }
    RawResponse response;
    response.head = buffered_.substr(0, head_end + 2);
    const std::vector<std::string> status_line =
        absl::StrSplit(response.head.substr(0, response.head.find("\r\n")),
                       absl::MaxSplits(' ', 2));
    const std::string length_field = "\r\nContent-Length: ";
    const size_t length_at = response.head.find(length_field);
    size_t length = 0;
    if (status_line.size() < 2 ||
        !absl::SimpleAtoi(status_line[1], &response.status) ||
        length_at == std::string::npos ||
        !absl::SimpleAtoi(
            response.head.substr(length_at + length_field.size(),
                                 response.head.find("\r\n", length_at + 2) -
                                     (length_at + length_field.size())),
            &length)) {
      return absl::DataLossError("bad response head: " + response.head);
    }
    if (to_head) length = 0;
    while (buffered_.size() < head_end + 4 + length) {
      PDW_RETURN_IF_ERROR(Receive());
    }
    response.body = buffered_.substr(head_end + 4, length);
    buffered_.erase(0, head_end + 4 + length);
    return response;
  }

  // Sends `raw` and reads its response.
  absl::StatusOr<RawResponse> Exchange(const std::string& raw,
                                       bool to_head = false) {
    if (!Send(raw)) return absl::UnavailableError(strerror(errno));
    return Read(to_head);
  }

 private:
  absl::Status Receive() {
    char buf[4096];
    const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
    if (n <= 0) {
      return absl::UnavailableError(
          absl::StrCat("connection ended (", n < 0 ? strerror(errno) : "EOF",
                       ") after '", buffered_, "'"));
    }
    buffered_.append(buf, static_cast<size_t>(n));
    return absl::OkStatus();
  }

  int fd_;
  std::string buffered_;  // received, not yet returned
};

constexpr char kGet11[] = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";

// A successful scrape of RegistryWithCounter() on a kept-alive connection.
void ExpectKeptAliveScrape(const absl::StatusOr<RawResponse>& response) {
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->status, 200) << response->head;
  EXPECT_TRUE(response->says_keep_alive()) << response->head;
  EXPECT_THAT(Samples(response->body, "pdworker_test_events_total"),
              Contains("pdworker_test_events_total 3"));
}

TEST(MetricsServerTest, AnswersManyRequestsOverOneHttp11Connection) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", RegistryWithCounter());
  ASSERT_TRUE(server.ok()) << server.status();
  KeepAliveClient client((*server)->port());
  ASSERT_GE(client.fd(), 0);
  for (int i = 0; i < 5; ++i) ExpectKeptAliveScrape(client.Exchange(kGet11));

  // HEAD, a 404 and the index keep the connection as well.
  absl::StatusOr<RawResponse> head = client.Exchange(
      "HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n", /*to_head=*/true);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ(head->status, 200);
  EXPECT_TRUE(head->says_keep_alive());
  EXPECT_EQ(head->body, "");
  absl::StatusOr<RawResponse> missing =
      client.Exchange("GET /nope HTTP/1.1\r\nHost: x\r\n\r\n");
  ASSERT_TRUE(missing.ok()) << missing.status();
  EXPECT_EQ(missing->status, 404);
  EXPECT_TRUE(missing->says_keep_alive());
  ExpectKeptAliveScrape(client.Exchange(kGet11));

  EXPECT_FALSE(ClosedByServer(client.fd(), std::chrono::milliseconds(0)));
  const MetricsServerStats stats = (*server)->stats();
  EXPECT_EQ(stats.connections_accepted, 1u);
  EXPECT_EQ(stats.requests_answered, 8u);
}

TEST(MetricsServerTest, ClosesWhenTheClientSaysConnectionClose) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", RegistryWithCounter());
  ASSERT_TRUE(server.ok()) << server.status();
  KeepAliveClient client((*server)->port());
  ExpectKeptAliveScrape(client.Exchange(kGet11));
  // Header names and options are case-insensitive; "close" wins in a list.
  absl::StatusOr<RawResponse> last = client.Exchange(
      "GET /metrics HTTP/1.1\r\nHost: x\r\nconnection: TE, Close\r\n\r\n");
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->status, 200);
  EXPECT_TRUE(last->says_close()) << last->head;
  EXPECT_TRUE(ClosedByServer(client.fd(), std::chrono::seconds(5)));
}

TEST(MetricsServerTest, Http10ClosesUnlessAskedToKeepAlive) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", RegistryWithCounter());
  ASSERT_TRUE(server.ok()) << server.status();

  KeepAliveClient plain((*server)->port());
  absl::StatusOr<RawResponse> once =
      plain.Exchange("GET /metrics HTTP/1.0\r\n\r\n");
  ASSERT_TRUE(once.ok()) << once.status();
  EXPECT_EQ(once->status, 200);
  EXPECT_TRUE(once->says_close()) << once->head;
  EXPECT_TRUE(ClosedByServer(plain.fd(), std::chrono::seconds(5)));

  KeepAliveClient asking((*server)->port());
  const std::string keep_alive =
      "GET /metrics HTTP/1.0\r\nConnection: keep-alive\r\n\r\n";
  ExpectKeptAliveScrape(asking.Exchange(keep_alive));
  ExpectKeptAliveScrape(asking.Exchange(keep_alive));
  EXPECT_EQ((*server)->stats().connections_accepted, 2u);
}

// Past the idle timeout (short here, the exchange deadline long) a kept-alive
// connection with no new request is closed.
TEST(MetricsServerTest, ClosesKeptAliveConnectionsAfterTheIdleTimeout) {
  MetricsServerOptions options;
  options.idle_timeout = std::chrono::milliseconds(200);
  options.connection_timeout = std::chrono::seconds(60);
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", RegistryWithCounter(), options);
  ASSERT_TRUE(server.ok()) << server.status();
  KeepAliveClient client((*server)->port());
  ExpectKeptAliveScrape(client.Exchange(kGet11));
  EXPECT_TRUE(ClosedByServer(client.fd(), std::chrono::seconds(10)));
  ExpectScrapeSucceeds((*server)->port());
}

// A kept-alive connection's next request gets the exchange deadline again:
// a client that starts one and never finishes is closed (the idle timeout,
// long here, does not apply once a request has begun).
TEST(MetricsServerTest, SlowSecondRequestMeetsTheExchangeDeadline) {
  MetricsServerOptions options;
  options.idle_timeout = std::chrono::seconds(60);
  options.connection_timeout = std::chrono::milliseconds(300);
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", RegistryWithCounter(), options);
  ASSERT_TRUE(server.ok()) << server.status();
  KeepAliveClient client((*server)->port());
  ExpectKeptAliveScrape(client.Exchange(kGet11));
  ASSERT_TRUE(client.Send("GET /metrics HTTP/1.1\r\nHost:"));
  EXPECT_TRUE(ClosedByServer(client.fd(), std::chrono::seconds(10)));
}

TEST(MetricsServerTest, ClosesAfterTheRequestBoundPerConnection) {
  MetricsServerOptions options;
  options.max_requests_per_connection = 3;
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", RegistryWithCounter(), options);
  ASSERT_TRUE(server.ok()) << server.status();
  for (int connection = 0; connection < 2; ++connection) {
    KeepAliveClient client((*server)->port());
    ExpectKeptAliveScrape(client.Exchange(kGet11));
    ExpectKeptAliveScrape(client.Exchange(kGet11));
    absl::StatusOr<RawResponse> last = client.Exchange(kGet11);
    ASSERT_TRUE(last.ok()) << last.status();
    EXPECT_EQ(last->status, 200);
    EXPECT_TRUE(last->says_close()) << last->head;
    EXPECT_THAT(Samples(last->body, "pdworker_test_events_total"),
                Contains("pdworker_test_events_total 3"));
    EXPECT_TRUE(ClosedByServer(client.fd(), std::chrono::seconds(5)));
  }
  EXPECT_EQ((*server)->stats().connections_accepted, 2u);
  EXPECT_EQ((*server)->stats().requests_answered, 6u);
}

// Requests sent back to back without waiting are answered in order on the
// same connection.
TEST(MetricsServerTest, AnswersPipelinedRequestsInOrder) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", RegistryWithCounter());
  ASSERT_TRUE(server.ok()) << server.status();
  KeepAliveClient client((*server)->port());
  ASSERT_TRUE(client.Send(absl::StrCat(
      kGet11, "HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
      "GET /nope HTTP/1.1\r\n\n",  // bare-LF line ends are accepted too
      kGet11, "GET / HTTP/1.1\r\nConnection: close\r\n\r\n")));
  ExpectKeptAliveScrape(client.Read());
  absl::StatusOr<RawResponse> head = client.Read(/*to_head=*/true);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ(head->status, 200);
  EXPECT_EQ(head->body, "");
  absl::StatusOr<RawResponse> missing = client.Read();
  ASSERT_TRUE(missing.ok()) << missing.status();
  EXPECT_EQ(missing->status, 404);
  ExpectKeptAliveScrape(client.Read());
  absl::StatusOr<RawResponse> index = client.Read();
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->status, 200);
  EXPECT_TRUE(index->says_close());
  EXPECT_TRUE(ClosedByServer(client.fd(), std::chrono::seconds(5)));
  EXPECT_EQ((*server)->stats().requests_answered, 5u);
}

// A request whose body this server does not read, or that it cannot parse,
// is answered and its connection closed: the stream cannot be framed past
// it.
TEST(MetricsServerTest, ClosesAfterRequestsItCannotFrame) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", RegistryWithCounter());
  ASSERT_TRUE(server.ok()) << server.status();
  const struct {
    std::string request;
    int status;
  } cases[] = {
      {"GET /metrics HTTP/1.1\r\nContent-Length: 4\r\n\r\nabcd", 200},
      {"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
       200},
      {"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405},
      {"garbage\r\n\r\n", 400},
  };
  for (const auto& c : cases) {
    KeepAliveClient client((*server)->port());
    absl::StatusOr<RawResponse> response = client.Exchange(c.request);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->status, c.status) << c.request;
    EXPECT_TRUE(response->says_close()) << c.request;
    EXPECT_TRUE(ClosedByServer(client.fd(), std::chrono::seconds(5)))
        << c.request;
  }
}

// Kept-alive connections count towards the cap; between requests they are
// waiting for one, so the longest idle is evicted for a newcomer and the
// scrape gets through.
TEST(MetricsServerTest, EvictsTheLongestIdleKeptAliveConnectionAtTheCap) {
  MetricsServerOptions options;
  options.max_connections = 4;
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", RegistryWithCounter(), options);
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<std::unique_ptr<KeepAliveClient>> clients;
  for (size_t i = 0; i < options.max_connections; ++i) {
    clients.push_back(std::make_unique<KeepAliveClient>((*server)->port()));
    ExpectKeptAliveScrape(clients.back()->Exchange(kGet11));
  }
  // The second client scrapes again: the first is now the longest idle.
  ExpectKeptAliveScrape(clients[1]->Exchange(kGet11));
  ExpectScrapeSucceeds((*server)->port());
  EXPECT_TRUE(ClosedByServer(clients[0]->fd(), std::chrono::seconds(5)));
  for (size_t i = 1; i < clients.size(); ++i) {
    ExpectKeptAliveScrape(clients[i]->Exchange(kGet11));
  }
}

// A real keep-alive client: Python's http.client sends every request over
// one HTTPConnection (it reconnects silently if the server closes, so the
// script also checks its socket's local port never changes).
TEST(MetricsServerTest, PythonHttpClientReusesOneConnection) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", RegistryWithCounter());
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string dir = testing::TestTmpDir();
  const std::string script = dir + "/keep_alive_client.py";
  std::ofstream(script) << R"py(import http.client
import sys

port, count = int(sys.argv[1]), int(sys.argv[2])
connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
local_ports = set()
for _ in range(count):
    connection.request("GET", "/metrics")
    response = connection.getresponse()
    body = response.read()
    assert response.status == 200, response.status
    assert b"pdworker_test_events_total 3" in body, body
    assert not response.will_close, response.getheaders()
    local_ports.add(connection.sock.getsockname()[1])
assert len(local_ports) == 1, local_ports
print("ok", count, "requests on port", local_ports.pop())
)py";
  constexpr int kRequests = 20;
  absl::StatusOr<testing::CommandResult> run = testing::RunCommand(
      {"/usr/bin/python3", script, absl::StrCat((*server)->port()),
       absl::StrCat(kRequests)},
      "", dir + "/keep_alive_client.log", absl::Seconds(60));
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->exit_code, 0) << run->output;
  EXPECT_THAT(run->output, HasSubstr("ok 20 requests"));
  const MetricsServerStats stats = (*server)->stats();
  EXPECT_EQ(stats.connections_accepted, 1u);
  EXPECT_EQ(stats.requests_answered, static_cast<uint64_t>(kRequests));
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
  MetricsServerOptions no_idle;
  no_idle.idle_timeout = std::chrono::milliseconds(0);
  EXPECT_EQ(MetricsServer::Start("127.0.0.1:0", RegistryWithCounter(), no_idle)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  MetricsServerOptions no_requests;
  no_requests.max_requests_per_connection = 0;
  EXPECT_EQ(
      MetricsServer::Start("127.0.0.1:0", RegistryWithCounter(), no_requests)
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdworker
