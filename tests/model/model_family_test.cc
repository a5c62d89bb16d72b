// The family files (worker/model/families/): each maps its published
// config.json onto the decoder layer description, the table finds every
// family by name, and the keys of features no family runs are refused by
// name.
#include "worker/model/model_family.h"

#include <cmath>
#include <functional>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "worker/model/model_config.h"

namespace pdworker {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

// Qwen/Qwen3-0.6B config.json as published: head_dim 128 with 16 heads over
// hidden 1024 (so head_dim != hidden / heads), tied embeddings, no window.
constexpr char kQwen3Config[] = R"({
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "initializer_range": 0.02,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// microsoft/phi-4 config.json as published: fused projections in the
// checkpoint, GQA 40/10, no RoPE scaling, no window.
constexpr char kPhi4Config[] = R"({
  "architectures": ["Phi3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 100257,
  "embd_pdrop": 0.0,
  "eos_token_id": 100265,
  "hidden_act": "silu",
  "hidden_size": 5120,
  "initializer_range": 0.02,
  "intermediate_size": 17920,
  "max_position_embeddings": 16384,
  "model_type": "phi3",
  "num_attention_heads": 40,
  "num_hidden_layers": 40,
  "num_key_value_heads": 10,
  "original_max_position_embeddings": 16384,
  "pad_token_id": 100349,
  "resid_pdrop": 0.0,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 250000,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.47.0",
  "use_cache": true,
  "vocab_size": 100352
})";

// google/gemma-2-9b config.json as published (no tie_word_embeddings key:
// Gemma2Config's default, true).
constexpr char kGemma2Config[] = R"({
  "architectures": ["Gemma2ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "attn_logit_softcapping": 50.0,
  "bos_token_id": 2,
  "cache_implementation": "hybrid",
  "eos_token_id": 1,
  "final_logit_softcapping": 30.0,
  "head_dim": 256,
  "hidden_act": "gelu_pytorch_tanh",
  "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 3584,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 8192,
  "model_type": "gemma2",
  "num_attention_heads": 16,
  "num_hidden_layers": 42,
  "num_key_value_heads": 8,
  "pad_token_id": 0,
  "query_pre_attn_scalar": 256,
  "rms_norm_eps": 1e-06,
  "rope_theta": 10000.0,
  "sliding_window": 4096,
  "sliding_window_size": 4096,
  "torch_dtype": "float32",
  "transformers_version": "4.42.0.dev0",
  "use_cache": true,
  "vocab_size": 256000
})";

// google/gemma-3-1b-it config.json as published: one full layer in six,
// the local layers' RoPE base, no caps.
constexpr char kGemma3Config[] = R"({
  "architectures": ["Gemma3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "attn_logit_softcapping": null,
  "bos_token_id": 2,
  "cache_implementation": "hybrid",
  "eos_token_id": [1, 106],
  "final_logit_softcapping": null,
  "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 1152,
  "initializer_range": 0.02,
  "intermediate_size": 6912,
  "max_position_embeddings": 32768,
  "model_type": "gemma3_text",
  "num_attention_heads": 4,
  "num_hidden_layers": 26,
  "num_key_value_heads": 1,
  "pad_token_id": 0,
  "query_pre_attn_scalar": 256,
  "rms_norm_eps": 1e-06,
  "rope_local_base_freq": 10000,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": 512,
  "sliding_window_pattern": 6,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.50.0.dev0",
  "use_cache": true,
  "vocab_size": 262144
})";

ModelConfig ParseOrDie(const std::string& text) {
  auto config = ParseModelConfig(text);
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *config : ModelConfig{};
}

std::string WithQwen3(const std::function<void(Json&)>& edit) {
  Json config = Json::parse(kQwen3Config);
  edit(config);
  return config.dump();
}

