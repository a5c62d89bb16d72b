// Phi3ForCausalLM (Phi-3, Phi-3.5, Phi-4): transformers' Phi3Attention has
// one qkv_proj ([q; k; v] rows) and Phi3MLP one gate_up_proj ([gate; up]
// rows, chunked in that order), neither with a bias; Phi-3-mini's
// sliding_window is recorded. The longrope scaling of the 128k variants and
// Phi-4-mini's partial_rotary_factor are read where every family reads them
// (rope_config.cc, ParseModelConfig).
#include "common/status_macros.h"
#include "worker/model/model_family.h"

namespace pdworker {
namespace {

absl::Status ParsePhi3(const config_json::Json& root, ModelConfig& config) {
  auto attention_bias =
      config_json::OptionalBool(root, "attention_bias", false);
  if (!attention_bias.ok()) return attention_bias.status();
  if (*attention_bias) {
    return config_json::FieldError(
        "attention_bias", "= true is not supported for Phi3ForCausalLM");
  }
  config.layer.qkv_tensors = ProjectionTensors::kFused;
  config.layer.gate_up_tensors = ProjectionTensors::kFused;
  PDW_ASSIGN_OR_RETURN(config.sliding_window, config_json::OptionalPositiveInt(
                                                  root, "sliding_window"));
  return absl::OkStatus();
}

}  // namespace

const ModelFamily kPhi3Family = {Architecture::kPhi3, "Phi3ForCausalLM", "phi3",
                                 &ParsePhi3};

}  // namespace pdworker
