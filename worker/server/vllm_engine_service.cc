#include "worker/server/vllm_engine_service.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"
#include "worker/rpc/parsed_call.h"
#include "worker/rpc/status_mapping.h"
#include "worker/server/tokenizer_bundle.h"
#include "worker/transfer/kv_transfer_params.h"

namespace pdworker {
namespace {

namespace vg = ::vllm::grpc::engine;
namespace common = ::smg::grpc::common;

// GetTokenizer's pieces (SMG's servicers send 64 KiB).
constexpr size_t kTokenizerChunkBytes = 64 * 1024;

void AppendLogprobs(absl::Span<const int32_t> tokens,
                    absl::Span<const TokenLogprobs> logprobs, int32_t num_top,
                    vg::OutputLogProbs* out) {
  for (size_t i = 0; i < tokens.size() && i < logprobs.size(); ++i) {
    out->add_token_ids(static_cast<uint32_t>(tokens[i]));
    out->add_token_logprobs(logprobs[i].logprob);
    if (num_top > 0) {
      vg::TopLogProbs* top = out->add_top_logprobs();
      for (const TopLogprob& t : logprobs[i].top) {
        top->add_token_ids(static_cast<uint32_t>(t.token_id));
        top->add_values(t.logprob);
      }
    }
  }
}

// A prefill worker reads no handle; it accepts only vLLM's NIXL hints.
absl::Status CheckPrefillHints(const std::string& json) {
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(json);
  } catch (
      const nlohmann::json::exception& e) {  // syntax, or a number out of range
    return absl::InvalidArgumentError(
        absl::StrCat("kv_transfer_params_json: not valid JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        "kv_transfer_params_json must be a JSON object");
  }
  if (root.contains("pdworker_kv_handle")) {
    return absl::FailedPreconditionError(
        "kv_transfer_params_json carries a KV handle, but this is a prefill "
        "worker (--role=prefill): send the decode leg to a decode worker");
  }
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() == "do_remote_decode" || it.key() == "do_remote_prefill") {
      if (!it.value().is_boolean()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "kv_transfer_params_json: ", it.key(), " must be a boolean"));
      }
      continue;
    }
    return absl::InvalidArgumentError(
        absl::StrCat("kv_transfer_params_json: ", it.key(),
                     " is not a key a prefill worker reads (do_remote_decode, "
                     "do_remote_prefill)"));
  }
  return absl::OkStatus();
}

// What the reactor needs from the service and the worker.
struct GenerateContext {
  Engine* engine = nullptr;
  const GenerateLimits* limits = nullptr;
  Role role = Role::kBoth;
  KvImporter* importer = nullptr;                 // decode side; may be null
  const v1::KvHandle* handle_template = nullptr;  // prefill side
  std::atomic<int64_t>* next_import = nullptr;    // unique imported KV ids
};

