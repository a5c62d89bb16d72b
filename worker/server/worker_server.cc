#include "worker/server/worker_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "worker/transfer/nccl_transfer.h"

namespace pdworker {
namespace {

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeCredentials(
    const ServerTls& tls) {
  if (tls.cert_chain_pem.empty() && tls.private_key_pem.empty()) {
    if (!tls.client_ca_pem.empty()) {
      return absl::InvalidArgumentError(
          "a client CA (mutual TLS) needs a server certificate and key");
    }
    return grpc::InsecureServerCredentials();
  }
  if (tls.cert_chain_pem.empty() || tls.private_key_pem.empty()) {
    return absl::InvalidArgumentError(
        "TLS needs both a certificate chain and its private key");
  }
  grpc::SslServerCredentialsOptions options(
      tls.client_ca_pem.empty()
          ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
          : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = tls.client_ca_pem;
  options.pem_key_cert_pairs.push_back(
      {tls.private_key_pem, tls.cert_chain_pem});
  return grpc::SslServerCredentials(options);
}

// host:port for KvHandle.source_address (see WorkerServerOptions).
std::string AdvertiseAddress(const std::string& listen_address, int port) {
  std::string host = listen_address.substr(0, listen_address.rfind(':'));
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::" ||
      host == "[::0]") {
    char name[256] = {};
    host = gethostname(name, sizeof(name) - 1) == 0 ? name : "localhost";
  }
  return absl::StrCat(host, ":", port);
}

}  // namespace

std::string CompleteAdvertiseAddress(const std::string& address, int port) {
  if (address.empty()) return address;
  if (address.front() == '[') {  // [v6] or [v6]:port
    return address.back() == ']' ? absl::StrCat(address, ":", port) : address;
  }
  const size_t colons = std::count(address.begin(), address.end(), ':');
  if (colons == 0) return absl::StrCat(address, ":", port);  // host, v4
  if (colons == 1) return address;                           // host:port
  return absl::StrCat("[", address, "]:", port);             // bare v6
}

namespace {

PeerTls DefaultPeerTls(const ServerTls& tls) {
  PeerTls peer;
  if (tls.cert_chain_pem.empty()) return peer;
  // A TLS worker's peers are TLS workers of the same deployment: trust the
  // CA its own clients are checked against (mutual TLS), else the system's
  // roots, and present its own certificate when a peer asks for one.
  peer.enabled = true;
  peer.root_certs_pem = tls.client_ca_pem;
  peer.cert_chain_pem = tls.cert_chain_pem;
  peer.private_key_pem = tls.private_key_pem;
  return peer;
}

// Milliseconds as gRPC's int channel arguments want them.
int ArgMillis(std::chrono::milliseconds d) {
  return static_cast<int>(
      std::min<int64_t>(d.count(), std::numeric_limits<int>::max()));
}

void ApplyKeepalive(const KeepalivePolicy& policy,
                    grpc::ServerBuilder& builder) {
  const bool without_calls = policy.permit_pings_without_calls ==
                             KeepalivePolicy::PingsWithoutCalls::kAccept;
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                             ArgMillis(policy.time));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             ArgMillis(policy.timeout));
  // Both ways: the worker pings idle connections too, and accepts a
  // router's pings on them.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS,
                             without_calls ? 1 : 0);
  builder.AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
      ArgMillis(policy.min_client_ping_interval));
  // The worker's own pings on an idle connection carry no data; the
  // default cap (2) would stop them before a dead peer is noticed.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerServer>> WorkerServer::Start(
    ModelRunner& runner, const WorkerServerOptions& options,
    WorkerMetrics* metrics) {
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeCredentials(options.tls);
  if (!credentials.ok()) return credentials.status();
  if (options.max_receive_message_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_receive_message_bytes must be positive, got ",
                     options.max_receive_message_bytes));
  }
  if (options.keepalive.time.count() <= 0 ||
      options.keepalive.timeout.count() <= 0 ||
      options.keepalive.min_client_ping_interval.count() <= 0) {
    return absl::InvalidArgumentError(
        "the keepalive time, timeout and minimum client ping interval must "
        "be positive");
  }
  if (options.engine.max_queue <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_queue must be positive, got ", options.engine.max_queue));
  }

  if (options.drain_timeout.count() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "drain_timeout must be >= 0, got ", options.drain_timeout.count()));
  }
  if (options.kv_lease_ttl.count() <= 0 ||
      options.importer.pull_timeout.count() <= 0 ||
      options.importer.num_threads <= 0) {
    return absl::InvalidArgumentError(
        "kv_lease_ttl, the pull timeout and the importer threads must be "
        "positive");
  }

  std::unique_ptr<WorkerServer> s(new WorkerServer());
  s->metrics_ = metrics;
  s->drain_timeout_ = options.drain_timeout;
  s->drain_linger_ = options.drain_linger;
  WorkerServer* self = s.get();
  // Lease blocks go back to the pool on the engine thread, between steps.
  s->leases_ = std::make_unique<KvLeaseTable>(
      options.kv_lease_ttl,
      [self](SequenceKv kv) {
        const absl::Status posted = self->engine_->Post(
            [kv](ModelRunner& r) mutable { r.FreeDetached(kv); });
        LOG_IF(WARNING, !posted.ok())
            << "KV lease blocks not freed (engine stopped): " << posted;
      },
      metrics);
  // KV cache events: nothing to publish without prefix caching.
  if (runner.kv_cache().prefix_caching() == PrefixCaching::kOn) {
    std::unique_ptr<KvEventPublisher> zmq;
    if (options.kv_events_zmq.has_value()) {
      PDW_ASSIGN_OR_RETURN(zmq,
                           KvEventPublisher::Create(*options.kv_events_zmq));
    }
    s->kv_events_ = std::make_unique<KvEventSink>(
        std::move(zmq), std::make_unique<KvEventStream>());
  } else if (options.kv_events_zmq.has_value()) {
    return absl::InvalidArgumentError(
        "--kv_events_endpoint needs --enable_prefix_caching: without a "
        "prefix cache there are no KV cache events");
  }
  s->engine_ = std::make_unique<Engine>(runner, options.engine, metrics,
                                        s->leases_.get(), s->kv_events_.get());
  PeerTls peer_tls =
      options.peer_tls.enabled ? options.peer_tls : DefaultPeerTls(options.tls);
  peer_tls.server_name_override = options.peer_tls.server_name_override;
  s->peers_ = std::make_unique<PeerChannels>(peer_tls,
                                             options.max_receive_message_bytes);
  const KvCacheView view = runner.kv_cache_view();
  const std::string fingerprint = runner.model_fingerprint();
  if (options.nccl_max_peers > 0 && NcclTransportAvailable(runner.device())) {
    s->nccl_factory_ = NewNcclCommFactory();
    s->nccl_comms_ = std::make_unique<NcclCommCache>(*s->nccl_factory_,
                                                     options.nccl_max_peers);
  }
  s->importer_ = std::make_unique<KvImporter>(
      *s->engine_, runner.device(), view, fingerprint, *s->peers_,
      options.importer, metrics, s->nccl_comms_.get());
  s->transfer_service_ = std::make_unique<KvTransferService>(
      *s->leases_, runner.device(), view, fingerprint, options.transfer,
      metrics, s->nccl_comms_.get());

  // Process-wide gRPC switches; both must precede the builder.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, *credentials, &s->port_);
  builder.RegisterService(s->transfer_service_.get());
  builder.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  ApplyKeepalive(options.keepalive, builder);
  // The advertised address may need the bound port: the service learns it
  // after BuildAndStart (before it serves any Forward).
  const std::string& advertise = options.advertise_address;
  s->service_ = std::make_unique<WorkerService>(
      runner, *s->engine_, metrics, options.device_name,
      HandoffParts{s->leases_.get(), s->importer_.get(), advertise,
                   s->transfer_service_->offers_cuda_ipc(),
                   s->transfer_service_->offers_nccl(),
                   s->transfer_service_->epoch()});
  builder.RegisterService(s->service_.get());
  VllmEngineServiceOptions engine_api;
  engine_api.model_dir = options.model_dir;
  engine_api.served_model_name = options.served_model_name;
  engine_api.kv_events =
      s->kv_events_ != nullptr ? s->kv_events_->stream() : nullptr;
  s->engine_api_ = std::make_unique<VllmEngineService>(
      runner, *s->engine_, engine_api, s->importer_.get(),
      &s->service_->handle_template());
  builder.RegisterService(s->engine_api_.get());
  auto arrivals = std::make_unique<CallArrivals>();
  s->arrivals_ = arrivals.get();
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(std::move(arrivals));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    s->server_.reset();
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen_address,
                     " (address in use, or not a valid host:port)"));
  }
  s->advertise_address_ =
      advertise.empty() ? AdvertiseAddress(options.listen_address, s->port_)
                        : CompleteAdvertiseAddress(advertise, s->port_);
  s->service_->SetAdvertiseAddress(s->advertise_address_);
  // The default health service starts out SERVING for "".
  s->SetHealth(false);
  return s;
}

