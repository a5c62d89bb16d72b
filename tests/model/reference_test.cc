// The independent numpy reference (tests/reference/llama_reference.py) on
// every tiny shape made by the make_tiny_model binary: shapes, finiteness,
// causality, greedy self-consistency, sharding/dtype invariance, and
// agreement with a second forward written here with plain loops.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/model/command.h"
#include "tests/model/config_layouts.h"
#include "tests/model/reference_runner.h"
#include "tests/model/test_paths.h"
#include "tests/model/tiny_model_maker.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/model/checkpoint.h"
#include "worker/model/model_config.h"

namespace pdworker {
namespace {

using model_testing::MakeTinyModel;
using model_testing::RunReferenceGreedy;
using model_testing::RunReferenceLogits;
using model_testing::TinyModelRequest;
using ::testing::HasSubstr;

// float64 math rounded to float32 once: recomputing the same rows in another
// batch shape may differ only in that final rounding.
constexpr float kSameComputationTolerance = 1e-5f;

std::string MakeModelOrDie(const TinyModelRequest& request) {
  auto dir = MakeTinyModel(request);
  EXPECT_TRUE(dir.ok()) << dir.status();
  return dir.ok() ? *dir : "";
}

float MaxAbsDiff(const float* a, const float* b, size_t n) {
  float worst = 0;
  for (size_t i = 0; i < n; ++i)
    worst = std::max(worst, std::fabs(a[i] - b[i]));
  return worst;
}

class ReferenceShapeTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ReferenceShapeTest, LogitsAreFiniteShapedAndCausal) {
  TinyModelRequest request;
  request.shape = GetParam();
  const std::string dir = MakeModelOrDie(request);
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  const size_t vocab = static_cast<size_t>(config->vocab_size);

  const std::vector<int32_t> long_sequence = {1, 17, 42, 99, 3,   250, 7,
                                              7, 8,  64, 5,  200, 31,  0};
  const std::vector<int32_t> prefix(long_sequence.begin(),
                                    long_sequence.begin() + 5);
  std::vector<int32_t> changed_tail = long_sequence;
  changed_tail[9] = 11;  // differs from position 9 on
  const std::vector<int32_t> repeated(6, 42);
  auto logits = RunReferenceLogits(
      dir, {long_sequence, prefix, changed_tail, repeated, {5}});
  ASSERT_TRUE(logits.ok()) << logits.status();
  ASSERT_EQ(logits->size(), 5u);
  const std::vector<float>& full = (*logits)[0];
  ASSERT_EQ(full.size(), long_sequence.size() * vocab);
  ASSERT_EQ((*logits)[1].size(), prefix.size() * vocab);
  ASSERT_EQ((*logits)[4].size(), vocab);

  for (const auto& sequence_logits : *logits) {
    for (const float v : sequence_logits) ASSERT_TRUE(std::isfinite(v));
  }
  // Not degenerate: each row spreads over a range of values, and rows at
  // different positions differ.
  for (size_t row = 0; row < long_sequence.size(); ++row) {
    const auto [lo, hi] = std::minmax_element(full.begin() + row * vocab,
                                              full.begin() + (row + 1) * vocab);
    EXPECT_GT(*hi - *lo, 1.0f) << "row " << row;
  }
  EXPECT_GT(MaxAbsDiff(&full[0], &full[vocab], vocab), 0.1f);

