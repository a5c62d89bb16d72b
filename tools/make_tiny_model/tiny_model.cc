#include "tools/make_tiny_model/tiny_model.h"

#include <cmath>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/fnv1a.h"
#include "nlohmann/json.hpp"
#include "worker/model/safetensors_writer.h"

namespace pdworker {
namespace {

using Json = nlohmann::json;

// All dimensions of one shape. head_dim_override 0 means "not in config.json"
// (then head_dim = hidden / heads).
struct TinyDims {
  const char* architecture;
  const char* model_type;
  int64_t hidden;
  int64_t intermediate;
  int64_t layers;
  int64_t heads;
  int64_t kv_heads;
  int64_t head_dim_override;
  int64_t vocab;
  double rope_theta;
  double rms_norm_eps;
  bool tied;
  bool qkv_bias;
  bool llama3_rope;
  int64_t max_position_embeddings = 512;
  // Qwen3: self_attn.q_norm / k_norm [head_dim] per layer.
  bool qk_norm = false;
  // rope_scaling other than llama3's (see llama3_rope).
  enum class Rope { kDefault, kLinear, kYarn, kLongrope };
  Rope rope = Rope::kDefault;
  // Phi-3: self_attn.qkv_proj and mlp.gate_up_proj instead of the separate
  // projections.
  bool fused_projections = false;
  // Gemma 2: four norms per layer, stored as w in x̂ * (1 + w), GeGLU,
  // query_pre_attn_scalar, soft-capping, a window.
  bool gemma2 = false;
  // Gemma3ForConditionalGeneration: the text model under "text_config" and
  // "language_model.", beside vision tower tensors.
  bool multimodal = false;
  // config.json "partial_rotary_factor" (written when not 1).
  double partial_rotary_factor = 1.0;
  // Gemma 2: Gemma-2-9B's own caps, window and query_pre_attn_scalar
  // instead of the tiny model's.
  bool gemma2_published = false;
};

// Small enough that the float64 reference and the CPU forward take
// milliseconds; each shape varies something the forward must get right.
TinyDims DimsFor(TinyShape shape) {
  switch (shape) {
    case TinyShape::kGqa:
      return {"LlamaForCausalLM",
              "llama",
              64,
              128,
              2,
              8,
              2,
              0,
              256,
              10000.0,
              1e-5,
              false,
              false,
              false};
    case TinyShape::kTied:
      return {"LlamaForCausalLM",
              "llama",
              64,
              160,
              2,
              4,
              4,
              0,
              320,
              10000.0,
              1e-5,
              true,
              false,
              false};
    case TinyShape::kQkvBias:
      return {"Qwen2ForCausalLM", "qwen2", 64,    192,  2,    4, 2, 0, 384,
              1000000.0,          1e-6,    false, true, false};
    case TinyShape::kHeadDim:
      return {"LlamaForCausalLM",
              "llama",
              64,
              128,
              3,
              4,
              2,
              32,
              256,
              10000.0,
              1e-5,
              false,
              false,
              false};
    case TinyShape::kLlama3Rope:
      return {"LlamaForCausalLM", "llama", 64,    128,   2,   4, 1, 0, 512,
              500000.0,           1e-5,    false, false, true};
    case TinyShape::kSmall:
      // Benchmarks: big enough that compute, not launch overhead, shows in
      // prefill steps; small enough for a 2-core CPU (3.8M parameters).
      return {"LlamaForCausalLM",
              "llama",
              256,
              704,
              4,
              8,
              2,
              0,
              2048,
              10000.0,
              1e-5,
              false,
              false,
              false};
    case TinyShape::kLlama1B:
      return {
          "LlamaForCausalLM", "llama", 2048, 8192,  16,    32,    8, 0, 128256,
          500000.0,           1e-5,    true, false, false, 131072};
    case TinyShape::kLlama0p5B:
      return {
          "LlamaForCausalLM", "llama", 896,  4864,  24,    14,   2, 0, 151936,
          1000000.0,          1e-6,    true, false, false, 32768};
    case TinyShape::kHeadDim64:
      return {"Qwen2ForCausalLM", "qwen2", 192,   448,  2,    3, 1, 0, 512,
              1000000.0,          1e-6,    false, true, false};
    case TinyShape::kQwen3:
      // Qwen3-0.6B's proportions: head_dim explicit and wider than
      // hidden / heads (4 x 32 = 128 > 64), GQA, q/k norm, theta 1e6.
      return {
          "Qwen3ForCausalLM", "qwen3", 64,    128,   2,     4,   2,   32, 256,
          1000000.0,          1e-6,    false, false, false, 512, true};
    case TinyShape::kLinearRope:
      return {"LlamaForCausalLM",
              "llama",
              64,
              128,
              2,
              4,
              2,
              0,
              256,
              10000.0,
              1e-5,
              false,
              false,
              false,
              512,
              false,
              TinyDims::Rope::kLinear};
    case TinyShape::kYarnRope:
      return {"Qwen2ForCausalLM",
              "qwen2",
              64,
              128,
              2,
              4,
              2,
              0,
              256,
              10000.0,
              1e-6,
              false,
              true,
              false,
              512,
              false,
              TinyDims::Rope::kYarn};
    case TinyShape::kPhi3:
      // Phi-4's layout (GQA, theta 2.5e5, untied, no window) scaled down.
      return {"Phi3ForCausalLM",
              "phi3",
              64,
              128,
              2,
              4,
              2,
              0,
              256,
              250000.0,
              1e-5,
              false,
              false,
              false,
              512,
              false,
              TinyDims::Rope::kDefault,
              true};
    case TinyShape::kGemma2:
      // Gemma-2-9B's layout scaled down: head_dim 32 over hidden 64 with 4
      // heads, GQA, tied embeddings, eps 1e-6.
      return {"Gemma2ForCausalLM",
              "gemma2",
              64,
              128,
              2,
              4,
              2,
              32,
              256,
              10000.0,
              1e-6,
              true,
              false,
              false,
              512,
              false,
              TinyDims::Rope::kDefault,
              false,
              true};
    case TinyShape::kMistralWindow:
      // Mistral v0.1's layout (GQA, no biases, every layer windowed) with a
      // window of 8 tokens, so the tests' prompts and generations leave it.
      return {"MistralForCausalLM",
              "mistral",
              64,
              128,
              2,
              4,
              2,
              0,
              256,
              10000.0,
              1e-5,
              false,
              false,
              false};
    case TinyShape::kGemma3Multimodal: {
      TinyDims d = DimsFor(TinyShape::kGemma3);
      d.multimodal = true;
      return d;
    }
    case TinyShape::kQwen3_8B_4Layers: {
      TinyDims d = DimsFor(TinyShape::kQwen3);
      d.hidden = 4096;
      d.intermediate = 12288;
      d.layers = 4;
      d.heads = 32;
      d.kv_heads = 8;
      d.head_dim_override = 128;
      d.vocab = 151936;
      d.max_position_embeddings = 40960;
      return d;
    }
    case TinyShape::kGemma2_9B_4Layers: {
      TinyDims d = DimsFor(TinyShape::kGemma2);
      d.hidden = 3584;
      d.intermediate = 14336;
      d.layers = 4;
      d.heads = 16;
      d.kv_heads = 8;
      d.head_dim_override = 256;
      d.vocab = 256000;
      d.max_position_embeddings = 8192;
      d.gemma2_published = true;
      return d;
    }
    case TinyShape::kPhi4Mini: {
      TinyDims d = DimsFor(TinyShape::kPhi3);
      d.tied = true;
      d.rope = TinyDims::Rope::kLongrope;
      d.partial_rotary_factor = 0.75;
      return d;
    }
    case TinyShape::kGemma3: {
      // Gemma-3's text layout scaled down: Gemma 2's layer with q/k norms,
      // 3 layers (sliding, full, sliding), no caps.
      TinyDims d = DimsFor(TinyShape::kGemma2);
      d.architecture = "Gemma3ForCausalLM";
      d.model_type = "gemma3_text";
      d.layers = 3;
      d.rope_theta = 1000000.0;
      d.qk_norm = true;
      return d;
    }
  }
  return DimsFor(TinyShape::kGqa);
}

// llama3 scaling: with head_dim 16 and theta 5e5 the RoPE wavelengths are
// ~6, ~32, ~167, ... tokens; original context 64 with low/high factors 1/4
// puts them in all three regimes (kept < 16, smoothed 16..64, scaled > 64).
constexpr double kLlama3Factor = 8.0;
constexpr double kLlama3LowFreqFactor = 1.0;
constexpr double kLlama3HighFreqFactor = 4.0;
constexpr int64_t kLlama3OriginalMaxPositions = 64;

// Gemma 2's caps (50 and 30 in the 9B) scaled to the tiny model's scores
// and logits, which are a few units.
constexpr double kGemma2AttnSoftcap = 2.0;
constexpr double kGemma2FinalSoftcap = 3.0;
// Windows shorter than the tests' sequences (prompts of up to ~20 tokens,
// 8 to 32 generated), so the masks matter.
constexpr int64_t kGemma2Window = 16;
constexpr int64_t kMistralWindow = 8;

// linear: positions interpolated by 2.
constexpr double kLinearFactor = 2.0;
// yarn as Qwen2.5's long-context configs write it, scaled down: with
// head_dim 16, theta 1e4 and an original context of 128, the ramp runs over
// pairs 0..3 (pair 0 keeps its frequency, 1-2 blend, 3+ are interpolated);
// factor = max_position_embeddings / original, so every transformers
// version (some derive the factor from that ratio) agrees.
constexpr double kYarnFactor = 4.0;
constexpr int64_t kYarnOriginalMaxPositions = 128;

// longrope as Phi-4-mini writes it, scaled down: one factor per rotated pair
// (12 of head_dim 16 rotate: 6 pairs), the long ones growing with the
// wavelength as the published lists do; an original context of 32 under
// max_position_embeddings 512 gives an attention factor of sqrt(1 + ln 16 /
// ln 32) = 1.34, and the tests' max_model_len (128) runs the long list.
constexpr double kLongropeShortFactor[] = {1.0, 1.02, 1.05, 1.1, 1.3, 1.6};
constexpr double kLongropeLongFactor[] = {1.0, 1.5, 2.5, 5.0, 9.0, 16.0};
constexpr int64_t kLongropeOriginalMaxPositions = 32;

// splitmix64 (Steele, Lea, Flood 2014): tiny, fast, and fully specified, so
// the weights are the same on every platform and compiler.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1), on a 2^-23 grid (exact in float32).
  float UniformSymmetric() {
    const uint64_t top24 = Next() >> 40;
    return static_cast<float>(top24) / static_cast<float>(1 << 23) - 1.0f;
  }

