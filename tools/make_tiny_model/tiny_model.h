// Deterministic tiny Llama-family checkpoints for tests: real Hugging Face
// model directories (config.json + model.safetensors, or shards + index) whose
// weights come from a fixed-seed generator, so every run and every machine
// writes the same bytes. Each shape exercises one feature of the family.
#ifndef PDWORKER_TOOLS_MAKE_TINY_MODEL_TINY_MODEL_H_
#define PDWORKER_TOOLS_MAKE_TINY_MODEL_TINY_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"

namespace pdworker {

// Every shape has hidden_size 64, max_position_embeddings 512, rms_norm_eps
// 1e-5 (1e-6 for qkv_bias), SiLU MLP; see tiny_model.cc for the full table.
enum class TinyShape {
  kGqa,         // Llama, 8 query heads sharing 2 KV heads
  kTied,        // Llama, tie_word_embeddings (no lm_head.weight), MHA
  kQkvBias,     // Qwen2: q/k/v biases, rope_theta 1e6
  kHeadDim,     // Llama, head_dim 32 != hidden/heads (16), 3 layers
  kLlama3Rope,  // Llama, llama3 rope_scaling with original context 64, MQA
  kSmall,       // benchmark config (hidden 256, 4 layers); not in All
  // GPU benchmarks: Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads,
  // 8 KV heads, intermediate 8192, vocab 128256, tied embeddings, theta 5e5,
  // plain RoPE, 131072 positions) with random weights; ~1.24B parameters,
  // 2.5 GB in bf16. Not in All.
  kLlama1B,
  // GPU benchmarks: Qwen2.5-0.5B's dimensions as a Llama, as
  // bench/torch_compare's llama_0p5b (hidden 896, 24 layers, 14 heads, 2 KV
  // heads, intermediate 4864, vocab 151936, tied embeddings, theta 1e6, eps
  // 1e-6, 32768 positions, no q/k/v bias) with random weights; ~494M
  // parameters, 0.99 GB in bf16: the launch-bound decode shape. Not in All.
  kLlama0p5B,
  // GPU tests of the kernels that need head_dim 64 (the tensor-core decode
  // attention, the decode megakernel): a Qwen2 with q/k/v biases, hidden
  // 192 = 3 query heads × 64 over 1 KV head, intermediate 448 (rows that
  // end inside a 256-element load chunk), 2 layers, vocab 512. Not in All.
  kHeadDim64,
  // Qwen3ForCausalLM: per-head q/k RMSNorm before RoPE, explicit head_dim 32
  // over hidden 64 with 4 query and 2 KV heads, theta 1e6, eps 1e-6.
  kQwen3,
  // Llama with linear rope_scaling (factor 2).
  kLinearRope,
  // Qwen2 with yarn rope_scaling (factor 4 over an original context of 128,
  // Qwen2.5's long-context spelling).
  kYarnRope,
  // Phi3ForCausalLM (Phi-4's layout): fused qkv_proj and gate_up_proj.
  kPhi3,
  // Gemma2ForCausalLM: sandwich (1 + w) norms, GeGLU, sqrt(hidden) embedding
  // scale, query_pre_attn_scalar 24, soft-capping, tied, a 16-token window
  // on the even layers.
  kGemma2,
  // MistralForCausalLM with an 8-token sliding window on every layer.
  kMistralWindow,
  // Gemma3ForCausalLM ("gemma3_text"): Gemma 2's layer with (1 + w) q/k
  // norms, sliding layers 0 and 2 with their own RoPE base (1e4) beside the
  // full layer's linearly scaled 1e6, no soft-capping.
  kGemma3,
  // The same text model as a Gemma3ForConditionalGeneration checkpoint:
  // config under text_config, tensors under language_model., two stand-in
  // vision tensors pdworker must leave unread.
  kGemma3Multimodal,
  // Phi3ForCausalLM as Phi-4-mini writes it: partial_rotary_factor 0.75 (12
  // of head_dim 16 rotate), longrope with six short and long factors over an
  // original context of 32 (max_position_embeddings 512), tied embeddings.
  kPhi4Mini,
  // Benchmark shapes of issue 41's GPU comparison, each with the published
  // model's layer and vocabulary and 4 of its decoder layers (per-layer
  // figures scale; a full checkpoint would take minutes to write): Qwen3-8B
  // (hidden 4096, 32 heads over 8, head_dim 128, MLP 12288, vocab 151936,
  // untied, q/k norm; ~4 GB in bf16) and Gemma-2-9B (hidden 3584, 16 heads
  // over 8, head_dim 256, MLP 14336, vocab 256000, tied, soft-caps 50/30,
  // 4096-token window on even layers; ~3.4 GB). Not in All.
  kQwen3_8B_4Layers,
  kGemma2_9B_4Layers,
};

std::vector<TinyShape> AllTinyShapes();
// "gqa", "tied", "qkv_bias", "head_dim", "llama3_rope", "qwen3",
// "linear_rope", "yarn_rope", "phi3", "gemma2", "mistral_window", "gemma3",
// "gemma3_multimodal", "phi4_mini", "small", "llama_1b", "llama_0p5b",
// "head_dim_64", "qwen3_8b_4layers", "gemma2_9b_4layers".
absl::string_view TinyShapeName(TinyShape shape);
absl::StatusOr<TinyShape> ParseTinyShape(absl::string_view name);

struct TinyModelOptions {
  TinyShape shape = TinyShape::kGqa;
  // Same seed -> same weights, independent of dtype and sharding (values are
  // generated in float32 and rounded to `dtype` when written).
  uint64_t seed = 0;
  DType dtype = DType::kFloat32;  // storage type; also config.json torch_dtype
  // 1: model.safetensors. N > 1: model-0000i-of-0000N.safetensors plus
  // model.safetensors.index.json, tensors split contiguously in HF order.
  int num_shards = 1;
  // config.json's max_position_embeddings; 0: the shape's (512 for the
  // small shapes). Benchmarks of long prompts raise it (no weight depends
  // on it).
  int64_t max_position_embeddings = 0;
};

// The config.json text for `options` (pretty-printed JSON).
std::string TinyModelConfigJson(const TinyModelOptions& options);

// Writes the model directory `out_dir` (created, with parents, if missing;
// existing checkpoint files are overwritten). InvalidArgument when
// num_shards is below 1 or above the number of tensors.
absl::Status WriteTinyModel(const TinyModelOptions& options,
                            const std::string& out_dir);

}  // namespace pdworker

#endif  // PDWORKER_TOOLS_MAKE_TINY_MODEL_TINY_MODEL_H_
