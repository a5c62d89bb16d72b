// Engine-owned requests on the CPU backend with a threaded stream, in every
// graph mode, with and without host/device overlap: their tokens equal a
// prompt generated alone step by step (the CPU kernels compute each row the
// same way whatever the batch, so equal means bit for bit, logprobs too),
// whatever else runs beside them.
#include <algorithm>
#include <random>
#include <string>
#include <thread>
#include <tuple>
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

struct Case {
  std::string mode;
  StepOverlap overlap;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return absl::StrCat(info.param.mode, info.param.overlap == StepOverlap::kOn
                                           ? "_overlap"
                                           : "_no_overlap");
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (const std::string& mode : engine_testing::AllModes()) {
    for (StepOverlap overlap : {StepOverlap::kOff, StepOverlap::kOn}) {
      cases.push_back({mode, overlap});
    }
  }
  return cases;
}

class EngineRequestsTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    dir_ = engine_testing::ModelDir();
    options_ = engine_testing::SmallOptions(GetParam().mode);
    EngineOptions engine_options;
    engine_options.overlap = GetParam().overlap;
    engine_ = engine_testing::StartEngine(dir_, options_, engine_options);
    // The reference: its own runner, inline stream, eager.
    reference_device_ = std::make_unique<CpuDevice>();
    auto reference = ModelRunner::Create(*reference_device_, dir_,
                                         engine_testing::SmallOptions("NONE"));
    ASSERT_TRUE(reference.ok()) << reference.status();
    reference_ = *std::move(reference);
  }

  Sampled Alone(const std::vector<int32_t>& prompt, int num_tokens,
                const SamplingOptions& sampling = {}) {
    absl::StatusOr<Sampled> s =
        ReferenceGeneration(*reference_, "ref", prompt, num_tokens, sampling);
    CHECK(s.ok()) << s.status();
    return *s;
  }

  Engine& engine() { return *engine_->engine; }

  std::string dir_;
  ModelRunnerOptions options_;
  std::unique_ptr<engine_testing::TestEngine> engine_;
  std::unique_ptr<CpuDevice> reference_device_;
  std::unique_ptr<ModelRunner> reference_;
};

TEST_P(EngineRequestsTest, GreedyTokensEqualEachPromptAloneStepByStep) {
  // Lengths around the step budget (64 tokens): chunked prefills beside
  // decodes, and more requests than seats (8).
  const std::vector<int> lengths = {1, 5, 17, 63, 64, 65, 100, 3, 40, 9};
  std::vector<std::unique_ptr<PendingGeneration>> pending;
  for (size_t i = 0; i < lengths.size(); ++i) {
    pending.push_back(std::make_unique<PendingGeneration>(
        engine(), Spec(absl::StrCat("r", i), Prompt(lengths[i], i), 12)));
  }
  for (size_t i = 0; i < lengths.size(); ++i) {
    const Generation g = pending[i]->Wait();
    ASSERT_TRUE(g.status.ok()) << i << ": " << g.status;
    EXPECT_EQ(g.finish_reason, FinishReason::kLength) << i;
    const Sampled alone = Alone(Prompt(lengths[i], i), 12);
    EXPECT_THAT(g.tokens, ElementsAreArray(alone.tokens)) << i;
    EXPECT_THAT(g.logprobs, ElementsAreArray(alone.logprobs)) << i;
  }
  const EngineSnapshot s = engine().snapshot();
  EXPECT_EQ(s.kv.used_blocks, 0);
  EXPECT_EQ(s.kv.num_sequences, 0);
  EXPECT_EQ(s.running_requests + s.waiting_requests, 0);
  EXPECT_EQ(s.finished_requests, static_cast<int64_t>(lengths.size()));
}

TEST_P(EngineRequestsTest, SeededSamplingEqualsEachPromptAlone) {
  // The draw depends only on (seed, position): batching changes nothing.
  std::vector<std::unique_ptr<PendingGeneration>> pending;
  for (int i = 0; i < 6; ++i) {
    SamplingOptions sampling;
    sampling.temperature = 0.9f;
    sampling.top_k = i % 2 == 0 ? 0 : 20;
    sampling.top_p = i % 3 == 0 ? 1.0f : 0.8f;
    sampling.seed = 1000 + i;
    pending.push_back(std::make_unique<PendingGeneration>(
        engine(),
        Spec(absl::StrCat("s", i), Prompt(7 + 11 * i, 50 + i), 10, sampling)));
  }
  for (int i = 0; i < 6; ++i) {
    const Generation g = pending[i]->Wait();
    ASSERT_TRUE(g.status.ok()) << g.status;
    SamplingOptions sampling;
    sampling.temperature = 0.9f;
    sampling.top_k = i % 2 == 0 ? 0 : 20;
    sampling.top_p = i % 3 == 0 ? 1.0f : 0.8f;
    sampling.seed = 1000 + i;
    const Sampled alone = Alone(Prompt(7 + 11 * i, 50 + i), 10, sampling);
    EXPECT_THAT(g.tokens, ElementsAreArray(alone.tokens)) << i;
  }
}

