// RouterApi::kRequestLevel: the reference router driving pdworker only
// through vllm.grpc.engine.VllmEngine, as SMG drives vLLM workers, so our
// end-to-end tests take the path an external router takes:
//  - aggregated: one Generate (streamed) on the least-loaded worker;
//  - P/D (SMG's sequential relay): a Generate with max_tokens 1 and no
//    stream on the least-loaded prefill worker, whose GenerateComplete
//    carries kv_transfer_params_json; then the original request plus that
//    JSON, streamed, on the least-loaded decode worker (always, even when
//    the prefill's token ends the request: the decode leg is what frees the
//    prefill worker's lease).
// The router's EOS becomes a stop_token_ids entry with ignore_eos, so the
// model's own EOS ids end nothing, as in the step-level mode.
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "tools/router/grpc_status.h"
#include "tools/router/router.h"

namespace pdworker::router {
namespace {

namespace vg = ::vllm::grpc::engine;
using Clock = std::chrono::steady_clock;

int64_t Micros(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}

vg::GenerateRequest ToGenerate(const GenerationRequest& request, int max_tokens,
                               bool stream) {
  vg::GenerateRequest g;
  g.set_request_id(request.request_id);
  for (const int32_t t : request.prompt)
    g.mutable_tokenized()->add_input_ids(t);
  g.set_stream(stream);
  vg::SamplingParams* p = g.mutable_sampling_params();
  p->set_temperature(request.sampling.temperature);
  p->set_top_k(static_cast<uint32_t>(request.sampling.top_k));
  p->set_top_p(request.sampling.top_p);
  // The step-level API's seed is 64-bit, this one's 32: equal below 2^32.
  if (request.sampling.seed.has_value()) {
    p->set_seed(static_cast<int32_t>(*request.sampling.seed));
  }
  p->set_max_tokens(max_tokens);
  p->set_ignore_eos(true);
  if (request.eos_token_id.has_value()) {
    p->add_stop_token_ids(static_cast<uint32_t>(*request.eos_token_id));
  }
  return g;
}

// The tokens of one Generate as they arrive, and how it ended.
struct GenerateOutcome {
  std::vector<std::pair<int32_t, Clock::time_point>> tokens;
  vg::GenerateComplete complete;
};

absl::StatusOr<GenerateOutcome> RunGenerate(PoolWorker& worker,
                                            const vg::GenerateRequest& request,
                                            std::chrono::milliseconds timeout,
                                            absl::string_view what) {
  grpc::ClientContext context;
  SetTimeout(&context, timeout);
  std::unique_ptr<grpc::ClientReader<vg::GenerateResponse>> reader =
      worker.engine->Generate(&context, request);
  GenerateOutcome out;
  bool completed = false;
  vg::GenerateResponse response;
  while (reader->Read(&response)) {
    const Clock::time_point now = Clock::now();
    if (response.has_chunk()) {
      for (const uint32_t t : response.chunk().token_ids()) {
        out.tokens.emplace_back(static_cast<int32_t>(t), now);
      }
    } else if (response.has_complete()) {
      out.complete = response.complete();
      completed = true;
      if (!request.stream()) {
        for (const uint32_t t : out.complete.output_ids()) {
          out.tokens.emplace_back(static_cast<int32_t>(t), now);
        }
      }
    }
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return FromGrpc(status, what, worker.address);
  if (!completed) {
    return absl::InternalError(absl::StrCat(
        what, " on ", worker.address, " ended without a complete message"));
  }
  return out;
}

FinishReason ToFinishReason(const GenerationRequest& request,
                            const vg::GenerateComplete& complete) {
  return complete.finish_reason() == "stop" &&
                 request.eos_token_id.has_value() &&
                 complete.matched_token_id() ==
                     static_cast<uint32_t>(*request.eos_token_id)
             ? FinishReason::kEos
             : FinishReason::kLength;
}

}  // namespace

absl::StatusOr<GenerationResult> Router::GenerateRequestLevel(
    const GenerationRequest& request, const TokenCallback& on_token) {
  const Clock::time_point started = Clock::now();
  GenerationResult result;
  // Picks the least-loaded worker of `pool` and runs `generate` there, on
  // the next worker while one refuses for not serving (draining).
  const auto place =
      [&](WorkerPool& pool, const vg::GenerateRequest& generate,
          int expected_tokens, std::chrono::milliseconds timeout,
          absl::string_view what,
          PoolWorker** worker) -> absl::StatusOr<GenerateOutcome> {
    for (int attempt = 0;; ++attempt) {
      absl::StatusOr<PoolWorker*> picked = PickForPrompt(
          pool, request, expected_tokens, &result.predicted_cached_tokens);
      if (!picked.ok()) return picked.status();
      *worker = *picked;
      absl::StatusOr<GenerateOutcome> out =
          RunGenerate(**picked, generate, timeout, what);
      if (out.ok() ||
          !TryAnotherWorker(pool, **picked, out.status(), attempt)) {
        return out;
      }
    }
  };
  const int expected_tokens =
      static_cast<int>(request.prompt.size()) + request.max_tokens;

  if (!disaggregated()) {
    PoolWorker* worker = nullptr;
    const Clock::time_point sent = Clock::now();
    absl::StatusOr<GenerateOutcome> out = place(
        *aggregated_, ToGenerate(request, request.max_tokens, /*stream=*/true),
        expected_tokens, options_.prefill_timeout, "Generate", &worker);
    if (!out.ok()) return out.status();
    result.prefill_address = result.decode_address = worker->address;
    Clock::time_point previous = started;
    for (const auto& [token, at] : out->tokens) {
      if (result.tokens.empty()) {
        result.timings.ttft_us = Micros(at - started);
        result.timings.prefill_us = Micros(at - sent);
      } else {
        result.timings.inter_token_us.push_back(Micros(at - previous));
      }
      previous = at;
      result.tokens.push_back(token);
      if (on_token) on_token(token);
    }
    result.finish_reason = ToFinishReason(request, out->complete);
    return result;
  }

  // 1. Prefill leg: one token, not streamed.
  PoolWorker* prefill = nullptr;
  const Clock::time_point prefill_sent = Clock::now();
  absl::StatusOr<GenerateOutcome> first =
      place(*prefill_, ToGenerate(request, 1, /*stream=*/false),
            static_cast<int>(request.prompt.size()), options_.prefill_timeout,
            "prefill Generate", &prefill);
  if (!first.ok()) return first.status();
  result.prefill_address = prefill->address;
  if (first->tokens.size() != 1 ||
      !first->complete.has_kv_transfer_params_json()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "prefill worker ", prefill->address,
        " returned no kv_transfer_params_json: it is not a pdworker prefill "
        "worker (--role=prefill)"));
  }
  const Clock::time_point first_at = first->tokens[0].second;
  result.timings.prefill_us = Micros(first_at - prefill_sent);
  result.timings.ttft_us = Micros(first_at - started);
  result.tokens.push_back(first->tokens[0].first);
  if (on_token) on_token(first->tokens[0].first);

