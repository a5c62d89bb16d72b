// Stop conditions of engine-owned requests, evaluated in the worker:
// max_tokens, stop token ids, EOS ids from generation_config.json (a list),
// ignore_eos, min_tokens (masked in the sampler, not only checked later)
// and the model's maximum length; each reports why it stopped and what
// matched. With overlap the check runs one step late and the extra token is
// discarded: the outputs must be the same.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/engine_test_util.h"

namespace pdworker {
namespace {

using engine_testing::Generation;
using engine_testing::PendingGeneration;
using engine_testing::Prompt;
using engine_testing::ReferenceGeneration;
using engine_testing::Sampled;
using engine_testing::Spec;
using ::testing::ElementsAreArray;

class EngineStopTest : public ::testing::TestWithParam<StepOverlap> {
 protected:
  std::unique_ptr<engine_testing::TestEngine> Start(const std::string& dir) {
    EngineOptions engine_options;
    engine_options.overlap = GetParam();
    return engine_testing::StartEngine(dir, engine_testing::SmallOptions(),
                                       engine_options);
  }

  // `prompt` alone, greedy, banning `banned` for the first `ban_until`
  // samples.
  Sampled Alone(const std::string& dir, const std::vector<int32_t>& prompt,
                int num_tokens, const std::vector<int32_t>& banned = {},
                int ban_until = 0) {
    CpuDevice device;
    auto runner =
        ModelRunner::Create(device, dir, engine_testing::SmallOptions("NONE"));
    CHECK(runner.ok()) << runner.status();
    absl::StatusOr<Sampled> s = ReferenceGeneration(
        **runner, "ref", prompt, num_tokens, {}, banned, ban_until);
    CHECK(s.ok()) << s.status();
    return *s;
  }

