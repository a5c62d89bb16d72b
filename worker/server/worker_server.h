// WorkerServer: a running pdworker gRPC server around one ModelRunner — the
// Worker service, the standard health service (grpc.health.v1) and server
// reflection, the executor, optional TLS/mTLS, and the lifecycle
//
//   Start (health NOT_SERVING) -> CaptureGraphsAndServe (SERVING)
//     -> Drain (NOT_SERVING, new calls UNAVAILABLE, in-flight complete) -> gone
//
// Health reports the same status for "" (the whole server) and for
// "pdworker.v1.Worker".
#ifndef PDWORKER_WORKER_SERVER_WORKER_SERVER_H_
#define PDWORKER_WORKER_SERVER_WORKER_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "metrics/worker_metrics.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/capture_session.h"
#include "worker/server/executor.h"
#include "worker/server/worker_service.h"

namespace pdworker {

// PEM contents (not paths). No certificate: plaintext. A client CA turns on
// mutual TLS: clients must present a certificate it signed.
struct ServerTls {
  std::string cert_chain_pem;
  std::string private_key_pem;
  std::string client_ca_pem;
};

struct WorkerServerOptions {
  // "host:port"; port 0 lets the kernel pick (see WorkerServer::port()).
  std::string listen_address = "127.0.0.1:0";
  ServerTls tls;
  // Largest request gRPC accepts; larger ones fail with RESOURCE_EXHAUSTED
  // before reaching any handler. gRPC's own default is 4 MiB.
  int max_receive_message_bytes = 4 << 20;
  ExecutorOptions executor;
  // GetStatus.device, e.g. "cpu".
  std::string device_name = "cpu";
};

class WorkerServer {
 public:
  // Listens and answers GetStatus / health (NOT_SERVING) at once; Forward
  // and Release answer UNAVAILABLE until CaptureGraphsAndServe(). `runner`
  // and `metrics` (may be null) must outlive the server; the executor thread
  // owns `runner` from now on. INVALID_ARGUMENT for inconsistent TLS
  // options, UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<WorkerServer>> Start(
      ModelRunner& runner, const WorkerServerOptions& options,
      WorkerMetrics* metrics);

  // Stops at once: queued calls fail with UNAVAILABLE. Use Drain() for a
  // graceful shutdown.
  ~WorkerServer();

  WorkerServer(const WorkerServer&) = delete;
  WorkerServer& operator=(const WorkerServer&) = delete;

  int port() const { return port_; }

  // Captures every CUDA graph on the executor thread (progress is logged),
  // then serves: health SERVING, Forward accepted.
  absl::StatusOr<CaptureSummary> CaptureGraphsAndServe();

  // Health NOT_SERVING, new Forward/Release calls UNAVAILABLE; queued and
  // running calls still complete. GetStatus and GetGraphStats keep
  // answering (serving=false) so routers can watch the drain. Non-blocking.
  void BeginDrain();
  // BeginDrain, wait for every queued call to complete, then stop
  // listening (other RPCs get a one-second grace) and stop the executor.
  void Drain();

  Executor& executor() { return *executor_; }
  grpc::Server& grpc_server() { return *server_; }

 private:
  WorkerServer() = default;
  void SetHealth(bool serving);
  void Shutdown();

  WorkerMetrics* metrics_ = nullptr;
  int port_ = 0;
  bool shut_down_ = false;
  // Destroyed in reverse: the gRPC server (whose reactors call into the
  // executor) goes first.
  std::unique_ptr<Executor> executor_;
  std::unique_ptr<WorkerService> service_;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_SERVER_WORKER_SERVER_H_