 private:
  uint64_t state_;
};

enum class Init {
  kMatrix,      // uniform with std 1/sqrt(fan_in): activations stay O(1), so
                // attention is far from uniform and RoPE/GQA mistakes show up
  kNorm,        // 1 +- 0.1
  kNormOffset,  // +- 0.1: Gemma's w in x̂ * (1 + w)
  kBias,        // uniform with std 0.1
};

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  Init init;
};

// HF's tensor order (embeddings, layers in order, final norm, lm_head).
std::vector<TensorSpec> TensorsFor(const TinyDims& d) {
  const int64_t head_dim =
      d.head_dim_override > 0 ? d.head_dim_override : d.hidden / d.heads;
  const int64_t q_size = d.heads * head_dim;
  const int64_t kv_size = d.kv_heads * head_dim;
  std::vector<TensorSpec> specs;
  specs.push_back(
      {"model.embed_tokens.weight", {d.vocab, d.hidden}, Init::kMatrix});
  const Init norm = d.gemma2 ? Init::kNormOffset : Init::kNorm;
  for (int64_t layer = 0; layer < d.layers; ++layer) {
    const std::string p = absl::StrCat("model.layers.", layer, ".");
    specs.push_back({p + "input_layernorm.weight", {d.hidden}, norm});
    if (d.fused_projections) {
      specs.push_back({p + "self_attn.qkv_proj.weight",
                       {q_size + 2 * kv_size, d.hidden},
                       Init::kMatrix});
    } else {
      specs.push_back(
          {p + "self_attn.q_proj.weight", {q_size, d.hidden}, Init::kMatrix});
      specs.push_back(
          {p + "self_attn.k_proj.weight", {kv_size, d.hidden}, Init::kMatrix});
      specs.push_back(
          {p + "self_attn.v_proj.weight", {kv_size, d.hidden}, Init::kMatrix});
    }
    if (d.qkv_bias) {
      specs.push_back({p + "self_attn.q_proj.bias", {q_size}, Init::kBias});
      specs.push_back({p + "self_attn.k_proj.bias", {kv_size}, Init::kBias});
      specs.push_back({p + "self_attn.v_proj.bias", {kv_size}, Init::kBias});
    }
    specs.push_back(
        {p + "self_attn.o_proj.weight", {d.hidden, q_size}, Init::kMatrix});
    if (d.qk_norm) {
      specs.push_back({p + "self_attn.q_norm.weight", {head_dim}, norm});
      specs.push_back({p + "self_attn.k_norm.weight", {head_dim}, norm});
    }
    specs.push_back({p + "post_attention_layernorm.weight", {d.hidden}, norm});
    if (d.gemma2) {
      specs.push_back(
          {p + "pre_feedforward_layernorm.weight", {d.hidden}, norm});
      specs.push_back(
          {p + "post_feedforward_layernorm.weight", {d.hidden}, norm});
    }
    if (d.fused_projections) {
      specs.push_back({p + "mlp.gate_up_proj.weight",
                       {2 * d.intermediate, d.hidden},
                       Init::kMatrix});
    } else {
      specs.push_back({p + "mlp.gate_proj.weight",
                       {d.intermediate, d.hidden},
                       Init::kMatrix});
      specs.push_back({p + "mlp.up_proj.weight",
                       {d.intermediate, d.hidden},
                       Init::kMatrix});
    }
    specs.push_back({p + "mlp.down_proj.weight",
                     {d.hidden, d.intermediate},
                     Init::kMatrix});
  }
  specs.push_back({"model.norm.weight", {d.hidden}, norm});
  if (!d.tied) {
    specs.push_back({"lm_head.weight", {d.vocab, d.hidden}, Init::kMatrix});
  }
  if (d.multimodal) {
    for (TensorSpec& spec : specs) spec.name = "language_model." + spec.name;
    // Stand-ins for the towers pdworker leaves unread.
    specs.push_back({"multi_modal_projector.mm_input_projection_weight",
                     {8, d.hidden},
                     Init::kMatrix});
    specs.push_back(
        {"vision_tower.vision_model.embeddings.patch_embedding.weight",
         {8, 3, 2, 2},
         Init::kMatrix});
  }
  return specs;
}

