// The model runner against the independent numpy reference
// (tests/reference/llama_reference.py): logits for prefill, decode, mixed and
// padded batches on every tiny checkpoint shape, and greedy generation.
#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"
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

INSTANTIATE_TEST_SUITE_P(AllShapes, ReferenceTest,
                         ::testing::ValuesIn(AllTinyShapes()),
                         [](const ::testing::TestParamInfo<TinyShape>& info) {
                           return std::string(TinyShapeName(info.param));
                         });

}  // namespace
}  // namespace pdworker
