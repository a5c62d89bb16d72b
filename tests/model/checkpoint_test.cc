// Checkpoint: single-file and sharded directories load identically, tensors
// match what config.json implies, and every broken directory is an error.
#include "worker/model/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/model/test_paths.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/model/float16.h"
#include "worker/model/model_config.h"
#include "worker/model/safetensors_writer.h"

namespace pdworker {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

std::string WriteModel(TinyShape shape, DType dtype, int shards,
                       uint64_t seed = 0) {
  std::string dir = model_testing::MakeUniqueTempDir(
      absl::StrCat("ckpt_", TinyShapeName(shape), "_", shards));
  TinyModelOptions options;
  options.shape = shape;
  options.dtype = dtype;
  options.num_shards = shards;
  options.seed = seed;
  const absl::Status status = WriteTinyModel(options, dir);
  EXPECT_TRUE(status.ok()) << status;
  return dir;
}

std::unique_ptr<Checkpoint> OpenOrDie(const std::string& dir) {
  auto checkpoint = Checkpoint::Open(dir);
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status();
  return checkpoint.ok() ? *std::move(checkpoint) : nullptr;
}

// Every tensor a Llama-family checkpoint must have, with its HF shape,
// derived from the config alone.
std::vector<std::pair<std::string, std::vector<int64_t>>> ExpectedTensors(
    const ModelConfig& c) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> expected = {
      {"model.embed_tokens.weight", {c.vocab_size, c.hidden_size}},
      {"model.norm.weight", {c.hidden_size}},
  };
  if (!c.tie_word_embeddings) {
    expected.push_back({"lm_head.weight", {c.vocab_size, c.hidden_size}});
  }
  const int64_t q = c.num_attention_heads * c.head_dim;
  const int64_t kv = c.num_key_value_heads * c.head_dim;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    expected.push_back({p + "input_layernorm.weight", {c.hidden_size}});
    expected.push_back(
        {p + "post_attention_layernorm.weight", {c.hidden_size}});
    if (c.layer.norm_placement == NormPlacement::kSandwich) {
      expected.push_back(
          {p + "pre_feedforward_layernorm.weight", {c.hidden_size}});
      expected.push_back(
          {p + "post_feedforward_layernorm.weight", {c.hidden_size}});
    }
    if (c.layer.qkv_tensors == ProjectionTensors::kFused) {
      expected.push_back(
          {p + "self_attn.qkv_proj.weight", {q + 2 * kv, c.hidden_size}});
    } else {
      expected.push_back({p + "self_attn.q_proj.weight", {q, c.hidden_size}});
      expected.push_back({p + "self_attn.k_proj.weight", {kv, c.hidden_size}});
      expected.push_back({p + "self_attn.v_proj.weight", {kv, c.hidden_size}});
    }
    expected.push_back({p + "self_attn.o_proj.weight", {c.hidden_size, q}});
    if (c.layer.qkv_bias) {
      expected.push_back({p + "self_attn.q_proj.bias", {q}});
      expected.push_back({p + "self_attn.k_proj.bias", {kv}});
      expected.push_back({p + "self_attn.v_proj.bias", {kv}});
    }
    if (c.layer.qk_norm == QkNorm::kPerHeadRms) {
      expected.push_back({p + "self_attn.q_norm.weight", {c.head_dim}});
      expected.push_back({p + "self_attn.k_norm.weight", {c.head_dim}});
    }
    if (c.layer.gate_up_tensors == ProjectionTensors::kFused) {
      expected.push_back({p + "mlp.gate_up_proj.weight",
                          {2 * c.intermediate_size, c.hidden_size}});
    } else {
      expected.push_back(
          {p + "mlp.gate_proj.weight", {c.intermediate_size, c.hidden_size}});
      expected.push_back(
          {p + "mlp.up_proj.weight", {c.intermediate_size, c.hidden_size}});
    }
    expected.push_back(
        {p + "mlp.down_proj.weight", {c.hidden_size, c.intermediate_size}});
  }
  return expected;
}

