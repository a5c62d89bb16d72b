// Several sampled rows per sequence (SequenceStep::num_samples, the verify
// step of speculative decoding): a step that feeds a sequence's last token
// and k draft tokens samples after each of them exactly what k + 1
// one-token steps would, in every graph mode, uniform batches of 1 + k
// tokens run in their FULL graphs, rejected drafts roll back with Truncate,
// and bad requests change nothing.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "tests/runner/model_runner_test_util.h"

namespace pdworker {
namespace {

using runner_testing::Seq;
using runner_testing::SmallOptions;
using runner_testing::TinyModelDir;

constexpr int kDrafts = 3;  // k: verify steps have 1 + k tokens
const std::vector<int32_t> kPromptA = {5, 17, 42, 8, 99, 3, 61};
const std::vector<int32_t> kPromptB = {1, 2, 3, 250, 7};
const std::vector<int32_t> kPromptC = {200, 4, 4, 9};

// What one-token greedy steps produce after a prompt: the token sampled at
// each step (the first one by the prefill) and the logits it came from.
struct Reference {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;
};

std::string ModeJson(const std::string& mode) {
  // Capture sizes that hold whole 1 + k token requests (4, 8, 16) and one
  // that does not (2): uniform verify batches pad to a multiple of 4.
  return R"({"cudagraph_mode":")" + mode +
         R"(","cudagraph_capture_sizes":[1,2,4,8,16]})";
}

absl::StatusOr<std::unique_ptr<ModelRunner>> MakeRunner(
    CpuDevice& device, TinyShape shape, const std::string& mode,
    int uniform_decode_query_len, PrefixCaching caching = PrefixCaching::kOff) {
  PDW_ASSIGN_OR_RETURN(const std::string dir, TinyModelDir(shape));
  ModelRunnerOptions o = SmallOptions(ModeJson(mode));
  o.uniform_decode_query_len = uniform_decode_query_len;
  o.prefix_caching = caching;
  PDW_ASSIGN_OR_RETURN(std::unique_ptr<ModelRunner> r,
                       ModelRunner::Create(device, dir, o));
  PDW_RETURN_IF_ERROR(r->CaptureGraphs().status());
  return r;
}

// `steps` one-token greedy steps after `prompt` on an eager runner.
Reference OneTokenSteps(TinyShape shape, const std::vector<int32_t>& prompt,
                        int steps) {
  Reference ref;
  CpuDevice device;
  auto runner = MakeRunner(device, shape, "NONE", 1);
  EXPECT_TRUE(runner.ok()) << runner.status();
  if (!runner.ok()) return ref;
  ModelRunner& r = **runner;
  std::vector<int32_t> next = prompt;
  for (int i = 0; i <= steps; ++i) {
    auto result = r.Execute({Seq("s", next)});
    EXPECT_TRUE(result.ok()) << result.status();
    if (!result.ok()) return ref;
    std::vector<float> logits;
    EXPECT_TRUE(r.ReadLogits(1, &logits).ok());
    ref.logits.push_back(std::move(logits));
    ref.tokens.push_back(result->sequences[0].token_id);
    next = {result->sequences[0].token_id};
  }
  return ref;
}

SequenceStep Verify(const std::string& id, std::vector<int32_t> tokens) {
  SequenceStep s = Seq(id, std::move(tokens));
  s.num_samples = static_cast<int32_t>(s.token_ids.size());
  return s;
}

// The rows a sequence sampled: prior_token_ids then token_id.
std::vector<int32_t> Rows(const SequenceResult& r) {
  std::vector<int32_t> rows = r.prior_token_ids;
  rows.push_back(r.token_id);
  return rows;
}

std::vector<int32_t> Slice(const std::vector<int32_t>& v, size_t from,
                           size_t n) {
  return std::vector<int32_t>(v.begin() + from, v.begin() + from + n);
}

class SampledRowsTest : public ::testing::TestWithParam<const char*> {};

