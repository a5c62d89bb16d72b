// Engine-owned requests with prefix caching, in every graph mode, with and
// without host/device overlap: requests that share a prompt prefix, or
// continue an earlier conversation (its prompt plus its outputs), start
// from the cached blocks, report them as cached_tokens, and still produce
// the tokens and logprobs of the prompt generated alone, bit for bit.
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

constexpr int kBs = 4;  // engine_testing::SmallOptions' block size

struct Case {
  std::string mode;
  StepOverlap overlap;
};

class EnginePrefixCacheTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    dir_ = engine_testing::ModelDir();
    ModelRunnerOptions options = engine_testing::SmallOptions(GetParam().mode);
    options.prefix_caching = PrefixCaching::kOn;
    EngineOptions engine_options;
    engine_options.overlap = GetParam().overlap;
    engine_ = engine_testing::StartEngine(dir_, options, engine_options);
    auto reference = ModelRunner::Create(reference_device_, dir_,
                                         engine_testing::SmallOptions("NONE"));
    ASSERT_TRUE(reference.ok()) << reference.status();
    reference_ = *std::move(reference);
  }

  // Runs `prompt` to completion and checks it against the prompt alone.
  Generation RunAndCheck(const std::string& id,
                         const std::vector<int32_t>& prompt, int num_tokens) {
    PendingGeneration pending(*engine_->engine, Spec(id, prompt, num_tokens));
    Generation g = pending.Wait();
    EXPECT_TRUE(g.status.ok()) << id << ": " << g.status;
    absl::StatusOr<Sampled> alone =
        ReferenceGeneration(*reference_, "ref", prompt, num_tokens);
    EXPECT_TRUE(alone.ok()) << alone.status();
    if (alone.ok()) {
      EXPECT_THAT(g.tokens, ElementsAreArray(alone->tokens)) << id;
      EXPECT_THAT(g.logprobs, ElementsAreArray(alone->logprobs)) << id;
    }
    return g;
  }

  std::string dir_;
  std::unique_ptr<engine_testing::TestEngine> engine_;
  CpuDevice reference_device_;
  std::unique_ptr<ModelRunner> reference_;
};