// Each tensor has its own stream keyed by (seed, name), so values do not
// depend on which other tensors exist or on the write order.
std::vector<float> Generate(const TensorSpec& spec, uint64_t seed) {
  int64_t count = 1;
  for (const int64_t dim : spec.shape) count *= dim;
  SplitMix64 rng(Fnv1a64(spec.name) ^ (seed * 0xd1b54a32d192ed03ull));
  std::vector<float> values(static_cast<size_t>(count));
  // A uniform on [-a, a) has std a / sqrt(3).
  const float sqrt3 = std::sqrt(3.0f);
  for (float& value : values) {
    const float u = rng.UniformSymmetric();
    switch (spec.init) {
      case Init::kMatrix:
        value = u * sqrt3 / std::sqrt(static_cast<float>(spec.shape.back()));
        break;
      case Init::kNorm:
        value = 1.0f + 0.1f * u;
        break;
      case Init::kNormOffset:
        value = 0.1f * u;
        break;
      case Init::kBias:
        value = 0.1f * sqrt3 * u;
        break;
    }
  }
  return values;
}

}  // namespace

std::vector<TinyShape> AllTinyShapes() {
  return {TinyShape::kGqa,
          TinyShape::kTied,
          TinyShape::kQkvBias,
          TinyShape::kHeadDim,
          TinyShape::kLlama3Rope,
          TinyShape::kQwen3,
          TinyShape::kLinearRope,
          TinyShape::kYarnRope,
          TinyShape::kPhi3,
          TinyShape::kGemma2,
          TinyShape::kMistralWindow,
          TinyShape::kGemma3,
          TinyShape::kGemma3Multimodal,
          TinyShape::kPhi4Mini};
}

