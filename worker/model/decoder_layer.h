// What differs between the decoder layers of the families pdworker serves,
// as data. A family file (worker/model/families/) fills it from config.json;
// the weights loader, the forward, the CUDA fusions and the config's
// fingerprint read these fields and never ask which family it was.
//
// Every layer is pre-norm: x = RMSNorm(h) -> attention -> h += o_proj;
// x = RMSNorm(h) -> gate/up -> SiLU(gate) * up -> h += down, with the tensor
// names of Hugging Face's Llama (model.layers.N.self_attn.{q,k,v,o}_proj,
// input_layernorm, post_attention_layernorm, mlp.{gate,up,down}_proj). The
// fields below are the departures from that.
#ifndef PDWORKER_WORKER_MODEL_DECODER_LAYER_H_
#define PDWORKER_WORKER_MODEL_DECODER_LAYER_H_

#include "absl/strings/string_view.h"

namespace pdworker {

enum class QkNorm {
  kNone,
  // Qwen3: after the projections and before RoPE, each q head and each k
  // head (head_dim values) is RMS-normalized with rms_norm_eps and scaled by
  // self_attn.q_norm.weight / self_attn.k_norm.weight, both [head_dim].
  kPerHeadRms,
};

// "none", "per_head_rms" (logs, errors and the config's fingerprint).
absl::string_view QkNormName(QkNorm qk_norm);

// How the checkpoint stores projections that read the same input. The
// weights are fused either way ([q; k; v] rows, [gate; up] rows), so the
// forward never sees the difference.
enum class ProjectionTensors {
  kSeparate,  // self_attn.{q,k,v}_proj, mlp.{gate,up}_proj (Llama's)
  kFused,     // self_attn.qkv_proj, mlp.gate_up_proj (Phi-3's), rows in the
              // same order
};

enum class NormPlacement {
  // Llama: input_layernorm before attention, post_attention_layernorm
  // before the MLP.
  kPre,
  // Gemma 2 and 3: input_layernorm before attention and
  // post_attention_layernorm on its output (before the residual add);
  // pre_feedforward_layernorm before the MLP and post_feedforward_layernorm
  // on its output.
  kSandwich,
};

enum class NormWeight {
  kPlain,    // RMSNorm(x) * w
  kOnePlus,  // Gemma: RMSNorm(x) * (1 + w), every norm of the model; the
             // loader folds the 1 into the weights
};

enum class MlpActivation {
  kSilu,      // "silu": down(silu(gate) * up)
  kGeluTanh,  // "gelu_pytorch_tanh" (GeGLU): down(gelu_tanh(gate) * up)
};

// config.json's hidden_act spelling of `activation`.
absl::string_view MlpActivationName(MlpActivation activation);

struct DecoderLayerSpec {
  // Biases on the attention projections: self_attn.{q,k,v}_proj.bias
  // [q_size], [kv_size], [kv_size] and self_attn.o_proj.bias [hidden].
  bool qkv_bias = false;
  bool o_proj_bias = false;
  QkNorm qk_norm = QkNorm::kNone;
  ProjectionTensors qkv_tensors = ProjectionTensors::kSeparate;
  ProjectionTensors gate_up_tensors = ProjectionTensors::kSeparate;
  NormPlacement norm_placement = NormPlacement::kPre;
  NormWeight norm_weight = NormWeight::kPlain;
  MlpActivation activation = MlpActivation::kSilu;
  // Gemma 2: the softmax scale is query_pre_attn_scalar^-1/2 instead of
  // head_dim^-1/2 (0: head_dim's).
  double query_pre_attn_scalar = 0;
  // Gemma 2: scores s (scaled) become cap * tanh(s / cap); 0: none.
  double attn_logit_softcapping = 0;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_MODEL_DECODER_LAYER_H_
