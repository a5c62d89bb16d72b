// MistralForCausalLM: no attention biases (transformers' MistralAttention has
// none; an attention_bias of true is refused rather than ignored), and v0.1's
// sliding window.
#include "absl/strings/str_cat.h"
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
  if (const config_json::Json* window =
          config_json::Find(root, "sliding_window");
      window != nullptr) {
    auto value = config_json::AsInt(*window, "sliding_window");
    if (!value.ok()) return value.status();
    if (*value <= 0) {
      return config_json::FieldError(
          "sliding_window", absl::StrCat("must be positive, got ", *value));
    }
    config.sliding_window = *value;
  }
  return absl::OkStatus();
}

}  // namespace

const ModelFamily kMistralFamily = {
    Architecture::kMistral, "MistralForCausalLM", "mistral", &ParseMistral};

}  // namespace pdworker