TEST(ModelFamilyTest, Qwen3AsPublished) {
  const ModelConfig c = ParseOrDie(kQwen3Config);
  EXPECT_EQ(c.architecture, Architecture::kQwen3);
  EXPECT_EQ(ArchitectureName(c.architecture), "Qwen3ForCausalLM");
  EXPECT_EQ(ModelTypeName(c.architecture), "qwen3");
  EXPECT_EQ(c.layer.qk_norm, QkNorm::kPerHeadRms);
  EXPECT_FALSE(c.layer.qkv_bias);
  EXPECT_FALSE(c.layer.o_proj_bias);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.q_size(), 2048);  // != hidden_size
  EXPECT_EQ(c.kv_size(), 1024);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.sliding_window.has_value());
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{151645});
  EXPECT_THAT(c.CanonicalString(), HasSubstr("qk_norm=per_head_rms;"));
}

TEST(ModelFamilyTest, Qwen3KeysChangeTheLayer) {
  const ModelConfig biased =
      ParseOrDie(WithQwen3([](Json& j) { j["attention_bias"] = true; }));
  EXPECT_TRUE(biased.layer.qkv_bias);
  EXPECT_TRUE(biased.layer.o_proj_bias);
  const ModelConfig windowed = ParseOrDie(WithQwen3([](Json& j) {
    j["use_sliding_window"] = true;
    j["sliding_window"] = 4096;
    j["max_window_layers"] = 0;  // every layer
  }));
  EXPECT_EQ(windowed.sliding_window, 4096);
  EXPECT_NE(windowed.Fingerprint(), ParseOrDie(kQwen3Config).Fingerprint());

  struct Bad {
    std::function<void(Json&)> edit;
    const char* names;
  };
  const Bad bad[] = {
      {[](Json& j) { j["use_sliding_window"] = true; }, "sliding_window"},
      {[](Json& j) {
         j["use_sliding_window"] = true;
         j["sliding_window"] = 0;
       },
       "sliding_window must be positive"},
      {[](Json& j) { j["use_sliding_window"] = "yes"; }, "use_sliding_window"},
      {[](Json& j) { j["attention_bias"] = 1; }, "attention_bias"},
  };
  for (const Bad& b : bad) {
    auto parsed = ParseModelConfig(WithQwen3(b.edit));
    ASSERT_FALSE(parsed.ok()) << b.names;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr(b.names));
  }
}

TEST(ModelFamilyTest, Phi4AsPublished) {
  const ModelConfig c = ParseOrDie(kPhi4Config);
  EXPECT_EQ(c.architecture, Architecture::kPhi3);
  EXPECT_EQ(ModelTypeName(c.architecture), "phi3");
  EXPECT_EQ(c.layer.qkv_tensors, ProjectionTensors::kFused);
  EXPECT_EQ(c.layer.gate_up_tensors, ProjectionTensors::kFused);
  EXPECT_FALSE(c.layer.qkv_bias);
  EXPECT_EQ(c.layer.qk_norm, QkNorm::kNone);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.num_key_value_heads, 10);
  EXPECT_FALSE(c.sliding_window.has_value());
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kNone);
}