// One Generate stream. The engine's updates (engine thread) become
// responses in a queue written one at a time; the stream finishes after
// the last update's responses are written. gRPC deletes it in OnDone, which
// comes after Finish, which comes after the engine's last update (or the
// import's failure): nothing calls into a deleted reactor.
//
// P/D: on a prefill worker every request is a prefill leg (it ends after
// its first token, its KV held under a lease, and its complete carries
// kv_transfer_params_json); on a decode worker a request with
// kv_transfer_params_json first pulls the prompt's KV (KvImporter), then
// emits the prefill worker's first token and decodes.
class GenerateReactor final : public MessageWriter {
 public:
  GenerateReactor(const GenerateContext& context,
                  const vg::GenerateRequest& request,
                  std::chrono::system_clock::time_point deadline)
      : engine_(*context.engine),
        handle_template_(context.handle_template),
        control_(std::make_shared<CallControl>()),
        arrival_(std::chrono::steady_clock::now()) {
    // The engine honours it: an expired request is aborted, its KV freed.
    control_->deadline = deadline;
    absl::StatusOr<GenerateCall> call =
        ToGenerateCall(request, *context.limits);
    if (!call.ok()) {
      Finish(ToGrpcStatus(call.status()));
      return;
    }
    stream_ = call->stream;
    num_top_ = call->spec.logprobs;
    prompt_tokens_ = static_cast<uint32_t>(call->spec.prompt.size());
    prompt_ = call->spec.prompt;
    request_id_ = call->spec.request_id;
    if (context.role == Role::kPrefill) {
      if (call->kv_transfer_params_json.has_value()) {
        const absl::Status hints =
            CheckPrefillHints(*call->kv_transfer_params_json);
        if (!hints.ok()) {
          Finish(ToGrpcStatus(hints));
          return;
        }
      }
      call->spec.handoff = KvHandoff::kHoldForDecode;
      Submit(std::move(call->spec));
      return;
    }
    if (!call->kv_transfer_params_json.has_value()) {
      Submit(std::move(call->spec));  // no handoff: prefill here
      return;
    }
    if (context.importer == nullptr) {
      Finish(ToGrpcStatus(absl::FailedPreconditionError(
          "kv_transfer_params_json: this worker imports no KV")));
      return;
    }
    absl::StatusOr<KvTransferParams> params =
        ParseKvTransferParamsJson(*call->kv_transfer_params_json);
    if (!params.ok()) {
      Finish(ToGrpcStatus(params.status()));
      return;
    }
    const auto& handed = params->handle.prompt_token_ids();
    if (!std::equal(handed.begin(), handed.end(), call->spec.prompt.begin(),
                    call->spec.prompt.end())) {
      Finish(ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "kv_transfer_params_json: the handle's prompt (", handed.size(),
          " tokens) is not this request's tokenized.input_ids (",
          call->spec.prompt.size(),
          " tokens): the KV would belong to another prompt"))));
      return;
    }
    ImportedPrompt imported;
    imported.kv_sequence_id =
        absl::StrCat(std::string(1, kEngineSequencePrefix), "import#",
                     context.next_import->fetch_add(1));
    imported.first_token_id = params->first_token.token_id;
    imported.first_logprob = params->first_token.logprob;
    imported.first_token_logprobs = {params->first_token.logprob,
                                     params->first_token.top_logprobs};
    KvImportRequest import;
    import.sequence_id = imported.kv_sequence_id;
    import.handle = params->handle;
    import.deadline = deadline;
    // A client that goes away while the import waits for room withdraws
    // it; the request runs at once, so it waits for a running seat too.
    import.control = control_;
    import.imported_as = ImportedAs::kRunningRequest;
    call->spec.imported = std::move(imported);
    // Called once: inline when refused, else from an importer thread.
    context.importer->Import(
        std::move(import),
        [this, spec = std::move(call->spec)](
            const absl::StatusOr<KvImportResult>& result) mutable {
          if (!result.ok()) {
            // The importer freed what it reserved; nothing else exists.
            std::lock_guard<std::mutex> lock(mu_);
            final_status_ = ToGrpcStatus(result.status());
            WriteNextLocked();
            return;
          }
          Submit(std::move(spec));
        });
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.pop_front();
    writing_ = false;
    if (!ok) {
      // The client is gone; OnCancel tells the engine. Nothing more to
      // write, but the stream still finishes once the engine ends it.
      queue_.clear();
      broken_ = true;
    }
    WriteNextLocked();
  }

  void OnCancel() override {
    control_->cancelled.store(true, std::memory_order_release);
    engine_.NotifyCancelled();
  }

  void OnDone() override { delete this; }

 private:
  void Submit(RequestSpec spec) {
    hold_ = spec.handoff == KvHandoff::kHoldForDecode;
    auto engine_request = std::make_unique<EngineRequest>();
    engine_request->spec = std::move(spec);
    // The RPC's arrival, so a decode leg's time to first token includes
    // its KV import.
    engine_request->arrival = arrival_;
    engine_request->control = control_;
    engine_request->on_update = [this](const RequestUpdate& u) { OnUpdate(u); };
    engine_.Submit(std::move(engine_request));
  }

  // Engine thread (or the constructor, when Submit refuses at once).
  void OnUpdate(const RequestUpdate& u) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!u.new_token_ids.empty() && !first_token_.has_value()) {
      FirstToken first;
      first.token_id = u.new_token_ids[0];
      first.logprob = u.new_logprobs[0];
      if (!u.new_token_logprobs.empty()) {
        first.logprob = u.new_token_logprobs[0].logprob;
        first.top_logprobs = u.new_token_logprobs[0].top;
      }
      first_token_ = std::move(first);
    }
    if (stream_ && !u.new_token_ids.empty()) {
      vg::GenerateStreamChunk* chunk = queue_.emplace_back().mutable_chunk();
      for (const int32_t t : u.new_token_ids) chunk->add_token_ids(t);
      chunk->set_prompt_tokens(prompt_tokens_);
      chunk->set_cached_tokens(static_cast<uint32_t>(u.num_cached_tokens));
      chunk->set_completion_tokens(
          static_cast<uint32_t>(u.new_token_ids.size()));
      if (num_top_ >= 0) {
        AppendLogprobs(u.new_token_ids, u.new_token_logprobs, num_top_,
                       chunk->mutable_output_logprobs());
      }
    }
    if (!stream_) {
      outputs_.insert(outputs_.end(), u.new_token_ids.begin(),
                      u.new_token_ids.end());
      if (num_top_ >= 0) {
        AppendLogprobs(u.new_token_ids, u.new_token_logprobs, num_top_,
                       &all_logprobs_);
      }
    }
    if (!u.last()) {
      WriteNextLocked();
      return;
    }
    if (!u.status.ok()) {
      final_status_ = ToGrpcStatus(u.status);
    } else {
      final_status_ = grpc::Status::OK;
      vg::GenerateComplete* complete = queue_.emplace_back().mutable_complete();
      complete->set_finish_reason(
          std::string(FinishReasonName(*u.finish_reason)));
      complete->set_prompt_tokens(prompt_tokens_);
      complete->set_cached_tokens(static_cast<uint32_t>(u.num_cached_tokens));
      // Streaming: the last step's tokens again, as vLLM's servicer does
      // (the router accumulates the chunks); otherwise every token.
      if (stream_) {
        for (const int32_t t : u.new_token_ids) complete->add_output_ids(t);
        if (num_top_ >= 0) {
          AppendLogprobs(u.new_token_ids, u.new_token_logprobs, num_top_,
                         complete->mutable_output_logprobs());
        }
      } else {
        for (const int32_t t : outputs_) complete->add_output_ids(t);
        if (num_top_ >= 0) *complete->mutable_output_logprobs() = all_logprobs_;
      }
      complete->set_completion_tokens(complete->output_ids_size());
      if (u.matched_token_id.has_value()) {
        complete->set_matched_token_id(
            static_cast<uint32_t>(*u.matched_token_id));
      }
      if (hold_ && u.lease.has_value() && first_token_.has_value()) {
        KvTransferParams params;
        params.handle = *handle_template_;
        params.handle.set_lease_id(u.lease->lease_id);
        params.handle.set_sequence_id(request_id_);
        params.handle.set_num_tokens(u.lease->num_tokens);
        params.handle.set_lease_expiry_unix_micros(
            std::chrono::duration_cast<std::chrono::microseconds>(
                u.lease->expiry.time_since_epoch())
                .count());
        params.handle.set_version(kKvHandleVersion);
        *params.handle.mutable_prompt_token_ids() = {prompt_.begin(),
                                                     prompt_.end()};
        params.first_token = *first_token_;
        complete->set_kv_transfer_params_json(ToKvTransferParamsJson(params));
      }
    }
    WriteNextLocked();
  }

  void WriteNextLocked() {
    if (writing_) return;
    if (broken_) queue_.clear();
    if (!queue_.empty()) {
      writing_ = true;
      StartWriteMessage(queue_.front());
      return;
    }
    if (final_status_.has_value() && !finished_) {
      finished_ = true;
      Finish(*final_status_);
    }
  }

  Engine& engine_;
  const v1::KvHandle* const handle_template_;
  const std::shared_ptr<CallControl> control_;
  const std::chrono::steady_clock::time_point arrival_;
  bool stream_ = false;
  bool hold_ = false;  // a prefill leg
  int32_t num_top_ = -1;
  uint32_t prompt_tokens_ = 0;
  std::vector<int32_t> prompt_;
  std::string request_id_;

  std::mutex mu_;
  // Responses not yet written; the front is being written when writing_.
  std::deque<vg::GenerateResponse> queue_;
  bool writing_ = false;
  bool broken_ = false;    // a write failed: the client is gone
  bool finished_ = false;  // Finish was called
  std::optional<grpc::Status> final_status_;
  std::optional<FirstToken> first_token_;
  // Non-streaming: everything, sent at the end.
  std::vector<int32_t> outputs_;
  vg::OutputLogProbs all_logprobs_;
};

}  // namespace