TEST_P(EngineRequestsTest, ArrivalTimesChangeNothing) {
  // Requests of different lengths join and leave the running batch at
  // random times; each one's tokens are those it gets alone.
  std::mt19937 rng(GetParam().mode.size() * 7 +
                   (GetParam().overlap == StepOverlap::kOn ? 1 : 0));
  std::vector<std::unique_ptr<PendingGeneration>> pending;
  std::vector<std::pair<std::vector<int32_t>, int>> asked;
  for (int i = 0; i < 16; ++i) {
    std::vector<int32_t> prompt =
        Prompt(1 + static_cast<int>(rng() % 90), 100 + i);
    const int max_tokens = 1 + static_cast<int>(rng() % 20);
    pending.push_back(std::make_unique<PendingGeneration>(
        engine(), Spec(absl::StrCat("a", i), prompt, max_tokens)));
    asked.emplace_back(std::move(prompt), max_tokens);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
  }
  for (int i = 0; i < 16; ++i) {
    const Generation g = pending[i]->Wait();
    ASSERT_TRUE(g.status.ok()) << g.status;
    const Sampled alone = Alone(asked[i].first, asked[i].second);
    EXPECT_THAT(g.tokens, ElementsAreArray(alone.tokens)) << i;
  }
  EXPECT_EQ(engine().snapshot().kv.used_blocks, 0);
}

TEST_P(EngineRequestsTest, StepLevelCallsAndRequestsShareSteps) {
  // A router drives "f" through Forward while the engine decodes its own
  // requests: some steps carry both, and each side gets its own tokens.
  // The references are computed first: computing them while the requests
  // run let a loaded machine finish all 40 steps before the first Forward.
  const std::vector<int32_t> prompt = Prompt(12, 300);
  const Sampled alone = Alone(prompt, 20);
  std::vector<Sampled> requests_alone;
  for (int i = 0; i < 4; ++i) {
    requests_alone.push_back(Alone(Prompt(10 + i, 200 + i), 40));
  }
  std::vector<std::unique_ptr<PendingGeneration>> pending;
  for (int i = 0; i < 4; ++i) {
    pending.push_back(std::make_unique<PendingGeneration>(
        engine(), Spec(absl::StrCat("q", i), Prompt(10 + i, 200 + i), 40)));
  }
  std::vector<int32_t> tokens;
  bool shared_a_step = false;
  absl::StatusOr<ForwardOutcome> out = engine_testing::Forward(
      engine(), "f", prompt, SequenceCreation::kMustBeNew);
  ASSERT_TRUE(out.ok()) << out.status();
  tokens.push_back(out->sequences[0].token_id);
  for (int i = 1; i < 20; ++i) {
    out = engine_testing::Forward(
        engine(), "f", {tokens.back()}, SequenceCreation::kMustExist,
        i == 19 ? AfterStep::kRelease : AfterStep::kKeep);
    ASSERT_TRUE(out.ok()) << out.status();
    tokens.push_back(out->sequences[0].token_id);
    shared_a_step = shared_a_step || (out->last_step.num_requests > 0 &&
                                      out->last_step.num_calls > 0);
  }
  EXPECT_THAT(tokens, ElementsAreArray(alone.tokens));
  EXPECT_TRUE(shared_a_step);
  for (int i = 0; i < 4; ++i) {
    const Generation g = pending[i]->Wait();
    ASSERT_TRUE(g.status.ok()) << g.status;
    EXPECT_THAT(g.tokens, ElementsAreArray(requests_alone[i].tokens)) << i;
  }
  EXPECT_EQ(engine().snapshot().kv.used_blocks, 0);
}

INSTANTIATE_TEST_SUITE_P(ModesAndOverlap, EngineRequestsTest,
                         ::testing::ValuesIn(AllCases()), CaseName);

}  // namespace
}  // namespace pdworker
