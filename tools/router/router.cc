#include "tools/router/router.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "tools/router/grpc_status.h"

namespace pdworker::router {
namespace {

using Clock = std::chrono::steady_clock;

int64_t Micros(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}

v1::SamplingParams ToProto(const Sampling& sampling) {
  v1::SamplingParams p;
  p.set_temperature(sampling.temperature);
  p.set_top_k(sampling.top_k);
  p.set_top_p(sampling.top_p);
  if (sampling.seed.has_value()) p.set_seed(*sampling.seed);
  return p;
}

bool IsEos(const GenerationRequest& request, int32_t token) {
  return request.eos_token_id.has_value() && token == *request.eos_token_id;
}

absl::Status ValidateRequest(const GenerationRequest& request) {
  if (request.request_id.empty()) {
    return absl::InvalidArgumentError("request_id is empty");
  }
  if (request.prompt.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", request.request_id, ": the prompt is empty"));
  }
  if (request.max_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", request.request_id,
                     ": max_tokens must be >= 1, got ", request.max_tokens));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Router>> Router::Create(
    const RouterOptions& options) {
  const bool has_prefill = !options.prefill_addresses.empty();
  const bool has_decode = !options.decode_addresses.empty();
  const bool has_aggregated = !options.aggregated_addresses.empty();
  if (has_aggregated && (has_prefill || has_decode)) {
    return absl::InvalidArgumentError(
        "give either prefill and decode workers, or aggregated workers, not "
        "both");
  }
  if (!has_aggregated && (has_prefill != has_decode || !has_prefill)) {
    return absl::InvalidArgumentError(
        "a disaggregated router needs at least one prefill and one decode "
        "worker (or give aggregated workers)");
  }
  std::unique_ptr<Router> router(new Router(options));
  if (has_aggregated) {
    auto pool = WorkerPool::Create(options.aggregated_addresses, options.pool);
    if (!pool.ok()) return pool.status();
    router->aggregated_ = *std::move(pool);
  } else {
    auto prefill = WorkerPool::Create(options.prefill_addresses, options.pool);
    if (!prefill.ok()) return prefill.status();
    auto decode = WorkerPool::Create(options.decode_addresses, options.pool);
    if (!decode.ok()) return decode.status();
    router->prefill_ = *std::move(prefill);
    router->decode_ = *std::move(decode);
  }
  if (options.route_by_prefix) {
    const std::vector<std::string>& prompt_pool =
        has_aggregated ? options.aggregated_addresses
                       : options.prefill_addresses;
    if (options.kv_events.empty()) {
      return absl::InvalidArgumentError(
          "route_by_prefix needs the KV events endpoints of the workers");
    }
    for (const auto& [address, endpoints] : options.kv_events) {
      if (std::find(prompt_pool.begin(), prompt_pool.end(), address) ==
          prompt_pool.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "KV events endpoints for ", address, ", which is not a ",
            has_aggregated ? "" : "prefill ", "worker of this router"));
      }
    }
    auto index = PrefixIndex::Create(options.kv_events, options.prefix_index);
    if (!index.ok()) return index.status();
    router->prefix_index_ = *std::move(index);
  }
  return router;
}

Router::~Router() {
  std::lock_guard<std::mutex> lock(batchers_mu_);
  batchers_.clear();
}

std::vector<PoolWorker*> Router::workers() {
  std::vector<PoolWorker*> all;
  for (WorkerPool* pool : {prefill_.get(), decode_.get(), aggregated_.get()}) {
    if (pool == nullptr) continue;
    for (int i = 0; i < pool->size(); ++i) all.push_back(&pool->worker(i));
  }
  return all;
}

DecodeBatcherStats Router::decode_stats() const {
  std::lock_guard<std::mutex> lock(batchers_mu_);
  DecodeBatcherStats total;
  for (const auto& [worker, batcher] : batchers_) total += batcher->stats();
  return total;
}

DecodeBatcher& Router::BatcherFor(PoolWorker& worker, WorkerPool& pool) {
  {
    std::lock_guard<std::mutex> lock(batchers_mu_);
    auto it = batchers_.find(&worker);
    if (it != batchers_.end()) return *it->second;
  }
  DecodeBatcherOptions options;
  options.step_timeout = options_.decode_step_timeout;
  // Outside the lock (it may refresh over RPC). The worker was just picked,
  // so its status is normally cached. Decode steps are one token each, so
  // the sequence limit is the binding one.
  const absl::StatusOr<v1::WorkerStatus> status = pool.Status(worker.index);
  if (status.ok() && status->max_num_seqs() > 0) {
    options.max_sequences_per_call = status->max_num_seqs();
    if (status->max_num_batched_tokens() > 0) {
      options.max_sequences_per_call = std::min(
          options.max_sequences_per_call, status->max_num_batched_tokens());
    }
  }
  std::lock_guard<std::mutex> lock(batchers_mu_);
  std::unique_ptr<DecodeBatcher>& batcher = batchers_[&worker];
  if (batcher == nullptr) {
    batcher = std::make_unique<DecodeBatcher>(worker, options);
  }
  return *batcher;
}

