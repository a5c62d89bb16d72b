// Speculative decoding of engine-owned requests (n-gram prompt lookup) on
// the CPU backend: every request's tokens and logprobs equal the prompt
// generated alone one token per step (greedy and seeded sampling), in every
// graph mode, with and without host/device overlap, at k 3 and 1, with
// requests of mixed lengths joining and leaving; drafts are accepted (fewer
// steps than tokens); stops inside an accepted run, abort and preemption
// leave no KV behind; the counters match what the metrics export.
#include <algorithm>
#include <memory>
#include <string>
#include <thread>
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
using ::testing::HasSubstr;

struct Case {
  std::string mode;
  StepOverlap overlap;
  int k;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return absl::StrCat(
      info.param.mode,
      info.param.overlap == StepOverlap::kOn ? "_overlap" : "_no_overlap", "_k",
      info.param.k);
}

// k = 3 in every mode, overlap on and off; k = 1 in the default mode (the
// suite also runs under ASan and TSan in CI).
std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (const std::string& mode : engine_testing::AllModes()) {
    for (StepOverlap overlap : {StepOverlap::kOff, StepOverlap::kOn}) {
      cases.push_back({mode, overlap, 3});
      if (mode == "FULL_AND_PIECEWISE") cases.push_back({mode, overlap, 1});
    }
  }
  return cases;
}

// A prompt that repeats a motif (n-gram lookup finds it), then `tail`
// pseudo-random tokens.
std::vector<int32_t> RepetitivePrompt(int motif_length, int repeats, int tail,
                                      uint64_t seed) {
  const std::vector<int32_t> motif = Prompt(motif_length, seed);
  std::vector<int32_t> prompt;
  for (int i = 0; i < repeats; ++i) {
    prompt.insert(prompt.end(), motif.begin(), motif.end());
  }
  const std::vector<int32_t> rest = Prompt(tail, seed + 1000);
  prompt.insert(prompt.end(), rest.begin(), rest.end());
  return prompt;
}

SpeculativeConfig Ngram(int k) {
  SpeculativeConfig c;
  c.method = SpeculativeMethod::kNgram;
  c.num_speculative_tokens = k;
  c.prompt_lookup_min = 1;
  c.prompt_lookup_max = 3;
  return c;
}

class EngineSpeculationTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    dir_ = engine_testing::ModelDir();
    ModelRunnerOptions options = engine_testing::SmallOptions(GetParam().mode);
    options.uniform_decode_query_len = 1 + GetParam().k;
    EngineOptions engine_options;
    engine_options.overlap = GetParam().overlap;
    engine_options.speculative = Ngram(GetParam().k);
    engine_ = engine_testing::StartEngine(dir_, options, engine_options);
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
  std::unique_ptr<engine_testing::TestEngine> engine_;
  std::unique_ptr<CpuDevice> reference_device_;
  std::unique_ptr<ModelRunner> reference_;
};

TEST_P(EngineSpeculationTest, GreedyTokensEqualEachPromptAlone) {
  // Mixed lengths (chunked prefills beside verify steps), more requests
  // than seats (8), repetitive and random prompts.
  struct Request {
    std::vector<int32_t> prompt;
    int max_tokens;
  };
  std::vector<Request> requests;
  for (int i = 0; i < 10; ++i) {
    requests.push_back(
        {i % 3 == 2 ? Prompt(5 + 9 * i, i)
                    : RepetitivePrompt(3 + i % 4, 3 + i % 3, i % 5, 40 + i),
         10 + 3 * i});
  }
  std::vector<std::unique_ptr<PendingGeneration>> pending;
  for (size_t i = 0; i < requests.size(); ++i) {
    RequestSpec spec =
        Spec(absl::StrCat("r", i), requests[i].prompt, requests[i].max_tokens);
    if (i % 4 == 1) spec.logprobs = 2;  // drafts verified with logprobs too
    pending.push_back(
        std::make_unique<PendingGeneration>(engine(), std::move(spec)));
  }
  int64_t tokens = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Generation g = pending[i]->Wait();
    ASSERT_TRUE(g.status.ok()) << i << ": " << g.status;
    EXPECT_EQ(g.finish_reason, FinishReason::kLength) << i;
    const Sampled alone = Alone(requests[i].prompt, requests[i].max_tokens);
    EXPECT_THAT(g.tokens, ElementsAreArray(alone.tokens)) << i;
    EXPECT_THAT(g.logprobs, ElementsAreArray(alone.logprobs)) << i;
    tokens += static_cast<int64_t>(g.tokens.size());
    if (i % 4 != 1) continue;
    // Greedy: every token's raw logprob is its row's best alternative's
    // (rows of accepted drafts included; their values against one-token
    // steps: sampled_rows_test).
    ASSERT_EQ(g.token_logprobs.size(), g.tokens.size()) << i;
    for (size_t t = 0; t < g.tokens.size(); ++t) {
      const TokenLogprobs& l = g.token_logprobs[t];
      ASSERT_EQ(l.top.size(), 2u) << i << " token " << t;
      EXPECT_EQ(l.top[0].token_id, g.tokens[t]) << i << " token " << t;
      EXPECT_EQ(l.top[0].logprob, l.logprob) << i << " token " << t;
      EXPECT_LE(l.logprob, 0.0f);
    }
  }
  const EngineSnapshot s = engine().snapshot();
  EXPECT_EQ(s.kv.used_blocks, 0);
  EXPECT_EQ(s.kv.num_sequences, 0);
  EXPECT_GT(s.spec_drafts, 0);
  EXPECT_GT(s.spec_accepted_tokens, 0);
  EXPECT_LE(s.spec_accepted_tokens, s.spec_draft_tokens);
  EXPECT_LE(s.spec_draft_tokens, s.spec_drafts * GetParam().k);
  // Each verify step gave its request its accepted drafts and one more.
  EXPECT_GE(tokens, s.spec_drafts + s.spec_accepted_tokens);
  // The metrics export the same counts.
  const std::string text = engine_->MetricsText();
  EXPECT_THAT(text,
              HasSubstr(absl::StrCat("pdworker_spec_decode_num_drafts_total ",
                                     s.spec_drafts)));
  EXPECT_THAT(text, HasSubstr(absl::StrCat(
                        "pdworker_spec_decode_num_accepted_tokens_total ",
                        s.spec_accepted_tokens)));
  EXPECT_THAT(text,
              HasSubstr("pdworker_spec_decode_num_accepted_tokens_per_pos_"
                        "total{position=\"0\"}"));
}

