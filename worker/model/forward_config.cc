#include "worker/model/forward_config.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace pdworker {

kernels::RopeConfig RopeConfigFor(const ModelConfig& c) {
  kernels::RopeConfig rope;
  rope.head_dim = static_cast<int>(c.RotaryDim());
  rope.theta = c.rope_theta;
  const RopeScaling& s = c.rope_scaling;
  rope.factor = s.factor;
  rope.low_freq_factor = s.low_freq_factor;
  rope.high_freq_factor = s.high_freq_factor;
  rope.original_max_position_embeddings =
      static_cast<int>(s.original_max_position_embeddings);
  rope.beta_fast = s.beta_fast;
  rope.beta_slow = s.beta_slow;
  rope.truncate = s.truncate;
  switch (s.type) {
    case RopeScalingType::kNone:
    case RopeScalingType::kDynamic:  // plain at every length served
      rope.scaling = kernels::RopeScalingType::kNone;
      break;
    case RopeScalingType::kLongrope:
      rope.scaling = kernels::RopeScalingType::kLongrope;
      rope.pair_factors = s.active_factors();
      break;
    case RopeScalingType::kLlama3:
      rope.scaling = kernels::RopeScalingType::kLlama3;
      break;
    case RopeScalingType::kLinear:
      rope.scaling = kernels::RopeScalingType::kLinear;
      break;
    case RopeScalingType::kYarn:
      rope.scaling = kernels::RopeScalingType::kYarn;
      break;
  }
  return rope;
}

// YaRN and LongRoPE multiply the rotated q and k values by their
// attention_factor (transformers scales cos and sin; vLLM its cos/sin
// cache). When every value rotates, q·k carries its square, which the
// softmax scale takes instead, so the kernels and the KV cache stay those of
// plain RoPE (and CUDA runs it); with partial rotary the unrotated values
// are not scaled, so the RoPE op scales cos and sin itself (rotary_scale).
bool FoldsAttentionFactor(const ModelConfig& c) {
  return c.RotaryDim() == c.head_dim;
}

// The attention's softmax scale.
float AttentionScale(const ModelConfig& c) {
  // Gemma 2 scales by query_pre_attn_scalar^-1/2 instead of head_dim's.
  const double scalar = c.layer.query_pre_attn_scalar > 0
                            ? c.layer.query_pre_attn_scalar
                            : static_cast<double>(c.head_dim);
  double scale = 1.0 / std::sqrt(scalar);
  if (FoldsAttentionFactor(c)) {
    scale *= c.rope_scaling.attention_factor * c.rope_scaling.attention_factor;
  }
  return static_cast<float>(scale);
}

std::vector<std::string> UnverifiedCudaFeatures(const ModelConfig& c) {
  std::vector<std::string> features;
  if (c.layer.qk_norm != QkNorm::kNone) {
    features.push_back(
        absl::StrCat("per-head q/k norm (self_attn.q_norm / "
                     "k_norm, qk_norm=",
                     QkNormName(c.layer.qk_norm), ")"));
  }
  if (c.RotaryDim() != c.head_dim) {
    features.push_back(
        absl::StrCat("partial rotary (partial_rotary_factor: ", c.RotaryDim(),
                     " of ", c.head_dim, " values rotate)"));
  }
  if (c.layer.norm_placement == NormPlacement::kSandwich) {
    features.push_back(
        "sandwich norms (post_attention_layernorm on the attention output, "
        "post_feedforward_layernorm)");
  }
  if (c.layer.activation != MlpActivation::kSilu) {
    features.push_back(absl::StrCat(
        "the ", MlpActivationName(c.layer.activation), " MLP activation"));
  }
  if (c.layer.attn_logit_softcapping != 0) {
    features.push_back("attn_logit_softcapping");
  }
  if (c.final_logit_softcapping != 0) {
    features.push_back("final_logit_softcapping");
  }
  if (c.embedding_multiplier != 1.0) {
    features.push_back("the embedding multiplier");
  }
  return features;
}

}  // namespace pdworker