absl::string_view TinyShapeName(TinyShape shape) {
  switch (shape) {
    case TinyShape::kGqa:
      return "gqa";
    case TinyShape::kTied:
      return "tied";
    case TinyShape::kQkvBias:
      return "qkv_bias";
    case TinyShape::kHeadDim:
      return "head_dim";
    case TinyShape::kLlama3Rope:
      return "llama3_rope";
    case TinyShape::kSmall:
      return "small";
    case TinyShape::kLlama1B:
      return "llama_1b";
    case TinyShape::kLlama0p5B:
      return "llama_0p5b";
    case TinyShape::kHeadDim64:
      return "head_dim_64";
    case TinyShape::kQwen3:
      return "qwen3";
    case TinyShape::kLinearRope:
      return "linear_rope";
    case TinyShape::kYarnRope:
      return "yarn_rope";
    case TinyShape::kPhi3:
      return "phi3";
    case TinyShape::kGemma2:
      return "gemma2";
    case TinyShape::kMistralWindow:
      return "mistral_window";
    case TinyShape::kGemma3:
      return "gemma3";
    case TinyShape::kGemma3Multimodal:
      return "gemma3_multimodal";
    case TinyShape::kPhi4Mini:
      return "phi4_mini";
    case TinyShape::kQwen3_8B_4Layers:
      return "qwen3_8b_4layers";
    case TinyShape::kGemma2_9B_4Layers:
      return "gemma2_9b_4layers";
  }
  return "unknown";
}