// Logits rows [first, first + n) of the last step equal `want`'s.
void ExpectLogitsRows(ModelRunner& r, int num_rows, int first,
                      const std::vector<std::vector<float>>& want,
                      const std::string& what) {
  std::vector<float> logits;
  ASSERT_TRUE(r.ReadLogits(num_rows, &logits).ok());
  const int vocab = static_cast<int>(r.model_config().vocab_size);
  for (size_t j = 0; j < want.size(); ++j) {
    for (int v = 0; v < vocab; ++v) {
      ASSERT_NEAR(logits[(first + j) * vocab + v], want[j][v], 1e-4f)
          << what << " row " << first + j << " token " << v;
    }
  }
}

// a verifies correct drafts, then drafts wrong from the second on (rolled
// back with Truncate), then continues beside the prompts of b and c (a
// mixed step); then uniform verify batches of two and of three sequences
// (8 tokens, a capture size; 12, padded to 16 with a padding request).
// Every row equals the one-token steps' token, and its logits theirs.
TEST_P(SampledRowsTest, RowsEqualOneTokenSteps) {
  const TinyShape shape = TinyShape::kGqa;
  const Reference ref_a = OneTokenSteps(shape, kPromptA, 19);
  const Reference ref_b = OneTokenSteps(shape, kPromptB, 9);
  const Reference ref_c = OneTokenSteps(shape, kPromptC, 4);
  ASSERT_EQ(ref_a.tokens.size(), 20u);
  ASSERT_EQ(ref_b.tokens.size(), 10u);
  ASSERT_EQ(ref_c.tokens.size(), 5u);
  const std::vector<int32_t>& ta = ref_a.tokens;
  const std::vector<int32_t>& tb = ref_b.tokens;
  const std::vector<int32_t>& tc = ref_c.tokens;
  auto logits_of = [](const Reference& ref, int from, int n) {
    return std::vector<std::vector<float>>(ref.logits.begin() + from,
                                           ref.logits.begin() + from + n);
  };

  CpuDevice device;
  auto runner = MakeRunner(device, shape, GetParam(), 1 + kDrafts);
  ASSERT_TRUE(runner.ok()) << runner.status();
  ModelRunner& r = **runner;
  const CudaGraphMode mode = r.resolved_mode();
  const RuntimeMode uniform_mode = mode.decode_mode() == RuntimeMode::kFull
                                       ? RuntimeMode::kFull
                                       : mode.mixed_mode();
  const int vocab = static_cast<int>(r.model_config().vocab_size);

  auto step = r.Execute({Seq("a", kPromptA)});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->sequences[0].token_id, ta[0]);
  EXPECT_TRUE(step->sequences[0].prior_token_ids.empty());

  // Correct drafts: the four rows are the next four one-token steps'.
  step = r.Execute({Verify("a", Slice(ta, 0, 4))});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(Rows(step->sequences[0]), Slice(ta, 1, 4));
  EXPECT_EQ(step->sequences[0].prior_logprobs.size(), 3u);
  EXPECT_EQ(step->sequences[0].num_tokens,
            static_cast<int>(kPromptA.size()) + 4);
  EXPECT_EQ(step->info.mode, uniform_mode);
  ExpectLogitsRows(r, 4, 0, logits_of(ref_a, 1, 4), "correct drafts");

  // Drafts wrong from the second on: rows 0 and 1 still follow the
  // accepted prefix; then the rejected drafts' KV is rolled back.
  const std::vector<int32_t> drafts = {ta[4], ta[5], (ta[6] + 1) % vocab,
                                       (ta[7] + 2) % vocab};
  step = r.Execute({Verify("a", drafts)});
  ASSERT_TRUE(step.ok()) << step.status();
  const std::vector<int32_t> rows = Rows(step->sequences[0]);
  EXPECT_EQ(rows[0], ta[5]);
  EXPECT_EQ(rows[1], ta[6]);  // the target's token where draft 2 was wrong
  ASSERT_TRUE(r.Truncate("a", static_cast<int>(kPromptA.size()) + 6).ok());

  // b's and c's prompts beside a's verify: a mixed step.
  step = r.Execute(
      {Verify("a", Slice(ta, 6, 4)), Seq("b", kPromptB), Seq("c", kPromptC)});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(Rows(step->sequences[0]), Slice(ta, 7, 4));
  EXPECT_EQ(Rows(step->sequences[1]), Slice(tb, 0, 1));
  EXPECT_EQ(Rows(step->sequences[2]), Slice(tc, 0, 1));
  ExpectLogitsRows(r, 6, 0, logits_of(ref_a, 7, 4), "mixed, a");
  ExpectLogitsRows(r, 6, 4, logits_of(ref_b, 0, 1), "mixed, b");
  ExpectLogitsRows(r, 6, 5, logits_of(ref_c, 0, 1), "mixed, c");

  // Two sequences of 1 + k: 8 tokens, a FULL graph's key where the mode
  // has FULL decode graphs.
  step =
      r.Execute({Verify("a", Slice(ta, 10, 4)), Verify("b", Slice(tb, 0, 4))});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(Rows(step->sequences[0]), Slice(ta, 11, 4));
  EXPECT_EQ(Rows(step->sequences[1]), Slice(tb, 1, 4));
  EXPECT_EQ(step->info.mode, uniform_mode);
  ExpectLogitsRows(r, 8, 4, logits_of(ref_b, 1, 4), "uniform 2, b");

  // Three: 12 tokens padded to 16 (a padding request of 4 tokens).
  step = r.Execute({Verify("a", Slice(ta, 14, 4)), Verify("b", Slice(tb, 4, 4)),
                    Verify("c", Slice(tc, 0, 4))});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(Rows(step->sequences[0]), Slice(ta, 15, 4));
  EXPECT_EQ(Rows(step->sequences[1]), Slice(tb, 5, 4));
  EXPECT_EQ(Rows(step->sequences[2]), Slice(tc, 1, 4));
  EXPECT_EQ(step->info.mode, uniform_mode);
  if (uniform_mode != RuntimeMode::kNone) {
    EXPECT_EQ(step->info.padded_tokens, 16);
  }
  ExpectLogitsRows(r, 12, 8, logits_of(ref_c, 1, 4), "uniform 3, c");

  // A step where nobody verifies drafts (one token each): it keeps a FULL
  // graph of its own where the mode has FULL decode graphs (one-token
  // decode keys), instead of PIECEWISE or eager.
  step = r.Execute({Seq("a", {ta[18]}), Seq("b", {tb[8]})});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->sequences[0].token_id, ta[19]);
  EXPECT_EQ(step->sequences[1].token_id, tb[9]);
  EXPECT_EQ(step->info.mode, uniform_mode);
  if (uniform_mode == RuntimeMode::kFull) {
    EXPECT_EQ(step->info.descriptor, (BatchDescriptor{2, 2, true}));
  }
  ExpectLogitsRows(r, 2, 0, logits_of(ref_a, 19, 1), "one-token, a");
}