TEST_P(EngineSpeculationTest, SeededSamplingEqualsEachPromptAlone) {
  auto sampling_for = [](int i) {
    SamplingOptions sampling;
    sampling.temperature = 0.7f;
    sampling.top_p = i % 2 == 0 ? 1.0f : 0.9f;
    sampling.top_k = i % 3 == 0 ? 0 : 16;
    sampling.seed = 77 + i;
    return sampling;
  };
  std::vector<std::unique_ptr<PendingGeneration>> pending;
  for (int i = 0; i < 5; ++i) {
    pending.push_back(std::make_unique<PendingGeneration>(
        engine(), Spec(absl::StrCat("s", i), RepetitivePrompt(4, 4, i, i), 16,
                       sampling_for(i))));
  }
  for (int i = 0; i < 5; ++i) {
    const Generation g = pending[i]->Wait();
    ASSERT_TRUE(g.status.ok()) << g.status;
    const Sampled alone =
        Alone(RepetitivePrompt(4, 4, i, i), 16, sampling_for(i));
    EXPECT_THAT(g.tokens, ElementsAreArray(alone.tokens)) << i;
    EXPECT_THAT(g.logprobs, ElementsAreArray(alone.logprobs)) << i;
  }
}

// A stop token id the reference reaches at output i ends the request there
// whether or not it falls inside an accepted run; max_tokens below the
// drafts' reach too.
TEST_P(EngineSpeculationTest, StopsInsideAcceptedRuns) {
  const std::vector<int32_t> prompt = RepetitivePrompt(5, 4, 0, 9);
  const Sampled alone = Alone(prompt, 24);
  for (size_t i = 1; i < alone.tokens.size(); i += 5) {
    // Only a token that did not occur earlier in the output stops there.
    if (std::find(alone.tokens.begin(), alone.tokens.begin() + i,
                  alone.tokens[i]) != alone.tokens.begin() + i) {
      continue;
    }
    RequestSpec spec = Spec(absl::StrCat("stop", i), prompt, 24);
    spec.stop.stop_token_ids = {alone.tokens[i]};
    const Generation g = PendingGeneration(engine(), spec).Wait();
    ASSERT_TRUE(g.status.ok()) << g.status;
    EXPECT_EQ(g.finish_reason, FinishReason::kStop) << i;
    EXPECT_EQ(g.matched_token_id, alone.tokens[i]) << i;
    EXPECT_THAT(g.tokens,
                ElementsAreArray(std::vector<int32_t>(
                    alone.tokens.begin(), alone.tokens.begin() + i + 1)))
        << i;
  }
  for (int max_tokens : {1, 2, 3, 5}) {
    const Generation g =
        PendingGeneration(
            engine(), Spec(absl::StrCat("max", max_tokens), prompt, max_tokens))
            .Wait();
    ASSERT_TRUE(g.status.ok()) << g.status;
    EXPECT_THAT(g.tokens,
                ElementsAreArray(std::vector<int32_t>(
                    alone.tokens.begin(), alone.tokens.begin() + max_tokens)));
  }
  EXPECT_EQ(engine().snapshot().kv.used_blocks, 0);
}

INSTANTIATE_TEST_SUITE_P(ModesOverlapAndK, EngineSpeculationTest,
                         ::testing::ValuesIn(AllCases()), CaseName);

