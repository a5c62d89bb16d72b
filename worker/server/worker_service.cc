#include "worker/server/worker_service.h"

#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "worker/engine/step_calls.h"
#include "worker/rpc/parsed_call.h"
#include "worker/rpc/status_mapping.h"
#include "worker/transfer/cuda_ipc.h"
#include "worker/transfer/kv_transfer_params.h"
#include "worker/transfer/kv_transfer_service.h"

namespace pdworker {
namespace {

v1::RuntimeMode ToProto(RuntimeMode mode) {
  switch (mode) {
    case RuntimeMode::kNone:
      return v1::RUNTIME_MODE_NONE;
    case RuntimeMode::kPiecewise:
      return v1::RUNTIME_MODE_PIECEWISE;
    case RuntimeMode::kFull:
      return v1::RUNTIME_MODE_FULL;
  }
  return v1::RUNTIME_MODE_UNSPECIFIED;
}

int64_t UnixMicros(std::chrono::system_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             t.time_since_epoch())
      .count();
}

void FillResponse(const v1::ForwardRequest& request,
                  const ForwardOutcome& outcome,
                  const v1::KvHandle& handle_template,
                  v1::ForwardResponse* response) {
  for (int i = 0; i < request.sequences_size(); ++i) {
    const SequenceResult& r = outcome.sequences[i];
    v1::SequenceOutput* out = response->add_sequences();
    out->set_sequence_id(request.sequences(i).sequence_id());
    out->set_token_id(r.token_id);
    out->set_logprob(r.logprob);
    out->set_num_tokens(r.num_tokens);
    out->set_cached_tokens(r.cached_tokens);
    out->mutable_prior_token_ids()->Add(r.prior_token_ids.begin(),
                                        r.prior_token_ids.end());
    out->mutable_prior_logprobs()->Add(r.prior_logprobs.begin(),
                                       r.prior_logprobs.end());
    if (static_cast<size_t>(i) < outcome.leases.size() &&
        outcome.leases[i].has_value()) {
      const KvLeaseInfo& lease = *outcome.leases[i];
      v1::KvHandle* handle = out->mutable_kv_handle();
      *handle = handle_template;
      handle->set_lease_id(lease.lease_id);
      handle->set_sequence_id(request.sequences(i).sequence_id());
      handle->set_num_tokens(lease.num_tokens);
      handle->set_lease_expiry_unix_micros(UnixMicros(lease.expiry));
      handle->set_version(kKvHandleVersion);
      // The call knows the sequence's tokens when it created it.
      if (request.sequences(i).start()) {
        *handle->mutable_prompt_token_ids() = request.sequences(i).token_ids();
      }
    }
  }
  const StepInfo& s = outcome.last_step;
  v1::StepInfo* step = response->mutable_step();
  step->set_runtime_mode(ToProto(s.mode));
  if (s.fallback_reason != FallbackReason::kNone) {
    step->set_fallback_reason(
        std::string{FallbackReasonName(s.fallback_reason)});
  }
  step->set_unpadded_tokens(s.unpadded_tokens);
  step->set_padded_tokens(s.padded_tokens);
  step->set_num_sequences(s.num_sequences);
  step->set_step_micros(static_cast<int64_t>(s.device_seconds * 1e6));
  response->set_num_steps(outcome.num_steps);
}

// One Forward RPC. Finished exactly once, by Complete (from the engine
// thread, or inline when refused); gRPC deletes it in OnDone.
class ForwardReactor final
    : public UnaryCall<v1::ForwardRequest, v1::ForwardResponse> {
 public:
  ForwardReactor(Engine& engine, WorkerMetrics* metrics,
                 const v1::KvHandle& handle_template,
                 const grpc::ByteBuffer* raw_request,
                 grpc::ByteBuffer* raw_response)
      : UnaryCall(raw_request, raw_response),
        engine_(engine),
        metrics_(metrics),
        handle_template_(handle_template),
        control_(std::make_shared<CallControl>()),
        start_(std::chrono::steady_clock::now()) {}

  const std::shared_ptr<CallControl>& control() const { return control_; }

  void Complete(const absl::StatusOr<ForwardOutcome>& outcome) {
    if (outcome.ok()) {
      FillResponse(request(), *outcome, handle_template_, &response());
    }
    if (metrics_ != nullptr) {
      metrics_->ObserveForwardCall(
          outcome.status().code(),
          std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                        start_)
              .count());
    }
    // Last use of `this`.
    Reply(ToGrpcStatus(outcome.status()));
  }

  void OnCancel() override {
    control_->cancelled.store(true, std::memory_order_release);
    engine_.NotifyCancelled();
  }

 private:
  Engine& engine_;
  WorkerMetrics* const metrics_;
  const v1::KvHandle& handle_template_;
  const std::shared_ptr<CallControl> control_;
  const std::chrono::steady_clock::time_point start_;
};