// Phi-3-mini-4k's window, the 128k variants' longrope, Phi-4-mini's partial
// rotary factor, and what pdworker refuses in a Phi-3 config.
TEST(ModelFamilyTest, Phi3KeysAndRefusals) {
  auto with = [](const std::function<void(Json&)>& edit) {
    Json config = Json::parse(kPhi4Config);
    edit(config);
    return config.dump();
  };
  EXPECT_EQ(ParseOrDie(with([](Json& j) {
              j["sliding_window"] = 2047;
            })).sliding_window,
            2047);
  // partial_rotary_factor 1.0 is plain RoPE; 0.75 rotates 96 of 128.
  EXPECT_EQ(ParseOrDie(with([](Json& j) {
              j["partial_rotary_factor"] = 1.0;
            })).RotaryDim(),
            128);
  EXPECT_EQ(ParseOrDie(with([](Json& j) {
              j["partial_rotary_factor"] = 0.75;
            })).RotaryDim(),
            96);
  // Phi-3-mini-128k's longrope: 48 factors per list over head_dim 96 (here
  // Phi-4's 128: 64), the original context at the top level.
  const ModelConfig longrope = ParseOrDie(with([](Json& j) {
    j["max_position_embeddings"] = 131072;
    j["original_max_position_embeddings"] = 4096;
    j["rope_scaling"] = {{"type", "longrope"},
                         {"short_factor", std::vector<double>(64, 1.1)},
                         {"long_factor", std::vector<double>(64, 3.0)}};
  }));
  EXPECT_EQ(longrope.rope_scaling.type, RopeScalingType::kLongrope);
  EXPECT_EQ(longrope.rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(longrope.rope_scaling.attention_factor,
                   std::sqrt(1 + std::log(32.0) / std::log(4096.0)));
  struct Bad {
    std::function<void(Json&)> edit;
    const char* names;
  };
  const Bad bad[] = {
      {[](Json& j) { j["partial_rotary_factor"] = 0.0; },
       "partial_rotary_factor"},
      {[](Json& j) {
         j["rope_scaling"] = {{"type", "longrope"},
                              {"short_factor", {1.0, 1.0}},
                              {"long_factor", {1.0, 2.0}}};
       },
       "rope_scaling.short_factor has 2 entries; the model rotates 64 pairs"},
      {[](Json& j) {
         j["partial_rotary_factor"] = 0.75;
         j["rope_scaling"] = {{"type", "longrope"},
                              {"short_factor", std::vector<double>(64, 1.0)},
                              {"long_factor", std::vector<double>(64, 1.0)}};
       },
       "the model rotates 48 pairs"},
      {[](Json& j) { j["attention_bias"] = true; }, "attention_bias"},
      {[](Json& j) { j["sliding_window"] = 0; }, "sliding_window"},
  };
  for (const Bad& b : bad) {
    auto parsed = ParseModelConfig(with(b.edit));
    ASSERT_FALSE(parsed.ok()) << b.names;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr(b.names));
  }
}

// microsoft/Phi-4-mini-instruct's config.json keys and sizes (the factor
// lists' 48 values are stand-ins of the published lengths): partial rotary
// 0.75 of head_dim 128, longrope over an original context of 4096, tied.
TEST(ModelFamilyTest, Phi4MiniAsPublished) {
  Json j = {
      {"architectures", {"Phi3ForCausalLM"}},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"bos_token_id", 199999},
      {"embd_pdrop", 0.0},
      {"eos_token_id", 199999},
      {"full_attn_mod", 1},
      {"hidden_act", "silu"},
      {"hidden_size", 3072},
      {"initializer_range", 0.02},
      {"intermediate_size", 8192},
      {"interpolate_factor", 1},
      {"lm_head_bias", false},
      {"max_position_embeddings", 131072},
      {"mlp_bias", false},
      {"model_type", "phi3"},
      {"num_attention_heads", 24},
      {"num_hidden_layers", 32},
      {"num_key_value_heads", 8},
      {"original_max_position_embeddings", 4096},
      {"pad_token_id", 199999},
      {"partial_rotary_factor", 0.75},
      {"resid_pdrop", 0.0},
      {"rms_norm_eps", 1e-05},
      {"rope_scaling",
       {{"long_factor", std::vector<double>(48, 2.5)},
        {"short_factor", std::vector<double>(48, 1.0)},
        {"type", "longrope"}}},
      {"rope_theta", 10000.0},
      {"sliding_window", 262144},
      {"tie_word_embeddings", true},
      {"torch_dtype", "bfloat16"},
      {"transformers_version", "4.45.0"},
      {"use_cache", true},
      {"vocab_size", 200064},
  };
  const ModelConfig c = ParseOrDie(j.dump());
  EXPECT_EQ(c.architecture, Architecture::kPhi3);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.RotaryDim(), 96);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kLongrope);
  EXPECT_EQ(c.rope_scaling.short_factor.size(), 48u);
  EXPECT_DOUBLE_EQ(c.rope_scaling.attention_factor,
                   std::sqrt(1 + std::log(32.0) / std::log(4096.0)));
  // The list the worker runs is part of the fingerprint, as is the partial
  // rotary dimension.
  ModelConfig long_list = c;
  long_list.rope_scaling.long_factor_active = true;
  EXPECT_NE(c.Fingerprint(), long_list.Fingerprint());
  EXPECT_THAT(long_list.CanonicalString(), HasSubstr("rope=longrope,long,"));
  EXPECT_THAT(c.CanonicalString(), HasSubstr("rotary_dim=96;"));
  ModelConfig other_inactive = long_list;
  other_inactive.rope_scaling.short_factor[0] = 1.5;
  EXPECT_EQ(long_list.Fingerprint(), other_inactive.Fingerprint())
      << "the list not run does not change what K/V hold";
}