absl::StatusOr<GenerationResult> Router::Generate(
    const GenerationRequest& request, const TokenCallback& on_token) {
  if (absl::Status valid = ValidateRequest(request); !valid.ok()) return valid;
  if (options_.api == RouterApi::kRequestLevel) {
    return GenerateRequestLevel(request, on_token);
  }
  return disaggregated() ? GenerateDisaggregated(request, on_token)
                         : GenerateAggregated(request, on_token);
}

absl::StatusOr<v1::SequenceOutput> Router::RunPrompt(
    PoolWorker& worker, const GenerationRequest& request, bool hold,
    Clock::time_point started, Clock::time_point* received,
    GenerationResult* result, const TokenCallback& on_token) {
  v1::ForwardRequest forward;
  v1::SequenceInput* input = forward.add_sequences();
  input->set_sequence_id(request.request_id);
  for (const int32_t t : request.prompt) input->add_token_ids(t);
  input->set_start(true);
  *input->mutable_sampling() = ToProto(request.sampling);
  input->set_hold_for_handoff(hold);
  // Aggregated and done after one token: free the KV with the step.
  input->set_release_after_step(!hold && request.max_tokens == 1);

  grpc::ClientContext context;
  SetTimeout(&context, options_.prefill_timeout);
  v1::ForwardResponse response;
  const Clock::time_point sent = Clock::now();
  const grpc::Status status =
      worker.worker->Forward(&context, forward, &response);
  *received = Clock::now();
  result->prefill_address = worker.address;
  result->cached_tokens = 0;
  if (!status.ok()) {
    // A failed call changes nothing on the worker, but a deadline the router
    // gave up on may have passed after the step ran. Held KV then expires
    // with its lease; a live aggregated sequence would stay forever, so free
    // it (NOT_FOUND when it never started; ids are unique among requests in
    // flight, so it cannot be another request's).
    if (!hold && (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
                  status.error_code() == grpc::StatusCode::CANCELLED)) {
      absl::Status released = ReleaseSequence(worker, request.request_id);
      if (!released.ok()) LOG(WARNING) << released;
    }
    return FromGrpc(status, hold ? "prefill Forward" : "Forward",
                    worker.address);
  }
  if (response.sequences_size() != 1) {
    return absl::InternalError(
        absl::StrCat("Forward on ", worker.address, " answered ",
                     response.sequences_size(), " sequences for 1"));
  }
  const v1::SequenceOutput& out = response.sequences(0);
  result->cached_tokens = out.cached_tokens();
  result->timings.prefill_us = Micros(*received - sent);
  result->timings.ttft_us = Micros(*received - started);
  result->tokens.push_back(out.token_id());
  if (on_token) on_token(out.token_id());
  return out;
}

bool Router::TryAnotherWorker(WorkerPool& pool, const PoolWorker& worker,
                              const absl::Status& error, int attempt) {
  if (!absl::IsUnavailable(error) || attempt + 1 >= pool.size()) return false;
  if (pool.Recheck(worker.index)) return false;  // still serving
  LOG(INFO) << "trying another worker: " << error;
  return true;
}

absl::StatusOr<PoolWorker*> Router::PickForPrompt(
    WorkerPool& pool, const GenerationRequest& request, int expected_tokens,
    int32_t* predicted) {
  WorkerPool* prompt_pool =
      disaggregated() ? prefill_.get() : aggregated_.get();
  if (prefix_index_ == nullptr || &pool != prompt_pool) {
    return pool.PickLeastLoaded(expected_tokens);
  }
  // The statuses are cached by the pool (refreshed in the background), so
  // this costs the prompt's hashing, not round trips.
  std::vector<int32_t> scores(pool.size(), 0);
  for (int i = 0; i < pool.size(); ++i) {
    const absl::StatusOr<v1::WorkerStatus> status = pool.Status(i);
    if (!status.ok()) continue;
    const std::string& address = pool.worker(i).address;
    prefix_index_->SetModel(address, status->model_fingerprint(),
                            status->kv_block_size(), status->prefix_caching());
    scores[i] = prefix_index_->LongestPrefixTokens(address, request.prompt);
  }
  absl::StatusOr<PoolWorker*> picked =
      pool.PickLeastLoaded(expected_tokens, scores);
  if (picked.ok()) *predicted = scores[(*picked)->index];
  return picked;
}

