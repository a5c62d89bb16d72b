// The model runner against the independent numpy reference
// (tests/reference/llama_reference.py): logits for prefill, decode, mixed and
// padded batches on every tiny checkpoint shape, and greedy generation.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/model/reference_runner.h"
#include "tests/runner/model_runner_test_util.h"

namespace pdworker {
namespace {

using runner_testing::Seq;
using runner_testing::SmallOptions;
using runner_testing::TinyModelDir;

// fp32 kernels vs the reference: differences come from accumulation order
// and fp32 rounding across a few layers of width 64; observed ~1e-6.
constexpr float kLogitTolerance = 2e-4f;

class ReferenceTest : public ::testing::TestWithParam<TinyShape> {};

// Compares row `row` of the runner's last logits with the reference's logits
// after tokens[0..position] of `sequence`.
void ExpectRowMatches(const std::vector<float>& runner_logits, int row,
                      const std::vector<float>& reference, int position,
                      int vocab, const std::string& what) {
  float worst = 0.0f;
  for (int v = 0; v < vocab; ++v) {
    const float got = runner_logits[static_cast<size_t>(row) * vocab + v];
    const float want = reference[static_cast<size_t>(position) * vocab + v];
    ASSERT_TRUE(std::isfinite(got)) << what << " token " << v;
    worst = std::max(worst, std::abs(got - want));
  }
  EXPECT_LE(worst, kLogitTolerance) << what;
}

TEST_P(ReferenceTest, PrefillDecodeMixedAndPaddedBatchesMatch) {
  auto dir = TinyModelDir(GetParam());
  ASSERT_TRUE(dir.ok()) << dir.status();
  // Default role graphs (FULL_AND_PIECEWISE), small capture sizes.
  CpuDevice device;
  auto runner = ModelRunner::Create(
      device, *dir,
      SmallOptions(R"({"cudagraph_capture_sizes":[1,2,4,8,16]})"));
  ASSERT_TRUE(runner.ok()) << runner.status();
  ModelRunner& r = **runner;
  ASSERT_TRUE(r.CaptureGraphs().ok());
  const int vocab = static_cast<int>(r.model_config().vocab_size);

  // Final token streams, fixed in advance (inputs need not be the samples).
  const std::vector<int32_t> a = {5, 17, 42, 8, 99, 3, 61, 12, 7, 30};
  const std::vector<int32_t> b = {1, 2, 3, 77, 4, 5};
  const std::vector<int32_t> c = {150, 9, 44, 21, 33, 8, 2};
  auto ref = model_testing::RunReferenceLogits(*dir, {a, b, c});
  ASSERT_TRUE(ref.ok()) << ref.status();

  struct Step {
    std::vector<SequenceStep> batch;
    // (sequence index into {a, b, c}, position) per batch row.
    std::vector<std::pair<int, int>> rows;
    const char* what;
  };
  const std::vector<Step> steps = {
      {{Seq("a", {a.begin(), a.begin() + 7}), Seq("b", {b[0], b[1], b[2]})},
       {{0, 6}, {1, 2}},
       "prefill of two prompts (10 tokens, padded to 16)"},
      {{Seq("a", {a[7]}), Seq("b", {b[3]})}, {{0, 7}, {1, 3}}, "decode of 2"},
      {{Seq("a", {a[8]}), Seq("c", {c.begin(), c.begin() + 5})},
       {{0, 8}, {2, 4}},
       "mixed: decode + prefill"},
      {{Seq("a", {a[9]}), Seq("b", {b[4]}), Seq("c", {c[5]})},
       {{0, 9}, {1, 4}, {2, 5}},
       "uniform decode of 3 padded to 4"},
      {{Seq("b", {b[5]}), Seq("c", {c[6]})}, {{1, 5}, {2, 6}}, "decode of 2"},
  };
  std::vector<float> logits;
  for (const Step& step : steps) {
    auto result = r.Execute(step.batch);
    ASSERT_TRUE(result.ok()) << step.what << ": " << result.status();
    ASSERT_TRUE(r.ReadLogits(static_cast<int>(step.rows.size()), &logits).ok());
    for (size_t row = 0; row < step.rows.size(); ++row) {
      const auto [seq, pos] = step.rows[row];
      ExpectRowMatches(logits, static_cast<int>(row), (*ref)[seq], pos, vocab,
                       std::string(step.what) + " row " + std::to_string(row));
    }
  }
}

TEST_P(ReferenceTest, Greedy32TokensEqualReference) {
  auto dir = TinyModelDir(GetParam());
  ASSERT_TRUE(dir.ok()) << dir.status();
  CpuDevice device;
  auto runner = ModelRunner::Create(device, *dir, SmallOptions("{}"));
  ASSERT_TRUE(runner.ok()) << runner.status();
  ModelRunner& r = **runner;
  ASSERT_TRUE(r.CaptureGraphs().ok());
  const std::vector<int32_t> prompt = {3, 14, 15, 92, 65, 35};
  auto expected = model_testing::RunReferenceGreedy(*dir, prompt, 32);
  ASSERT_TRUE(expected.ok()) << expected.status();

  std::vector<int32_t> got;
  auto step = r.Execute({Seq("g", prompt)});
  ASSERT_TRUE(step.ok()) << step.status();
  got.push_back(step->sequences[0].token_id);
  while (got.size() < 32) {
    step = r.Execute({Seq("g", {got.back()})});
    ASSERT_TRUE(step.ok()) << step.status();
    got.push_back(step->sequences[0].token_id);
  }
  EXPECT_EQ(got, *expected);
}

// LongRoPE's other list: a Phi-4-mini checkpoint whose context is its
// original one (max_position_embeddings 32 = original_max_position_
// embeddings) runs short_factor, with an attention factor of 1, against the
// reference's short list; its fingerprint differs from the long list's.
TEST(LongropeReferenceTest, ShortFactorWithinTheOriginalContext) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir =
      std::string(tmp ? tmp : "/tmp") + "/tiny_phi4_mini_short";
  TinyModelOptions options;
  options.shape = TinyShape::kPhi4Mini;
  options.seed = 7;
  options.max_position_embeddings = 32;
  ASSERT_TRUE(WriteTinyModel(options, dir).ok());
  CpuDevice device;
  ModelRunnerOptions o = SmallOptions("{}");
  o.max_model_len = 32;
  auto runner = ModelRunner::Create(device, dir, o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  ModelRunner& r = **runner;
  EXPECT_FALSE(r.model_config().rope_scaling.long_factor_active);
  EXPECT_EQ(r.model_config().rope_scaling.attention_factor, 1.0);
  const std::vector<int32_t> prompt = {3, 14, 15, 92, 65, 35};
  auto expected = model_testing::RunReferenceGreedy(dir, prompt, 16);
  ASSERT_TRUE(expected.ok()) << expected.status();
  std::vector<int32_t> got;
  auto step = r.Execute({Seq("g", prompt)});
  ASSERT_TRUE(step.ok()) << step.status();
  got.push_back(step->sequences[0].token_id);
  while (got.size() < 16) {
    step = r.Execute({Seq("g", {got.back()})});
    ASSERT_TRUE(step.ok()) << step.status();
    got.push_back(step->sequences[0].token_id);
  }
  EXPECT_EQ(got, *expected);

  // The long list (the default checkpoint, max_model_len 128 > 32).
  auto long_dir = TinyModelDir(TinyShape::kPhi4Mini);
  ASSERT_TRUE(long_dir.ok()) << long_dir.status();
  CpuDevice long_device;
  auto long_runner = ModelRunner::Create(long_device, *long_dir, o);
  ASSERT_TRUE(long_runner.ok()) << long_runner.status();
  EXPECT_FALSE((*long_runner)->model_config().rope_scaling.long_factor_active)
      << "max_model_len 32 does not exceed the original context";
  ModelRunnerOptions longer = o;
  longer.max_model_len = 33;
  CpuDevice longer_device;
  auto longer_runner = ModelRunner::Create(longer_device, *long_dir, longer);
  ASSERT_TRUE(longer_runner.ok()) << longer_runner.status();
  EXPECT_TRUE((*longer_runner)->model_config().rope_scaling.long_factor_active);
  EXPECT_NE((*long_runner)->model_config().Fingerprint(),
            (*longer_runner)->model_config().Fingerprint());
}

// RoPE "dynamic" (NTK): transformers raises the base only for sequences
// longer than max_position_embeddings, which max_model_len never exceeds,
// so every served length runs plain RoPE: the same logits, bit for bit, as
// the checkpoint without the key (and another fingerprint, since the
// config differs).
TEST(DynamicRopeTest, IsPlainRopeAtEveryServedLength) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp ? tmp : "/tmp") + "/tiny_dynamic";
  TinyModelOptions options;
  options.shape = TinyShape::kGqa;
  options.seed = 7;
  ASSERT_TRUE(WriteTinyModel(options, dir).ok());
  nlohmann::json config = nlohmann::json::parse(TinyModelConfigJson(options));
  config["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 4.0}};
  {
    std::ofstream out(dir + "/config.json");
    out << config.dump(2);
  }
  auto plain_dir = TinyModelDir(TinyShape::kGqa);
  ASSERT_TRUE(plain_dir.ok()) << plain_dir.status();
  std::vector<std::vector<float>> logits;
  std::vector<std::string> fingerprints;
  for (const std::string& d : {dir, *plain_dir}) {
    CpuDevice device;
    auto runner = ModelRunner::Create(device, d, SmallOptions("{}"));
    ASSERT_TRUE(runner.ok()) << runner.status();
    std::vector<int32_t> prompt(60);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = (i * 37 + 5) % 256;
    auto step = (*runner)->Execute({Seq("a", prompt)});
    ASSERT_TRUE(step.ok()) << step.status();
    logits.emplace_back();
    ASSERT_TRUE((*runner)->ReadLogits(1, &logits.back()).ok());
    fingerprints.push_back((*runner)->model_config().Fingerprint());
  }
  EXPECT_EQ(logits[0], logits[1]);
  EXPECT_NE(fingerprints[0], fingerprints[1]);
}

// mistral_window (every layer slides over 8 tokens, blocks of 4): a
// sequence that gives back the blocks leaving its window generates the
// reference's tokens, holds at most the window's blocks (plus the one being
// filled and the one a step crosses into), and its early entries are freed.
TEST(WindowBlocksReferenceTest, FreedBlocksChangeNoTokenAndBoundTheMemory) {
  auto dir = TinyModelDir(TinyShape::kMistralWindow);
  ASSERT_TRUE(dir.ok()) << dir.status();
  for (const char* mode : {"NONE", "FULL_AND_PIECEWISE"}) {
    SCOPED_TRACE(mode);
    CpuDevice device;
    auto runner = ModelRunner::Create(
        device, *dir,
        SmallOptions(absl::StrCat(R"({"cudagraph_mode":")", mode, R"("})")));
    ASSERT_TRUE(runner.ok()) << runner.status();
    ModelRunner& r = **runner;
    ASSERT_TRUE(r.CaptureGraphs().ok());
    const std::vector<int32_t> prompt = {3,  14, 15, 92, 65, 35, 89,
                                         79, 32, 38, 46, 26, 43};
    auto expected = model_testing::RunReferenceGreedy(*dir, prompt, 40);
    ASSERT_TRUE(expected.ok()) << expected.status();
    std::vector<int32_t> got;
    SequenceStep step = Seq("g", prompt);
    step.window_blocks = WindowBlocks::kFree;
    int most_blocks = 0;
    while (got.size() < 40) {
      auto result = r.Execute({step});
      ASSERT_TRUE(result.ok()) << result.status();
      got.push_back(result->sequences[0].token_id);
      most_blocks = std::max(most_blocks, r.kv_cache().Stats().used_blocks);
      step.token_ids = {got.back()};
    }
    EXPECT_EQ(got, *expected);
    const SequenceKv* kv = r.kv_cache().Find("g");
    ASSERT_NE(kv, nullptr);
    EXPECT_EQ(kv->blocks.front(), kFreedBlock);
    // 53 tokens would need 14 blocks; the window needs 8 / 4 + 1, and the
    // block a step writes into one more (the prompt's step held 4).
    EXPECT_LE(most_blocks, 4);
    EXPECT_LE(r.kv_cache().Stats().used_blocks, 4);
  }
}

INSTANTIATE_TEST_SUITE_P(AllShapes, ReferenceTest,
                         ::testing::ValuesIn(AllTinyShapes()),
                         [](const ::testing::TestParamInfo<TinyShape>& info) {
                           return std::string(TinyShapeName(info.param));
                         });

}  // namespace
}  // namespace pdworker