WorkerServer::~WorkerServer() {
  if (server_ == nullptr) return;  // Start failed half-way
  BeginDrain();
  Shutdown();
}

void WorkerServer::SetHealth(bool serving) {
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus(serving);  // every service, "" included
  health->SetServingStatus(v1::Worker::service_full_name(), serving);
  health->SetServingStatus(vllm::grpc::engine::VllmEngine::service_full_name(),
                           serving);
}

absl::StatusOr<CaptureSummary> WorkerServer::CaptureGraphsAndServe() {
  CaptureSummary summary;
  int graphs = 0;
  const absl::Status captured =
      engine_->RunExclusive([&](ModelRunner& runner) -> absl::Status {
        absl::StatusOr<CaptureSummary> s = runner.CaptureGraphs();
        if (!s.ok()) return s.status();
        summary = *std::move(s);
        graphs = runner.NumCapturedGraphs();
        return absl::OkStatus();
      });
  if (!captured.ok()) return captured;
  if (metrics_ != nullptr) metrics_->SetCaptureSummary(summary, graphs);
  service_->SetGraphsCaptured(graphs);
  service_->SetState(ServingState::kServing);
  engine_api_->SetState(ServingState::kServing);
  SetHealth(true);
  LOG(INFO) << "serving: " << graphs << " graphs captured in "
            << summary.total_seconds << " s";
  return summary;
}