absl::StatusOr<v1::SequenceOutput> Router::PlacePrompt(
    WorkerPool& pool, const GenerationRequest& request, bool hold,
    Clock::time_point started, Clock::time_point* received,
    GenerationResult* result, const TokenCallback& on_token,
    PoolWorker** worker) {
  // KV the request holds on the worker: the prompt, plus the generated
  // tokens when it also decodes there.
  const int expected_tokens =
      static_cast<int>(request.prompt.size()) + (hold ? 0 : request.max_tokens);
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<PoolWorker*> picked = PickForPrompt(
        pool, request, expected_tokens, &result->predicted_cached_tokens);
    if (!picked.ok()) return picked.status();
    *worker = *picked;
    absl::StatusOr<v1::SequenceOutput> first =
        RunPrompt(**picked, request, hold, started, received, result, on_token);
    if (first.ok() ||
        !TryAnotherWorker(pool, **picked, first.status(), attempt)) {
      return first;
    }
  }
}

absl::StatusOr<GenerationResult> Router::GenerateAggregated(
    const GenerationRequest& request, const TokenCallback& on_token) {
  const Clock::time_point started = Clock::now();
  GenerationResult result;
  PoolWorker* worker = nullptr;
  Clock::time_point first_at;
  absl::StatusOr<v1::SequenceOutput> first =
      PlacePrompt(*aggregated_, request, /*hold=*/false, started, &first_at,
                  &result, on_token, &worker);
  if (!first.ok()) return first.status();
  result.decode_address = worker->address;

  if (request.max_tokens == 1) {  // released by the step itself
    result.finish_reason = IsEos(request, first->token_id())
                               ? FinishReason::kEos
                               : FinishReason::kLength;
    return result;
  }
  if (IsEos(request, first->token_id())) {
    result.finish_reason = FinishReason::kEos;
    if (absl::Status released = ReleaseSequence(*worker, request.request_id);
        !released.ok()) {
      return released;
    }
    return result;
  }
  if (absl::Status decoded =
          Decode(*worker, *aggregated_, request, first_at, &result, on_token);
      !decoded.ok()) {
    return decoded;
  }
  return result;
}

absl::StatusOr<GenerationResult> Router::GenerateDisaggregated(
    const GenerationRequest& request, const TokenCallback& on_token) {
  const Clock::time_point started = Clock::now();
  GenerationResult result;
  PoolWorker* prefill = nullptr;
  Clock::time_point first_at;
  absl::StatusOr<v1::SequenceOutput> first =
      PlacePrompt(*prefill_, request, /*hold=*/true, started, &first_at,
                  &result, on_token, &prefill);
  if (!first.ok()) return first.status();

  const v1::KvHandle& handle = first->kv_handle();
  if (handle.lease_id().empty()) {
    // A worker that ignores hold_for_handoff (an older pdworker) kept the
    // sequence live instead of leasing its KV: free it and say why.
    absl::Status released = ReleaseSequence(*prefill, request.request_id);
    if (!released.ok()) LOG(WARNING) << released;
    return absl::FailedPreconditionError(absl::StrCat(
        "prefill worker ", prefill->address,
        " returned no KV handle for hold_for_handoff: it does not support the "
        "P/D handoff"));
  }

  const bool eos = IsEos(request, first->token_id());
  if (request.max_tokens == 1 || eos) {
    result.finish_reason = eos ? FinishReason::kEos : FinishReason::kLength;
    ReleaseLease(*prefill, handle.lease_id());
    return result;
  }

  const int expected_tokens =
      static_cast<int>(request.prompt.size()) + request.max_tokens;
  v1::ImportKvRequest import;
  import.set_sequence_id(request.request_id);
  *import.mutable_handle() = handle;
  v1::ImportKvResponse imported;
  absl::StatusOr<PoolWorker*> decode;
  grpc::Status status;
  for (int attempt = 0;; ++attempt) {
    decode = decode_->PickLeastLoaded(expected_tokens);
    if (!decode.ok()) {
      ReleaseLease(*prefill, handle.lease_id());
      return decode.status();
    }
    result.decode_address = (*decode)->address;
    grpc::ClientContext context;
    SetTimeout(&context, options_.import_timeout);
    const Clock::time_point sent = Clock::now();
    status = (*decode)->worker->ImportKv(&context, import, &imported);
    result.timings.transfer_us = Micros(Clock::now() - sent);
    // A draining decode worker refuses before it touches the lease.
    if (status.ok() ||
        !TryAnotherWorker(*decode_, **decode,
                          FromGrpc(status, "ImportKv", (*decode)->address),
                          attempt)) {
      break;
    }
  }
  if (!status.ok()) {
    // The decode worker frees what it allocated on any error; whether it
    // already released the lease depends on where the import failed, so
    // release it here too (NOT_FOUND then). A deadline the router gave up on
    // may have raced the install: free the sequence too, in case it exists.
    ReleaseLease(*prefill, handle.lease_id());
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      absl::Status released = ReleaseSequence(**decode, request.request_id);
      if (!released.ok()) LOG(WARNING) << released;
    }
    return FromGrpc(status, "ImportKv", (*decode)->address);
  }
  result.timings.worker_transfer_us = imported.transfer_micros();
  result.timings.transfer_bytes = imported.transfer_bytes();

  if (absl::Status decoded =
          Decode(**decode, *decode_, request, first_at, &result, on_token);
      !decoded.ok()) {
    return decoded;
  }
  return result;
}