TEST(ModelFamilyTest, Gemma2AsPublished) {
  const ModelConfig c = ParseOrDie(kGemma2Config);
  EXPECT_EQ(c.architecture, Architecture::kGemma2);
  EXPECT_EQ(ModelTypeName(c.architecture), "gemma2");
  EXPECT_EQ(c.layer.norm_placement, NormPlacement::kSandwich);
  EXPECT_EQ(c.layer.norm_weight, NormWeight::kOnePlus);
  EXPECT_EQ(c.layer.activation, MlpActivation::kGeluTanh);
  EXPECT_EQ(c.layer.query_pre_attn_scalar, 256);
  EXPECT_EQ(c.layer.attn_logit_softcapping, 50);
  EXPECT_EQ(c.final_logit_softcapping, 30);
  EXPECT_DOUBLE_EQ(c.embedding_multiplier, std::sqrt(3584.0));
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.q_size(), 4096);  // != hidden_size
  EXPECT_THAT(c.CanonicalString(), HasSubstr("sandwich_norms;"));
}

// Keys absent take Gemma2Config's defaults; a null cap means none; what the
// family does not run is refused by name.
TEST(ModelFamilyTest, Gemma2DefaultsNullsAndRefusals) {
  auto with = [](const std::function<void(Json&)>& edit) {
    Json config = Json::parse(kGemma2Config);
    edit(config);
    return config.dump();
  };
  const ModelConfig defaults = ParseOrDie(with([](Json& j) {
    for (const char* key :
         {"head_dim", "query_pre_attn_scalar", "attn_logit_softcapping",
          "final_logit_softcapping", "sliding_window"}) {
      j.erase(key);
    }
    j["tie_word_embeddings"] = false;
  }));
  EXPECT_EQ(defaults.head_dim, 256);
  EXPECT_EQ(defaults.layer.query_pre_attn_scalar, 256);
  EXPECT_EQ(defaults.layer.attn_logit_softcapping, 50);
  EXPECT_EQ(defaults.final_logit_softcapping, 30);
  EXPECT_EQ(defaults.sliding_window, 4096);
  EXPECT_FALSE(defaults.tie_word_embeddings);
  const ModelConfig uncapped = ParseOrDie(with([](Json& j) {
    j["attn_logit_softcapping"] = nullptr;
    j["final_logit_softcapping"] = nullptr;
    j["sliding_window"] = nullptr;
  }));
  EXPECT_EQ(uncapped.layer.attn_logit_softcapping, 0);
  EXPECT_EQ(uncapped.final_logit_softcapping, 0);
  EXPECT_FALSE(uncapped.sliding_window.has_value());
  EXPECT_NE(uncapped.Fingerprint(), ParseOrDie(kGemma2Config).Fingerprint());

  struct Bad {
    std::function<void(Json&)> edit;
    const char* names;
  };
  const Bad bad[] = {
      {[](Json& j) { j["hidden_activation"] = "silu"; }, "hidden_activation"},
      {[](Json& j) { j["hidden_act"] = "gelu"; }, "hidden_act"},
      {[](Json& j) { j["attention_bias"] = true; }, "attention_bias"},
      {[](Json& j) { j["query_pre_attn_scalar"] = 0; },
       "query_pre_attn_scalar"},
      {[](Json& j) { j["query_pre_attn_scalar"] = nullptr; },
       "query_pre_attn_scalar"},
      {[](Json& j) { j["attn_logit_softcapping"] = -1.0; },
       "attn_logit_softcapping"},
      {[](Json& j) { j["final_logit_softcapping"] = "30"; },
       "final_logit_softcapping"},
      {[](Json& j) { j["sliding_window"] = 4096.5; }, "sliding_window"},
  };
  for (const Bad& b : bad) {
    auto parsed = ParseModelConfig(with(b.edit));
    ASSERT_FALSE(parsed.ok()) << b.names;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr(b.names));
  }
}

