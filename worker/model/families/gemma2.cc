// Gemma2ForCausalLM (Gemma 2: 2B, 9B, 27B), as transformers' Gemma2 modeling
// computes it: the input embeddings times sqrt(hidden_size); every RMSNorm
// as x̂ * (1 + w); four norms per layer (input_layernorm and
// post_attention_layernorm around attention, pre_feedforward_layernorm and
// post_feedforward_layernorm around the MLP); GeGLU with gelu_pytorch_tanh;
// softmax scale query_pre_attn_scalar^-1/2; attention scores and final
// logits soft-capped (cap * tanh(x / cap)); every other layer (the even ones)
// attends to a sliding window, recorded here (ModelRunner caps
// max_model_len to it). Keys absent from config.json take Gemma2Config's
// defaults (head_dim 256, query_pre_attn_scalar 256, caps 50 and 30,
// window 4096, tied embeddings); a null cap means none.
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/model/model_family.h"

namespace pdworker {

using config_json::Json;

namespace {

// A positive number, `fallback` when the key is absent, 0 when it is null.
absl::StatusOr<double> OptionalPositive(const Json& root, const char* key,
                                        double fallback) {
  const auto it = root.find(key);
  if (it == root.end()) return fallback;
  if (it->is_null()) return 0.0;
  PDW_ASSIGN_OR_RETURN(const double value, config_json::AsNumber(*it, key));
  if (!(value > 0) || std::isinf(value)) {
    return config_json::FieldError(
        key, absl::StrCat("must be positive (or null), got ", value));
  }
  return value;
}

}  // namespace

absl::Status ParseGemmaLayer(const Json& root, const GemmaDefaults& defaults,
                             ModelConfig& config) {
  PDW_ASSIGN_OR_RETURN(
      const bool attention_bias,
      config_json::OptionalBool(root, "attention_bias", false));
  if (attention_bias) {
    return config_json::FieldError(
        "attention_bias", absl::StrCat("= true is not supported for ",
                                       ArchitectureName(config.architecture)));
  }
  if (config_json::Find(root, "head_dim") == nullptr) config.head_dim = 256;
  if (config_json::Find(root, "tie_word_embeddings") == nullptr) {
    config.tie_word_embeddings = true;
  }
  config.layer.norm_placement = NormPlacement::kSandwich;
  config.layer.norm_weight = NormWeight::kOnePlus;
  config.layer.activation = MlpActivation::kGeluTanh;
  PDW_ASSIGN_OR_RETURN(config.layer.query_pre_attn_scalar,
                       OptionalPositive(root, "query_pre_attn_scalar", 256));
  if (config.layer.query_pre_attn_scalar == 0) {
    return config_json::FieldError("query_pre_attn_scalar",
                                   "must be a positive number, got null");
  }
  PDW_ASSIGN_OR_RETURN(config.layer.attn_logit_softcapping,
                       OptionalPositive(root, "attn_logit_softcapping",
                                        defaults.attn_logit_softcapping));
  PDW_ASSIGN_OR_RETURN(config.final_logit_softcapping,
                       OptionalPositive(root, "final_logit_softcapping",
                                        defaults.final_logit_softcapping));
  PDW_ASSIGN_OR_RETURN(const double window,
                       OptionalPositive(root, "sliding_window", 4096));
  if (window > 0) {
    if (window != std::floor(window)) {
      return config_json::FieldError(
          "sliding_window", absl::StrCat("must be an integer, got ", window));
    }
    config.sliding_window = static_cast<int64_t>(window);
  }
  config.embedding_multiplier =
      std::sqrt(static_cast<double>(config.hidden_size));
  return absl::OkStatus();
}

namespace {

absl::Status ParseGemma2(const Json& root, ModelConfig& config) {
  PDW_RETURN_IF_ERROR(ParseGemmaLayer(
      root, {/*attn_logit_softcapping=*/50, /*final_logit_softcapping=*/30},
      config));
  // Gemma2DecoderLayer: the even layers slide.
  if (config.sliding_window.has_value()) {
    for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
      config.sliding_layers.push_back(i % 2 == 0);
    }
  }
  return absl::OkStatus();
}

}  // namespace

const ModelFamily kGemma2Family = {Architecture::kGemma2, "Gemma2ForCausalLM",
                                   "gemma2", &ParseGemma2};

}  // namespace pdworker