absl::StatusOr<TinyShape> ParseTinyShape(absl::string_view name) {
  for (const TinyShape shape : AllTinyShapes()) {
    if (TinyShapeName(shape) == name) return shape;
  }
  for (const TinyShape shape :
       {TinyShape::kSmall, TinyShape::kLlama1B, TinyShape::kLlama0p5B,
        TinyShape::kHeadDim64, TinyShape::kQwen3_8B_4Layers,
        TinyShape::kGemma2_9B_4Layers}) {
    if (TinyShapeName(shape) == name) return shape;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown tiny model shape \"", name,
      "\"; known: gqa, tied, qkv_bias, head_dim, llama3_rope, qwen3, "
      "linear_rope, yarn_rope, phi3, gemma2, mistral_window, gemma3, "
      "gemma3_multimodal, phi4_mini, small, llama_1b, llama_0p5b, "
      "head_dim_64, qwen3_8b_4layers, gemma2_9b_4layers"));
}

std::string TinyModelConfigJson(const TinyModelOptions& options) {
  const TinyDims d = DimsFor(options.shape);
  Json config = {
      {"architectures", {d.architecture}},
      {"model_type", d.model_type},
      {"hidden_size", d.hidden},
      {"intermediate_size", d.intermediate},
      {"num_hidden_layers", d.layers},
      {"num_attention_heads", d.heads},
      {"num_key_value_heads", d.kv_heads},
      {"vocab_size", d.vocab},
      {"max_position_embeddings", options.max_position_embeddings > 0
                                      ? options.max_position_embeddings
                                      : d.max_position_embeddings},
      {"rms_norm_eps", d.rms_norm_eps},
      {"rope_theta", d.rope_theta},
      {"hidden_act", "silu"},
      {"tie_word_embeddings", d.tied},
      {"torch_dtype", absl::StrCat(DTypeName(options.dtype))},
      {"bos_token_id", 1},
      {"eos_token_id", 2},
      {"rope_scaling", nullptr},
  };
  if (d.head_dim_override > 0) config["head_dim"] = d.head_dim_override;
  // Qwen2 has no attention_bias field (its q/k/v biases are implied).
  if (!d.qkv_bias) config["attention_bias"] = false;
  if (d.qk_norm) {
    // The rest of Qwen3's published config.json keys (Qwen3-8B's, with this
    // shape's sizes); no window.
    config["use_sliding_window"] = false;
    config["sliding_window"] = nullptr;
    config["max_window_layers"] = d.layers;
    config["attention_dropout"] = 0.0;
  }
  if (d.llama3_rope) {
    config["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", kLlama3Factor},
        {"low_freq_factor", kLlama3LowFreqFactor},
        {"high_freq_factor", kLlama3HighFreqFactor},
        {"original_max_position_embeddings", kLlama3OriginalMaxPositions},
    };
  }
  if (d.fused_projections) {
    // The rest of Phi-4's published config.json keys.
    config["original_max_position_embeddings"] = d.max_position_embeddings;
    config["sliding_window"] = nullptr;
    config["embd_pdrop"] = 0.0;
    config["resid_pdrop"] = 0.0;
    config["attention_dropout"] = 0.0;
  }
  if (d.gemma2) {
    // Gemma-2-9B's keys; caps small enough that tanh bends the tiny model's
    // scores and logits, a window shorter than the tests' sequences.
    config["hidden_act"] = "gelu_pytorch_tanh";
    config["hidden_activation"] = "gelu_pytorch_tanh";
    config["query_pre_attn_scalar"] = 24;
    config["attn_logit_softcapping"] = kGemma2AttnSoftcap;
    config["final_logit_softcapping"] = kGemma2FinalSoftcap;
    config["sliding_window"] = kGemma2Window;
    if (d.gemma2_published) {
      config["query_pre_attn_scalar"] = 256;
      config["attn_logit_softcapping"] = 50.0;
      config["final_logit_softcapping"] = 30.0;
      config["sliding_window"] = 4096;
    }
    config["cache_implementation"] = "hybrid";
    config["attention_dropout"] = 0.0;
  }
  if (options.shape == TinyShape::kGemma3 ||
      options.shape == TinyShape::kGemma3Multimodal) {
    // Gemma 3 4B's keys: no caps, the local layers' base beside a linearly
    // scaled global RoPE, one full layer in every two.
    config["attn_logit_softcapping"] = nullptr;
    config["final_logit_softcapping"] = nullptr;
    config["rope_local_base_freq"] = 10000.0;
    config["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
    config["sliding_window_pattern"] = 2;
  }
  if (options.shape == TinyShape::kMistralWindow) {
    config["sliding_window"] = kMistralWindow;
  }
  if (d.rope == TinyDims::Rope::kLinear) {
    config["rope_scaling"] = {{"rope_type", "linear"},
                              {"factor", kLinearFactor}};
  }
  if (d.rope == TinyDims::Rope::kYarn) {
    // Qwen2.5's spelling ("type", as its model card tells users to add).
    config["rope_scaling"] = {
        {"type", "yarn"},
        {"factor", kYarnFactor},
        {"original_max_position_embeddings", kYarnOriginalMaxPositions}};
  }
  if (d.rope == TinyDims::Rope::kLongrope) {
    // Phi-4-mini's spelling: "type", the original context at the top level.
    config["rope_scaling"] = {{"type", "longrope"},
                              {"short_factor", kLongropeShortFactor},
                              {"long_factor", kLongropeLongFactor}};
    config["original_max_position_embeddings"] = kLongropeOriginalMaxPositions;
  }
  if (d.partial_rotary_factor != 1.0) {
    config["partial_rotary_factor"] = d.partial_rotary_factor;
  }
  if (d.multimodal) {
    // Gemma 3 4B's layout: the text model's keys under text_config, the
    // token ids and dtype at the top level only.
    Json text = config;
    for (const char* key :
         {"architectures", "torch_dtype", "bos_token_id", "eos_token_id"}) {
      text.erase(key);
    }
    config = {
        {"architectures", {"Gemma3ForConditionalGeneration"}},
        {"model_type", "gemma3"},
        {"text_config", text},
        {"vision_config",
         {{"model_type", "siglip_vision_model"}, {"hidden_size", 8}}},
        {"mm_tokens_per_image", 4},
        {"image_token_index", 255},
        {"bos_token_id", 1},
        {"eos_token_id", 2},
        {"torch_dtype", config["torch_dtype"]},
    };
  }
  return config.dump(2) + "\n";
}

