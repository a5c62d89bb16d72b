// ParseModelConfig / LoadModelConfig: real published configs, the tiny
// shapes, defaults, and a table of invalid configs whose errors must name the
// offending field; Fingerprint stability and sensitivity.
#include "worker/model/model_config.h"

#include <cmath>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/model/config_layouts.h"
#include "tests/model/test_paths.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace pdworker {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

// meta-llama/Llama-3.1-8B config.json as published.
constexpr char kLlama31Config[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// Qwen/Qwen2-0.5B config.json as published.
constexpr char kQwen2Config[] = R"({
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151643,
  "hidden_act": "silu",
  "hidden_size": 896,
  "initializer_range": 0.02,
  "intermediate_size": 4864,
  "max_position_embeddings": 131072,
  "max_window_layers": 24,
  "model_type": "qwen2",
  "num_attention_heads": 14,
  "num_hidden_layers": 24,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 131072,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.1",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// mistralai/Mistral-7B-v0.1 config.json as published.
constexpr char kMistralConfig[] = R"({
  "architectures": ["MistralForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "sliding_window": 4096,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.34.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
})";

ModelConfig ParseOrDie(const std::string& text) {
  auto config = ParseModelConfig(text);
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *config : ModelConfig();
}

TEST(ModelConfigTest, ParsesLlama31) {
  const ModelConfig c = ParseOrDie(kLlama31Config);
  EXPECT_EQ(c.architecture, Architecture::kLlama);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 14336);
  EXPECT_EQ(c.num_hidden_layers, 32);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.num_queries_per_kv(), 4);
  EXPECT_EQ(c.q_size(), 4096);
  EXPECT_EQ(c.kv_size(), 1024);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.layer.qkv_bias);
  EXPECT_FALSE(c.layer.o_proj_bias);
  EXPECT_EQ(c.torch_dtype, DType::kBFloat16);
  EXPECT_EQ(c.bos_token_id, 128000);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));
  EXPECT_FALSE(c.sliding_window.has_value());
}

TEST(ModelConfigTest, ParsesQwen2WithImpliedQkvBias) {
  const ModelConfig c = ParseOrDie(kQwen2Config);
  EXPECT_EQ(c.architecture, Architecture::kQwen2);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_TRUE(c.layer.qkv_bias);
  EXPECT_FALSE(c.layer.o_proj_bias);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kNone);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  // use_sliding_window is false: the window does not apply.
  EXPECT_FALSE(c.sliding_window.has_value());
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{151643});
}

TEST(ModelConfigTest, ParsesMistralWithSlidingWindow) {
  const ModelConfig c = ParseOrDie(kMistralConfig);
  EXPECT_EQ(c.architecture, Architecture::kMistral);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_FALSE(c.layer.qkv_bias);
  EXPECT_EQ(c.head_dim, 128);
}

