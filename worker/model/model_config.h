// The model description from a Hugging Face config.json: the shape of a
// pre-norm dense decoder (Llama, Qwen2, Mistral, Qwen3; one file per family in
// worker/model/families/), its layer's departures from Llama's
// (decoder_layer.h) and its numerics (RMSNorm eps, RoPE base and llama3
// frequency scaling). Everything the forward pass and the KV cache size
// themselves by comes from here.
#ifndef PDWORKER_WORKER_MODEL_MODEL_CONFIG_H_
#define PDWORKER_WORKER_MODEL_MODEL_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "worker/model/decoder_layer.h"

namespace pdworker {

// config.json "architectures": the family (model_family.h) whose file read
// the config.
enum class Architecture {
  kLlama,
  kQwen2,
  kMistral,
  kQwen3,
  kPhi3,
  kGemma2,
  kGemma3,
};

// "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM",
// "Qwen3ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
// "Gemma3ForCausalLM".
absl::string_view ArchitectureName(Architecture architecture);
// config.json "model_type" of the family: "llama", "qwen2", ...
absl::string_view ModelTypeName(Architecture architecture);

enum class RopeScalingType {
  kNone,    // plain RoPE: inv_freq[i] = theta^(-2i / head_dim)
  kLlama3,  // Llama 3.1 frequency-dependent rescaling of inv_freq
  kLinear,  // position interpolation: inv_freq / factor
  kYarn,    // YaRN: interpolated low, extrapolated high frequencies, a
            // ramp between, and attention_factor on q and k
  // Dynamic NTK: transformers raises the base only for sequences longer than
  // max_position_embeddings, which max_model_len never exceeds here, so it
  // is plain RoPE at every length served (vLLM's table is plain too).
  kDynamic,
  // Phi-3's LongRoPE: every rotated pair's frequency divided by its own
  // factor (short_factor or long_factor), and attention_factor on the
  // rotated q and k.
  kLongrope,
};

// "default", "llama3", "linear", "yarn", "dynamic", "longrope" (config.json's
// rope_type names).
absl::string_view RopeScalingTypeName(RopeScalingType type);

// config.json "rope_scaling" (or transformers 5's "rope_parameters"). For
// kNone the numbers are unused (and zero); each other type reads the fields
// its comment names.
struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  // llama3, linear, yarn: how much the (low) frequencies are slowed.
  double factor = 0;
  double low_freq_factor = 0;   // llama3: wavelengths above original/low
                                // are scaled
  double high_freq_factor = 0;  // llama3: wavelengths below original/high
                                // are kept
  // llama3, yarn: the pre-training context, in tokens (yarn: defaults to
  // max_position_embeddings when the key is absent, as transformers does).
  int64_t original_max_position_embeddings = 0;
  // yarn: the rotation counts bounding the ramp (transformers' and vLLM's
  // defaults 32 and 1), whether its ends are rounded outward ("truncate",
  // default true), and the factor q and k are multiplied by after the
  // rotation ("attention_factor"; absent: 0.1 ln(factor) + 1, or the
  // mscale / mscale_all_dim ratio when both are set), resolved here.
  double beta_fast = 0;
  double beta_slow = 0;
  bool truncate = true;
  // yarn, longrope: what the rotated q and k values are multiplied by (1
  // otherwise). longrope: "attention_factor", or sqrt(1 + ln(s) / ln(o)) for
  // s = max_position_embeddings / original_max_position_embeddings (o) when
  // s > 1, as transformers resolves it.
  double attention_factor = 1;
  // longrope: one divisor per rotated pair (rotary_dim / 2 each). vLLM's
  // rule picks one list for the worker's life, so that K/V already cached
  // never changes meaning: long_factor when max_model_len exceeds
  // original_max_position_embeddings (transformers switches per forward by
  // the sequence's length instead). ModelRunner::Create sets
  // long_factor_active from its max_model_len; it is part of the
  // fingerprint.
  std::vector<double> short_factor;
  std::vector<double> long_factor;
  bool long_factor_active = false;
  const std::vector<double>& active_factors() const {
    return long_factor_active ? long_factor : short_factor;
  }
};

