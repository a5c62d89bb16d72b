// MetricsServer: the Prometheus pull endpoint (GET /metrics, text exposition
// format 0.0.4) on its own port, serving one registry.
//
// Why not prometheus::Exposer: it runs on civetweb, which Debian builds with
// a fixed 100 KiB thread stack. glibc places static TLS on every thread's
// stack, and the worker binary's static TLS (cuBLASLt ~92 KiB + glog ~30 KiB
// + cuBLAS ~12 KiB) does not fit, so civetweb cannot start a thread and the
// Exposer constructor throws ("null context when constructing CivetServer")
// in any binary that links CUDA. This server is plain sockets and one
// std::thread with a default stack; prometheus-cpp still does the
// serialization.
#ifndef PDWORKER_METRICS_METRICS_SERVER_H_
#define PDWORKER_METRICS_METRICS_SERVER_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "prometheus/registry.h"

namespace pdworker {

struct MetricsServerOptions {
  // Open connections at most. Each costs one fd and at most ~8 KiB of
  // request buffer (plus its response while it is being written). At the cap
  // a newcomer evicts the connection that has waited longest for a complete
  // request (idle keep-alive connections included): a real scrape sends its
  // request within milliseconds of connecting or of its previous answer, so
  // the longest waiting are the likely attackers or forgotten clients.
  size_t max_connections = 1024;
  // For one exchange: from accept (or the first byte of a later request on a
  // kept-alive connection) to the last byte of its response. A slow client
  // (slow-loris sender, or a reader that does not read) holds its slot for at
  // most this long per request.
  std::chrono::milliseconds connection_timeout{5000};
  // How long a kept-alive connection may sit between a response and the
  // first byte of its next request before it is closed. Scrapers poll every
  // 50 ms (llm-d's endpoint picker) to 15-60 s (Prometheus); past this they
  // simply reconnect.
  std::chrono::milliseconds idle_timeout{30000};
  // Requests answered on one connection at most; the last is answered with
  // "Connection: close". Bounds how long one client keeps a slot (at most
  // this many times connection_timeout + idle_timeout) and spreads
  // long-lived scrapers over fresh connections.
  int max_requests_per_connection = 1000;
};

// Counters since Start(), for tests and logs.
struct MetricsServerStats {
  uint64_t connections_accepted = 0;
  uint64_t requests_answered = 0;
};

// One event-loop thread poll()s the listening socket and every open
// connection (all non-blocking), so an idle or slow-loris client costs an fd
// and a buffer but never a thread: a scrape is parsed and answered as soon as
// its request head arrives, however many other clients sit idle.
//
// Persistent connections (RFC 9112, section 9): an HTTP/1.1 request keeps its
// connection open unless it says "Connection: close"; an HTTP/1.0 request
// only when it says "Connection: keep-alive". Pipelined requests are answered
// in order, one at a time (a later request is read only once the earlier
// response is written). The server closes after: a response it marked
// "Connection: close" (the client asked, the per-connection request bound
// was reached, the request was malformed, not GET/HEAD, or announced a body,
// whose framing this server does not read), the idle timeout, or a missed
// exchange deadline.
class MetricsServer {
 public:
  // Listens on `bind_address` ("host:port" or "[v6-host]:port"; port 0 picks
  // a free port, see port()) and serves `registry` at /metrics until
  // destroyed. Keeps `registry` alive.
  // INVALID_ARGUMENT for a null registry, a malformed address or options
  // that are not positive; UNAVAILABLE when the address cannot be bound
  // (e.g. in use).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& bind_address,
      std::shared_ptr<prometheus::Registry> registry,
      MetricsServerOptions options = {});

  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  // Stops listening, closes every connection (answered or not) and joins the
  // thread: no scrape touches the registry afterwards. Prompt (no timeout
  // waits).
  ~MetricsServer();

  // The port actually bound.
  int port() const { return port_; }

  MetricsServerStats stats() const {
    return {connections_accepted_.load(std::memory_order_relaxed),
            requests_answered_.load(std::memory_order_relaxed)};
  }

 private:
  MetricsServer(std::shared_ptr<prometheus::Registry> registry,
                MetricsServerOptions options, int listen_fd, int wake_read_fd,
                int wake_write_fd, int port);

  // Runs on loop_ until the wake pipe becomes readable; owns every
  // connection, so no state is shared with other threads.
  void EventLoop();
  // The full response (status line, headers, body) to one request head,
  // and whether the connection closes after it. `may_keep_alive`: false
  // when this is the connection's last allowed request.
  struct Reply {
    std::string bytes;
    bool close = true;
  };
  Reply Respond(absl::string_view request_head, bool may_keep_alive) const;

  const std::shared_ptr<prometheus::Registry> registry_;
  const MetricsServerOptions options_;
  const int listen_fd_;
  // A byte written here wakes the loop's poll() on shutdown.
  const int wake_read_fd_;
  const int wake_write_fd_;
  const int port_;

  // Written by the loop only; read by stats().
  std::atomic<uint64_t> connections_accepted_{0};
  std::atomic<uint64_t> requests_answered_{0};

  std::thread loop_;
};

}  // namespace pdworker

#endif  // PDWORKER_METRICS_METRICS_SERVER_H_
