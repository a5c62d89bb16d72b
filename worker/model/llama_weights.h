// LlamaWeights: a checkpoint of any family (decoder_layer.h) laid out in
// device memory the way the forward wants it: fp32 on the CPU backend, bf16
// on CUDA (whatever the checkpoint's dtype; f32/f16 tensors are rounded to
// nearest even). Gemma's (1 + w) norm weights are stored with the 1 added.
#ifndef PDWORKER_WORKER_MODEL_LLAMA_WEIGHTS_H_
#define PDWORKER_WORKER_MODEL_LLAMA_WEIGHTS_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "worker/model/checkpoint.h"
#include "worker/model/model_config.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/device.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {

// One decoder layer. Projections that read the same input are fused so each
// is one GEMM: qkv = [q; k; v] rows, gate_up = [gate; up] rows (HF's
// [out_features, in_features] layout, concatenated along out_features).
struct LlamaLayerWeights {
  DeviceBuffer input_norm;  // [hidden]
  DeviceBuffer qkv;         // [q_size + 2 * kv_size, hidden]
  DeviceBuffer qkv_bias;    // [q_size + 2 * kv_size] or empty
  // QkNorm::kPerHeadRms: self_attn.q_norm / k_norm, each [head_dim];
  // otherwise empty.
  DeviceBuffer q_norm;
  DeviceBuffer k_norm;
  DeviceBuffer o_proj;     // [hidden, q_size]
  DeviceBuffer o_bias;     // [hidden] or empty
  DeviceBuffer post_norm;  // [hidden]; the norm before the MLP
                           // (Gemma's pre_feedforward_layernorm)
  // NormPlacement::kSandwich (Gemma): the norms on the attention output
  // (Gemma's post_attention_layernorm) and on the MLP output
  // (post_feedforward_layernorm), each [hidden]; otherwise empty.
  DeviceBuffer post_attention_output_norm;
  DeviceBuffer post_mlp_output_norm;
  DeviceBuffer gate_up;  // [2 * intermediate, hidden]
  DeviceBuffer down;     // [hidden, intermediate]
};

struct LlamaWeights {
  DeviceBuffer embed_tokens;  // [vocab, hidden]
  std::vector<LlamaLayerWeights> layers;
  DeviceBuffer final_norm;  // [hidden]
  DeviceBuffer lm_head;     // [vocab, hidden]; == embed_tokens when tied
  // Element type of every buffer above (kernels::ModelDTypeFor the device).
  DType dtype = DType::kFloat32;
  // Owns all of the above.
  std::unique_ptr<Arena> arena;
};

// Bytes LoadLlamaWeights allocates for `config` in `dtype`, alignment
// included.
size_t LlamaWeightBytes(const ModelConfig& config,
                        DType dtype = DType::kFloat32);

// Bytes one decode step reads from the weights: every layer's norms and
// projections, the final norm and the LM head matrix, but only one row of
// the embedding table per token (a tied table counts once, as the LM head).
// The numerator of the "fraction of HBM bandwidth" figure.
size_t LlamaDecodeWeightBytes(const ModelConfig& config, DType dtype);

// Reads every tensor (checking names and shapes), fuses and uploads them in
// the element type the device's kernels use (fp32 on the CPU backend, bf16 on
// CUDA). Errors name the tensor. Returns once the uploads have run, on
// success and on error alike.
absl::StatusOr<LlamaWeights> LoadLlamaWeights(const ModelConfig& config,
                                              const Checkpoint& checkpoint,
                                              Device& device, Stream& stream);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_MODEL_LLAMA_WEIGHTS_H_