class ReleaseReactor final
    : public UnaryCall<v1::ReleaseRequest, v1::ReleaseResponse> {
 public:
  ReleaseReactor(Engine& engine, const grpc::ByteBuffer* raw_request,
                 grpc::ByteBuffer* raw_response)
      : UnaryCall(raw_request, raw_response),
        engine_(engine),
        control_(std::make_shared<CallControl>()) {}

  const std::shared_ptr<CallControl>& control() const { return control_; }

  void Complete(const absl::StatusOr<ReleaseOutcome>& outcome) {
    if (outcome.ok()) response().set_freed_blocks(outcome->freed_blocks);
    Reply(ToGrpcStatus(outcome.status()));
  }

  void OnCancel() override {
    control_->cancelled.store(true, std::memory_order_release);
    engine_.NotifyCancelled();
  }

 private:
  Engine& engine_;
  const std::shared_ptr<CallControl> control_;
};

// One ImportKv RPC: a client that cancels withdraws the import while it
// waits for KV room (a pull already running finishes).
class ImportKvReactor final
    : public UnaryCall<v1::ImportKvRequest, v1::ImportKvResponse> {
 public:
  ImportKvReactor(Engine& engine, const grpc::ByteBuffer* raw_request,
                  grpc::ByteBuffer* raw_response)
      : UnaryCall(raw_request, raw_response),
        engine_(engine),
        control_(std::make_shared<CallControl>()) {}

  const std::shared_ptr<CallControl>& control() const { return control_; }

  void OnCancel() override {
    control_->cancelled.store(true, std::memory_order_release);
    engine_.NotifyCancelled();
  }

 private:
  Engine& engine_;
  const std::shared_ptr<CallControl> control_;
};

v1::KvHandle HandleTemplate(const ModelRunner& runner,
                            const HandoffParts& handoff) {
  v1::KvHandle h;
  h.set_source_address(handoff.advertise_address);
  h.set_model_fingerprint(runner.model_fingerprint());
  *h.mutable_layout() = ToProto(runner.kv_cache_view().layout);
  // Best first: pullers take the first one they can use.
  if (handoff.offers_cuda_ipc) {
    h.add_transports(std::string{KvTransportName(KvTransport::kCudaIpc)});
  }
  if (handoff.offers_nccl) {
    h.add_transports(std::string{KvTransportName(KvTransport::kNccl)});
  }
  h.add_transports(std::string{KvTransportName(KvTransport::kGrpc)});
  h.set_source_host_id(HostId());
  h.set_source_epoch(handoff.source_epoch);
  return h;
}

}  // namespace

WorkerService::WorkerService(const ModelRunner& runner, Engine& engine,
                             WorkerMetrics* metrics,
                             const std::string& device_name,
                             const HandoffParts& handoff)
    : engine_(engine),
      metrics_(metrics),
      graph_stats_(runner.graph_stats()),
      table_header_{runner.resolved_mode(),
                    runner.dispatcher().capture_sizes()},
      limits_{runner.options().max_num_seqs,
              static_cast<int>(runner.model_config().vocab_size),
              runner.max_model_len(),
              runner.options().uniform_decode_query_len},
      handoff_(handoff),
      handle_template_(HandleTemplate(runner, handoff)),
      fingerprint_(runner.model_fingerprint()),
      kv_layout_(runner.kv_cache_view().layout),
      role_(runner.options().role),
      prefix_caching_(runner.kv_cache().prefix_caching() ==
                      PrefixCaching::kOn) {
  const ModelRunnerOptions& o = runner.options();
  std::lock_guard<std::mutex> lock(mu_);
  v1::WorkerStatus& s = status_template_;
  s.set_role(std::string{RoleName(o.role)});
  s.set_configured_mode(runner.graph_plan().mode.ToString());
  s.set_resolved_mode(runner.resolved_mode().ToString());
  s.set_mode_downgrade_reason(runner.downgrade_reason());
  for (const int size : runner.dispatcher().capture_sizes()) {
    s.add_capture_sizes(size);
  }
  s.set_kv_block_size(o.block_size);
  s.set_max_num_seqs(o.max_num_seqs);
  s.set_max_num_batched_tokens(o.max_num_batched_tokens);
  s.set_max_model_len(runner.max_model_len());
  s.set_vocab_size(static_cast<int32_t>(runner.model_config().vocab_size));
  s.set_model_fingerprint(runner.model_fingerprint());
  s.set_device(device_name);
  s.set_advertise_address(handoff.advertise_address);
  s.set_prefix_caching(runner.kv_cache().prefix_caching() ==
                       PrefixCaching::kOn);
}