TEST(ModelConfigTest, ParsesEveryTinyShape) {
  for (const TinyShape shape : AllTinyShapes()) {
    SCOPED_TRACE(TinyShapeName(shape));
    TinyModelOptions options;
    options.shape = shape;
    options.dtype = DType::kBFloat16;
    const ModelConfig c = ParseOrDie(TinyModelConfigJson(options));
    EXPECT_EQ(c.torch_dtype, DType::kBFloat16);
    EXPECT_EQ(c.hidden_size, 64);
    EXPECT_EQ(c.max_position_embeddings, 512);
    switch (shape) {
      case TinyShape::kGqa:
        EXPECT_EQ(c.num_attention_heads, 8);
        EXPECT_EQ(c.num_key_value_heads, 2);
        EXPECT_EQ(c.head_dim, 8);
        break;
      case TinyShape::kTied:
        EXPECT_TRUE(c.tie_word_embeddings);
        break;
      case TinyShape::kQkvBias:
        EXPECT_EQ(c.architecture, Architecture::kQwen2);
        EXPECT_TRUE(c.layer.qkv_bias);
        EXPECT_FALSE(c.layer.o_proj_bias);
        break;
      case TinyShape::kHeadDim:
        EXPECT_EQ(c.head_dim, 32);
        EXPECT_NE(c.head_dim, c.hidden_size / c.num_attention_heads);
        EXPECT_EQ(c.q_size(), 128);
        break;
      case TinyShape::kLlama3Rope:
        EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kLlama3);
        EXPECT_LT(c.rope_scaling.original_max_position_embeddings,
                  c.max_position_embeddings);
        break;
      case TinyShape::kQwen3:
        EXPECT_EQ(c.architecture, Architecture::kQwen3);
        EXPECT_EQ(c.layer.qk_norm, QkNorm::kPerHeadRms);
        EXPECT_FALSE(c.layer.qkv_bias);
        EXPECT_EQ(c.head_dim, 32);
        EXPECT_FALSE(c.sliding_window.has_value());
        break;
      case TinyShape::kLinearRope:
        EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kLinear);
        EXPECT_EQ(c.rope_scaling.factor, 2.0);
        break;
      case TinyShape::kYarnRope:
        EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kYarn);
        EXPECT_EQ(c.rope_scaling.factor, 4.0);
        EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 128);
        EXPECT_DOUBLE_EQ(c.rope_scaling.attention_factor,
                         0.1 * std::log(4.0) + 1.0);
        break;
      case TinyShape::kPhi3:
        EXPECT_EQ(c.architecture, Architecture::kPhi3);
        EXPECT_EQ(c.layer.qkv_tensors, ProjectionTensors::kFused);
        EXPECT_EQ(c.layer.gate_up_tensors, ProjectionTensors::kFused);
        EXPECT_FALSE(c.layer.qkv_bias);
        EXPECT_FALSE(c.sliding_window.has_value());
        break;
      case TinyShape::kGemma2:
        EXPECT_EQ(c.architecture, Architecture::kGemma2);
        EXPECT_EQ(c.layer.norm_placement, NormPlacement::kSandwich);
        EXPECT_EQ(c.layer.norm_weight, NormWeight::kOnePlus);
        EXPECT_EQ(c.layer.activation, MlpActivation::kGeluTanh);
        EXPECT_EQ(c.layer.query_pre_attn_scalar, 24);
        EXPECT_GT(c.layer.attn_logit_softcapping, 0);
        EXPECT_GT(c.final_logit_softcapping, 0);
        EXPECT_EQ(c.embedding_multiplier, 8.0);  // sqrt(64)
        EXPECT_EQ(c.sliding_window, 16);
        EXPECT_EQ(c.sliding_layers, (std::vector<bool>{true, false}));
        break;
      case TinyShape::kGemma3:
        EXPECT_EQ(c.architecture, Architecture::kGemma3);
        EXPECT_EQ(c.layer.qk_norm, QkNorm::kPerHeadRms);
        EXPECT_EQ(c.layer.norm_placement, NormPlacement::kSandwich);
        EXPECT_EQ(c.layer.attn_logit_softcapping, 0);
        EXPECT_EQ(c.final_logit_softcapping, 0);
        EXPECT_EQ(c.local_rope_theta, 10000.0);
        EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kLinear);
        EXPECT_EQ(c.sliding_layers, (std::vector<bool>{true, false, true}));
        break;
      case TinyShape::kGemma3Multimodal:
        EXPECT_EQ(c.architecture, Architecture::kGemma3);
        EXPECT_EQ(c.tensor_prefix, "language_model.");
        EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{2});
        EXPECT_EQ(c.sliding_layers, (std::vector<bool>{true, false, true}));
        break;
      case TinyShape::kPhi4Mini:
        EXPECT_EQ(c.architecture, Architecture::kPhi3);
        EXPECT_EQ(c.head_dim, 16);
        EXPECT_EQ(c.RotaryDim(), 12);
        EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kLongrope);
        EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 32);
        EXPECT_EQ(c.rope_scaling.short_factor.size(), 6u);
        EXPECT_EQ(c.rope_scaling.long_factor.size(), 6u);
        // sqrt(1 + ln(512 / 32) / ln(32)), transformers' default.
        EXPECT_DOUBLE_EQ(c.rope_scaling.attention_factor,
                         std::sqrt(1 + std::log(16.0) / std::log(32.0)));
        EXPECT_FALSE(c.rope_scaling.long_factor_active)
            << "the runner picks the list from max_model_len";
        break;
      case TinyShape::kMistralWindow:
        EXPECT_EQ(c.architecture, Architecture::kMistral);
        EXPECT_EQ(c.sliding_window, 8);
        EXPECT_EQ(c.sliding_layers, (std::vector<bool>{true, true}));
        break;
      case TinyShape::kSmall:
      case TinyShape::kLlama1B:
      case TinyShape::kLlama0p5B:
      case TinyShape::kHeadDim64:
        ADD_FAILURE() << "benchmark and GPU-only shapes are not part of "
                         "AllTinyShapes()";
        break;
    }
  }
}

