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

}  // namespace

const ModelFamily kGemma3Family = {Architecture::kGemma3, "Gemma3ForCausalLM",
                                   "gemma3_text", &ParseGemma3};

}  // namespace pdworker
