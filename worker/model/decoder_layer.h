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

struct DecoderLayerSpec {
  // Biases on the attention projections: self_attn.{q,k,v}_proj.bias
  // [q_size], [kv_size], [kv_size] and self_attn.o_proj.bias [hidden].
  bool qkv_bias = false;
  bool o_proj_bias = false;
  QkNorm qk_norm = QkNorm::kNone;
  ProjectionTensors qkv_tensors = ProjectionTensors::kSeparate;
  ProjectionTensors gate_up_tensors = ProjectionTensors::kSeparate;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_MODEL_DECODER_LAYER_H_