// The Llama-3.2-1B shape as transformers 5 save_pretrained writes it: RoPE
// base and scaling inside "rope_parameters", "dtype", no top-level
// rope_theta. Reading only the old fields would silently give theta 10000.
constexpr char kTransformers5Config[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "dtype": "bfloat16",
  "eos_token_id": 128001,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rope_type": "llama3"
  },
  "tie_word_embeddings": true,
  "transformers_version": "5.17.0",
  "use_cache": true,
  "vocab_size": 128256
})";

TEST(ModelConfigTest, ParsesTransformers5RopeParameters) {
  const ModelConfig c = ParseOrDie(kTransformers5Config);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(c.torch_dtype, DType::kBFloat16);
  EXPECT_TRUE(c.tie_word_embeddings);

  // "default" RoPE in the new layout: the base from rope_parameters.
  Json j = Json::parse(kTransformers5Config);
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}};
  const ModelConfig d = ParseOrDie(j.dump());
  EXPECT_DOUBLE_EQ(d.rope_theta, 1e6);
  EXPECT_EQ(d.rope_scaling.type, RopeScalingType::kNone);

  // Both layouts present and agreeing (configs converted by hand) is fine;
  // a rope_parameters without rope_theta keeps the top-level one.
  j["rope_theta"] = 1e6;
  j["rope_scaling"] = nullptr;
  EXPECT_DOUBLE_EQ(ParseOrDie(j.dump()).rope_theta, 1e6);
  j["rope_parameters"].erase("rope_theta");
  j["rope_theta"] = 250000.0;
  EXPECT_DOUBLE_EQ(ParseOrDie(j.dump()).rope_theta, 250000.0);
}

// The same model written by transformers 4 and 5 is the same model: equal
// canonical strings (so equal fingerprints, so KV handoffs between a worker
// loading either layout are allowed) and equal storage dtype.
// The benchmark shapes by name (make_tiny_model --shape, gpu_decode_bench
// --shape), with the sizes bench/torch_compare/configs.py gives the same
// models (the 1B one's llama3 RoPE scaling aside: plain RoPE here): other
// sizes would make the pdworker-only figures incomparable with the torch
// ones.
TEST(ModelConfigTest, BenchmarkShapesParseByNameWithTheirDimensions) {
  struct Want {
    const char* name;
    int64_t hidden, intermediate, layers, heads, kv_heads, head_dim, vocab;
    double rope_theta, eps;
    int64_t max_positions;
  };
  for (const Want& w : {Want{"llama_1b", 2048, 8192, 16, 32, 8, 64, 128256,
                             500000.0, 1e-5, 131072},
                        Want{"llama_0p5b", 896, 4864, 24, 14, 2, 64, 151936,
                             1000000.0, 1e-6, 32768}}) {
    SCOPED_TRACE(w.name);
    absl::StatusOr<TinyShape> shape = ParseTinyShape(w.name);
    ASSERT_TRUE(shape.ok()) << shape.status();
    EXPECT_EQ(TinyShapeName(*shape), w.name);
    TinyModelOptions options;
    options.shape = *shape;
    options.dtype = DType::kBFloat16;
    const ModelConfig c = ParseOrDie(TinyModelConfigJson(options));
    EXPECT_EQ(c.architecture, Architecture::kLlama);
    EXPECT_EQ(c.hidden_size, w.hidden);
    EXPECT_EQ(c.intermediate_size, w.intermediate);
    EXPECT_EQ(c.num_hidden_layers, w.layers);
    EXPECT_EQ(c.num_attention_heads, w.heads);
    EXPECT_EQ(c.num_key_value_heads, w.kv_heads);
    EXPECT_EQ(c.head_dim, w.head_dim);
    EXPECT_EQ(c.vocab_size, w.vocab);
    EXPECT_TRUE(c.tie_word_embeddings);
    EXPECT_FALSE(c.layer.qkv_bias);
    EXPECT_DOUBLE_EQ(c.rope_theta, w.rope_theta);
    EXPECT_DOUBLE_EQ(c.rms_norm_eps, w.eps);
    EXPECT_EQ(c.max_position_embeddings, w.max_positions);
  }
  EXPECT_FALSE(ParseTinyShape("llama_0p5").ok());
}