  // Causality: the prefix's logits are the long sequence's first rows...
  EXPECT_LE(MaxAbsDiff((*logits)[1].data(), full.data(), prefix.size() * vocab),
            kSameComputationTolerance);
  // ...and changing token 9 leaves rows 0..8 alone but changes row 9 on.
  const std::vector<float>& changed = (*logits)[2];
  EXPECT_LE(MaxAbsDiff(changed.data(), full.data(), 9 * vocab),
            kSameComputationTolerance);
  for (size_t row = 9; row < long_sequence.size(); ++row) {
    EXPECT_GT(MaxAbsDiff(&changed[row * vocab], &full[row * vocab], vocab),
              1e-3f)
        << "row " << row;
  }
  // A run of one token attends to identical values at every position, so
  // (with RoPE touching only q and k) every row is the same.
  const std::vector<float>& same = (*logits)[3];
  for (size_t row = 1; row < repeated.size(); ++row) {
    EXPECT_LE(MaxAbsDiff(&same[row * vocab], &same[0], vocab), 1e-4f)
        << "row " << row;
  }
}

TEST_P(ReferenceShapeTest, GreedyTokensAreTheArgmaxOfTheLogits) {
  TinyModelRequest request;
  request.shape = GetParam();
  const std::string dir = MakeModelOrDie(request);
  const std::vector<int32_t> prompt = {3, 14, 15, 92, 65};
  constexpr int kSteps = 8;
  auto greedy = RunReferenceGreedy(dir, prompt, kSteps);
  ASSERT_TRUE(greedy.ok()) << greedy.status();
  ASSERT_EQ(greedy->size(), static_cast<size_t>(kSteps));

  // One full forward over prompt + generated[:-1] must reproduce every
  // greedy choice at its position.
  std::vector<int32_t> sequence = prompt;
  sequence.insert(sequence.end(), greedy->begin(), greedy->end() - 1);
  auto logits = RunReferenceLogits(dir, {sequence});
  ASSERT_TRUE(logits.ok()) << logits.status();
  const size_t vocab = (*logits)[0].size() / sequence.size();
  for (int step = 0; step < kSteps; ++step) {
    const size_t row = prompt.size() - 1 + static_cast<size_t>(step);
    const float* begin = &(*logits)[0][row * vocab];
    const int32_t argmax =
        static_cast<int32_t>(std::max_element(begin, begin + vocab) - begin);
    EXPECT_EQ((*greedy)[step], argmax) << "step " << step;
  }
}

TEST(ReferenceTest, ShardingDoesNotChangeLogitsAndDtypeBarely) {
  const std::vector<std::vector<int32_t>> sequences = {{1, 2, 3, 4, 5, 6, 7}};
  TinyModelRequest request;
  request.shape = "llama3_rope";
  request.dtype = "bfloat16";
  auto one = RunReferenceLogits(MakeModelOrDie(request), sequences);
  request.shards = 3;
  auto three = RunReferenceLogits(MakeModelOrDie(request), sequences);
  request.shards = 1;
  request.dtype = "float32";
  auto f32 = RunReferenceLogits(MakeModelOrDie(request), sequences);
  ASSERT_TRUE(one.ok() && three.ok() && f32.ok());
  EXPECT_EQ((*one)[0], (*three)[0]);
  // bf16 weights are the f32 ones rounded to 8 bits: logits move a little.
  const float diff =
      MaxAbsDiff((*one)[0].data(), (*f32)[0].data(), (*one)[0].size());
  EXPECT_GT(diff, 0.0f);
  EXPECT_LT(diff, 0.25f);
}

// transformers 5 writes the RoPE base and scaling into "rope_parameters".
// The reference must read them there: a reader that only knows the old
// fields falls back to theta 10000 without scaling and silently computes
// other logits. The GPU comparison against transformers relies on this.
TEST(ReferenceTest, ReadsTheTransformers5ConfigLayout) {
  const std::vector<std::vector<int32_t>> sequences = {
      {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20}};
  TinyModelRequest request;
  request.shape = "llama3_rope";
  const std::string old_layout = MakeModelOrDie(request);
  const std::string new_layout = MakeModelOrDie(request);
  const auto read_config = [](const std::string& dir) {
    std::ifstream file(dir + "/config.json");
    return nlohmann::json::parse(file);
  };
  const auto write_config = [](const std::string& dir,
                               const nlohmann::json& config) {
    std::ofstream(dir + "/config.json") << config.dump(2);
  };
  nlohmann::json config =
      model_testing::ToTransformers5Layout(read_config(new_layout));
  ASSERT_FALSE(config.contains("rope_theta"));
  ASSERT_EQ(config["rope_parameters"]["rope_type"], "llama3");
  write_config(new_layout, config);
  auto before = RunReferenceLogits(old_layout, sequences);
  auto after = RunReferenceLogits(new_layout, sequences);
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ((*before)[0], (*after)[0]);

  // The base inside rope_parameters is the one used.
  config["rope_parameters"]["rope_theta"] =
      config["rope_parameters"]["rope_theta"].get<double>() * 4;
  write_config(new_layout, config);
  auto other_theta = RunReferenceLogits(new_layout, sequences);
  ASSERT_TRUE(other_theta.ok()) << other_theta.status();
  EXPECT_GT(MaxAbsDiff((*before)[0].data(), (*other_theta)[0].data(),
                       (*before)[0].size()),
            1e-3f);
}

TEST(ReferenceTest, BinaryWritesTheSameBytesAsTheLibrary) {
  TinyModelRequest request;
  request.shape = "head_dim";
  request.dtype = "float16";
  request.seed = 5;
  const std::string from_binary = MakeModelOrDie(request);
  const std::string from_library = model_testing::MakeUniqueTempDir("library");
  TinyModelOptions options;
  options.shape = TinyShape::kHeadDim;
  options.dtype = DType::kFloat16;
  options.seed = 5;
  ASSERT_TRUE(WriteTinyModel(options, from_library).ok());
  const auto read = [](const std::string& path) {
    std::ifstream file(path, std::ios::binary);
    std::ostringstream text;
    text << file.rdbuf();
    return text.str();
  };
  for (const char* name : {"/config.json", "/model.safetensors"}) {
    const std::string a = read(from_binary + name);
    EXPECT_FALSE(a.empty()) << name;
    EXPECT_EQ(a, read(from_library + name)) << name;
  }
}

TEST(ReferenceTest, ShapeAllWritesOneLoadableDirectoryPerShape) {
  const std::string out = model_testing::MakeUniqueTempDir("all_shapes");
  auto run = model_testing::RunCommand(absl::StrCat(
      model_testing::ShellQuote(
          model_testing::RunfilePath("tools/make_tiny_model/make_tiny_model")),
      " --shape=all --shards=2 --out_dir=", model_testing::ShellQuote(out)));
  ASSERT_TRUE(run.ok()) << run.status();
  for (const TinyShape shape : AllTinyShapes()) {
    const std::string dir = absl::StrCat(out, "/", TinyShapeName(shape));
    SCOPED_TRACE(dir);
    auto config = LoadModelConfig(dir);
    ASSERT_TRUE(config.ok()) << config.status();
    auto checkpoint = Checkpoint::Open(dir);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
    EXPECT_EQ((*checkpoint)->num_files(), 2u);
  }
}

TEST(ReferenceTest, BadInputsAreErrors) {
  const std::string dir = MakeModelOrDie(TinyModelRequest{});
  auto out_of_vocab = RunReferenceLogits(dir, {{1, 256}});  // vocab is 256
  ASSERT_FALSE(out_of_vocab.ok());
  EXPECT_THAT(std::string(out_of_vocab.status().message()),
              HasSubstr("outside vocab"));
  EXPECT_FALSE(RunReferenceLogits(dir, {{}}).ok());
  EXPECT_FALSE(RunReferenceLogits(dir + "/missing", {{1}}).ok());

  TinyModelRequest bad_shape;
  bad_shape.shape = "mamba";
  auto made = MakeTinyModel(bad_shape);
  ASSERT_FALSE(made.ok());
  EXPECT_THAT(std::string(made.status().message()), HasSubstr("mamba"));
}

// ---------------------------------------------------------------------------
// A second forward, written here with plain loops over doubles: RoPE as an
// explicit rotation of the pairs (i, i + head_dim/2) by position * inv_freq[i]
// (what HF's x*cos + rotate_half(x)*sin computes), llama3 frequencies from
// Meta's piecewise formula, one softmax per (query head, position). It shares
// nothing with the Python reference, so a slip in either (a sign in the
// rotation, the GQA head mapping, weight orientation, biases, tying) shows as
// a mismatch.

using Vector = std::vector<double>;

Vector MatVec(const std::vector<float>& w, int64_t out, int64_t in,
              const Vector& x) {
  Vector y(static_cast<size_t>(out), 0.0);
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) y[o] += w[o * in + i] * x[i];
  }
  return y;
}