struct ModelConfig {
  Architecture architecture = Architecture::kLlama;
  int64_t hidden_size = 0;          // residual stream width
  int64_t intermediate_size = 0;    // MLP width (gate/up outputs)
  int64_t num_hidden_layers = 0;    // decoder layers
  int64_t num_attention_heads = 0;  // query heads
  int64_t num_key_value_heads = 0;  // K/V heads; query head h reads KV head
                                    // h / (num_attention_heads / this)
  int64_t head_dim = 0;  // per-head width; may differ from hidden/heads
  // config.json "partial_rotary_factor" * head_dim (Phi-4-mini: 0.75 x 128):
  // RoPE rotates each head's first rotary_dim values, as pairs (i, i +
  // rotary_dim / 2); the rest pass unrotated. 0: head_dim.
  int64_t rotary_dim = 0;
  int64_t RotaryDim() const { return rotary_dim > 0 ? rotary_dim : head_dim; }
  double rms_norm_eps = 0;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  // Gemma 3: the sliding layers rotate with this base and plain RoPE
  // (rope_local_base_freq), the full layers with rope_theta and
  // rope_scaling. Unset: every layer rotates alike.
  std::optional<double> local_rope_theta;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;  // longest supported sequence, tokens
  // true: there is no lm_head.weight; logits = hidden @ embed_tokens^T.
  bool tie_word_embeddings = false;
  // What the family's layer does differently from Llama's: attention biases,
  // q/k norm (the family file sets it).
  DecoderLayerSpec layer;
  // Gemma: the input embeddings are multiplied by sqrt(hidden_size) (the
  // tied LM head reads the table unscaled); 1 elsewhere.
  double embedding_multiplier = 1.0;
  // Gemma 2: logits x become cap * tanh(x / cap); 0: none.
  double final_logit_softcapping = 0;
  // config.json "torch_dtype" (or "dtype"): the checkpoint's storage type.
  // Absent -> float32, transformers' default.
  DType torch_dtype = DType::kFloat32;
  // Token ids when present ("eos_token_id" may be a list in HF configs).
  // The EOS ids end engine-owned requests: generation_config.json's when it
  // names them (transformers' generate() reads that file, and instruct
  // checkpoints list their end-of-turn ids only there), else config.json's.
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> pad_token_id;
  std::vector<int64_t> eos_token_ids;
  enum class EosSource { kNone, kConfig, kGenerationConfig };
  EosSource eos_source = EosSource::kNone;
  // Mistral's "sliding_window" (and Qwen2's and Qwen3's when
  // "use_sliding_window" is true, Gemma 2's, Phi-3's): a sliding layer's
  // query sees only the last this-many positions, its own included. The CPU
  // attention masks to it; the CUDA kernels have no window yet, so there
  // ModelRunner caps max_model_len to it (within the window full attention
  // is the same computation) and refuses a longer explicit one.
  std::optional<int64_t> sliding_window;
  // With sliding_window: one entry per layer, true where the window applies
  // (every layer for Mistral and Phi-3, the layers from max_window_layers on
  // for Qwen2/Qwen3, the even layers for Gemma 2; config.json's layer_types
  // when it lists them). Empty without a window.
  std::vector<bool> sliding_layers;
  bool SlidesAt(int64_t layer) const {
    return sliding_window.has_value() && layer >= 0 &&
           layer < static_cast<int64_t>(sliding_layers.size()) &&
           sliding_layers[layer];
  }

  // A multimodal checkpoint's text model (model_family.h's
  // TextModelWrapper): every tensor name is this + the text model's name
  // ("language_model." + "model.layers.0..."); tensors under
  // ignored_tensor_prefixes (the other towers) are not read. Empty for a
  // text checkpoint.
  std::string tensor_prefix;
  std::vector<std::string> ignored_tensor_prefixes;

  // Derived sizes.
  int64_t q_size() const { return num_attention_heads * head_dim; }
  int64_t kv_size() const { return num_key_value_heads * head_dim; }
  int64_t num_queries_per_kv() const {
    return num_attention_heads / num_key_value_heads;
  }

  // A stable hash (16 lowercase hex digits, FNV-1a 64 over a canonical
  // "field=value;" string) of every field that defines the model's shape and
  // numerics: architecture, sizes, heads, head_dim, eps, RoPE, vocab, tying,
  // the layer spec, the sliding window. Two workers with equal fingerprints
  // compute the same KV layout and the same positions' K/V, so a KV handoff
  // between them is meaningful.
  // torch_dtype, token ids and max_position_embeddings are excluded: they do
  // not change what a KV block holds. Weights are not covered: the worker
  // publishes and checks ModelFingerprint() (model_fingerprint.h), which
  // combines this shape with a digest of the weights.
  std::string Fingerprint() const;
  // The canonical string Fingerprint() hashes (for logs and debugging).
  std::string CanonicalString() const;
};

// Parses config.json text: the shared keys here, the family's own in its file
// (model_family.h). Unknown fields are ignored (HF configs carry many), except
// the ones that announce something pdworker does not run (quantization_config,
// mixture-of-experts and MLA keys, mlp_bias), which are refused. Errors are
// InvalidArgument and name the field, e.g. "config.json: num_key_value_heads
// must be an integer, got string \"2\"" or "config.json: num_attention_heads
// (8) must be a multiple of num_key_value_heads (3)".
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text);

// What pdworker reads from generation_config.json: its "eos_token_id" (an id
// or a list; nullopt when absent or null). Other fields (sampling defaults)
// are the router's business. INVALID_ARGUMENT naming the field otherwise.
struct GenerationConfig {
  std::optional<std::vector<int64_t>> eos_token_ids;
};
absl::StatusOr<GenerationConfig> ParseGenerationConfig(
    const std::string& json_text);

// Reads <model_dir>/config.json and parses it (NotFound when it is missing),
// then <model_dir>/generation_config.json when present: its EOS ids replace
// config.json's.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_MODEL_MODEL_CONFIG_H_