VllmEngineService::VllmEngineService(const ModelRunner& runner, Engine& engine,
                                     const VllmEngineServiceOptions& options,
                                     KvImporter* importer,
                                     const v1::KvHandle* handle_template)
    : engine_(engine),
      importer_(importer),
      handle_template_(handle_template),
      options_(options),
      limits_{static_cast<int>(runner.model_config().vocab_size),
              runner.max_model_len()},
      role_(runner.options().role),
      max_num_seqs_(runner.options().max_num_seqs),
      kv_total_tokens_(int64_t{runner.kv_cache().Stats().total_blocks} *
                       runner.kv_cache().block_size()),
      kv_block_size_(runner.kv_cache().block_size()),
      started_(std::chrono::steady_clock::now()) {
  const ModelConfig& c = runner.model_config();
  model_info_.set_model_path(options.model_dir);
  model_info_.set_is_generation(true);
  model_info_.set_max_context_length(runner.max_model_len());
  model_info_.set_vocab_size(static_cast<uint32_t>(c.vocab_size));
  model_info_.set_supports_vision(false);
  model_info_.set_served_model_name(options.served_model_name.empty()
                                        ? options.model_dir
                                        : options.served_model_name);
  model_info_.set_tokenizer_path(options.model_dir);
  model_info_.set_model_type(std::string(ModelTypeName(c.architecture)));
  model_info_.add_architectures(std::string(ArchitectureName(c.architecture)));
  for (const int64_t id : c.eos_token_ids) {
    model_info_.add_eos_token_ids(static_cast<int32_t>(id));
  }
  model_info_.set_pad_token_id(
      static_cast<int32_t>(c.pad_token_id.value_or(0)));
  model_info_.set_bos_token_id(
      static_cast<int32_t>(c.bos_token_id.value_or(0)));
  // The prompt must leave room for one output token.
  model_info_.set_max_req_input_len(runner.max_model_len() - 1);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* VllmEngineService::Generate(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request) {
  last_receive_unix_.store(
      absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()),
      std::memory_order_relaxed);
  vg::GenerateRequest request;
  if (grpc::Status parsed = ParseRequest(*raw_request, &request);
      !parsed.ok()) {
    return new ListWriter({}, parsed);
  }
  if (state_.load(std::memory_order_acquire) == ServingState::kStarting) {
    return new ListWriter({}, grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                           "the worker is capturing CUDA "
                                           "graphs and not serving yet"));
  }
  GenerateContext generate;
  generate.engine = &engine_;
  generate.limits = &limits_;
  generate.role = role_;
  generate.importer = importer_;
  generate.handle_template = handle_template_;
  generate.next_import = &next_import_;
  return new GenerateReactor(generate, request, context->deadline());
}

