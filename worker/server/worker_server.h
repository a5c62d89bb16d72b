// WorkerServer: a running pdworker gRPC server around one ModelRunner — the
// Worker service, the request-level VllmEngine service, the standard health
// service (grpc.health.v1) and server reflection, the engine, optional
// TLS/mTLS, and the lifecycle
//
//   Start (health NOT_SERVING) -> CaptureGraphsAndServe (SERVING)
//     -> Drain (NOT_SERVING, new calls UNAVAILABLE, in-flight complete) -> gone
//
// Health reports the same status for "" (the whole server), for
// "pdworker.v1.Worker" and for "vllm.grpc.engine.VllmEngine".
#ifndef PDWORKER_WORKER_SERVER_WORKER_SERVER_H_
#define PDWORKER_WORKER_SERVER_WORKER_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "metrics/worker_metrics.h"
#include "worker/engine/engine.h"
#include "worker/engine/kv_lease_table.h"
#include "worker/kv_events/kv_event_publisher.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/capture_session.h"
#include "worker/server/call_arrivals.h"
#include "worker/server/kv_event_sink.h"
#include "worker/server/vllm_engine_service.h"
#include "worker/server/worker_service.h"
#include "worker/transfer/kv_importer.h"
#include "worker/transfer/kv_transfer_service.h"
#include "worker/transfer/nccl_comm_cache.h"
#include "worker/transfer/peer_channels.h"

namespace pdworker {

// PEM contents (not paths). No certificate: plaintext. A client CA turns on
// mutual TLS: clients must present a certificate it signed.
struct ServerTls {
  std::string cert_chain_pem;
  std::string private_key_pem;
  std::string client_ca_pem;
};

// How long no call may have arrived before a drained worker shuts its
// server down (see WorkerServerOptions::drain_linger). A call on its way
// reaches the server within a network round trip; a router still sending
// to a draining worker sends more often than this.
inline constexpr std::chrono::milliseconds kDrainQuietPeriod{250};

// HTTP/2 keepalive on the worker's connections (routers and decode workers
// pulling KV).
struct KeepalivePolicy {
  // The worker pings a connection after `time` without traffic and closes
  // it when the ping is not answered within `timeout`: a router whose node
  // vanished (no FIN, no RST) does not hold a connection for gRPC's default
  // two hours.
  std::chrono::milliseconds time{30000};
  std::chrono::milliseconds timeout{10000};
  // The most often a client may ping (routers keep idle connections warm
  // this way; grpc-go allows 10 s at the least). gRPC's server default is
  // once per 5 minutes, and it answers more with GOAWAY "too_many_pings".
  std::chrono::milliseconds min_client_ping_interval{5000};
  // Whether clients may ping with no call in flight (an idle router
  // connection). gRPC's server default refuses (counts them as abuse).
  enum class PingsWithoutCalls { kAccept, kRefuse };
  PingsWithoutCalls permit_pings_without_calls = PingsWithoutCalls::kAccept;
};

struct WorkerServerOptions {
  // "host:port"; port 0 lets the kernel pick (see WorkerServer::port()).
  std::string listen_address = "127.0.0.1:0";
  ServerTls tls;
  // Largest request gRPC accepts; larger ones fail with RESOURCE_EXHAUSTED
  // before reaching any handler. gRPC's own default is 4 MiB.
  int max_receive_message_bytes = 4 << 20;
  KeepalivePolicy keepalive;
  EngineOptions engine;
  // GetStatus.device, e.g. "cpu".
  std::string device_name = "cpu";
  // The request-level API (vllm.grpc.engine.VllmEngine): the checkpoint
  // directory (GetModelInfo.model_path, GetTokenizer's files) and the name
  // routers see (empty: the directory).
  std::string model_dir;
  std::string served_model_name;

  // --- KV handoff (DESIGN.md "P/D KV handoff") ---
  // Where decode workers pull from this worker (KvHandle.source_address):
  // host:port, or a bare host (IPv4, IPv6 or name; e.g. a pod IP) to which
  // the bound port is added (IPv6 bracketed). Empty: the listen address
  // with the bound port, with the host name in place of a wildcard host
  // (0.0.0.0, [::]).
  std::string advertise_address;
  // How long a held lease waits for its decode worker before its blocks are
  // freed.
  std::chrono::milliseconds kv_lease_ttl{30000};
  // Drain's bound on waiting for live sequences and held leases. Keep it
  // below the orchestrator's kill deadline (Kubernetes'
  // terminationGracePeriodSeconds).
  std::chrono::milliseconds drain_timeout{30000};
  // After the drain, before the server shuts down: keep answering
  // UNAVAILABLE until no call has arrived for kDrainQuietPeriod, for at most
  // this long (0: shut down at once). See call_arrivals.h for why.
  std::chrono::milliseconds drain_linger{3000};
  KvImporterOptions importer;
  KvTransferServiceOptions transfer;
  // NCCL communicators kept at once, one per (source, puller) pair this
  // worker is part of, each taking up to kNcclCommDeviceBytes of device
  // memory (worker/transfer/nccl_transfer.h); beyond, the least recently
  // used idle one is dropped, or the pull uses the gRPC stream. 0: no NCCL
  // transport. Only used on CUDA with NCCL built in.
  int nccl_max_peers = 8;
  // How KV pulls connect to peers. Not enabled: derived from `tls` (a TLS
  // worker talks TLS: root = the client CA, else the system's roots; client
  // certificate = the server's). server_name_override applies either way.
  PeerTls peer_tls;
  // KV cache events (prefix caching): vLLM's ZMQ publisher when set
  // (--kv_events_endpoint); SMG's SubscribeKvEvents stream whenever the
  // runner caches prefixes.
  std::optional<KvEventPublisherOptions> kv_events_zmq;
};

class WorkerServer {
 public:
  // Listens and answers GetStatus / health (NOT_SERVING) at once; Forward
  // and Release answer UNAVAILABLE until CaptureGraphsAndServe(). `runner`
  // and `metrics` (may be null) must outlive the server; the engine thread
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