absl::Status Router::Decode(PoolWorker& worker, WorkerPool& pool,
                            const GenerationRequest& request,
                            Clock::time_point last_token_at,
                            GenerationResult* result,
                            const TokenCallback& on_token) {
  DecodeJob job;
  job.sequence_id = request.request_id;
  job.last_token = result->tokens.back();
  job.tokens_to_generate =
      request.max_tokens - static_cast<int>(result->tokens.size());
  job.eos_token_id = request.eos_token_id;
  job.sampling = ToProto(request.sampling);
  const Clock::time_point joined = Clock::now();
  std::shared_ptr<DecodeStream> stream =
      BatcherFor(worker, pool).Join(std::move(job));

  Clock::time_point previous = last_token_at;
  bool first_step = true;
  while (std::optional<DecodeStream::Token> token = stream->Next()) {
    if (first_step) {
      result->timings.first_decode_step_us = Micros(token->arrival - joined);
      first_step = false;
    }
    result->timings.inter_token_us.push_back(Micros(token->arrival - previous));
    previous = token->arrival;
    result->tokens.push_back(token->id);
    if (on_token) on_token(token->id);
  }

  absl::Status status = stream->status();
  if (!status.ok()) {
    // A failed step changes nothing: the sequence is still live there
    // (unless the worker lost it: NOT_FOUND, which ReleaseSequence accepts).
    absl::Status released = ReleaseSequence(worker, request.request_id);
    if (!released.ok()) LOG(WARNING) << released;
    return status;
  }
  result->finish_reason = IsEos(request, result->tokens.back())
                              ? FinishReason::kEos
                              : FinishReason::kLength;
  if (!stream->released()) {
    // EOS before the step that would have released it.
    return ReleaseSequence(worker, request.request_id);
  }
  return absl::OkStatus();
}

absl::Status Router::ReleaseSequence(PoolWorker& worker,
                                     const std::string& sequence_id) {
  v1::ReleaseRequest request;
  request.add_sequence_ids(sequence_id);
  v1::ReleaseResponse response;
  grpc::ClientContext context;
  SetTimeout(&context, options_.control_timeout);
  const grpc::Status status =
      worker.worker->Release(&context, request, &response);
  if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
    return absl::OkStatus();
  }
  return FromGrpc(status, absl::StrCat("Release(", sequence_id, ")"),
                  worker.address);
}

void Router::ReleaseLease(PoolWorker& worker, const std::string& lease_id) {
  v1::ReleaseKvRequest request;
  request.set_lease_id(lease_id);
  v1::ReleaseKvResponse response;
  grpc::ClientContext context;
  SetTimeout(&context, options_.control_timeout);
  // Through the channel the prompt went over, not handle.source_address: the
  // address a worker advertises to its peers need not be reachable from the
  // router.
  const grpc::Status status =
      worker.kv_transfer->ReleaseKv(&context, request, &response);
  if (!status.ok() && status.error_code() != grpc::StatusCode::NOT_FOUND) {
    LOG(WARNING) << FromGrpc(status, "ReleaseKv", worker.address)
                 << " (the lease expires on its own)";
  }
}

}  // namespace pdworker::router
