// Stateless checks of a vllm.grpc.engine GenerateRequest, done on the gRPC
// thread: what a router sends becomes an engine RequestSpec, or is refused
// naming the field. SMG fills every SamplingParams field on every request,
// so each field is judged by its value: neutral values are accepted, a value
// that would change the tokens and that pdworker does not implement is
// refused (UNIMPLEMENTED), an invalid one too (INVALID_ARGUMENT). What needs
// the engine's state (a live request id, the KV cache) is checked there.
#ifndef PDWORKER_WORKER_SERVER_GENERATE_REQUEST_H_
#define PDWORKER_WORKER_SERVER_GENERATE_REQUEST_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "proto/vllm_engine.pb.h"
#include "worker/engine/request.h"

namespace pdworker {

struct GenerateLimits {
  int vocab_size = 0;
  int max_model_len = 0;
};

struct GenerateCall {
  RequestSpec spec;
  bool stream = false;
  // GenerateRequest.kv_transfer_params_json when set (P/D decode leg).
  std::optional<std::string> kv_transfer_params_json;
};

// The mapping, vLLM's where the two differ from proto3 defaults:
// temperature unset -> 1.0; top_p 0 -> off; repetition_penalty 0 -> 1;
// max_tokens unset -> up to the maximum length; seed unset -> a seed
// derived from the request id (DefaultSeed), so a request id replays.
// Refused: text input (the router tokenizes), no or empty input, n > 1,
// non-zero frequency/presence penalty, repetition_penalty other than 1,
// min_p outside [0, 1], non-empty logit_bias, prompt_logprobs, logprobs
// outside [0, 20], structured output, multimodal input, the legacy
// kv_transfer_params, data_parallel_rank other than 0, max_tokens 0.
// truncate_prompt_tokens keeps the prompt's last N tokens (-1: the model's
// maximum length). Stop strings are the router's (it detokenizes, matches
// and aborts, as SMG does for vLLM workers): accepted, no effect here.
absl::StatusOr<GenerateCall> ToGenerateCall(
    const vllm::grpc::engine::GenerateRequest& request,
    const GenerateLimits& limits);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_SERVER_GENERATE_REQUEST_H_
