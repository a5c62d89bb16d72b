// The KV handoff of the request-level API (vllm.grpc.engine.VllmEngine):
// what a prefill worker returns in GenerateComplete.kv_transfer_params_json
// and a decode worker reads from GenerateRequest.kv_transfer_params_json, as
// SMG relays it between vLLM workers. One JSON object:
//
//   {
//     "pdworker_kv_handle": <v1::KvHandle in protobuf's JSON mapping,
//                            version 2, with prompt_token_ids>,
//     "first_token": {"token_id": 17, "logprob": -0.31,
//                     "top_logprobs": [{"token_id": 17, "logprob": -0.31},
//                                      ...]},
//     "do_remote_prefill": true      // optional, vLLM's NIXL hints; any
//     "do_remote_decode": false      // other key is refused
//   }
//
// The decode worker pulls the prompt's KV through the handle (the same
// pull-with-lease path as Worker.ImportKv), emits first_token as the
// request's first output, then decodes.
#ifndef PDWORKER_WORKER_TRANSFER_KV_TRANSFER_PARAMS_H_
#define PDWORKER_WORKER_TRANSFER_KV_TRANSFER_PARAMS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/worker.pb.h"
#include "worker/runner/model_runner.h"

namespace pdworker {

// The handle version that carries prompt_token_ids.
inline constexpr int32_t kKvHandleVersion = 2;

// The token the prefill worker sampled after the prompt, and its raw
// logprobs (the alternatives the request asked for; empty otherwise).
struct FirstToken {
  int32_t token_id = -1;
  float logprob = 0.0f;
  std::vector<TopLogprob> top_logprobs;
};

struct KvTransferParams {
  v1::KvHandle handle;
  FirstToken first_token;
};

std::string ToKvTransferParamsJson(const KvTransferParams& params);

// INVALID_ARGUMENT naming the field for text that is not such an object: not
// JSON, an unknown key, a handle that is not a v1::KvHandle (unknown fields
// included) or not version 2, a first token without an id. The handle's
// content (model, layout, lease) is checked by the importer.
absl::StatusOr<KvTransferParams> ParseKvTransferParamsJson(
    absl::string_view json);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_TRANSFER_KV_TRANSFER_PARAMS_H_
