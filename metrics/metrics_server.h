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

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"

namespace pdworker {

struct MetricsServerOptions {
  // Open connections at most. Each costs one fd and at most ~8 KiB of
  // request buffer (plus its response while it is being written). At the cap
  // a newcomer evicts the oldest connection that has not sent a complete
  // request yet: a real scrape completes in milliseconds, so the oldest
  // idle connections are the likely attackers.
  size_t max_connections = 1024;
  // From accept to the last response byte; a connection past it is closed,
  // so an idle or slow client holds its slot for at most this long.
  std::chrono::milliseconds connection_timeout{5000};
};

// One event-loop thread poll()s the listening socket and every open
// connection (all non-blocking), so an idle or slow-loris client costs an fd
// and a buffer but never a thread: a scrape is parsed and answered as soon as
// its request head arrives, however many other clients sit idle. Each
// response is "Connection: close".
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

 private:
  MetricsServer(std::shared_ptr<prometheus::Registry> registry,
                MetricsServerOptions options, int listen_fd, int wake_read_fd,
                int wake_write_fd, int port);

  // Runs on loop_ until the wake pipe becomes readable; owns every
  // connection, so no state is shared with other threads.
  void EventLoop();
  // The full response (status line, headers, body) to one request head.
  std::string Respond(const std::string& request_head) const;

  const std::shared_ptr<prometheus::Registry> registry_;
  const MetricsServerOptions options_;
  const int listen_fd_;
  // A byte written here wakes the loop's poll() on shutdown.
  const int wake_read_fd_;
  const int wake_write_fd_;
  const int port_;

  std::thread loop_;
};

}  // namespace pdworker

#endif  // PDWORKER_METRICS_METRICS_SERVER_H_