// Which layers slide: Qwen's max_window_layers, and config.json's
// layer_types over the family's choice; a window no layer uses is dropped.
TEST(ModelFamilyTest, SlidingLayersFollowTheConfig) {
  const ModelConfig qwen = ParseOrDie(WithQwen3([](Json& j) {
    j["num_hidden_layers"] = 4;
    j["use_sliding_window"] = true;
    j["sliding_window"] = 64;
    j["max_window_layers"] = 2;
  }));
  EXPECT_EQ(qwen.sliding_layers, (std::vector<bool>{false, false, true, true}));
  EXPECT_FALSE(qwen.SlidesAt(1));
  EXPECT_TRUE(qwen.SlidesAt(2));
  EXPECT_THAT(qwen.CanonicalString(), HasSubstr("window_layers=0011;"));
  const ModelConfig typed = ParseOrDie(WithQwen3([](Json& j) {
    j["num_hidden_layers"] = 3;
    j["use_sliding_window"] = true;
    j["sliding_window"] = 64;
    j["layer_types"] = {"sliding_attention", "full_attention",
                        "sliding_attention"};
  }));
  EXPECT_EQ(typed.sliding_layers, (std::vector<bool>{true, false, true}));
  // Every layer past the model's: no layer slides, so no window.
  const ModelConfig unused = ParseOrDie(WithQwen3([](Json& j) {
    j["use_sliding_window"] = true;
    j["sliding_window"] = 64;
    j["max_window_layers"] = 28;
  }));
  EXPECT_FALSE(unused.sliding_window.has_value());
  EXPECT_TRUE(unused.sliding_layers.empty());

  struct Bad {
    std::function<void(Json&)> edit;
    const char* names;
  };
  const Bad bad[] = {
      {[](Json& j) { j["layer_types"] = {"full_attention"}; }, "layer_types"},
      {[](Json& j) {
         j["num_hidden_layers"] = 1;
         j["layer_types"] = {"chunked_attention"};
       },
       "layer_types[0]"},
      {[](Json& j) {
         j["num_hidden_layers"] = 1;
         j["layer_types"] = {"sliding_attention"};
       },
       "sliding_window is not set"},
      {[](Json& j) {
         j["use_sliding_window"] = true;
         j["sliding_window"] = 64;
         j["max_window_layers"] = "2";
       },
       "max_window_layers"},
  };
  for (const Bad& b : bad) {
    auto parsed = ParseModelConfig(WithQwen3(b.edit));
    ASSERT_FALSE(parsed.ok()) << b.names;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr(b.names));
  }
}

TEST(ModelFamilyTest, Gemma3AsPublished) {
  const ModelConfig c = ParseOrDie(kGemma3Config);
  EXPECT_EQ(c.architecture, Architecture::kGemma3);
  EXPECT_EQ(ModelTypeName(c.architecture), "gemma3_text");
  EXPECT_EQ(c.layer.qk_norm, QkNorm::kPerHeadRms);
  EXPECT_EQ(c.layer.norm_weight, NormWeight::kOnePlus);
  EXPECT_EQ(c.layer.attn_logit_softcapping, 0);
  EXPECT_EQ(c.final_logit_softcapping, 0);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.local_rope_theta, 1e4);
  EXPECT_EQ(c.sliding_window, 512);
  ASSERT_EQ(c.sliding_layers.size(), 26u);
  for (int i = 0; i < 26; ++i) {
    EXPECT_EQ(c.SlidesAt(i), (i + 1) % 6 != 0) << i;
  }
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{1, 106}));
  // YaRN on the global layers beside the sliding layers' own base: its
  // attention factor would reach every layer's softmax scale: refused.
  Json yarn = Json::parse(kGemma3Config);
  yarn["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  auto refused = ParseModelConfig(yarn.dump());
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("rope_scaling"));
  EXPECT_THAT(refused.status().message(), HasSubstr("local RoPE base"));
}

