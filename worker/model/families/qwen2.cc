// Qwen2ForCausalLM (Qwen2, Qwen2.5): transformers' Qwen2Attention hard-codes
// bias=True on q/k/v and False on o (there is no attention_bias key), and a
// sliding window when use_sliding_window is set.
#include "absl/strings/str_cat.h"
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
