// Qwen3ForCausalLM (Qwen3 dense, 0.6B to 32B): transformers' Qwen3Attention
// puts bias=config.attention_bias on q/k/v and o, normalizes every q and k
// head with self_attn.q_norm / k_norm (Qwen3RMSNorm over head_dim) before
// RoPE, and takes head_dim from the config (128 for every size, so
// num_attention_heads * head_dim != hidden_size on 0.6B and 4B:
// ParseModelConfig reads the explicit key).
#include "worker/model/model_family.h"

namespace pdworker {
namespace {

absl::Status ParseQwen3(const config_json::Json& root, ModelConfig& config) {
  auto attention_bias =
      config_json::OptionalBool(root, "attention_bias", false);
  if (!attention_bias.ok()) return attention_bias.status();
  config.layer.qkv_bias = *attention_bias;
  config.layer.o_proj_bias = *attention_bias;
  config.layer.qk_norm = QkNorm::kPerHeadRms;
  return ParseQwenSlidingWindow(root, config);
}

}  // namespace

const ModelFamily kQwen3Family = {Architecture::kQwen3, "Qwen3ForCausalLM",
                                  "qwen3", &ParseQwen3};

}  // namespace pdworker