// google/gemma-3-4b-it config.json as published: the text model's few
// keys under text_config (the rest are Gemma3TextConfig's defaults), a
// vision tower beside it.
constexpr char kGemma3MultimodalConfig[] = R"({
  "architectures": ["Gemma3ForConditionalGeneration"],
  "boi_token_index": 255999,
  "eoi_token_index": 256000,
  "eos_token_id": [1, 106],
  "image_token_index": 262144,
  "initializer_range": 0.02,
  "mm_tokens_per_image": 256,
  "model_type": "gemma3",
  "text_config": {
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "model_type": "gemma3_text",
    "num_hidden_layers": 34,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024
  },
  "torch_dtype": "bfloat16",
  "transformers_version": "4.50.0.dev0",
  "vision_config": {
    "hidden_size": 1152,
    "image_size": 896,
    "intermediate_size": 4304,
    "model_type": "siglip_vision_model",
    "num_attention_heads": 16,
    "num_hidden_layers": 27,
    "patch_size": 14,
    "vision_use_head": false
  }
})";

TEST(ModelFamilyTest, Gemma3MultimodalServesItsTextModel) {
  const ModelConfig c = ParseOrDie(kGemma3MultimodalConfig);
  EXPECT_EQ(c.architecture, Architecture::kGemma3);
  EXPECT_EQ(c.tensor_prefix, "language_model.");
  EXPECT_EQ(
      c.ignored_tensor_prefixes,
      (std::vector<std::string>{"vision_tower.", "multi_modal_projector."}));
  EXPECT_EQ(c.hidden_size, 2560);
  EXPECT_EQ(c.num_hidden_layers, 34);
  EXPECT_EQ(c.num_attention_heads, 8);  // defaults from here on
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.vocab_size, 262208);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.local_rope_theta, 1e4);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kLinear);
  EXPECT_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_EQ(c.sliding_window, 1024);
  EXPECT_EQ(c.layer.qk_norm, QkNorm::kPerHeadRms);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.torch_dtype, DType::kBFloat16);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{1, 106}));
  // A quantized multimodal checkpoint says so at the top level: refused.
  Json quantized = Json::parse(kGemma3MultimodalConfig);
  quantized["quantization_config"] = {{"quant_method", "awq"}, {"bits", 4}};
  auto refused = ParseModelConfig(quantized.dump());
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("quantization_config"));
  auto missing = ParseModelConfig(R"({"architectures":
      ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"})");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(), HasSubstr("text_config"));
}

// transformers 5 writes Gemma 3's two RoPEs into rope_parameters keyed by
// layer type (and layer_types instead of the pattern): the same model.
TEST(ModelFamilyTest, Gemma3InTransformers5Layout) {
  Json v5 = Json::parse(kGemma3Config);
  v5.erase("rope_theta");
  v5.erase("rope_scaling");
  v5.erase("rope_local_base_freq");
  v5.erase("sliding_window_pattern");
  v5["rope_parameters"] = {
      {"full_attention", {{"rope_type", "default"}, {"rope_theta", 1e6}}},
      {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 1e4}}}};
  for (int i = 0; i < 26; ++i) {
    v5["layer_types"].push_back((i + 1) % 6 != 0 ? "sliding_attention"
                                                 : "full_attention");
  }
  const ModelConfig c = ParseOrDie(v5.dump());
  const ModelConfig v4 = ParseOrDie(kGemma3Config);
  EXPECT_EQ(c.local_rope_theta, 1e4);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.sliding_layers, v4.sliding_layers);
  EXPECT_EQ(c.Fingerprint(), v4.Fingerprint());
  // Both spellings of the local base, disagreeing: refused.
  v5["rope_local_base_freq"] = 5000;
  auto refused = ParseModelConfig(v5.dump());
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("rope_local_base_freq"));
}