// The GPU tests' shape for the kernels that need head_dim 64 (tensor-core
// decode attention, decode megakernel): a Qwen2 with biases whose rows end
// inside a 256-element load chunk.
TEST(ModelConfigTest, HeadDim64ShapeParsesByName) {
  absl::StatusOr<TinyShape> shape = ParseTinyShape("head_dim_64");
  ASSERT_TRUE(shape.ok()) << shape.status();
  TinyModelOptions options;
  options.shape = *shape;
  options.dtype = DType::kBFloat16;
  const ModelConfig c = ParseOrDie(TinyModelConfigJson(options));
  EXPECT_EQ(c.architecture, Architecture::kQwen2);
  EXPECT_TRUE(c.layer.qkv_bias);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.num_attention_heads, 3);
  EXPECT_EQ(c.num_key_value_heads, 1);
  EXPECT_NE(c.hidden_size % 256, 0);
  EXPECT_NE(c.intermediate_size % 256, 0);
}

TEST(ModelConfigTest, Transformers5LayoutEqualsTransformers4Layout) {
  std::vector<std::pair<std::string, std::string>> configs = {
      {"llama31", kLlama31Config},
      {"qwen2", kQwen2Config},
      {"mistral", kMistralConfig}};
  for (const TinyShape shape : AllTinyShapes()) {
    TinyModelOptions options;
    options.shape = shape;
    options.dtype = DType::kBFloat16;
    configs.push_back(
        {std::string(TinyShapeName(shape)), TinyModelConfigJson(options)});
  }
  for (const auto& [name, text] : configs) {
    SCOPED_TRACE(name);
    const ModelConfig old_layout = ParseOrDie(text);
    const ModelConfig new_layout = ParseOrDie(
        model_testing::ToTransformers5Layout(Json::parse(text)).dump());
    EXPECT_EQ(new_layout.CanonicalString(), old_layout.CanonicalString());
    EXPECT_EQ(new_layout.torch_dtype, old_layout.torch_dtype);
  }
}

// A minimal valid config for the invalid-config table to mutate.
Json BaseConfig() {
  return Json{{"architectures", {"LlamaForCausalLM"}},
              {"hidden_size", 64},
              {"intermediate_size", 128},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 8},
              {"num_key_value_heads", 2},
              {"rms_norm_eps", 1e-5},
              {"vocab_size", 256},
              {"max_position_embeddings", 512}};
}

TEST(ModelConfigTest, DefaultsMatchTransformers) {
  Json j = BaseConfig();
  j.erase("num_key_value_heads");
  const ModelConfig c = ParseOrDie(j.dump());
  EXPECT_EQ(c.num_key_value_heads, 8);  // = num_attention_heads
  EXPECT_EQ(c.head_dim, 8);             // = hidden / heads
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kNone);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.layer.qkv_bias);
  EXPECT_EQ(c.torch_dtype, DType::kFloat32);

  // Explicit nulls mean "unset", and "dtype" is the newer name of torch_dtype.
  j["head_dim"] = nullptr;
  j["rope_scaling"] = nullptr;
  j["dtype"] = "float16";
  j["attention_bias"] = true;
  const ModelConfig d = ParseOrDie(j.dump());
  EXPECT_EQ(d.head_dim, 8);
  EXPECT_EQ(d.torch_dtype, DType::kFloat16);
  // Llama's attention_bias covers o_proj too.
  EXPECT_TRUE(d.layer.qkv_bias);
  EXPECT_TRUE(d.layer.o_proj_bias);

  // Older configs spell rope_scaling's type "type"; "default" means none.
  j["rope_scaling"] = {{"type", "default"}};
  EXPECT_EQ(ParseOrDie(j.dump()).rope_scaling.type, RopeScalingType::kNone);
}

struct InvalidCase {
  const char* name;
  std::function<void(Json&)> mutate;
  std::vector<const char*> expected;  // substrings of the message
};