grpc::ServerUnaryReactor* VllmEngineService::Embed(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  return AnswerNow<vg::EmbedRequest, vg::EmbedResponse>(
      context, raw_request, raw_response,
      [](const vg::EmbedRequest&, vg::EmbedResponse*) {
        return grpc::Status(
            grpc::StatusCode::UNIMPLEMENTED,
            "Embed: pdworker serves generative (decoder) models only");
      });
}

grpc::ServerUnaryReactor* VllmEngineService::HealthCheck(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  return AnswerNow<vg::HealthCheckRequest, vg::HealthCheckResponse>(
      context, raw_request, raw_response,
      [this](const vg::HealthCheckRequest&, vg::HealthCheckResponse* response) {
        const std::string problem = HealthProblem();
        response->set_healthy(problem.empty());
        response->set_message(problem.empty() ? "healthy" : problem);
        return grpc::Status::OK;
      });
}

std::string VllmEngineService::HealthProblem() const {
  const EngineSnapshot s = engine_.snapshot();
  const ServingState state = state_.load(std::memory_order_acquire);
  const bool busy =
      s.queued_calls > 0 || s.running_requests > 0 || s.waiting_requests > 0;
  if (state == ServingState::kStarting) {
    return "capturing CUDA graphs, not serving yet";
  }
  if (state == ServingState::kDraining) return "draining (shutting down)";
  if (!s.device_error.ok()) {
    return absl::StrCat("device error: ", s.device_error.message());
  }
  if (busy && std::chrono::steady_clock::now() - s.last_step_at >
                  options_.health_step_window) {
    return absl::StrCat("busy, and no step finished in the last ",
                        std::chrono::duration_cast<std::chrono::seconds>(
                            options_.health_step_window)
                            .count(),
                        " s");
  }
  return "";
}