// The same shape under another family is another model: the layer spec is
// part of the fingerprint, so a Qwen2 worker never takes a Qwen3's KV.
TEST(ModelFamilyTest, TheFamilyIsPartOfTheFingerprint) {
  const ModelConfig qwen3 = ParseOrDie(kQwen3Config);
  std::set<std::string> fingerprints;
  for (const ModelFamily* family : ModelFamilies()) {
    const ModelConfig c = ParseOrDie(WithQwen3([family](Json& j) {
      j["architectures"] = {std::string(family->architecture_name)};
      j["model_type"] = std::string(family->model_type);
      j.erase("hidden_act");  // each family's own
    }));
    EXPECT_EQ(c.architecture, family->architecture);
    EXPECT_EQ(c.layer.qk_norm == QkNorm::kPerHeadRms,
              family->architecture == Architecture::kQwen3 ||
                  family->architecture == Architecture::kGemma3);
    fingerprints.insert(c.Fingerprint());
  }
  EXPECT_EQ(fingerprints.size(), ModelFamilies().size());
  // Families without q/k norm keep the canonical string they had before
  // the field existed (no "qk_norm=").
  const ModelConfig llama = ParseOrDie(
      WithQwen3([](Json& j) { j["architectures"] = {"LlamaForCausalLM"}; }));
  EXPECT_THAT(llama.CanonicalString(), ::testing::Not(HasSubstr("qk_norm")));
  EXPECT_NE(llama.Fingerprint(), qwen3.Fingerprint());
}

TEST(ModelFamilyTest, TheTableFindsEveryFamilyOnce) {
  std::set<std::string> names, types;
  std::set<Architecture> architectures;
  for (const ModelFamily* family : ModelFamilies()) {
    names.insert(std::string(family->architecture_name));
    types.insert(std::string(family->model_type));
    architectures.insert(family->architecture);
    EXPECT_EQ(FindModelFamily(family->architecture_name), family);
    EXPECT_EQ(&FamilyOf(family->architecture), family);
    EXPECT_EQ(ArchitectureName(family->architecture),
              family->architecture_name);
  }
  EXPECT_EQ(names.size(), ModelFamilies().size());
  EXPECT_EQ(types.size(), ModelFamilies().size());
  EXPECT_EQ(architectures.size(), ModelFamilies().size());
  EXPECT_EQ(FindModelFamily("Qwen3MoeForCausalLM"), nullptr);
}

// An architecture no family reads is refused listing the ones that exist.
TEST(ModelFamilyTest, AnUnknownArchitectureListsTheSupportedOnes) {
  auto parsed = ParseModelConfig(WithQwen3([](Json& j) {
    j["architectures"] = {"Llama4ForConditionalGeneration"};
  }));
  ASSERT_FALSE(parsed.ok());
  for (const ModelFamily* family : ModelFamilies()) {
    EXPECT_THAT(parsed.status().message(),
                HasSubstr(std::string(family->architecture_name)));
  }
  EXPECT_THAT(parsed.status().message(),
              HasSubstr("Llama4ForConditionalGeneration"));
}

// Keys that announce what no family runs are refused naming the key, in
// every family, rather than ignored.
TEST(ModelFamilyTest, UnsupportedFeaturesAreRefusedByName) {
  struct Case {
    const char* key;
    Json value;
    const char* what;
  };
  const Case cases[] = {
      {"quantization_config",
       {{"quant_method", "awq"}, {"bits", 4}},
       "quantized weights"},
      {"num_experts", 128, "mixture-of-experts"},
      {"num_local_experts", 8, "mixture-of-experts"},
      {"n_routed_experts", 64, "mixture-of-experts"},
      {"kv_lora_rank", 512, "latent attention"},
      {"mlp_bias", true, "mlp_bias"},
  };
  for (const ModelFamily* family : ModelFamilies()) {
    for (const Case& c : cases) {
      SCOPED_TRACE(absl::StrCat(family->architecture_name, " ", c.key));
      auto parsed = ParseModelConfig(WithQwen3([&](Json& j) {
        j["architectures"] = {std::string(family->architecture_name)};
        j[c.key] = c.value;
      }));
      ASSERT_FALSE(parsed.ok());
      EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(parsed.status().message(), HasSubstr(c.key));
      EXPECT_THAT(parsed.status().message(), HasSubstr(c.what));
    }
    // null means unset, as everywhere in HF configs.
    EXPECT_TRUE(ParseModelConfig(WithQwen3([&](Json& j) {
                  j["architectures"] = {std::string(family->architecture_name)};
                  j.erase("hidden_act");
                  j["quantization_config"] = nullptr;
                  j["num_experts"] = nullptr;
                })).ok());
  }
}

}  // namespace
}  // namespace pdworker