std::vector<InvalidCase> InvalidCases() {
  const auto remove = [](const char* field) {
    return [field](Json& j) { j.erase(field); };
  };
  const auto set = [](const char* field, const Json& value) {
    return [field, value](Json& j) { j[field] = value; };
  };
  const Json llama3 = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 64}};
  const auto llama3_without = [llama3](const char* field) {
    return [llama3, field](Json& j) {
      j["rope_scaling"] = llama3;
      j["rope_scaling"].erase(field);
    };
  };
  std::vector<InvalidCase> cases = {
      {"missing_hidden_size",
       remove("hidden_size"),
       {"hidden_size", "missing"}},
      {"missing_intermediate_size",
       remove("intermediate_size"),
       {"intermediate_size", "missing"}},
      {"missing_layers",
       remove("num_hidden_layers"),
       {"num_hidden_layers", "missing"}},
      {"missing_heads",
       remove("num_attention_heads"),
       {"num_attention_heads", "missing"}},
      {"missing_vocab", remove("vocab_size"), {"vocab_size", "missing"}},
      {"missing_max_positions",
       remove("max_position_embeddings"),
       {"max_position_embeddings", "missing"}},
      {"missing_eps", remove("rms_norm_eps"), {"rms_norm_eps", "missing"}},
      {"null_hidden_size", set("hidden_size", nullptr), {"hidden_size"}},
      {"missing_architectures",
       remove("architectures"),
       {"architectures", "missing"}},
      {"unsupported_architecture",
       set("architectures", {"GPT2LMHeadModel"}),
       {"architectures", "GPT2LMHeadModel", "LlamaForCausalLM",
        "Qwen2ForCausalLM", "MistralForCausalLM"}},
      {"architectures_not_list",
       set("architectures", "LlamaForCausalLM"),
       {"architectures", "list"}},
      {"unsupported_rope_mrope",
       set("rope_scaling", {{"rope_type", "mrope"}, {"factor", 4.0}}),
       {"rope_scaling.rope_type", "mrope", "llama3, linear, yarn, dynamic"}},
      {"dynamic_factor_below_one",
       set("rope_scaling", {{"rope_type", "dynamic"}, {"factor", 0.5}}),
       {"rope_scaling.factor", "at least 1"}},
      {"longrope_old_key_without_factors",
       set("rope_scaling", {{"type", "longrope"}, {"factor", 2.0}}),
       {"rope_scaling.short_factor", "missing"}},
      {"longrope_lists_of_different_lengths",
       set("rope_scaling", {{"type", "longrope"},
                            {"short_factor", {1.0, 1.0, 1.0, 1.0}},
                            {"long_factor", {1.0, 2.0}}}),
       {"rope_scaling.long_factor", "2 entries", "short_factor 4"}},
      {"longrope_list_not_one_per_pair",
       set("rope_scaling", {{"type", "su"},
                            {"short_factor", {1.0, 1.0}},
                            {"long_factor", {1.0, 2.0}}}),
       {"rope_scaling.short_factor", "2 entries", "4 pairs"}},
      {"longrope_factor_not_positive",
       set("rope_scaling", {{"type", "longrope"},
                            {"short_factor", {1.0, 1.0, 1.0, 1.0}},
                            {"long_factor", {1.0, 2.0, 0.0, 4.0}}}),
       {"rope_scaling.long_factor[2]", "positive"}},
      {"longrope_mscale",
       set("rope_scaling", {{"type", "longrope"},
                            {"short_factor", {1.0, 1.0, 1.0, 1.0}},
                            {"long_factor", {1.0, 2.0, 3.0, 4.0}},
                            {"short_mscale", 1.2}}),
       {"rope_scaling.short_mscale", "not supported"}},
      {"partial_rotary_factor_above_one",
       set("partial_rotary_factor", 1.5),
       {"partial_rotary_factor", "(0, 1]"}},
      {"partial_rotary_factor_odd",
       set("partial_rotary_factor", 0.375),
       {"partial_rotary_factor", "even", "got 3"}},
      {"linear_without_factor",
       set("rope_scaling", {{"rope_type", "linear"}}),
       {"rope_scaling.factor", "missing"}},
      {"linear_zero_factor",
       set("rope_scaling", {{"rope_type", "linear"}, {"factor", 0.0}}),
       {"rope_scaling.factor", "positive"}},
      {"yarn_factor_below_one",
       set("rope_scaling", {{"rope_type", "yarn"}, {"factor", 0.5}}),
       {"rope_scaling.factor", "at least 1"}},
      {"yarn_betas_reversed",
       set("rope_scaling", {{"rope_type", "yarn"},
                            {"factor", 4.0},
                            {"beta_fast", 1.0},
                            {"beta_slow", 32.0}}),
       {"rope_scaling.beta_fast", "beta_slow"}},
      {"yarn_bad_original",
       set("rope_scaling", {{"rope_type", "yarn"},
                            {"factor", 4.0},
                            {"original_max_position_embeddings", -5}}),
       {"rope_scaling.original_max_position_embeddings", "positive"}},
      {"yarn_zero_attention_factor",
       set("rope_scaling",
           {{"rope_type", "yarn"}, {"factor", 4.0}, {"attention_factor", 0.0}}),
       {"rope_scaling.attention_factor", "positive"}},
      {"rope_scaling_without_type",
       set("rope_scaling", {{"factor", 2.0}}),
       {"rope_scaling.rope_type", "missing"}},
      {"rope_scaling_not_object",
       set("rope_scaling", "llama3"),
       {"rope_scaling"}},
      {"llama3_missing_factor",
       llama3_without("factor"),
       {"rope_scaling.factor", "missing"}},
      {"llama3_missing_original",
       llama3_without("original_max_position_embeddings"),
       {"rope_scaling.original_max_position_embeddings"}},
      {"llama3_high_not_above_low",
       [llama3](Json& j) {
         j["rope_scaling"] = llama3;
         j["rope_scaling"]["high_freq_factor"] = 1.0;
       },
       {"rope_scaling.high_freq_factor"}},
      {"heads_not_multiple_of_kv",
       set("num_key_value_heads", 3),
       {"num_attention_heads", "num_key_value_heads", "multiple"}},
      {"hidden_size_string",
       set("hidden_size", "64"),
       {"hidden_size", "integer", "string"}},
      {"hidden_size_fractional",
       set("hidden_size", 64.5),
       {"hidden_size", "integer"}},
      {"kv_heads_bool",
       set("num_key_value_heads", true),
       {"num_key_value_heads", "integer"}},
      {"head_dim_string", set("head_dim", "x"), {"head_dim", "integer"}},
      {"eps_string", set("rms_norm_eps", "1e-5"), {"rms_norm_eps", "number"}},
      {"theta_bool", set("rope_theta", true), {"rope_theta", "number"}},
      {"tie_string",
       set("tie_word_embeddings", "yes"),
       {"tie_word_embeddings", "boolean"}},
      {"attention_bias_int",
       set("attention_bias", 1),
       {"attention_bias", "boolean"}},
      {"torch_dtype_number", set("torch_dtype", 16), {"torch_dtype", "string"}},
      {"torch_dtype_unknown",
       set("torch_dtype", "int8"),
       {"torch_dtype", "int8", "bfloat16"}},
      {"hidden_act_gelu", set("hidden_act", "gelu"), {"hidden_act", "gelu"}},
      {"mlp_bias", set("mlp_bias", true), {"mlp_bias"}},
      {"mistral_attention_bias",
       [](Json& j) {
         j["architectures"] = {"MistralForCausalLM"};
         j["attention_bias"] = true;
       },
       {"attention_bias", "MistralForCausalLM"}},
      {"zero_hidden_size", set("hidden_size", 0), {"hidden_size", "positive"}},
      {"negative_layers",
       set("num_hidden_layers", -1),
       {"num_hidden_layers", "positive"}},
      {"zero_heads", set("num_attention_heads", 0), {"num_attention_heads"}},
      {"zero_vocab", set("vocab_size", 0), {"vocab_size", "positive"}},
      {"odd_head_dim", set("head_dim", 15), {"head_dim", "even"}},
      {"hidden_not_divisible_without_head_dim",
       set("num_attention_heads", 6),
       {"head_dim", "hidden_size", "num_attention_heads"}},
      {"zero_eps", set("rms_norm_eps", 0), {"rms_norm_eps", "positive"}},
      {"negative_theta", set("rope_theta", -1.0), {"rope_theta", "positive"}},
      {"rope_parameters_not_object",
       set("rope_parameters", 10000.0),
       {"rope_parameters", "object"}},
      {"rope_parameters_unknown_layer_type",
       set("rope_parameters",
           {{"full_attention", {{"rope_type", "default"}, {"rope_theta", 1e6}}},
            {"chunked_attention",
             {{"rope_type", "default"}, {"rope_theta", 1e4}}}}),
       {"rope_parameters.chunked_attention", "layer type"}},
      {"rope_parameters_without_full_attention",
       set("rope_parameters",
           {{"sliding_attention",
             {{"rope_type", "default"}, {"rope_theta", 1e4}}}}),
       {"rope_parameters.full_attention", "missing"}},
      {"rope_parameters_scaled_sliding_layers",
       set("rope_parameters",
           {{"full_attention", {{"rope_type", "default"}, {"rope_theta", 1e6}}},
            {"sliding_attention",
             {{"rope_type", "linear"}, {"factor", 2.0}, {"rope_theta", 1e4}}}}),
       {"rope_parameters.sliding_attention.rope_type", "default"}},
      {"rope_parameters_without_type",
       set("rope_parameters", {{"rope_theta", 1e6}}),
       {"rope_parameters.rope_type", "missing"}},
      {"rope_parameters_longrope",
       set("rope_parameters",
           {{"rope_type", "longrope"}, {"rope_theta", 1e6}, {"factor", 4.0}}),
       {"rope_parameters.short_factor", "missing"}},
      {"rope_parameters_yarn_below_one",
       set("rope_parameters",
           {{"rope_type", "yarn"}, {"rope_theta", 1e6}, {"factor", 0.25}}),
       {"rope_parameters.factor", "at least 1"}},
      {"rope_parameters_llama3_without_factor",
       [llama3](Json& j) {
         j["rope_parameters"] = llama3;
         j["rope_parameters"].erase("factor");
       },
       {"rope_parameters.factor", "missing"}},
      {"rope_parameters_theta_string",
       set("rope_parameters",
           {{"rope_type", "default"}, {"rope_theta", "1e6"}}),
       {"rope_parameters.rope_theta", "number"}},
      {"rope_theta_disagrees_with_rope_parameters",
       [](Json& j) {
         j["rope_theta"] = 10000.0;
         j["rope_parameters"] = {{"rope_type", "default"},
                                 {"rope_theta", 500000.0}};
       },
       {"rope_theta", "10000", "500000", "disagrees"}},
      {"rope_scaling_disagrees_with_rope_parameters",
       [llama3](Json& j) {
         j["rope_scaling"] = llama3;
         j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e4}};
       },
       {"rope_scaling", "disagrees", "rope_parameters"}},
      {"negative_theta_in_rope_parameters",
       set("rope_parameters", {{"rope_type", "default"}, {"rope_theta", -1.0}}),
       {"rope_theta", "positive"}},
      {"huge_unsigned",
       set("vocab_size", 18446744073709551615ull),
       {"vocab_size", "out of range"}},
      {"eos_string", set("eos_token_id", "2"), {"eos_token_id"}},
  };
  return cases;
}