TEST(CheckpointTest, EveryShapeHasExactlyTheTensorsItsConfigImplies) {
  for (const TinyShape shape : AllTinyShapes()) {
    SCOPED_TRACE(TinyShapeName(shape));
    const std::string dir = WriteModel(shape, DType::kFloat32, 1);
    auto config = LoadModelConfig(dir);
    ASSERT_TRUE(config.ok()) << config.status();
    auto checkpoint = OpenOrDie(dir);
    ASSERT_NE(checkpoint, nullptr);
    // A multimodal checkpoint's text tensors sit under its prefix, beside
    // the other towers' (not counted).
    const std::string& prefix = config->tensor_prefix;
    size_t text_tensors = 0;
    for (const std::string& name : checkpoint->TensorNames()) {
      bool other_tower = false;
      for (const std::string& ignored : config->ignored_tensor_prefixes) {
        other_tower |= name.rfind(ignored, 0) == 0;
      }
      text_tensors += other_tower ? 0 : 1;
    }
    const auto expected = ExpectedTensors(*config);
    EXPECT_EQ(text_tensors, expected.size());
    for (const auto& [name, tensor_shape] : expected) {
      ASSERT_TRUE(checkpoint->Has(prefix + name)) << prefix + name;
      auto values = checkpoint->GetFloat32(prefix + name, tensor_shape);
      ASSERT_TRUE(values.ok()) << values.status();
      for (const float v : *values) ASSERT_TRUE(std::isfinite(v)) << name;
    }
    EXPECT_EQ(checkpoint->Has(prefix + "lm_head.weight"),
              !config->tie_word_embeddings);
  }
}

TEST(CheckpointTest, ThreeShardsLoadIdenticallyToOne) {
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const std::string one_dir = WriteModel(TinyShape::kQkvBias, dtype, 1);
    const std::string three_dir = WriteModel(TinyShape::kQkvBias, dtype, 3);
    EXPECT_TRUE(
        std::filesystem::exists(three_dir + "/model.safetensors.index.json"));
    EXPECT_FALSE(std::filesystem::exists(three_dir + "/model.safetensors"));
    auto one = OpenOrDie(one_dir);
    auto three = OpenOrDie(three_dir);
    ASSERT_NE(one, nullptr);
    ASSERT_NE(three, nullptr);
    EXPECT_EQ(one->num_files(), 1u);
    EXPECT_EQ(three->num_files(), 3u);
    ASSERT_EQ(one->TensorNames(), three->TensorNames());
    for (const std::string& name : one->TensorNames()) {
      const TensorInfo* a = one->Find(name);
      const TensorInfo* b = three->Find(name);
      ASSERT_EQ(a->shape, b->shape) << name;
      ASSERT_EQ(a->dtype, b->dtype) << name;
      auto va = one->GetFloat32(name, a->shape);
      auto vb = three->GetFloat32(name, a->shape);
      ASSERT_TRUE(va.ok() && vb.ok());
      ASSERT_EQ(0,
                std::memcmp(va->data(), vb->data(), va->size() * sizeof(float)))
          << name;
    }
  }
}

TEST(CheckpointTest, SameSeedSameBytesOtherSeedOtherWeights) {
  const std::string a = WriteModel(TinyShape::kGqa, DType::kFloat32, 1, 7);
  const std::string b = WriteModel(TinyShape::kGqa, DType::kFloat32, 1, 7);
  const std::string c = WriteModel(TinyShape::kGqa, DType::kFloat32, 1, 8);
  const auto read = [](const std::string& path) {
    std::ifstream file(path, std::ios::binary);
    std::ostringstream text;
    text << file.rdbuf();
    return text.str();
  };
  EXPECT_EQ(read(a + "/model.safetensors"), read(b + "/model.safetensors"));
  EXPECT_EQ(read(a + "/config.json"), read(b + "/config.json"));
  auto ca = OpenOrDie(a);
  auto cc = OpenOrDie(c);
  auto wa = ca->GetFloat32("lm_head.weight", {256, 64});
  auto wc = cc->GetFloat32("lm_head.weight", {256, 64});
  ASSERT_TRUE(wa.ok() && wc.ok());
  EXPECT_NE(*wa, *wc);
}