Vector RmsNorm(const Vector& x, const std::vector<float>& weight, double eps) {
  double mean_square = 0;
  for (const double v : x) mean_square += v * v;
  mean_square /= static_cast<double>(x.size());
  Vector y(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    y[i] = x[i] / std::sqrt(mean_square + eps) * weight[i];
  }
  return y;
}

// Qwen3's q/k norm: RmsNorm over each of `heads` heads of `d` values.
void NormalizeEachHead(Vector& x, int64_t heads, int64_t d,
                       const std::vector<float>& weight, double eps) {
  for (int64_t head = 0; head < heads; ++head) {
    const Vector one(x.begin() + head * d, x.begin() + (head + 1) * d);
    const Vector normalized = RmsNorm(one, weight, eps);
    std::copy(normalized.begin(), normalized.end(), x.begin() + head * d);
  }
}

std::vector<float> Get(const Checkpoint& checkpoint, const std::string& name,
                       const std::vector<int64_t>& shape) {
  auto values = checkpoint.GetFloat32(name, shape);
  EXPECT_TRUE(values.ok()) << values.status();
  return values.ok() ? *values : std::vector<float>();
}

// inv_freq[i], i < head_dim / 2.
Vector InverseFrequencies(const ModelConfig& c) {
  Vector inv_freq(static_cast<size_t>(c.head_dim / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    inv_freq[i] = std::pow(c.rope_theta, -2.0 * static_cast<double>(i) /
                                             static_cast<double>(c.head_dim));
  }
  const RopeScaling& s = c.rope_scaling;
  if (s.type == RopeScalingType::kLinear) {
    for (double& f : inv_freq) f /= s.factor;
    return inv_freq;
  }
  if (s.type == RopeScalingType::kYarn) {
    // Pair i's dimension index against the ramp [low, high] where the
    // number of turns over the original context falls from beta_fast to
    // beta_slow; interpolated (f / factor) above it, kept below it.
    const double d = static_cast<double>(c.head_dim);
    auto dim_of = [&](double turns) {
      return d *
             std::log(static_cast<double>(s.original_max_position_embeddings) /
                      (turns * 2 * M_PI)) /
             (2 * std::log(c.rope_theta));
    };
    double low = dim_of(s.beta_fast), high = dim_of(s.beta_slow);
    if (s.truncate) low = std::floor(low), high = std::ceil(high);
    low = std::max(low, 0.0);
    high = std::min(high, d - 1);
    if (low == high) high += 0.001;
    for (size_t i = 0; i < inv_freq.size(); ++i) {
      const double t =
          std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
      inv_freq[i] = t * inv_freq[i] / s.factor + (1 - t) * inv_freq[i];
    }
    return inv_freq;
  }
  if (s.type != RopeScalingType::kLlama3) return inv_freq;
  const double original =
      static_cast<double>(s.original_max_position_embeddings);
  for (double& f : inv_freq) {
    const double wavelength = 2 * M_PI / f;
    if (wavelength < original / s.high_freq_factor) continue;  // kept
    if (wavelength > original / s.low_freq_factor) {
      f /= s.factor;  // slowed down
      continue;
    }
    const double smooth = (original / wavelength - s.low_freq_factor) /
                          (s.high_freq_factor - s.low_freq_factor);
    f = (1 - smooth) * f / s.factor + smooth * f;
  }
  return inv_freq;
}

// Rotates every head of `x` ([heads * head_dim]) for `position`.
void Rotate(Vector& x, int64_t heads, int64_t head_dim, const Vector& inv_freq,
            int64_t position) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(position) * inv_freq[i];
      double& a = x[h * head_dim + i];
      double& b = x[h * head_dim + i + half];
      const double rotated_a = a * std::cos(angle) - b * std::sin(angle);
      const double rotated_b = b * std::cos(angle) + a * std::sin(angle);
      a = rotated_a;
      b = rotated_b;
    }
  }
}

