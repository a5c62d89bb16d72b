// MetricsServer: the Prometheus pull endpoint (GET /metrics, text exposition
// format 0.0.4) on its own port, serving one registry.
//
// Why not prometheus::Exposer: it runs on civetweb, which Debian builds with
// a fixed 100 KiB thread stack. glibc places static TLS on every thread's
// stack, and the worker binary's static TLS (cuBLASLt ~92 KiB + glog ~30 KiB
// + cuBLAS ~12 KiB) does not fit, so civetweb cannot start a thread and the
// Exposer constructor throws ("null context when constructing CivetServer")
// in any binary that links CUDA. This server is plain sockets and
// std::threads with default stacks; prometheus-cpp still does the
// serialization.
#ifndef PDWORKER_METRICS_METRICS_SERVER_H_
#define PDWORKER_METRICS_METRICS_SERVER_H_

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "prometheus/registry.h"

namespace pdworker {

// Connections are served by a small fixed pool (kNumWorkers); each request
// has a few seconds to arrive and be answered, excess concurrent
// connections are closed at once, so a stuck client cannot pin memory or
// threads. Each response is "Connection: close".
class MetricsServer {
 public:
  // Listens on `bind_address` ("host:port" or "[v6-host]:port"; port 0 picks
  // a free port, see port()) and serves `registry` at /metrics until
  // destroyed. Keeps `registry` alive.
  // INVALID_ARGUMENT for a null registry or a malformed address;
  // UNAVAILABLE when the address cannot be bound (e.g. in use).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& bind_address,
      std::shared_ptr<prometheus::Registry> registry);

  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  // Stops listening, aborts in-flight connections and joins every thread:
  // no scrape touches the registry afterwards. Prompt (no timeout waits).
  ~MetricsServer();

  // The port actually bound.
  int port() const { return port_; }

 private:
  static constexpr int kNumWorkers = 2;
  static constexpr size_t kMaxPendingConnections = 16;

  MetricsServer(std::shared_ptr<prometheus::Registry> registry, int listen_fd,
                int wake_read_fd, int wake_write_fd, int port);

  void AcceptLoop();
  void WorkerLoop();
  // Reads one request from `fd` and writes the response.
  void Serve(int fd);

  const std::shared_ptr<prometheus::Registry> registry_;
  const int listen_fd_;
  // A byte written here wakes the acceptor's poll() on shutdown.
  const int wake_read_fd_;
  const int wake_write_fd_;
  const int port_;

  std::mutex mu_;
  std::condition_variable work_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<int> pending_ ABSL_GUARDED_BY(mu_);
  // Being served: shut down on stop so blocked reads return at once.
  std::set<int> active_ ABSL_GUARDED_BY(mu_);

  std::thread acceptor_;
  std::vector<std::thread> workers_;
};

}  // namespace pdworker

#endif  // PDWORKER_METRICS_METRICS_SERVER_H_