std::vector<int32_t> Join(std::vector<int32_t> a,
                          const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST_P(EnginePrefixCacheTest, SharedSystemPromptIsComputedOnce) {
  const std::vector<int32_t> system = Prompt(40, 7);  // 10 full blocks
  const Generation first = RunAndCheck("a", Join(system, Prompt(5, 1)), 6);
  EXPECT_EQ(first.cached_tokens, 0);
  // Longer than one step's budget (64 tokens) too: chunks continue from the
  // cached length.
  for (int i = 0; i < 3; ++i) {
    const Generation g = RunAndCheck(
        absl::StrCat("b", i), Join(system, Prompt(3 + 20 * i, 10 + i)), 5);
    EXPECT_EQ(g.cached_tokens, 40) << i;
  }
  // Exactly the cached blocks: the last token is computed again.
  EXPECT_EQ(RunAndCheck("c", system, 4).cached_tokens, 36);
  // Nothing shared.
  EXPECT_EQ(RunAndCheck("d", Prompt(30, 99), 4).cached_tokens, 0);
  const EngineSnapshot s = engine_->engine->snapshot();
  EXPECT_EQ(s.kv.used_blocks, 0);
  EXPECT_GE(s.kv.hit_tokens, 3 * 40 + 36);
}

TEST_P(EnginePrefixCacheTest, ANextTurnFindsThePreviousAnswerCached) {
  // With overlap, decoded tokens reach the KV cache before the host knows
  // their ids; their blocks are cached once the ids are read back.
  const std::vector<int32_t> prompt = Prompt(40, 3);
  const Generation turn1 = RunAndCheck("t1", prompt, 12);
  ASSERT_EQ(turn1.tokens.size(), 12u);
  // Turn 2: the prompt, the 12 outputs, a new user token. The cache holds
  // K/V for the prompt and the first 11 outputs (the last output was never
  // fed back): 51 tokens, 12 full blocks.
  const std::vector<int32_t> turn2 = Join(Join(prompt, turn1.tokens), {5});
  EXPECT_EQ(RunAndCheck("t2", turn2, 4).cached_tokens, (40 + 11) / kBs * kBs);
}

TEST_P(EnginePrefixCacheTest, ConcurrentRequestsShareAPrefix) {
  const std::vector<int32_t> system = Prompt(24, 21);
  // The first request's prompt is cached as soon as its step is planned;
  // the others arrive while it runs.
  std::vector<std::unique_ptr<PendingGeneration>> pending;
  for (int i = 0; i < 6; ++i) {
    pending.push_back(std::make_unique<PendingGeneration>(
        *engine_->engine,
        Spec(absl::StrCat("r", i), Join(system, Prompt(2 + i, 50 + i)), 8)));
  }
  for (int i = 0; i < 6; ++i) {
    const Generation g = pending[i]->Wait();
    ASSERT_TRUE(g.status.ok()) << g.status;
    absl::StatusOr<Sampled> alone = ReferenceGeneration(
        *reference_, "ref", Join(system, Prompt(2 + i, 50 + i)), 8);
    ASSERT_TRUE(alone.ok());
    EXPECT_THAT(g.tokens, ElementsAreArray(alone->tokens)) << i;
    EXPECT_THAT(g.logprobs, ElementsAreArray(alone->logprobs)) << i;
    EXPECT_TRUE(g.cached_tokens == 0 || g.cached_tokens == 24)
        << g.cached_tokens;
  }
  EXPECT_EQ(engine_->engine->snapshot().kv.used_blocks, 0);
}

// engine_preemption_test's load with prefix caching on: a KV cache for a
// fraction of the load (32 blocks of 4 tokens for 8 requests of 20 + 30
// tokens), so running requests preempt others by recompute, whose
// recompute may find its own freed blocks still cached. Every request still
// gets the tokens it gets alone. (Here rather than in
// engine_preemption_test: that one also runs under TSan, whose CI budget
// this would exceed.)
TEST(EnginePrefixCachePreemptionTest, EveryRequestCompletesUnchanged) {
  const std::string dir = engine_testing::ModelDir();
  CpuDevice device;
  auto reference =
      ModelRunner::Create(device, dir, engine_testing::SmallOptions("NONE"));
  ASSERT_TRUE(reference.ok()) << reference.status();
  for (const std::string mode : {"NONE", "FULL_AND_PIECEWISE"}) {
    ModelRunnerOptions options = engine_testing::SmallOptions(mode);
    options.kv_cache_bytes = 32 * 1024;
    options.prefix_caching = PrefixCaching::kOn;
    auto t = engine_testing::StartEngine(dir, options, EngineOptions{});
    std::vector<std::unique_ptr<PendingGeneration>> pending;
    for (int i = 0; i < 8; ++i) {
      pending.push_back(std::make_unique<PendingGeneration>(
          *t->engine, Spec(absl::StrCat("r", i), Prompt(20, 400 + i), 30)));
    }
    for (int i = 0; i < 8; ++i) {
      const Generation g = pending[i]->Wait();
      ASSERT_TRUE(g.status.ok()) << mode << " " << i << ": " << g.status;
      absl::StatusOr<Sampled> alone =
          ReferenceGeneration(**reference, "ref", Prompt(20, 400 + i), 30);
      ASSERT_TRUE(alone.ok()) << alone.status();
      EXPECT_THAT(g.tokens, ElementsAreArray(alone->tokens)) << mode << i;
      EXPECT_THAT(g.logprobs, ElementsAreArray(alone->logprobs)) << mode << i;
    }
    const EngineSnapshot s = t->engine->snapshot();
    EXPECT_GT(s.preemptions, 0) << mode;
    EXPECT_EQ(s.kv.used_blocks, 0) << mode;
    EXPECT_EQ(s.finished_requests, 8) << mode;
  }
}

INSTANTIATE_TEST_SUITE_P(
    ModesAndOverlap, EnginePrefixCacheTest,
    ::testing::Values(Case{"NONE", StepOverlap::kOff},
                      Case{"NONE", StepOverlap::kOn},
                      Case{"PIECEWISE", StepOverlap::kOn},
                      Case{"FULL", StepOverlap::kOn},
                      Case{"FULL_DECODE_ONLY", StepOverlap::kOn},
                      Case{"FULL_AND_PIECEWISE", StepOverlap::kOff},
                      Case{"FULL_AND_PIECEWISE", StepOverlap::kOn}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return absl::StrCat(
          info.param.mode,
          info.param.overlap == StepOverlap::kOn ? "_overlap" : "_no_overlap");
    });

}  // namespace
}  // namespace pdworker