TEST(ModelConfigTest, InvalidConfigsNameTheField) {
  for (const InvalidCase& c : InvalidCases()) {
    SCOPED_TRACE(c.name);
    Json j = BaseConfig();
    c.mutate(j);
    auto config = ParseModelConfig(j.dump());
    ASSERT_FALSE(config.ok()) << c.name << " was accepted: " << j.dump();
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    for (const char* expected : c.expected) {
      EXPECT_THAT(std::string(config.status().message()), HasSubstr(expected));
    }
  }
}

TEST(ModelConfigTest, NotJsonOrNotObject) {
  auto bad = ParseModelConfig("{\"hidden_size\": ");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("JSON"));
  auto list = ParseModelConfig("[1, 2]");
  ASSERT_FALSE(list.ok());
  EXPECT_THAT(std::string(list.status().message()), HasSubstr("object"));
}

// A number JSON can spell but a double cannot hold is refused like any
// other bad text (found by tests/fuzz/model_config_fuzz: the parser's
// out_of_range exception was not caught and ended the process).
TEST(ModelConfigTest, NumberOverflowIsRefusedNotThrown) {
  auto config = ParseModelConfig(R"({"rms_norm_eps": 1e999})");
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(config.status().message()),
              HasSubstr("config.json: not valid JSON"));
  auto generation = ParseGenerationConfig(R"({"eos_token_id": [2, 1e8009]})");
  EXPECT_EQ(generation.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(generation.status().message()),
              HasSubstr("number overflow"));
}