// The generator's weights have the advertised statistics: fan-in scaled
// matrices (std ~ 1/sqrt(in_features)) and norms in 1 +- 0.1.
TEST(CheckpointTest, WeightsHaveTheIntendedScale) {
  auto checkpoint = OpenOrDie(WriteModel(TinyShape::kGqa, DType::kFloat32, 1));
  auto down =
      checkpoint->GetFloat32("model.layers.0.mlp.down_proj.weight", {64, 128});
  ASSERT_TRUE(down.ok());
  double sum_squares = 0;
  for (const float v : *down) sum_squares += static_cast<double>(v) * v;
  const double std_dev = std::sqrt(sum_squares / down->size());
  EXPECT_NEAR(std_dev, 1.0 / std::sqrt(128.0), 0.1 / std::sqrt(128.0));
  auto norm = checkpoint->GetFloat32("model.norm.weight", {64});
  ASSERT_TRUE(norm.ok());
  for (const float v : *norm) {
    EXPECT_GE(v, 0.9f);
    EXPECT_LE(v, 1.1f);
  }
}

TEST(CheckpointTest, LowerPrecisionCheckpointsHoldRoundedValues) {
  auto f32 = OpenOrDie(WriteModel(TinyShape::kTied, DType::kFloat32, 1));
  auto bf16 = OpenOrDie(WriteModel(TinyShape::kTied, DType::kBFloat16, 2));
  auto f16 = OpenOrDie(WriteModel(TinyShape::kTied, DType::kFloat16, 1));
  const std::vector<int64_t> shape = {320, 64};
  auto exact = f32->GetFloat32("model.embed_tokens.weight", shape);
  auto b = bf16->GetFloat32("model.embed_tokens.weight", shape);
  auto h = f16->GetFloat32("model.embed_tokens.weight", shape);
  ASSERT_TRUE(exact.ok() && b.ok() && h.ok());
  for (size_t i = 0; i < exact->size(); ++i) {
    const float x = (*exact)[i];
    // Rounding error at most half an ulp: 2^-8 relative (bf16), 2^-11
    // relative (f16) or half the f16 subnormal spacing 2^-24 near zero.
    ASSERT_LE(std::fabs((*b)[i] - x), std::fabs(x) * 0x1p-8f) << i;
    ASSERT_LE(std::fabs((*h)[i] - x),
              std::max(std::fabs(x) * 0x1p-11f, 0x1p-25f))
        << i;
    uint32_t bits;
    std::memcpy(&bits, &(*b)[i], 4);
    ASSERT_EQ(bits & 0xffffu, 0u) << "bf16 values have 8 significant bits";
  }
  // The bf16 checkpoint stores the f32 one's values rounded to nearest
  // even (what UploadTensor makes of an f32 tensor for a bf16 device).
  for (size_t i = 0; i < b->size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &(*b)[i], 4);
    ASSERT_EQ(FloatToBFloat16Bits((*exact)[i]), bits >> 16) << i;
  }
}

TEST(CheckpointTest, ShapeMismatchAndMissingTensorAreErrors) {
  auto checkpoint = OpenOrDie(WriteModel(TinyShape::kTied, DType::kFloat32, 1));
  auto wrong = checkpoint->GetFloat32("model.embed_tokens.weight", {64, 320});
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong.status().message()),
              HasSubstr("[320, 64], expected [64, 320]"));
  EXPECT_THAT(std::string(wrong.status().message()),
              HasSubstr("model.embed_tokens.weight"));
  auto missing = checkpoint->GetFloat32("lm_head.weight", {320, 64});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("lm_head.weight"));
  EXPECT_FALSE(checkpoint->Has("lm_head.weight"));
  EXPECT_EQ(checkpoint->Find("lm_head.weight"), nullptr);
}

Json ReadIndex(const std::string& dir) {
  std::ifstream file(dir + "/model.safetensors.index.json");
  return Json::parse(file);
}

void WriteIndex(const std::string& dir, const Json& index) {
  std::ofstream file(dir + "/model.safetensors.index.json");
  file << index.dump();
}

