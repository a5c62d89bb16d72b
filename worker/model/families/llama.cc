// LlamaForCausalLM (Llama 2, 3, 3.1, 3.2 and the many checkpoints that reuse
// its layout): transformers' LlamaAttention puts bias=config.attention_bias
// on all four attention projections.
#include "worker/model/model_family.h"

namespace pdworker {
namespace {

absl::Status ParseLlama(const config_json::Json& root, ModelConfig& config) {
  auto attention_bias =
      config_json::OptionalBool(root, "attention_bias", false);
  if (!attention_bias.ok()) return attention_bias.status();
  config.layer.qkv_bias = *attention_bias;
  config.layer.o_proj_bias = *attention_bias;
  return absl::OkStatus();
}

}  // namespace

const ModelFamily kLlamaFamily = {Architecture::kLlama, "LlamaForCausalLM",
                                  "llama", &ParseLlama};

}  // namespace pdworker