  // Captures every CUDA graph on the engine thread (progress is logged),
  // then serves: health SERVING, Forward accepted.
  absl::StatusOr<CaptureSummary> CaptureGraphsAndServe();

  // Health NOT_SERVING; calls that would start a sequence (Forward with
  // start, ImportKv) get UNAVAILABLE, so routers place new requests
  // elsewhere; live sequences keep stepping until released. GetStatus and
  // GetGraphStats keep answering (serving=false) so routers can watch the
  // drain. Non-blocking.
  void BeginDrain();
  // How Drain() ends.
  enum class DrainEnd {
    // Stop listening: gRPC's server shutdown (GOAWAY; other RPCs get a
    // one-second grace, then are cancelled). gRPC ends a call that reaches
    // the server while it shuts down with CANCELLED (it fails calls that
    // arrive after its shutdown began, before its GOAWAY has reached their
    // clients); the linger before it only makes that unlikely.
    kShutDownServer,
    // For a process that exits right after Drain() returns, without
    // destroying the server: everything behind the gRPC server stops, the
    // server keeps answering every call at once (UNAVAILABLE), and Drain()
    // returns once the calls that arrived before the engine stopped have
    // ended (at most a second). The process exit then closes every
    // connection, and a client whose call was on its way sees UNAVAILABLE
    // (the connection closed), never CANCELLED. Destroying the server
    // later still shuts it down.
    kLeaveServerToProcessExit,
  };

  // BeginDrain, then wait (at most `drain_timeout`) until the worker holds
  // nothing: no live sequence (routers finish and release them, as vLLM and
  // SGLang let in-flight requests finish on SIGTERM), no queued call, no
  // KV import, no held lease (PullKv and ReleaseKv keep being served). Then
  // wait for accepted imports (each bounded by the pull timeout), linger
  // while calls still arrive (they get UNAVAILABLE; at most
  // `drain_linger`), stop the engine (calls still queued get UNAVAILABLE)
  // and end as `end` says.
  void Drain(DrainEnd end = DrainEnd::kShutDownServer);

  Engine& engine() { return *engine_; }
  KvLeaseTable& leases() { return *leases_; }
  const std::string& advertise_address() const { return advertise_address_; }
  grpc::Server& grpc_server() { return *server_; }

 private:
  WorkerServer() = default;
  void SetHealth(bool serving);
  // Stops the engine, NCCL transfers and KV event streams; the gRPC server
  // keeps answering (UNAVAILABLE). Idempotent.
  void StopBehindServer();
  // StopBehindServer, then gRPC's server shutdown. Idempotent.
  void Shutdown();

  WorkerMetrics* metrics_ = nullptr;
  int port_ = 0;
  bool stopped_behind_server_ = false;
  bool shut_down_ = false;
  std::string advertise_address_;
  std::chrono::milliseconds drain_timeout_{0};
  std::chrono::milliseconds drain_linger_{0};
  // Owned by server_ (its interceptor factory); valid while server_ is.
  CallArrivals* arrivals_ = nullptr;
  // Destroyed in reverse: the gRPC server (whose reactors call into the
  // rest) goes first; the importer joins its pulls; the lease table hands
  // its blocks to the (stopped) engine last.
  // Outlives the engine (which publishes into it) and the services.
  std::unique_ptr<KvEventSink> kv_events_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<KvLeaseTable> leases_;
  std::unique_ptr<PeerChannels> peers_;
  // Null without the NCCL transport; outlives the importer and the
  // transfer service, which hold its leases.
  std::unique_ptr<NcclCommFactory> nccl_factory_;
  std::unique_ptr<NcclCommCache> nccl_comms_;
  std::unique_ptr<KvImporter> importer_;
  std::unique_ptr<KvTransferService> transfer_service_;
  std::unique_ptr<WorkerService> service_;
  std::unique_ptr<VllmEngineService> engine_api_;
  std::unique_ptr<grpc::Server> server_;
};

// `address` as host:port: unchanged when it has a port, else `port` added
// (an IPv6 literal bracketed). "10.0.0.7" -> "10.0.0.7:50051",
// "fd00::7" -> "[fd00::7]:50051", "w:1" -> "w:1".
std::string CompleteAdvertiseAddress(const std::string& address, int port);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_SERVER_WORKER_SERVER_H_
