// Requests under pressure: a KV cache sized for a fraction of the load
// (running requests preempt the most recently admitted by recompute, and
// every request still completes with the tokens it gets alone), and a long
// prompt arriving while many requests decode (the decodes never wait more
// than one step: each of their tokens comes from the step after the last).
#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/config.h"
#include "absl/strings/str_cat.h"
#include "dispatcher/compilation_config.h"
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

class EnginePreemptionTest : public ::testing::TestWithParam<Case> {};

TEST_P(EnginePreemptionTest, AKvCacheForAFractionOfTheLoadCompletesEverything) {
  const std::string dir = engine_testing::ModelDir();
  ModelRunnerOptions options = engine_testing::SmallOptions(GetParam().mode);
  // 32 blocks of 4 tokens = 128 tokens, for 8 requests of 20 + 30 tokens
  // (13 blocks each, 104 in all).
  options.kv_cache_bytes = 32 * 1024;
  EngineOptions engine_options;
  engine_options.overlap = GetParam().overlap;
  auto t = engine_testing::StartEngine(dir, options, engine_options);

  std::vector<std::unique_ptr<PendingGeneration>> pending;
  for (int i = 0; i < 8; ++i) {
    pending.push_back(std::make_unique<PendingGeneration>(
        *t->engine, Spec(absl::StrCat("r", i), Prompt(20, 400 + i), 30)));
  }
  CpuDevice device;
  auto reference =
      ModelRunner::Create(device, dir, engine_testing::SmallOptions("NONE"));
  ASSERT_TRUE(reference.ok()) << reference.status();
  for (int i = 0; i < 8; ++i) {
    const Generation g = pending[i]->Wait();
    ASSERT_TRUE(g.status.ok()) << i << ": " << g.status;
    EXPECT_EQ(g.finish_reason, FinishReason::kLength);
    absl::StatusOr<Sampled> alone =
        ReferenceGeneration(**reference, "ref", Prompt(20, 400 + i), 30);
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_THAT(g.tokens, ElementsAreArray(alone->tokens)) << i;
    EXPECT_THAT(g.logprobs, ElementsAreArray(alone->logprobs)) << i;
  }
  const EngineSnapshot s = t->engine->snapshot();
  EXPECT_GT(s.preemptions, 0);
  EXPECT_EQ(s.kv.used_blocks, 0);
  EXPECT_EQ(s.finished_requests, 8);
}

// Sanitized builds run this scenario at half the size (the instrumented CPU
// kernels are several times slower, and CI runs every variant under ASan and
// TSan): the prompt still takes at least 8 chunked steps beside the decodes,
// which outlast it.
#if defined(ABSL_HAVE_ADDRESS_SANITIZER) || defined(ABSL_HAVE_THREAD_SANITIZER)
constexpr int kSanitizerDivisor = 2;
#else
constexpr int kSanitizerDivisor = 1;
#endif

TEST_P(EnginePreemptionTest, ALongPromptNeverMakesADecodeWait) {
  constexpr int kDecodes = 16 / kSanitizerDivisor;
  constexpr int kDecodeTokens = 120 / kSanitizerDivisor;
  constexpr int kLongPrompt = 2000 / kSanitizerDivisor;
  constexpr int kStepTokens = 256 / kSanitizerDivisor;
  engine_testing::ModelDirOptions model;
  model.max_position_embeddings = 4096;
  const std::string dir = engine_testing::ModelDir(model);
  ModelRunnerOptions options = engine_testing::SmallOptions(GetParam().mode);
  options.max_num_seqs = 32;
  options.max_num_batched_tokens = kStepTokens;
  options.max_model_len = 2100;
  options.kv_cache_bytes = int64_t{4} << 20;
  auto config = ParseCompilationConfig(
      absl::StrCat(R"({"cudagraph_mode":")", GetParam().mode,
                   R"(","cudagraph_capture_sizes":[1,2,4,8,16,24,32]})"));
  ASSERT_TRUE(config.ok()) << config.status();
  options.compilation = *config;
  EngineOptions engine_options;
  engine_options.overlap = GetParam().overlap;
  auto t = engine_testing::StartEngine(dir, options, engine_options);

  std::vector<std::unique_ptr<PendingGeneration>> decoding;
  for (int i = 0; i < kDecodes; ++i) {
    decoding.push_back(std::make_unique<PendingGeneration>(
        *t->engine,
        Spec(absl::StrCat("d", i), Prompt(8, 500 + i), kDecodeTokens)));
  }
  for (const auto& d : decoding) {
    while (d->TokensSoFar() < 2) std::this_thread::yield();
  }
  const std::vector<int32_t> long_prompt = Prompt(kLongPrompt, 600);
  PendingGeneration prompt(*t->engine, Spec("long", long_prompt, 4));
  const Generation p = prompt.Wait();
  ASSERT_TRUE(p.status.ok()) << p.status;

  int64_t first_step = 0;
  for (int i = 0; i < kDecodes; ++i) {
    const Generation g = decoding[i]->Wait();
    ASSERT_TRUE(g.status.ok()) << g.status;
    ASSERT_EQ(g.tokens.size(), static_cast<size_t>(kDecodeTokens));
    // The first token ends the prefill; every later one comes from the
    // very next step, the long prompt's chunks included.
    for (size_t k = 1; k < g.token_steps.size(); ++k) {
      EXPECT_EQ(g.token_steps[k], g.token_steps[k - 1] + 1)
          << "request " << i << " token " << k;
    }
    first_step = std::max(first_step, g.token_steps[0]);
  }
  // The long prompt took several steps, all while the others decoded: in
  // chunks of at most kStepTokens - kDecodes tokens.
  ASSERT_FALSE(p.token_steps.empty());
  EXPECT_GE(p.token_steps[0] - first_step,
            kLongPrompt / (kStepTokens - kDecodes));
  const int64_t last_decode = [&] {
    int64_t last = 0;
    for (const auto& d : decoding)
      last = std::max(last, d->Wait().token_steps.back());
    return last;
  }();
  EXPECT_LT(p.token_steps.back(), last_decode)
      << "the prompt finished after the decodes: the test proves nothing";

  // And its tokens are those it gets alone.
  CpuDevice device;
  ModelRunnerOptions ref_options = options;
  auto none = ParseCompilationConfig(R"({"cudagraph_mode":"NONE"})");
  ASSERT_TRUE(none.ok());
  ref_options.compilation = *none;
  auto reference = ModelRunner::Create(device, dir, ref_options);
  ASSERT_TRUE(reference.ok()) << reference.status();
  absl::StatusOr<Sampled> alone =
      ReferenceGeneration(**reference, "ref", long_prompt, 4);
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_THAT(p.tokens, ElementsAreArray(alone->tokens));
}

INSTANTIATE_TEST_SUITE_P(
    ModesAndOverlap, EnginePreemptionTest,
    ::testing::Values(Case{"NONE", StepOverlap::kOff},
                      Case{"NONE", StepOverlap::kOn},
                      Case{"FULL_AND_PIECEWISE", StepOverlap::kOff},
                      Case{"FULL_AND_PIECEWISE", StepOverlap::kOn},
                      Case{"FULL_DECODE_ONLY", StepOverlap::kOn},
                      Case{"PIECEWISE", StepOverlap::kOn}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return absl::StrCat(
          info.param.mode,
          info.param.overlap == StepOverlap::kOn ? "_overlap" : "_no_overlap");
    });

}  // namespace
}  // namespace pdworker