// With temperature, each row draws at its own position (the RNG counter):
// the same tokens as one-token steps with the same seed.
TEST_P(SampledRowsTest, RowsDrawAtTheirPositions) {
  SamplingOptions sampling;
  sampling.temperature = 0.9f;
  sampling.top_p = 0.95f;
  sampling.seed = 1234;
  std::vector<int32_t> drawn;
  {
    CpuDevice device;
    auto runner = MakeRunner(device, TinyShape::kGqa, "NONE", 1);
    ASSERT_TRUE(runner.ok()) << runner.status();
    std::vector<int32_t> next = kPromptA;
    for (int i = 0; i < 5; ++i) {
      SequenceStep s = Seq("a", next);
      s.sampling = sampling;
      auto result = (*runner)->Execute({s});
      ASSERT_TRUE(result.ok()) << result.status();
      drawn.push_back(result->sequences[0].token_id);
      next = {drawn.back()};
    }
  }
  CpuDevice device;
  auto runner = MakeRunner(device, TinyShape::kGqa, GetParam(), 1 + kDrafts);
  ASSERT_TRUE(runner.ok()) << runner.status();
  SequenceStep prefill = Seq("a", kPromptA);
  prefill.sampling = sampling;
  auto result = (*runner)->Execute({prefill});
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->sequences[0].token_id, drawn[0]);
  SequenceStep verify = Verify("a", Slice(drawn, 0, 4));
  verify.sampling = sampling;
  result = (*runner)->Execute({verify});
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(Rows(result->sequences[0]), Slice(drawn, 1, 4));
}