grpc::ServerUnaryReactor* VllmEngineService::Abort(
    grpc::CallbackServerContext* /*context*/,
    const grpc::ByteBuffer* raw_request, grpc::ByteBuffer* raw_response) {
  // Answered by the engine thread once the aborts ran.
  auto* reactor = new UnaryCall<vg::AbortRequest, vg::AbortResponse>(
      raw_request, raw_response);
  if (!reactor->parse_status().ok()) {
    reactor->Reply(reactor->parse_status());
    return reactor;
  }
  auto call = std::make_unique<AbortCall>();
  for (const std::string& id : reactor->request().request_ids()) {
    if (id.empty()) {
      reactor->Reply(ToGrpcStatus(
          absl::InvalidArgumentError("request_ids has an empty id")));
      return reactor;
    }
    if (std::find(call->request_ids.begin(), call->request_ids.end(), id) ==
        call->request_ids.end()) {
      call->request_ids.push_back(id);
    }
  }
  if (call->request_ids.empty()) {
    reactor->Reply(
        ToGrpcStatus(absl::InvalidArgumentError("request_ids is empty")));
    return reactor;
  }
  call->done = [reactor](const absl::StatusOr<AbortOutcome>& outcome) {
    reactor->Reply(ToGrpcStatus(outcome.status()));
  };
  engine_.Submit(std::move(call));
  return reactor;
}

grpc::ServerUnaryReactor* VllmEngineService::GetModelInfo(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  return AnswerNow<vg::GetModelInfoRequest, vg::GetModelInfoResponse>(
      context, raw_request, raw_response,
      [this](const vg::GetModelInfoRequest&,
             vg::GetModelInfoResponse* response) {
        *response = model_info_;
        return grpc::Status::OK;
      });
}

grpc::ServerUnaryReactor* VllmEngineService::GetServerInfo(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  return AnswerNow<vg::GetServerInfoRequest, vg::GetServerInfoResponse>(
      context, raw_request, raw_response,
      [this](const vg::GetServerInfoRequest&,
             vg::GetServerInfoResponse* response) {
        const EngineSnapshot s = engine_.snapshot();
        response->set_active_requests(
            static_cast<uint32_t>(s.running_requests + s.waiting_requests));
        response->set_is_paused(false);
        response->set_last_receive_timestamp(
            last_receive_unix_.load(std::memory_order_relaxed));
        response->set_uptime_seconds(
            std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                          started_)
                .count());
        response->set_server_type("vllm-grpc");
        response->set_data_parallel_size(1);
        // P/D: kv_transfer_params_json carries pdworker's own KV handle; a
        // router that does not know the connector relays the JSON untouched.
        response->set_kv_connector("PdworkerConnector");
        response->set_kv_role(role_ == Role::kPrefill  ? "kv_producer"
                              : role_ == Role::kDecode ? "kv_consumer"
                                                       : "kv_both");
        return grpc::Status::OK;
      });
}

