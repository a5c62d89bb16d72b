#include "worker/server/generate_request.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/token_ids.h"
#include "worker/kernels/logprobs.h"
#include "worker/server/request_validation.h"

namespace pdworker {
namespace {

namespace vg = ::vllm::grpc::engine;

// Most alternatives per token: what the logprobs kernels compute (vLLM's
// default max_logprobs).
constexpr int32_t kMaxLogprobs = kernels::kMaxTopLogprobs;

absl::Status Unsupported(absl::string_view field, absl::string_view what) {
  return absl::UnimplementedError(
      absl::StrCat("sampling_params.", field, ": ", what,
                   " is not implemented by pdworker; send the neutral value"));
}

absl::StatusOr<SamplingOptions> ToSampling(const vg::SamplingParams& p,
                                           absl::string_view request_id) {
  SamplingOptions o;
  o.temperature = p.has_temperature() ? p.temperature() : 1.0f;
  if (!std::isfinite(o.temperature) || o.temperature < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling_params.temperature=", p.temperature(),
                     " must be a finite number >= 0 (0 = greedy)"));
  }
  o.top_p = p.top_p() == 0.0f ? 1.0f : p.top_p();
  if (!std::isfinite(p.top_p()) || o.top_p <= 0.0f || o.top_p > 1.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling_params.top_p=", p.top_p(), " must be in (0, 1] (0 = off)"));
  }
  o.top_k = static_cast<int32_t>(
      std::min<uint32_t>(p.top_k(), std::numeric_limits<int32_t>::max()));
  o.min_p = p.min_p();
  if (!std::isfinite(o.min_p) || o.min_p < 0.0f || o.min_p > 1.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling_params.min_p=", p.min_p(), " must be in [0, 1] (0 = off)"));
  }
  if (p.frequency_penalty() != 0.0f) {
    return Unsupported("frequency_penalty",
                       absl::StrCat(p.frequency_penalty()));
  }
  if (p.presence_penalty() != 0.0f) {
    return Unsupported("presence_penalty", absl::StrCat(p.presence_penalty()));
  }
  if (p.repetition_penalty() != 0.0f && p.repetition_penalty() != 1.0f) {
    return Unsupported("repetition_penalty",
                       absl::StrCat(p.repetition_penalty()));
  }
  o.seed = p.has_seed() ? static_cast<uint64_t>(static_cast<uint32_t>(p.seed()))
                        : DefaultSeed(request_id);
  return o;
}

}  // namespace

absl::StatusOr<GenerateCall> ToGenerateCall(const vg::GenerateRequest& request,
                                            const GenerateLimits& limits) {
  GenerateCall call;
  RequestSpec& spec = call.spec;
  spec.request_id = request.request_id();
  if (spec.request_id.empty()) {
    return absl::InvalidArgumentError("request_id is empty");
  }
  switch (request.input_case()) {
    case vg::GenerateRequest::kText:
      return absl::InvalidArgumentError(
          "text input: pdworker has no tokenizer; the router must tokenize "
          "the prompt and send tokenized.input_ids");
    case vg::GenerateRequest::INPUT_NOT_SET:
      return absl::InvalidArgumentError(
          "input: neither tokenized nor text is set");
    case vg::GenerateRequest::kTokenized:
      break;
  }
  const auto& ids = request.tokenized().input_ids();
  if (ids.empty()) {
    return absl::InvalidArgumentError("tokenized.input_ids is empty");
  }
  if (absl::Status s =
          CheckTokenIds("tokenized.input_ids", ids, limits.vocab_size);
      !s.ok()) {
    return s;
  }
  spec.prompt.assign(ids.begin(), ids.end());

  if (request.has_mm_inputs()) {
    return absl::UnimplementedError(
        "mm_inputs: multimodal input is not implemented by pdworker");
  }
  if (request.has_kv_transfer_params()) {
    return absl::UnimplementedError(
        "kv_transfer_params: the legacy Mooncake side channel is not "
        "implemented; pdworker hands KV over through "
        "kv_transfer_params_json");
  }
  if (request.has_data_parallel_rank() && request.data_parallel_rank() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("data_parallel_rank=", request.data_parallel_rank(),
                     ": this worker has one data-parallel rank (0)"));
  }
  if (request.has_kv_transfer_params_json()) {
    call.kv_transfer_params_json = request.kv_transfer_params_json();
  }
  call.stream = request.stream();

  const vg::SamplingParams& p = request.sampling_params();
  absl::StatusOr<SamplingOptions> sampling = ToSampling(p, spec.request_id);
  if (!sampling.ok()) return sampling.status();
  spec.sampling = *sampling;

  if (p.n() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling_params.n=", p.n(),
                     ": pdworker runs one sequence per request; send n "
                     "requests"));
  }
  if (!p.logit_bias().empty()) {
    return Unsupported("logit_bias", "a non-empty bias map");
  }
  if (p.has_prompt_logprobs()) {
    return Unsupported("prompt_logprobs", "prompt logprobs");
  }
  if (p.constraint_case() != vg::SamplingParams::CONSTRAINT_NOT_SET) {
    return absl::UnimplementedError(
        "sampling_params.constraint: structured output (json_schema, regex, "
        "grammar, structural_tag, json_object, choice) is not implemented by "
        "pdworker");
  }
  if (p.has_logprobs()) {
    if (p.logprobs() < 0 || p.logprobs() > kMaxLogprobs) {
      return absl::InvalidArgumentError(
          absl::StrCat("sampling_params.logprobs=", p.logprobs(),
                       " must be in [0, ", kMaxLogprobs, "]"));
    }
    spec.logprobs = p.logprobs();
  }

  if (p.has_max_tokens()) {
    if (p.max_tokens() == 0) {
      return absl::InvalidArgumentError(
          "sampling_params.max_tokens=0: a request generates at least one "
          "token");
    }
    spec.stop.max_tokens = static_cast<int32_t>(std::min<uint32_t>(
        p.max_tokens(), std::numeric_limits<int32_t>::max()));
  }
  spec.stop.min_tokens = static_cast<int32_t>(
      std::min<uint32_t>(p.min_tokens(), std::numeric_limits<int32_t>::max()));
  if (absl::Status s = CheckTokenIds("sampling_params.stop_token_ids",
                                     p.stop_token_ids(), limits.vocab_size);
      !s.ok()) {
    return s;
  }
  for (const uint32_t id : p.stop_token_ids()) {
    spec.stop.stop_token_ids.push_back(static_cast<int32_t>(id));
  }
  spec.stop.eos = p.ignore_eos() ? EosHandling::kIgnore : EosHandling::kStop;

  if (p.has_truncate_prompt_tokens()) {
    const int32_t keep = p.truncate_prompt_tokens() == -1
                             ? limits.max_model_len
                             : p.truncate_prompt_tokens();
    if (keep <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sampling_params.truncate_prompt_tokens=", p.truncate_prompt_tokens(),
          " must be >= 1 (or -1: the model's maximum length)"));
    }
    if (static_cast<int32_t>(spec.prompt.size()) > keep) {
      spec.prompt.erase(spec.prompt.begin(), spec.prompt.end() - keep);
    }
  }
  return call;
}

}  // namespace pdworker