  // 2. Decode leg: the original request, streamed, with the handoff. Its
  // first token is the prefill's again.
  vg::GenerateRequest decode_request =
      ToGenerate(request, request.max_tokens, /*stream=*/true);
  decode_request.set_kv_transfer_params_json(
      first->complete.kv_transfer_params_json());
  PoolWorker* decode = nullptr;
  const Clock::time_point decode_sent = Clock::now();
  absl::StatusOr<GenerateOutcome> rest =
      place(*decode_, decode_request, expected_tokens, options_.import_timeout,
            "decode Generate", &decode);
  if (!rest.ok()) return rest.status();
  result.decode_address = decode->address;
  if (rest->tokens.empty() || rest->tokens[0].first != result.tokens[0]) {
    return absl::InternalError(
        absl::StrCat("decode worker ", decode->address,
                     " did not start with the prefill worker's token"));
  }
  // The decode leg's first token arrives once the KV is imported.
  result.timings.transfer_us = Micros(rest->tokens[0].second - decode_sent);
  Clock::time_point previous = first_at;
  for (size_t i = 1; i < rest->tokens.size(); ++i) {
    const auto& [token, at] = rest->tokens[i];
    if (i == 1) {
      result.timings.first_decode_step_us = Micros(at - rest->tokens[0].second);
    }
    result.timings.inter_token_us.push_back(Micros(at - previous));
    previous = at;
    result.tokens.push_back(token);
    if (on_token) on_token(token);
  }
  result.finish_reason = ToFinishReason(request, rest->complete);
  return result;
}

}  // namespace pdworker::router