grpc::ServerUnaryReactor* VllmEngineService::GetLoads(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  return AnswerNow<vg::GetLoadsRequest, vg::GetLoadsResponse>(
      context, raw_request, raw_response,
      [this](const vg::GetLoadsRequest& request,
             vg::GetLoadsResponse* response) {
        if (request.has_dp_rank() && request.dp_rank() != 0) {
          return ToGrpcStatus(absl::InvalidArgumentError(
              absl::StrCat("dp_rank=", request.dp_rank(),
                           ": this worker has one data-parallel rank (0)")));
        }
        const EngineSnapshot s = engine_.snapshot();
        response->set_timestamp(absl::FormatTime(
            absl::RFC3339_full, absl::Now(), absl::UTCTimeZone()));
        response->set_version("pdworker");
        response->set_dp_rank_count(1);
        vg::SchedulerLoad* load = response->add_loads();
        load->set_dp_rank(0);
        load->set_num_running_reqs(static_cast<int32_t>(s.running_requests));
        load->set_num_waiting_reqs(static_cast<int32_t>(s.waiting_requests));
        load->set_num_total_reqs(
            static_cast<int32_t>(s.running_requests + s.waiting_requests));
        load->set_num_used_tokens(
            static_cast<int32_t>(int64_t{s.kv.used_blocks} * kv_block_size_));
        load->set_max_total_num_tokens(static_cast<int32_t>(kv_total_tokens_));
        // vLLM's kv_cache_usage: blocks held by sequences, leases and
        // imports over all blocks (free cached blocks count as free).
        const double usage =
            s.kv.total_blocks > 0
                ? static_cast<double>(s.kv.used_blocks) / s.kv.total_blocks
                : 0.0;
        load->set_token_usage(usage);
        load->set_utilization(usage);  // as SMG's servicers report it
        load->set_max_running_requests(max_num_seqs_);
        load->set_num_waiting_uncached_tokens(static_cast<int32_t>(
            std::min<int64_t>(s.waiting_uncached_tokens,
                              std::numeric_limits<int32_t>::max())));
        load->set_gen_throughput(s.generation_tokens_per_second);
        load->set_cache_hit_rate(s.prefix_cache_hit_rate);
        return grpc::Status::OK;
      });
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* VllmEngineService::GetTokenizer(
    grpc::CallbackServerContext* /*context*/,
    const grpc::ByteBuffer* raw_request) {
  common::GetTokenizerRequest request;
  if (grpc::Status parsed = ParseRequest(*raw_request, &request);
      !parsed.ok()) {
    return new ListWriter({}, parsed);
  }
  absl::StatusOr<TokenizerBundle> bundle =
      BuildTokenizerBundle(options_.model_dir);
  if (!bundle.ok()) return new ListWriter({}, ToGrpcStatus(bundle.status()));
  std::vector<grpc::ByteBuffer> chunks;
  for (size_t offset = 0; offset < bundle->zip.size() || chunks.empty();
       offset += kTokenizerChunkBytes) {
    common::GetTokenizerChunk chunk;
    if (offset < bundle->zip.size()) {
      chunk.set_data(bundle->zip.substr(offset, kTokenizerChunkBytes));
    }
    if (offset + kTokenizerChunkBytes >= bundle->zip.size()) {
      chunk.set_sha256(bundle->sha256_hex);  // the last piece
    }
    SerializeMessage(chunk, &chunks.emplace_back());
  }
  return new ListWriter(std::move(chunks), grpc::Status::OK);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>*
VllmEngineService::SubscribeKvEvents(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* raw_request) {
  common::SubscribeKvEventsRequest request;
  if (grpc::Status parsed = ParseRequest(*raw_request, &request);
      !parsed.ok()) {
    return new ListWriter({}, parsed);
  }
  if (options_.kv_events == nullptr) {
    return new ListWriter(
        {}, grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                         "SubscribeKvEvents: prefix caching is off "
                         "(--enable_prefix_caching=false), so this worker "
                         "publishes no KV cache events"));
  }
  return options_.kv_events->Subscribe(context, raw_request);
}

}  // namespace pdworker