absl::Status WriteTinyModel(const TinyModelOptions& options,
                            const std::string& out_dir) {
  const TinyDims dims = DimsFor(options.shape);
  const std::vector<TensorSpec> specs = TensorsFor(dims);
  const int64_t num_tensors = static_cast<int64_t>(specs.size());
  if (options.num_shards < 1 || options.num_shards > num_tensors) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shards=", options.num_shards, " must be in [1, ", num_tensors,
        "] for shape ", TinyShapeName(options.shape)));
  }
  std::error_code error;
  std::filesystem::create_directories(out_dir, error);
  if (error) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create ", out_dir, ": ", error.message()));
  }
  if (absl::Status status = WriteStringToFile(
          absl::StrCat(out_dir, "/config.json"), TinyModelConfigJson(options));
      !status.ok()) {
    return status;
  }

  const int shards = options.num_shards;
  std::vector<SafetensorsWriter> writers(static_cast<size_t>(shards));
  std::vector<std::string> file_names;
  for (int i = 0; i < shards; ++i) {
    file_names.push_back(
        shards == 1
            ? std::string("model.safetensors")
            : absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, shards));
    writers[static_cast<size_t>(i)].SetMetadata("format", "pt");
  }
  Json weight_map = Json::object();
  uint64_t total_size = 0;
  for (int64_t t = 0; t < num_tensors; ++t) {
    // Contiguous split: tensor t goes to shard floor(t * shards / tensors),
    // so every shard gets at least one tensor.
    const size_t shard = static_cast<size_t>(t * shards / num_tensors);
    const TensorSpec& spec = specs[static_cast<size_t>(t)];
    if (absl::Status status = writers[shard].Add(
            spec.name, options.dtype, spec.shape, Generate(spec, options.seed));
        !status.ok()) {
      return status;
    }
    weight_map[spec.name] = file_names[shard];
  }
  for (int i = 0; i < shards; ++i) {
    total_size += writers[static_cast<size_t>(i)].data_bytes();
    if (absl::Status status = writers[static_cast<size_t>(i)].WriteToFile(
            absl::StrCat(out_dir, "/", file_names[static_cast<size_t>(i)]));
        !status.ok()) {
      return status;
    }
  }
  // A stale file of the other layout would shadow (or confuse) this one.
  const std::string single = absl::StrCat(out_dir, "/model.safetensors");
  const std::string index =
      absl::StrCat(out_dir, "/model.safetensors.index.json");
  if (shards == 1) {
    std::filesystem::remove(index, error);
    return absl::OkStatus();
  }
  std::filesystem::remove(single, error);
  const Json index_json = {
      {"metadata", {{"total_size", total_size}}},
      {"weight_map", weight_map},
  };
  return WriteStringToFile(index, index_json.dump(2) + "\n");
}

}  // namespace pdworker