Vector Projection(const Checkpoint& w, const std::string& prefix, int64_t out,
                  int64_t in, bool bias, const Vector& x) {
  Vector y = MatVec(Get(w, prefix + ".weight", {out, in}), out, in, x);
  if (bias) {
    const std::vector<float> b = Get(w, prefix + ".bias", {out});
    for (int64_t i = 0; i < out; ++i) y[i] += b[i];
  }
  return y;
}

// Logits [position][vocab] for `tokens`.
std::vector<Vector> HandWrittenLogits(const ModelConfig& c, const Checkpoint& w,
                                      const std::vector<int32_t>& tokens) {
  const int64_t hidden = c.hidden_size;
  const int64_t heads = c.num_attention_heads;
  const int64_t kv_heads = c.num_key_value_heads;
  const int64_t d = c.head_dim;
  const int64_t group = heads / kv_heads;
  const size_t n = tokens.size();
  const Vector inv_freq = InverseFrequencies(c);
  const std::vector<float> embed =
      Get(w, "model.embed_tokens.weight", {c.vocab_size, hidden});
  std::vector<Vector> h;
  h.reserve(n);
  for (const int32_t t : tokens) {
    h.emplace_back(embed.begin() + t * hidden,
                   embed.begin() + (t + 1) * hidden);
  }
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const std::string p = absl::StrCat("model.layers.", layer, ".");
    std::vector<Vector> q(n), k(n), v(n);
    for (size_t pos = 0; pos < n; ++pos) {
      const Vector x =
          RmsNorm(h[pos], Get(w, p + "input_layernorm.weight", {hidden}),
                  c.rms_norm_eps);
      if (c.layer.qkv_tensors == ProjectionTensors::kFused) {
        const Vector qkv =
            Projection(w, p + "self_attn.qkv_proj", (heads + 2 * kv_heads) * d,
                       hidden, c.layer.qkv_bias, x);
        const auto at = [&qkv](int64_t i) { return qkv.begin() + i; };
        q[pos] = Vector(at(0), at(heads * d));
        k[pos] = Vector(at(heads * d), at((heads + kv_heads) * d));
        v[pos] = Vector(at((heads + kv_heads) * d), qkv.end());
      } else {
        q[pos] = Projection(w, p + "self_attn.q_proj", heads * d, hidden,
                            c.layer.qkv_bias, x);
        k[pos] = Projection(w, p + "self_attn.k_proj", kv_heads * d, hidden,
                            c.layer.qkv_bias, x);
        v[pos] = Projection(w, p + "self_attn.v_proj", kv_heads * d, hidden,
                            c.layer.qkv_bias, x);
      }
      if (c.layer.qk_norm == QkNorm::kPerHeadRms) {
        NormalizeEachHead(q[pos], heads, d,
                          Get(w, p + "self_attn.q_norm.weight", {d}),
                          c.rms_norm_eps);
        NormalizeEachHead(k[pos], kv_heads, d,
                          Get(w, p + "self_attn.k_norm.weight", {d}),
                          c.rms_norm_eps);
      }
      Rotate(q[pos], heads, d, inv_freq, static_cast<int64_t>(pos));
      Rotate(k[pos], kv_heads, d, inv_freq, static_cast<int64_t>(pos));
      if (c.rope_scaling.type == RopeScalingType::kYarn) {
        // YaRN scales the rotated q and k (HF: cos and sin).
        for (double& x : q[pos]) x *= c.rope_scaling.attention_factor;
        for (double& x : k[pos]) x *= c.rope_scaling.attention_factor;
      }
    }
    for (size_t pos = 0; pos < n; ++pos) {
      Vector attention(static_cast<size_t>(heads * d), 0.0);
      for (int64_t head = 0; head < heads; ++head) {
        const int64_t kv = head / group;
        // Scores against keys 0..pos (causal; a sliding layer only the last
        // `window` of them), softmax, weighted values.
        const size_t first =
            c.SlidesAt(layer) &&
                    pos + 1 > static_cast<size_t>(*c.sliding_window)
                ? pos + 1 - static_cast<size_t>(*c.sliding_window)
                : 0;
        Vector scores(pos + 1, -1e300);
        double max_score = -1e300;
        for (size_t j = first; j <= pos; ++j) {
          double dot = 0;
          for (int64_t i = 0; i < d; ++i) {
            dot += q[pos][head * d + i] * k[j][kv * d + i];
          }
          scores[j] = dot / std::sqrt(static_cast<double>(d));
          max_score = std::max(max_score, scores[j]);
        }
        double total = 0;
        for (double& s : scores) total += (s = std::exp(s - max_score));
        for (size_t j = 0; j <= pos; ++j) {
          for (int64_t i = 0; i < d; ++i) {
            attention[head * d + i] += scores[j] / total * v[j][kv * d + i];
          }
        }
      }
      const Vector o = Projection(w, p + "self_attn.o_proj", hidden, heads * d,
                                  c.layer.o_proj_bias, attention);
      for (int64_t i = 0; i < hidden; ++i) h[pos][i] += o[i];
    }
    const int64_t inter = c.intermediate_size;
    for (size_t pos = 0; pos < n; ++pos) {
      const Vector x = RmsNorm(
          h[pos], Get(w, p + "post_attention_layernorm.weight", {hidden}),
          c.rms_norm_eps);
      Vector gate, up;
      if (c.layer.gate_up_tensors == ProjectionTensors::kFused) {
        const Vector gate_up =
            Projection(w, p + "mlp.gate_up_proj", 2 * inter, hidden, false, x);
        gate = Vector(gate_up.begin(), gate_up.begin() + inter);
        up = Vector(gate_up.begin() + inter, gate_up.end());
      } else {
        gate = Projection(w, p + "mlp.gate_proj", inter, hidden, false, x);
        up = Projection(w, p + "mlp.up_proj", inter, hidden, false, x);
      }
      Vector act(static_cast<size_t>(inter));
      for (int64_t i = 0; i < inter; ++i) {
        act[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
      }
      const Vector down =
          Projection(w, p + "mlp.down_proj", hidden, inter, false, act);
      for (int64_t i = 0; i < hidden; ++i) h[pos][i] += down[i];
    }
  }
  const std::string head_name =
      c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  const std::vector<float> lm_head = Get(w, head_name, {c.vocab_size, hidden});
  const std::vector<float> final_norm = Get(w, "model.norm.weight", {hidden});
  std::vector<Vector> logits;
  logits.reserve(n);
  for (size_t pos = 0; pos < n; ++pos) {
    logits.push_back(MatVec(lm_head, c.vocab_size, hidden,
                            RmsNorm(h[pos], final_norm, c.rms_norm_eps)));
  }
  return logits;
}