TEST(CheckpointTest, MissingShardIsNotFound) {
  const std::string dir = WriteModel(TinyShape::kGqa, DType::kFloat32, 3);
  std::filesystem::remove(dir + "/model-00002-of-00003.safetensors");
  auto checkpoint = Checkpoint::Open(dir);
  ASSERT_FALSE(checkpoint.ok());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(checkpoint.status().message()),
              HasSubstr("model-00002-of-00003.safetensors"));
}

TEST(CheckpointTest, TensorMissingFromItsShardIsAnError) {
  const std::string dir = WriteModel(TinyShape::kGqa, DType::kFloat32, 3);
  Json index = ReadIndex(dir);
  // lm_head lives in the last shard; point the index at the first.
  ASSERT_EQ(index["weight_map"]["lm_head.weight"],
            "model-00003-of-00003.safetensors");
  index["weight_map"]["lm_head.weight"] = "model-00001-of-00003.safetensors";
  WriteIndex(dir, index);
  auto checkpoint = Checkpoint::Open(dir);
  ASSERT_FALSE(checkpoint.ok());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(checkpoint.status().message()),
              HasSubstr("\"lm_head.weight\" in model-00001-of-00003"));
}

TEST(CheckpointTest, MalformedIndexesAreErrors) {
  const std::string dir = WriteModel(TinyShape::kGqa, DType::kFloat32, 2);
  const Json good = ReadIndex(dir);
  const std::vector<std::pair<std::string, std::function<void(Json&)>>> cases =
      {
          {"escaping_path",
           [](Json& j) {
             j["weight_map"]["lm_head.weight"] = "../model.safetensors";
           }},
          {"absolute_path",
           [](Json& j) { j["weight_map"]["lm_head.weight"] = "/etc/passwd"; }},
          {"shard_not_string",
           [](Json& j) { j["weight_map"]["lm_head.weight"] = 3; }},
          {"no_weight_map", [](Json& j) { j.erase("weight_map"); }},
          {"weight_map_list",
           [](Json& j) {
             j["weight_map"] = {1, 2};
           }},
      };
  for (const auto& [name, mutate] : cases) {
    SCOPED_TRACE(name);
    Json index = good;
    mutate(index);
    WriteIndex(dir, index);
    auto checkpoint = Checkpoint::Open(dir);
    ASSERT_FALSE(checkpoint.ok());
    EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument)
        << checkpoint.status();
  }
  {
    std::ofstream file(dir + "/model.safetensors.index.json");
    file << "{\"weight_map\": ";
  }
  auto not_json = Checkpoint::Open(dir);
  ASSERT_FALSE(not_json.ok());
  EXPECT_THAT(std::string(not_json.status().message()), HasSubstr("JSON"));
}

TEST(CheckpointTest, EmptyDirectoryAndCorruptShard) {
  auto empty =
      Checkpoint::Open(model_testing::MakeUniqueTempDir("empty_model"));
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(empty.status().message()),
              HasSubstr("model.safetensors"));

  const std::string dir = WriteModel(TinyShape::kGqa, DType::kFloat32, 1);
  const std::string path = dir + "/model.safetensors";
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 3);
  auto truncated = Checkpoint::Open(dir);
  ASSERT_FALSE(truncated.ok());
  EXPECT_EQ(truncated.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CheckpointTest, SingleFileWinsOverIndex) {
  // transformers prefers model.safetensors when both exist.
  const std::string dir = WriteModel(TinyShape::kGqa, DType::kFloat32, 1);
  WriteIndex(dir, Json{{"weight_map", {{"x", "missing.safetensors"}}}});
  auto checkpoint = OpenOrDie(dir);
  ASSERT_NE(checkpoint, nullptr);
  EXPECT_TRUE(checkpoint->Has("lm_head.weight"));
  EXPECT_FALSE(checkpoint->Has("x"));
}

TEST(CheckpointTest, RejectsInvalidShardCounts) {
  TinyModelOptions options;
  options.num_shards = 0;
  EXPECT_FALSE(
      WriteTinyModel(options, model_testing::MakeUniqueTempDir("bad_shards"))
          .ok());
  options.num_shards = 1000;
  EXPECT_FALSE(
      WriteTinyModel(options, model_testing::MakeUniqueTempDir("bad_shards"))
          .ok());
}

}  // namespace
}  // namespace pdworker
