// Gemma3ForCausalLM (Gemma 3's text models, model_type "gemma3_text": the
// 1B, and the text part of the larger checkpoints), as transformers' Gemma3
// modeling computes it: Gemma 2's layer (ParseGemmaLayer) without the caps
// by default, plus per-head q/k norms (Gemma3RMSNorm, 1 + w) before RoPE,
// sliding layers by "layer_types" or else "sliding_window_pattern" (layer i
// slides unless (i + 1) is a multiple of it; default 6), and the sliding
// layers' own RoPE base (rope_local_base_freq, default 10000, unscaled)
// beside rope_theta and rope_scaling for the full layers.
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/model/model_family.h"

namespace pdworker {
namespace {

using config_json::Json;

absl::Status ParseGemma3(const Json& root, ModelConfig& config) {
  PDW_RETURN_IF_ERROR(ParseGemmaLayer(root, GemmaDefaults{}, config));
  config.layer.qk_norm = QkNorm::kPerHeadRms;
  if (const Json* base = config_json::Find(root, "rope_local_base_freq");
      base != nullptr) {
    PDW_ASSIGN_OR_RETURN(const double theta,
                         config_json::AsNumber(*base, "rope_local_base_freq"));
    if (config.local_rope_theta.has_value() &&
        *config.local_rope_theta != theta) {
      return config_json::FieldError(
          "rope_local_base_freq",
          absl::StrCat("(", theta,
                       ") disagrees with rope_parameters.sliding_attention."
                       "rope_theta (",
                       *config.local_rope_theta, "); remove one of them"));
    }
    config.local_rope_theta = theta;
  } else if (!config.local_rope_theta.has_value()) {
    config.local_rope_theta = 10000.0;
  }
  if (config.sliding_window.has_value()) {
    int64_t pattern = 6;
    if (const Json* value = config_json::Find(root, "sliding_window_pattern");
        value != nullptr) {
      PDW_ASSIGN_OR_RETURN(
          pattern, config_json::AsInt(*value, "sliding_window_pattern"));
      if (pattern <= 0) {
        return config_json::FieldError(
            "sliding_window_pattern",
            absl::StrCat("must be positive, got ", pattern));
      }
    }
    for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
      config.sliding_layers.push_back((i + 1) % pattern != 0);
    }
  }
  return absl::OkStatus();
}

// Gemma3ForConditionalGeneration (Gemma 3 4B, 12B, 27B): the text model's
// keys under "text_config", most of them left to Gemma3TextConfig's
// defaults (below); the token ids and dtype at the top level.
absl::StatusOr<Json> Gemma3TextConfig(const Json& root) {
  const Json* text = config_json::Find(root, "text_config");
  if (text == nullptr || !text->is_object()) {
    return config_json::FieldError(
        "text_config",
        "must be an object (Gemma3ForConditionalGeneration "
        "nests the text model's config there)");
  }
  // transformers' Gemma3TextConfig defaults (the 1B's shape).
  Json config = {
      {"vocab_size", 262208},
      {"hidden_size", 2304},
      {"intermediate_size", 9216},
      {"num_hidden_layers", 26},
      {"num_attention_heads", 8},
      {"num_key_value_heads", 4},
      {"head_dim", 256},
      {"hidden_activation", "gelu_pytorch_tanh"},
      {"max_position_embeddings", 131072},
      {"rms_norm_eps", 1e-6},
      {"rope_theta", 1000000.0},
      {"attention_bias", false},
      {"query_pre_attn_scalar", 256},
      {"sliding_window", 4096},
      {"final_logit_softcapping", nullptr},
      {"attn_logit_softcapping", nullptr},
      {"rope_local_base_freq", 10000.0},
      {"sliding_window_pattern", 6},
  };
  for (const auto& [key, value] : text->items()) config[key] = value;
  // The top-level keys that describe the text model too; a quantized
  // checkpoint's quantization_config among them, so it is refused as for a
  // text checkpoint rather than lost with the wrapper.
  for (const char* key :
       {"eos_token_id", "bos_token_id", "pad_token_id", "torch_dtype", "dtype",
        "tie_word_embeddings", "quantization_config"}) {
    if (config.contains(key)) continue;
    if (const Json* value = config_json::Find(root, key); value != nullptr) {
      config[key] = *value;
    }
  }
  config["architectures"] = {"Gemma3ForCausalLM"};
  return config;
}

constexpr absl::string_view kGemma3IgnoredPrefixes[] = {
    "vision_tower.", "multi_modal_projector."};

}  // namespace

const TextModelWrapper kGemma3MultimodalWrapper = {
    "Gemma3ForConditionalGeneration", "language_model.", kGemma3IgnoredPrefixes,
    &Gemma3TextConfig};

const ModelFamily kGemma3Family = {Architecture::kGemma3, "Gemma3ForCausalLM",
                                   "gemma3_text", &ParseGemma3};

}  // namespace pdworker