TEST(ModelConfigTest, LoadsFromDirectory) {
  const std::string dir = model_testing::MakeUniqueTempDir("config");
  {
    std::ofstream file(dir + "/config.json");
    file << kLlama31Config;
  }
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->hidden_size, 4096);

  auto missing = LoadModelConfig(dir + "/nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("config.json"));

  {
    std::ofstream file(dir + "/config.json");
    file << R"({"architectures": ["BertModel"]})";
  }
  auto invalid = LoadModelConfig(dir);
  ASSERT_FALSE(invalid.ok());
  // The error says which file.
  EXPECT_THAT(std::string(invalid.status().message()),
              HasSubstr(dir + "/config.json"));
}

TEST(ModelConfigTest, GenerationConfigEosIdsReplaceConfigJsons) {
  const std::string dir = model_testing::MakeUniqueTempDir("generation");
  {
    std::ofstream file(dir + "/config.json");
    file << kLlama31Config;  // eos_token_id [128001, 128008, 128009]
  }
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->eos_source, ModelConfig::EosSource::kConfig);
  EXPECT_EQ(config->eos_token_ids,
            (std::vector<int64_t>{128001, 128008, 128009}));

  // An instruct checkpoint names its end-of-turn id only here.
  {
    std::ofstream file(dir + "/generation_config.json");
    file << R"({"bos_token_id": 128000, "do_sample": true,
                "eos_token_id": [128001, 128009], "temperature": 0.6})";
  }
  config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->eos_source, ModelConfig::EosSource::kGenerationConfig);
  EXPECT_EQ(config->eos_token_ids, (std::vector<int64_t>{128001, 128009}));

  // One id, not a list.
  {
    std::ofstream file(dir + "/generation_config.json");
    file << R"({"eos_token_id": 7})";
  }
  config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->eos_token_ids, std::vector<int64_t>{7});

  // Without eos_token_id (or null) config.json's ids stay.
  for (const char* text :
       {R"({"temperature": 0.7})", R"({"eos_token_id": null})"}) {
    {
      std::ofstream file(dir + "/generation_config.json");
      file << text;
    }
    config = LoadModelConfig(dir);
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_EQ(config->eos_source, ModelConfig::EosSource::kConfig) << text;
    EXPECT_EQ(config->eos_token_ids.size(), 3u) << text;
  }

  // A bad file fails the load, naming the file and the field.
  for (const auto& [text, field] :
       std::vector<std::pair<std::string, std::string>>{
           {R"({"eos_token_id": "2"})", "eos_token_id"},
           {R"({"eos_token_id": [1, -3]})", "eos_token_id[1]"},
           {R"({"eos_token_id": [1, 2.5]})", "eos_token_id[1]"},
           {R"([1, 2])", "JSON object"},
           {R"({"eos_token_id": )", "not valid JSON"}}) {
    {
      std::ofstream file(dir + "/generation_config.json");
      file << text;
    }
    config = LoadModelConfig(dir);
    ASSERT_FALSE(config.ok()) << text;
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(config.status().message()),
                HasSubstr(dir + "/generation_config.json"));
    EXPECT_THAT(std::string(config.status().message()), HasSubstr(field));
  }
}

