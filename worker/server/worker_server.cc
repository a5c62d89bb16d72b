#include "worker/server/worker_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

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
  if (options.executor.max_queue <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_queue must be positive, got ", options.executor.max_queue));
  }

  std::unique_ptr<WorkerServer> s(new WorkerServer());
  s->metrics_ = metrics;
  s->executor_ = std::make_unique<Executor>(runner, options.executor, metrics);
  s->service_ = std::make_unique<WorkerService>(runner, *s->executor_, metrics,
                                                options.device_name);

  // Process-wide gRPC switches; both must precede the builder.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, *credentials, &s->port_);
  builder.RegisterService(s->service_.get());
  builder.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    s->server_.reset();
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen_address,
                     " (address in use, or not a valid host:port)"));
  }
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
}

absl::StatusOr<CaptureSummary> WorkerServer::CaptureGraphsAndServe() {
  CaptureSummary summary;
  int graphs = 0;
  const absl::Status captured =
      executor_->RunExclusive([&](ModelRunner& runner) -> absl::Status {
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
  SetHealth(true);
  LOG(INFO) << "serving: " << graphs << " graphs captured in "
            << summary.total_seconds << " s";
  return summary;
}

void WorkerServer::BeginDrain() {
  service_->SetState(ServingState::kDraining);
  executor_->BeginDrain();
  SetHealth(false);
}

void WorkerServer::Drain() {
  BeginDrain();
  LOG(INFO) << "draining: " << executor_->snapshot().queued_calls
            << " calls in flight";
  executor_->WaitUntilIdle();
  Shutdown();
  LOG(INFO) << "drained";
}

void WorkerServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  // Executor first: whatever is still queued fails with UNAVAILABLE, so no
  // reactor waits on it while the server shuts down.
  executor_->Stop();
  // Our calls are all finished; the grace is for the others (e.g. health
  // Watch streams), which are then cancelled.
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  server_->Wait();
}

}  // namespace pdworker
