// ParseModelConfig / LoadModelConfig: real published configs, the tiny
// shapes, generation_config.json; Fingerprint stability and sensitivity.
// (Defaults and the invalid-config table: model_config_invalid_test.cc.)
#include "worker/model/model_config.h"

#include <cmath>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

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
      case TinyShape::kQwen3_8B_4Layers:
      case TinyShape::kGemma2_9B_4Layers:
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

// Issue 41's GPU benchmark shapes: the published layers of Qwen3-8B and
// Gemma-2-9B (four of them), with their families' keys.
TEST(ModelConfigTest, Issue41BenchmarkShapesHaveThePublishedLayers) {
  TinyModelOptions options;
  options.dtype = DType::kBFloat16;
  absl::StatusOr<TinyShape> qwen3 = ParseTinyShape("qwen3_8b_4layers");
  ASSERT_TRUE(qwen3.ok()) << qwen3.status();
  options.shape = *qwen3;
  const ModelConfig q = ParseOrDie(TinyModelConfigJson(options));
  EXPECT_EQ(q.architecture, Architecture::kQwen3);
  EXPECT_EQ(q.hidden_size, 4096);
  EXPECT_EQ(q.intermediate_size, 12288);
  EXPECT_EQ(q.num_attention_heads, 32);
  EXPECT_EQ(q.num_key_value_heads, 8);
  EXPECT_EQ(q.head_dim, 128);
  EXPECT_EQ(q.vocab_size, 151936);
  EXPECT_EQ(q.num_hidden_layers, 4);
  EXPECT_EQ(q.layer.qk_norm, QkNorm::kPerHeadRms);
  EXPECT_FALSE(q.tie_word_embeddings);
  absl::StatusOr<TinyShape> gemma2 = ParseTinyShape("gemma2_9b_4layers");
  ASSERT_TRUE(gemma2.ok()) << gemma2.status();
  options.shape = *gemma2;
  const ModelConfig g = ParseOrDie(TinyModelConfigJson(options));
  EXPECT_EQ(g.architecture, Architecture::kGemma2);
  EXPECT_EQ(g.hidden_size, 3584);
  EXPECT_EQ(g.intermediate_size, 14336);
  EXPECT_EQ(g.num_attention_heads, 16);
  EXPECT_EQ(g.num_key_value_heads, 8);
  EXPECT_EQ(g.head_dim, 256);
  EXPECT_EQ(g.vocab_size, 256000);
  EXPECT_EQ(g.layer.query_pre_attn_scalar, 256);
  EXPECT_EQ(g.layer.attn_logit_softcapping, 50);
  EXPECT_EQ(g.final_logit_softcapping, 30);
  EXPECT_EQ(g.sliding_window, 4096);
  EXPECT_EQ(g.sliding_layers, (std::vector<bool>{true, false, true, false}));
  EXPECT_TRUE(g.tie_word_embeddings);
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
