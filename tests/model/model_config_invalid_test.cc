// ParseModelConfig on a minimal config: the defaults transformers assumes
// where a key is absent, and a table of invalid configs whose errors must
// name the offending field (and change nothing: ParseModelConfig is pure).
#include <functional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "worker/model/model_config.h"

namespace pdworker {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

ModelConfig ParseOrDie(const std::string& text) {
  auto config = ParseModelConfig(text);
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *config : ModelConfig{};
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

}  // namespace
}  // namespace pdworker
