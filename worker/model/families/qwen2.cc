// Qwen2ForCausalLM (Qwen2, Qwen2.5): transformers' Qwen2Attention hard-codes
// bias=True on q/k/v and False on o (there is no attention_bias key), and a
// sliding window on the layers from max_window_layers on when
// use_sliding_window is set.
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/model/model_family.h"

namespace pdworker {

absl::Status ParseQwenSlidingWindow(const config_json::Json& root,
                                    ModelConfig& config) {
  auto use_window =
      config_json::OptionalBool(root, "use_sliding_window", false);
  if (!use_window.ok()) return use_window.status();
  if (!*use_window) return absl::OkStatus();
  auto window = config_json::RequiredInt(root, "sliding_window");
  if (!window.ok()) return window.status();
  if (*window <= 0) {
    return config_json::FieldError(
        "sliding_window", absl::StrCat("must be positive, got ", *window));
  }
  config.sliding_window = *window;
  // transformers' Qwen2/Qwen3: the window applies from max_window_layers
  // (default 28) on.
  int64_t first = 28;
  if (const config_json::Json* value =
          config_json::Find(root, "max_window_layers");
      value != nullptr) {
    PDW_ASSIGN_OR_RETURN(first,
                         config_json::AsInt(*value, "max_window_layers"));
  }
  config.sliding_layers.clear();
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    config.sliding_layers.push_back(i >= first);
  }
  return absl::OkStatus();
}

namespace {

absl::Status ParseQwen2(const config_json::Json& root, ModelConfig& config) {
  config.layer.qkv_bias = true;
  config.layer.o_proj_bias = false;
  return ParseQwenSlidingWindow(root, config);
}

}  // namespace

const ModelFamily kQwen2Family = {Architecture::kQwen2, "Qwen2ForCausalLM",
                                  "qwen2", &ParseQwen2};

}  // namespace pdworker