INSTANTIATE_TEST_SUITE_P(Modes, SampledRowsTest,
                         ::testing::Values("NONE", "PIECEWISE",
                                           "FULL_DECODE_ONLY",
                                           "FULL_AND_PIECEWISE"));

// Raw logprobs and top alternatives come for every row: each row's equal
// those a one-token step at its position returns.
TEST(SampledRowsLogprobsTest, EveryRowHasTheOneTokenStepsLogprobs) {
  std::vector<SequenceResult> want;
  std::vector<int32_t> tokens;
  {
    CpuDevice device;
    auto runner = MakeRunner(device, TinyShape::kGqa, "NONE", 1);
    ASSERT_TRUE(runner.ok()) << runner.status();
    std::vector<int32_t> next = kPromptA;
    for (int i = 0; i < 5; ++i) {
      SequenceStep s = Seq("a", next);
      s.num_top_logprobs = 3;
      auto result = (*runner)->Execute({s});
      ASSERT_TRUE(result.ok()) << result.status();
      want.push_back(result->sequences[0]);
      tokens.push_back(result->sequences[0].token_id);
      next = {tokens.back()};
    }
  }
  CpuDevice device;
  auto runner =
      MakeRunner(device, TinyShape::kGqa, "FULL_AND_PIECEWISE", 1 + kDrafts);
  ASSERT_TRUE(runner.ok()) << runner.status();
  ASSERT_TRUE((*runner)->Execute({Seq("a", kPromptA)}).ok());
  SequenceStep verify = Verify("a", Slice(tokens, 0, 4));
  verify.num_top_logprobs = 3;
  auto result = (*runner)->Execute({verify, Seq("b", {1, 2, 3})});
  ASSERT_TRUE(result.ok()) << result.status();
  const SequenceResult& got = result->sequences[0];
  ASSERT_EQ(got.prior_raw_logprobs.size(), 3u);
  ASSERT_EQ(got.prior_top_logprobs.size(), 3u);
  for (int j = 0; j < 4; ++j) {
    const SequenceResult& one = want[1 + j];
    const float raw = j < 3 ? got.prior_raw_logprobs[j] : got.raw_logprob;
    const std::vector<TopLogprob>& top =
        j < 3 ? got.prior_top_logprobs[j] : got.top_logprobs;
    EXPECT_NEAR(raw, one.raw_logprob, 1e-5f) << "row " << j;
    ASSERT_EQ(top.size(), one.top_logprobs.size()) << "row " << j;
    for (size_t t = 0; t < top.size(); ++t) {
      EXPECT_EQ(top[t].token_id, one.top_logprobs[t].token_id) << j;
      EXPECT_NEAR(top[t].logprob, one.top_logprobs[t].logprob, 1e-5f) << j;
    }
  }
  // The sequence beside it asked for none.
  EXPECT_TRUE(result->sequences[1].prior_raw_logprobs.empty());
  EXPECT_TRUE(result->sequences[1].top_logprobs.empty());
}

// A sequence's bans hold in every one of its rows.
TEST(SampledRowsBansTest, BansHoldInEveryRow) {
  const Reference ref = OneTokenSteps(TinyShape::kGqa, kPromptA, 4);
  ASSERT_EQ(ref.tokens.size(), 5u);
  CpuDevice device;
  auto runner = MakeRunner(device, TinyShape::kGqa, "NONE", 1 + kDrafts);
  ASSERT_TRUE(runner.ok()) << runner.status();
  ASSERT_TRUE((*runner)->Execute({Seq("a", kPromptA)}).ok());
  SequenceStep verify = Verify("a", Slice(ref.tokens, 0, 4));
  verify.banned_token_ids = Slice(ref.tokens, 1, 4);
  auto result = (*runner)->Execute({verify});
  ASSERT_TRUE(result.ok()) << result.status();
  for (const int32_t token : Rows(result->sequences[0])) {
    for (const int32_t banned : verify.banned_token_ids) {
      EXPECT_NE(token, banned);
    }
  }
}

