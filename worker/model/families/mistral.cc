// MistralForCausalLM: no attention biases (transformers' MistralAttention has
// none; an attention_bias of true is refused rather than ignored), and v0.1's
// sliding window.
#include "common/status_macros.h"
#include "worker/model/model_family.h"

namespace pdworker {
namespace {

absl::Status ParseMistral(const config_json::Json& root, ModelConfig& config) {
  auto attention_bias =
      config_json::OptionalBool(root, "attention_bias", false);
  if (!attention_bias.ok()) return attention_bias.status();
  if (*attention_bias) {
    return config_json::FieldError(
        "attention_bias", "= true is not supported for MistralForCausalLM");
  }
  PDW_ASSIGN_OR_RETURN(config.sliding_window, config_json::OptionalPositiveInt(
                                                  root, "sliding_window"));
  return absl::OkStatus();
}

}  // namespace

const ModelFamily kMistralFamily = {
    Architecture::kMistral, "MistralForCausalLM", "mistral", &ParseMistral};

}  // namespace pdworker