TEST_P(ReferenceShapeTest, MatchesAPlainLoopsForward) {
  TinyModelRequest request;
  request.shape = GetParam();
  request.dtype = "bfloat16";
  const std::string dir = MakeModelOrDie(request);
  auto config = LoadModelConfig(dir);
  auto checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(config.ok() && checkpoint.ok());
  // Long enough that llama3's slowed-down and smoothed frequencies turn
  // through visibly different angles than plain RoPE would.
  std::vector<int32_t> tokens(24);
  for (int i = 0; i < 24; ++i) tokens[i] = (i * 37 + 11) % 256;
  auto logits = RunReferenceLogits(dir, {tokens});
  ASSERT_TRUE(logits.ok()) << logits.status();
  const std::vector<Vector> expected =
      HandWrittenLogits(*config, **checkpoint, tokens);
  const size_t vocab = static_cast<size_t>(config->vocab_size);
  ASSERT_EQ((*logits)[0].size(), tokens.size() * vocab);
  for (size_t pos = 0; pos < tokens.size(); ++pos) {
    for (size_t i = 0; i < vocab; ++i) {
      ASSERT_NEAR((*logits)[0][pos * vocab + i], expected[pos][i],
                  1e-5 * std::max(1.0, std::fabs(expected[pos][i])))
          << "position " << pos << " logit " << i;
    }
  }
}

// Every test shape but gemma2, whose layer (sandwich norms, GeGLU,
// soft-capping) the hand-written forward above does not implement; the
// runner tests check gemma2 against the numpy reference.
INSTANTIATE_TEST_SUITE_P(EveryShape, ReferenceShapeTest,
                         ::testing::Values("gqa", "tied", "qkv_bias",
                                           "head_dim", "llama3_rope", "qwen3",
                                           "linear_rope", "yarn_rope", "phi3",
                                           "mistral_window"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace pdworker