TEST(ModelConfigTest, FingerprintIsStableAndIgnoresNonShapeFields) {
  const std::string a = ParseOrDie(kLlama31Config).Fingerprint();
  EXPECT_EQ(a.size(), 16u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_EQ(a, ParseOrDie(kLlama31Config).Fingerprint());

  // Key order, formatting, dtype, unknown fields and token ids do not matter.
  Json j = Json::parse(kLlama31Config);
  j["torch_dtype"] = "float32";
  j["eos_token_id"] = 7;
  j["some_new_field"] = {1, 2, 3};
  j["max_position_embeddings"] = 4096;
  EXPECT_EQ(ParseOrDie(j.dump(4)).Fingerprint(), a);
}

TEST(ModelConfigTest, FingerprintChangesWithEveryShapeField) {
  const Json base = Json::parse(kLlama31Config);
  const std::string reference = ParseOrDie(base.dump()).Fingerprint();
  const std::vector<std::pair<std::string, std::function<void(Json&)>>>
      changes = {
          {"hidden_size", [](Json& j) { j["hidden_size"] = 4160; }},
          {"intermediate_size",
           [](Json& j) { j["intermediate_size"] = 14337; }},
          {"num_hidden_layers", [](Json& j) { j["num_hidden_layers"] = 31; }},
          {"num_attention_heads",
           [](Json& j) {
             j["num_attention_heads"] = 16;
             j["head_dim"] = 128;
           }},
          {"num_key_value_heads",
           [](Json& j) { j["num_key_value_heads"] = 4; }},
          {"head_dim", [](Json& j) { j["head_dim"] = 64; }},
          {"rms_norm_eps", [](Json& j) { j["rms_norm_eps"] = 1e-6; }},
          {"rope_theta", [](Json& j) { j["rope_theta"] = 500001.0; }},
          {"rope_scaling.factor",
           [](Json& j) { j["rope_scaling"]["factor"] = 16.0; }},
          {"rope_scaling.original",
           [](Json& j) {
             j["rope_scaling"]["original_max_position_embeddings"] = 4096;
           }},
          {"rope_scaling_null", [](Json& j) { j["rope_scaling"] = nullptr; }},
          {"vocab_size", [](Json& j) { j["vocab_size"] = 128000; }},
          {"tie_word_embeddings",
           [](Json& j) { j["tie_word_embeddings"] = true; }},
          {"attention_bias", [](Json& j) { j["attention_bias"] = true; }},
          {"architecture",
           [](Json& j) { j["architectures"] = {"MistralForCausalLM"}; }},
      };
  std::vector<std::string> seen = {reference};
  for (const auto& [name, change] : changes) {
    SCOPED_TRACE(name);
    Json j = base;
    change(j);
    const std::string fingerprint = ParseOrDie(j.dump()).Fingerprint();
    for (const std::string& other : seen) EXPECT_NE(fingerprint, other);
    seen.push_back(fingerprint);
  }
}

}  // namespace
}  // namespace pdworker