void WorkerServer::BeginDrain() {
  service_->SetState(ServingState::kDraining);
  engine_api_->SetState(ServingState::kDraining);
  engine_->BeginDrain();
  SetHealth(false);
}

void WorkerServer::Drain(DrainEnd end) {
  BeginDrain();
  // What still holds the worker: requests in flight (live sequences, calls,
  // imports) and prompts prefilled for decode workers (leases).
  const auto held = [this] {
    const EngineSnapshot s = engine_->snapshot();
    // Waiting engine-owned requests hold no KV yet but will run.
    return std::make_tuple(int64_t{s.kv.num_sequences} + s.waiting_requests,
                           s.queued_calls,
                           static_cast<int64_t>(importer_->in_flight()),
                           static_cast<int64_t>(leases_->size()));
  };
  auto [sequences, calls, imports, leases] = held();
  LOG(INFO) << "draining: waiting up to " << drain_timeout_.count()
            << " ms for " << sequences
            << " live sequences and waiting requests, " << calls << " calls, "
            << imports << " KV imports and " << leases << " KV leases";
  const auto give_up = std::chrono::steady_clock::now() + drain_timeout_;
  while (sequences + calls + imports + leases > 0 &&
         std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::tie(sequences, calls, imports, leases) = held();
  }
  if (sequences + calls + leases > 0) {
    LOG(WARNING) << "drain timeout (" << drain_timeout_.count()
                 << " ms): stopping with " << sequences
                 << " live sequences (their requests fail), " << calls
                 << " calls and " << leases << " KV leases";
  }
  // Accepted imports finish (each is bounded by the pull timeout): they need
  // the engine to install or give back their blocks.
  while (importer_->in_flight() > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // Calls still on their way (a router that has not yet noticed the drain)
  // get UNAVAILABLE from us, not CANCELLED from gRPC's shutdown (nor a
  // closed connection).
  const auto now = [] { return std::chrono::steady_clock::now(); };
  const auto linger_end = now() + drain_linger_;
  while (now() < linger_end && now() - arrivals_->last() < kDrainQuietPeriod) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const bool still_arriving = now() - arrivals_->last() < kDrainQuietPeriod;
  if (end == DrainEnd::kLeaveServerToProcessExit) {
    LOG_IF(WARNING, still_arriving)
        << "calls still arriving after a " << drain_linger_.count()
        << " ms linger (--drain_linger): stopping anyway; they end "
           "UNAVAILABLE. Routers should stop sending once health reports "
           "NOT_SERVING";
    StopBehindServer();
    // From here every call is answered at once (UNAVAILABLE): wait only for
    // the ones that may carry real work's answer.
    arrivals_->Cut();
    if (!arrivals_->WaitForCallsBeforeCut(std::chrono::seconds(1))) {
      LOG(WARNING) << "calls still open a second after the engine stopped: "
                      "their clients see UNAVAILABLE";
    }
    LOG(INFO) << "drained";
    return;
  }
  LOG_IF(WARNING, still_arriving)
      << "calls still arriving after a " << drain_linger_.count()
      << " ms linger (--drain_linger): shutting down anyway; calls that "
         "arrive now may end CANCELLED. Routers should stop sending once "
         "health reports NOT_SERVING";
  Shutdown();
  LOG(INFO) << "drained";
}

void WorkerServer::StopBehindServer() {
  if (stopped_behind_server_) return;
  stopped_behind_server_ = true;
  // Engine first: whatever is still queued fails with UNAVAILABLE, so no
  // reactor waits on it while the server shuts down.
  engine_->Stop();
  // NCCL transfers still running (the drain is over) give up now rather
  // than at their deadlines, and the kept communicators are freed.
  if (nccl_comms_ != nullptr) nccl_comms_->Shutdown();
  // SubscribeKvEvents streams never end by themselves: end them (UNAVAILABLE)
  // so the server's shutdown does not wait on them.
  if (kv_events_ != nullptr && kv_events_->stream() != nullptr) {
    kv_events_->stream()->Shutdown();
  }
}

void WorkerServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  StopBehindServer();
  // Our calls are all finished; the grace is for the others (e.g. health
  // Watch streams), which are then cancelled.
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  server_->Wait();
}

}  // namespace pdworker