  // The first output index >= 2 whose token did not appear before it (a
  // token that can serve as a stop id without stopping earlier).
  static int FreshIndex(const std::vector<int32_t>& tokens) {
    for (size_t i = 2; i < tokens.size(); ++i) {
      if (std::find(tokens.begin(), tokens.begin() + i, tokens[i]) ==
              tokens.begin() + i &&
          tokens[i] != 2) {  // 2 is the tiny model's config.json EOS
        return static_cast<int>(i);
      }
    }
    return -1;
  }
};

TEST_P(EngineStopTest, MaxTokensEndsWithLength) {
  const std::string dir = engine_testing::ModelDir();
  auto t = Start(dir);
  for (const int max_tokens : {1, 2, 7}) {
    PendingGeneration p(*t->engine, Spec(absl::StrCat("m", max_tokens),
                                         Prompt(9, 1), max_tokens));
    const Generation g = p.Wait();
    ASSERT_TRUE(g.status.ok()) << g.status;
    EXPECT_EQ(g.tokens.size(), static_cast<size_t>(max_tokens));
    EXPECT_EQ(g.finish_reason, FinishReason::kLength);
    EXPECT_FALSE(g.matched_token_id.has_value());
  }
}

TEST_P(EngineStopTest, StopTokenIdEndsTheRequestAndIsReported) {
  const std::string dir = engine_testing::ModelDir();
  const std::vector<int32_t> prompt = Prompt(13, 2);
  const Sampled alone = Alone(dir, prompt, 24);
  const int k = FreshIndex(alone.tokens);
  ASSERT_GE(k, 0);
  auto t = Start(dir);
  RequestSpec spec = Spec("stop", prompt, 24);
  spec.stop.stop_token_ids = {250, alone.tokens[k]};
  PendingGeneration p(*t->engine, spec);
  const Generation g = p.Wait();
  ASSERT_TRUE(g.status.ok()) << g.status;
  EXPECT_EQ(g.finish_reason, FinishReason::kStop);
  EXPECT_EQ(g.matched_token_id, alone.tokens[k]);
  // The stop token is the last output; nothing sampled after it (the
  // overlapped step's extra token) is streamed.
  EXPECT_THAT(g.tokens, ElementsAreArray(alone.tokens.begin(),
                                         alone.tokens.begin() + k + 1));
  EXPECT_EQ(t->engine->snapshot().kv.used_blocks, 0);
}

TEST_P(EngineStopTest, EosIdsFromGenerationConfigStopUnlessIgnored) {
  const std::vector<int32_t> prompt = Prompt(21, 3);
  const Sampled alone = Alone(engine_testing::ModelDir(), prompt, 24);
  const int k = FreshIndex(alone.tokens);
  ASSERT_GE(k, 0);
  // generation_config.json lists two ids; config.json says 2.
  engine_testing::ModelDirOptions model;
  model.generation_eos_ids = std::vector<int32_t>{251, alone.tokens[k]};
  const std::string dir = engine_testing::ModelDir(model);
  auto t = Start(dir);

  RequestSpec spec = Spec("eos", prompt, 24);
  spec.stop.eos = EosHandling::kStop;
  PendingGeneration stopped(*t->engine, spec);
  Generation g = stopped.Wait();
  ASSERT_TRUE(g.status.ok()) << g.status;
  EXPECT_EQ(g.finish_reason, FinishReason::kStop);
  EXPECT_FALSE(g.matched_token_id.has_value());  // vLLM: no stop_reason
  EXPECT_THAT(g.tokens, ElementsAreArray(alone.tokens.begin(),
                                         alone.tokens.begin() + k + 1));

  spec.request_id = "ignore";
  spec.stop.eos = EosHandling::kIgnore;
  PendingGeneration ignored(*t->engine, spec);
  g = ignored.Wait();
  ASSERT_TRUE(g.status.ok()) << g.status;
  EXPECT_EQ(g.finish_reason, FinishReason::kLength);
  EXPECT_THAT(g.tokens, ElementsAreArray(alone.tokens));
}

TEST_P(EngineStopTest, MinTokensMasksStopAndEosIdsInTheSampler) {
  const std::string dir = engine_testing::ModelDir();
  const std::vector<int32_t> prompt = Prompt(11, 4);
  const Sampled alone = Alone(dir, prompt, 30);
  const int k = FreshIndex(alone.tokens);
  ASSERT_GE(k, 0);
  const int32_t stop_id = alone.tokens[k];
  const int min_tokens = k + 4;
  // What the request must produce: sampling with {EOS, stop_id} banned for
  // its first min_tokens samples, then cut at the first of them.
  const std::vector<int32_t> banned = {2, stop_id};
  const Sampled masked = Alone(dir, prompt, 30, banned, min_tokens);
  EXPECT_NE(masked.tokens, alone.tokens);  // the mask changed the outputs
  size_t end = masked.tokens.size();
  bool stops = false;
  for (size_t i = min_tokens - 1; i < masked.tokens.size(); ++i) {
    if (masked.tokens[i] == 2 || masked.tokens[i] == stop_id) {
      end = i + 1;
      stops = true;
      break;
    }
  }
  for (int i = 0; i < min_tokens; ++i) {
    EXPECT_NE(masked.tokens[i], stop_id) << i;
    EXPECT_NE(masked.tokens[i], 2) << i;
  }

  auto t = Start(dir);
  RequestSpec spec = Spec("min", prompt, 30);
  spec.stop.eos = EosHandling::kStop;
  spec.stop.stop_token_ids = {stop_id};
  spec.stop.min_tokens = min_tokens;
  PendingGeneration p(*t->engine, spec);
  const Generation g = p.Wait();
  ASSERT_TRUE(g.status.ok()) << g.status;
  EXPECT_THAT(g.tokens, ElementsAreArray(masked.tokens.begin(),
                                         masked.tokens.begin() + end));
  EXPECT_EQ(g.finish_reason,
            stops ? FinishReason::kStop : FinishReason::kLength);
}

TEST_P(EngineStopTest, TheModelsMaximumLengthEndsWithLength) {
  const std::string dir = engine_testing::ModelDir();
  auto t = Start(dir);  // max_model_len 128
  RequestSpec spec = Spec("long", Prompt(120, 5), /*max_tokens=*/0);
  PendingGeneration p(*t->engine, spec);
  const Generation g = p.Wait();
  ASSERT_TRUE(g.status.ok()) << g.status;
  EXPECT_EQ(g.tokens.size(), 8u);  // 120 + 8 = 128
  EXPECT_EQ(g.finish_reason, FinishReason::kLength);
  EXPECT_THAT(g.tokens, ElementsAreArray(Alone(dir, Prompt(120, 5), 8).tokens));
}

INSTANTIATE_TEST_SUITE_P(Overlap, EngineStopTest,
                         ::testing::Values(StepOverlap::kOff, StepOverlap::kOn),
                         [](const ::testing::TestParamInfo<StepOverlap>& i) {
                           return i.param == StepOverlap::kOn ? "overlap"
                                                              : "no_overlap";
                         });

}  // namespace
}  // namespace pdworker