// With prefix caching, a sequence created by a step with num_samples = n
// computes at least its last n tokens: a 13-token prompt whose first 12
// are cached (3 blocks) takes 2 blocks for n = 4, and its rows equal a
// runner's without the cache.
TEST(SampledRowsPrefixCacheTest, TheSampledTokensAreComputed) {
  std::vector<int32_t> prompt;
  for (int i = 0; i < 13; ++i) prompt.push_back((37 * i + 11) % 256);
  std::vector<int32_t> want;
  {
    CpuDevice device;
    auto runner = MakeRunner(device, TinyShape::kGqa, "NONE", 1 + kDrafts);
    ASSERT_TRUE(runner.ok()) << runner.status();
    SequenceStep s = Seq("y", prompt);
    s.num_samples = 4;
    auto result = (*runner)->Execute({s});
    ASSERT_TRUE(result.ok()) << result.status();
    want = Rows(result->sequences[0]);
  }
  CpuDevice device;
  auto runner = MakeRunner(device, TinyShape::kGqa, "FULL_AND_PIECEWISE",
                           1 + kDrafts, PrefixCaching::kOn);
  ASSERT_TRUE(runner.ok()) << runner.status();
  ModelRunner& r = **runner;
  ASSERT_TRUE(r.Execute({Seq("x", prompt)}).ok());
  SequenceStep s = Seq("y", prompt);
  s.num_samples = 4;
  auto result = r.Execute({s});
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->sequences[0].cached_tokens, 8);
  EXPECT_EQ(Rows(result->sequences[0]), want);
  // One sample: the usual cap (all but the last token's block).
  ASSERT_TRUE(r.Execute({Seq("z", prompt)}).ok());
  EXPECT_EQ(r.kv_cache().Find("z")->num_tokens, 13);
}

// num_samples outside [1, min(tokens, uniform_decode_query_len)], or with
// a placeholder last token: INVALID_ARGUMENT naming the field, and the
// sequence is unchanged.
TEST(SampledRowsRefusalTest, BadRequestsChangeNothing) {
  CpuDevice device;
  auto runner =
      MakeRunner(device, TinyShape::kGqa, "FULL_AND_PIECEWISE", 1 + kDrafts);
  ASSERT_TRUE(runner.ok()) << runner.status();
  ModelRunner& r = **runner;
  ASSERT_TRUE(r.Execute({Seq("a", kPromptA)}).ok());
  const int32_t length = r.kv_cache().Find("a")->num_tokens;
  const int free_blocks = r.kv_cache().Stats().free_blocks;
  auto expect_refused = [&](const SequenceStep& s, const std::string& field) {
    auto result = r.Execute({s});
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument)
        << field << ": " << result.status();
    EXPECT_NE(result.status().message().find(field), std::string::npos)
        << result.status();
    EXPECT_EQ(r.kv_cache().Find("a")->num_tokens, length) << field;
    EXPECT_EQ(r.kv_cache().Stats().free_blocks, free_blocks) << field;
  };
  SequenceStep s = Verify("a", {1, 2, 3});
  s.num_samples = 4;  // more than its tokens
  expect_refused(s, "num_samples");
  s = Verify("a", {1, 2, 3, 4, 5});  // more than uniform_decode_query_len
  expect_refused(s, "num_samples");
  s = Verify("a", {1, 2});
  s.num_samples = 0;
  expect_refused(s, "num_samples");
  // Launched steps in flight: a placeholder last token cannot verify.
  auto slot = r.Launch({Seq("b", {9, 9, 9})});
  ASSERT_TRUE(slot.ok()) << slot.status();
  s = Verify("a", {1, 2});
  s.last_token_from = SampleRef{*slot, 0};
  auto launched = r.Launch({s});
  EXPECT_EQ(launched.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(launched.status().message().find("last_token_from"),
            std::string::npos)
      << launched.status();
  ASSERT_TRUE(r.Retire(*slot).ok());
  EXPECT_EQ(r.kv_cache().Find("a")->num_tokens, length);
}

}  // namespace
}  // namespace pdworker