void WorkerService::SetAdvertiseAddress(const std::string& address) {
  CHECK(state() == ServingState::kStarting);
  handoff_.advertise_address = address;
  handle_template_.set_source_address(address);
  std::lock_guard<std::mutex> lock(mu_);
  status_template_.set_advertise_address(address);
}

void WorkerService::SetState(ServingState state) {
  state_.store(state, std::memory_order_release);
}

void WorkerService::SetGraphsCaptured(int graphs) {
  std::lock_guard<std::mutex> lock(mu_);
  status_template_.set_graphs_captured(graphs);
}

absl::Status WorkerService::CheckServing(WhileDraining while_draining) const {
  switch (state()) {
    case ServingState::kServing:
      return absl::OkStatus();
    case ServingState::kStarting:
      return absl::UnavailableError(
          "the worker is starting (capturing CUDA graphs); retry shortly");
    case ServingState::kDraining:
      if (while_draining == WhileDraining::kLetTheEngineDecide) {
        return absl::OkStatus();
      }
      return absl::UnavailableError(
          "the worker is draining (shutting down) and takes no new "
          "sequences; send this request to another worker");
  }
  return absl::UnavailableError("the worker is not serving");
}

grpc::ServerUnaryReactor* WorkerService::Forward(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  auto* reactor = new ForwardReactor(engine_, metrics_, handle_template_,
                                     raw_request, raw_response);
  if (!reactor->parse_status().ok()) {
    reactor->Complete(FromGrpcStatus(reactor->parse_status()));
    return reactor;
  }
  const v1::ForwardRequest* request = &reactor->request();
  if (absl::Status serving = CheckServing(WhileDraining::kLetTheEngineDecide);
      !serving.ok()) {
    reactor->Complete(serving);
    return reactor;
  }
  absl::StatusOr<ForwardCallSpec> spec =
      ValidateForwardRequest(*request, limits_);
  if (!spec.ok()) {
    reactor->Complete(spec.status());
    return reactor;
  }
  if (role_ == Role::kDecode) {
    for (int i = 0; i < request->sequences_size(); ++i) {
      if (!request->sequences(i).hold_for_handoff()) continue;
      reactor->Complete(absl::FailedPreconditionError(absl::StrCat(
          "sequences[", i,
          "].hold_for_handoff: this worker's role is decode; prompts are "
          "held for handoff by prefill (or both) workers")));
      return reactor;
    }
  }
  auto call = std::make_unique<ForwardCall>();
  call->spec = std::move(*spec);
  call->control = reactor->control();
  call->control->deadline = context->deadline();
  call->done = [reactor](const absl::StatusOr<ForwardOutcome>& outcome) {
    reactor->Complete(outcome);
  };
  // The reactor may be finished (and soon deleted) from here on.
  engine_.Submit(std::move(call));
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::Release(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  auto* reactor = new ReleaseReactor(engine_, raw_request, raw_response);
  if (!reactor->parse_status().ok()) {
    reactor->Reply(reactor->parse_status());
    return reactor;
  }
  const v1::ReleaseRequest* request = &reactor->request();
  if (absl::Status serving = CheckServing(WhileDraining::kLetTheEngineDecide);
      !serving.ok()) {
    reactor->Complete(serving);
    return reactor;
  }
  absl::StatusOr<std::vector<std::string>> ids =
      ValidateReleaseRequest(*request);
  if (!ids.ok()) {
    reactor->Complete(ids.status());
    return reactor;
  }
  auto call = std::make_unique<ReleaseCall>();
  call->sequence_ids = std::move(*ids);
  call->control = reactor->control();
  call->control->deadline = context->deadline();
  call->done = [reactor](const absl::StatusOr<ReleaseOutcome>& outcome) {
    reactor->Complete(outcome);
  };
  engine_.Submit(std::move(call));
  return reactor;
}

void WorkerService::FillStatus(v1::WorkerStatus* response) const {
  const EngineSnapshot snapshot = engine_.snapshot();
  {
    std::lock_guard<std::mutex> lock(mu_);
    *response = status_template_;
  }
  response->set_kv_blocks_total(snapshot.kv.total_blocks);
  response->set_kv_blocks_free(snapshot.kv.free_blocks);
  response->set_num_sequences(snapshot.kv.num_sequences);
  response->set_kv_blocks_cached(snapshot.kv.cached_blocks);
  response->set_serving(state() == ServingState::kServing);
  if (handoff_.leases != nullptr) {
    response->set_kv_leases(static_cast<int32_t>(handoff_.leases->size()));
  }
  if (handoff_.importer != nullptr) {
    response->set_kv_imports(
        static_cast<int32_t>(handoff_.importer->in_flight()));
  }
}

void WorkerService::FillGraphStats(v1::GraphStatsResponse* response) const {
  const std::vector<GraphStatsRow> rows = graph_stats_.Snapshot();
  for (const GraphStatsRow& row : rows) {
    v1::GraphStatsRow* out = response->add_rows();
    out->set_unpadded_tokens(row.unpadded_tokens);
    out->set_padded_tokens(row.padded_tokens);
    out->set_num_paddings(row.num_paddings);
    out->set_runtime_mode(ToProto(row.mode));
    out->set_count(row.count);
  }
  response->set_table(RenderGraphStatsTable(table_header_, rows));
}

grpc::ServerUnaryReactor* WorkerService::GetStatus(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  return AnswerNow<v1::GetStatusRequest, v1::WorkerStatus>(
      context, raw_request, raw_response,
      [this](const v1::GetStatusRequest&, v1::WorkerStatus* response) {
        FillStatus(response);
        return grpc::Status::OK;
      });
}

grpc::ServerUnaryReactor* WorkerService::GetGraphStats(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  return AnswerNow<v1::GetGraphStatsRequest, v1::GraphStatsResponse>(
      context, raw_request, raw_response,
      [this](const v1::GetGraphStatsRequest&,
             v1::GraphStatsResponse* response) {
        FillGraphStats(response);
        return grpc::Status::OK;
      });
}

grpc::ServerUnaryReactor* WorkerService::ImportKv(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  auto* call = new ImportKvReactor(engine_, raw_request, raw_response);
  if (!call->parse_status().ok()) {
    call->Reply(call->parse_status());
    return call;
  }
  const v1::ImportKvRequest& request = call->request();
  absl::Status refused = CheckServing(WhileDraining::kRefuse);
  if (refused.ok() && role_ == Role::kPrefill) {
    refused = absl::FailedPreconditionError(
        "ImportKv: this worker's role is prefill; KV is imported by decode "
        "(or both) workers");
  }
  if (refused.ok() && handoff_.importer == nullptr) {
    refused = absl::UnimplementedError("this worker imports no KV");
  }
  if (refused.ok()) {
    refused = CheckSequenceId("sequence_id", request.sequence_id());
  }
  if (refused.ok()) {
    refused = ValidateKvHandle(request.handle(), fingerprint_, kv_layout_,
                               limits_.max_model_len);
    if (refused.code() == absl::StatusCode::kFailedPrecondition &&
        metrics_ != nullptr) {
      metrics_->ObserveKvTransfer(KvTransport::kGrpc,
                                  KvTransferDirection::kReceive,
                                  KvTransferOutcome::kModelMismatch, 0, 0.0);
    }
  }
  if (!refused.ok()) {
    call->Reply(ToGrpcStatus(refused));
    return call;
  }
  KvImportRequest import;
  import.sequence_id = request.sequence_id();
  import.handle = request.handle();
  import.deadline = context->deadline();
  import.control = call->control();
  import.control->deadline = import.deadline;
  handoff_.importer->Import(
      std::move(import), [call](const absl::StatusOr<KvImportResult>& result) {
        if (result.ok()) {
          v1::ImportKvResponse& response = call->response();
          response.set_num_tokens(result->num_tokens);
          response.set_transport(
              std::string{KvTransportName(result->transport)});
          response.set_transfer_bytes(result->transfer_bytes);
          response.set_cached_tokens(result->cached_tokens);
          response.set_transfer_micros(
              static_cast<int64_t>(result->transfer_seconds * 1e6));
          response.set_import_micros(
              static_cast<int64_t>(result->import_seconds * 1e6));
        }
        call->Reply(ToGrpcStatus(result.status()));
      });
  return call;
}

grpc::ServerUnaryReactor* WorkerService::FlushCache(
    grpc::CallbackServerContext* /*context*/,
    const grpc::ByteBuffer* raw_request, grpc::ByteBuffer* raw_response) {
  using Call = UnaryCall<v1::FlushCacheRequest, v1::FlushCacheResponse>;
  auto* call = new Call(raw_request, raw_response);
  if (!call->parse_status().ok()) {
    call->Reply(call->parse_status());
    return call;
  }
  if (absl::Status serving = CheckServing(WhileDraining::kLetTheEngineDecide);
      !serving.ok()) {
    call->Reply(ToGrpcStatus(serving));
    return call;
  }
  if (!prefix_caching_) {
    call->Reply(ToGrpcStatus(absl::FailedPreconditionError(
        "prefix caching is off (--enable_prefix_caching=false): there is "
        "no cache to flush")));
    return call;
  }
  // Between steps, on the engine thread (the KV cache's owner); the engine
  // publishes AllBlocksCleared with the step's other events.
  const absl::Status posted = engine_.Post([call](ModelRunner& runner) {
    call->response().set_cleared_blocks(
        runner.kv_cache().Stats().cached_blocks);
    runner.ClearPrefixCache();
    call->Reply(grpc::Status::OK);
  });
  if (!posted.ok()) call->Reply(ToGrpcStatus(posted));
  return call;
}

}  // namespace pdworker