// With room for fewer requests than run, speculating requests are preempted
// (their KV freed, drafts and all) and recomputed: outputs unchanged, and
// nothing is left behind; an abort mid-run frees its KV too.
TEST(EngineSpeculationPressureTest, PreemptionAndAbortLeaveNoKv) {
  const std::string dir = engine_testing::ModelDir();
  ModelRunnerOptions options = engine_testing::SmallOptions();
  options.uniform_decode_query_len = 4;
  // 32 blocks of 4 tokens (1 KiB each) for 6 requests of 19 + 30 tokens
  // (13 blocks each) and one of 15 + 60.
  options.kv_cache_bytes = 32 * 1024;
  EngineOptions engine_options;
  engine_options.speculative = Ngram(3);
  auto t = engine_testing::StartEngine(dir, options, engine_options);
  CpuDevice device;
  auto reference =
      ModelRunner::Create(device, dir, engine_testing::SmallOptions("NONE"));
  ASSERT_TRUE(reference.ok()) << reference.status();
  std::vector<std::unique_ptr<PendingGeneration>> pending;
  for (int i = 0; i < 6; ++i) {
    pending.push_back(std::make_unique<PendingGeneration>(
        *t->engine,
        Spec(absl::StrCat("p", i), RepetitivePrompt(4, 4, 3, 100 + i), 30)));
  }
  auto aborted = std::make_unique<PendingGeneration>(
      *t->engine, Spec("abort-me", RepetitivePrompt(3, 5, 0, 7), 60));
  while (aborted->TokensSoFar() < 4) std::this_thread::yield();
  ASSERT_TRUE(engine_testing::Abort(*t->engine, {"abort-me"}).ok());
  EXPECT_EQ(aborted->Wait().finish_reason, FinishReason::kAbort);
  for (int i = 0; i < 6; ++i) {
    const Generation g = pending[i]->Wait();
    ASSERT_TRUE(g.status.ok()) << g.status;
    absl::StatusOr<Sampled> alone = ReferenceGeneration(
        **reference, "ref", RepetitivePrompt(4, 4, 3, 100 + i), 30);
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_THAT(g.tokens, ElementsAreArray(alone->tokens)) << i;
  }
  const EngineSnapshot s = t->engine->snapshot();
  EXPECT_GT(s.preemptions, 0);
  EXPECT_GT(s.spec_accepted_tokens, 0);
  EXPECT_EQ(s.kv.used_blocks, 0);
  EXPECT_EQ(s.kv.num_sequences, 0);
}

// With prefix caching, blocks filled by drafts may be cached and shared
// before the verify step's rollback (which then copies or uncaches them):
// requests whose prompts repeat each other's prompts and outputs still get
// exactly their tokens alone.
TEST(EngineSpeculationPrefixCacheTest, SharedPromptsEqualEachPromptAlone) {
  const std::string dir = engine_testing::ModelDir();
  ModelRunnerOptions options = engine_testing::SmallOptions();
  options.uniform_decode_query_len = 4;
  options.prefix_caching = PrefixCaching::kOn;
  EngineOptions engine_options;
  engine_options.speculative = Ngram(3);
  auto t = engine_testing::StartEngine(dir, options, engine_options);
  CpuDevice device;
  auto reference =
      ModelRunner::Create(device, dir, engine_testing::SmallOptions("NONE"));
  ASSERT_TRUE(reference.ok()) << reference.status();
  const std::vector<int32_t> base = RepetitivePrompt(4, 4, 2, 5);
  std::vector<std::vector<int32_t>> prompts = {base};
  for (int round = 0; round < 3; ++round) {
    std::vector<std::unique_ptr<PendingGeneration>> pending;
    for (size_t i = 0; i < prompts.size(); ++i) {
      pending.push_back(std::make_unique<PendingGeneration>(
          *t->engine, Spec(absl::StrCat("c", round, "_", i), prompts[i], 12)));
    }
    std::vector<std::vector<int32_t>> next;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const Generation g = pending[i]->Wait();
      ASSERT_TRUE(g.status.ok()) << g.status;
      absl::StatusOr<Sampled> alone =
          ReferenceGeneration(**reference, "ref", prompts[i], 12);
      ASSERT_TRUE(alone.ok()) << alone.status();
      EXPECT_THAT(g.tokens, ElementsAreArray(alone->tokens))
          << round << "/" << i;
      // The next round's prompts: this one's prompt and output (a chat's
      // next turn), and again with a token more.
      std::vector<int32_t> turn = prompts[i];
      turn.insert(turn.end(), g.tokens.begin(), g.tokens.end());
      if (turn.size() + 13 > 128) continue;
      next.push_back(turn);
      turn.push_back(7);
      next.push_back(turn);
    }
    prompts = next;
  }
  const EngineSnapshot s = t->engine->snapshot();
  EXPECT_GT(s.spec_accepted_tokens, 0);
  EXPECT_EQ(s.kv.num_sequences, 0);
}

}  // namespace
}  // namespace pdworker
