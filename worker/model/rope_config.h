// config.json's RoPE keys (ParseModelConfig's part): the base and scaling
// from transformers 4's "rope_theta" / "rope_scaling" or transformers 5's
// "rope_parameters" (per layer type too: Gemma 3's local base), the types
// pdworker runs (default, llama3, linear, yarn) and the refusals of the
// others, naming the key.
#ifndef PDWORKER_WORKER_MODEL_ROPE_CONFIG_H_
#define PDWORKER_WORKER_MODEL_ROPE_CONFIG_H_

#include "absl/status/status.h"
#include "nlohmann/json.hpp"
#include "worker/model/model_config.h"

namespace pdworker {

// Reads the RoPE keys of config.json's `root` into config->rope_theta,
// rope_scaling and local_rope_theta. A config whose two layouts disagree is
// refused rather than guessed at.
absl::Status ParseRope(const nlohmann::json& root, ModelConfig* config);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_MODEL_ROPE_CONFIG_H_
