// The request-level metrics and load gauges a real engine exports
// (metrics/README.md "Requests" and "Load"): one histogram sample per
// request (or per token update) with milestones in order, token counters
// equal to what the requests streamed, finish reasons, and load gauges that
// follow the queue, the running batch and step-level sequences.
#include <algorithm>
#include <chrono>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/engine_test_util.h"

namespace pdworker {
namespace {

using engine_testing::Generation;
using engine_testing::PendingGeneration;
using engine_testing::Prompt;
using engine_testing::Spec;

// The value of the sample `series` ("name" or "name{labels}", labels as
// the exposition orders them) in `text`; -1 when absent.
double Value(const std::string& text, const std::string& series) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (absl::StartsWith(line, series + " ")) {
      return std::stod(line.substr(series.size() + 1));
    }
  }
  return -1;
}

// Token-bearing updates of a generation: one per step that gave it tokens.
int TokenUpdates(const Generation& g) {
  return static_cast<int>(
      std::set<int64_t>(g.token_steps.begin(), g.token_steps.end()).size());
}

class EngineRequestMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    t_ = engine_testing::StartEngine(engine_testing::ModelDir(),
                                     engine_testing::SmallOptions(),
                                     EngineOptions());
  }
  Engine& engine() { return *t_->engine; }
  std::string Text() const { return t_->MetricsText(); }

  // Polls the engine's metrics until `series` reads `value` (60 s cap: a
  // hung engine, not a timing assertion).
  bool WaitForValue(const std::string& series, double value) {
    const auto give_up =
        std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < give_up) {
      if (Value(Text(), series) == value) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  }

  std::unique_ptr<engine_testing::TestEngine> t_;
};

TEST_F(EngineRequestMetricsTest, FinishedRequestsGiveOneSampleEachInOrder) {
  const std::vector<int> prompt_lengths = {5, 9, 13};
  const std::vector<int> max_tokens = {4, 6, 1};
  std::vector<std::unique_ptr<PendingGeneration>> pending;
  for (size_t i = 0; i < prompt_lengths.size(); ++i) {
    pending.push_back(std::make_unique<PendingGeneration>(
        engine(), Spec(absl::StrCat("r", i), Prompt(prompt_lengths[i], i + 1),
                       max_tokens[i])));
  }
  int tokens = 0, prompt_tokens = 0, inter_token_samples = 0;
  for (size_t i = 0; i < pending.size(); ++i) {
    const Generation g = pending[i]->Wait();
    ASSERT_TRUE(g.status.ok()) << g.status;
    ASSERT_EQ(g.tokens.size(), static_cast<size_t>(max_tokens[i]));
    tokens += static_cast<int>(g.tokens.size());
    prompt_tokens += prompt_lengths[i];
    inter_token_samples += TokenUpdates(g) - 1;
  }
  const std::string text = Text();
  for (const char* name : {"time_to_first_token", "e2e_latency", "queue_time",
                           "prefill_time", "decode_time"}) {
    EXPECT_EQ(
        Value(text, absl::StrCat("pdworker_request_", name, "_seconds_count")),
        3)
        << name;
  }
  EXPECT_EQ(Value(text, "pdworker_request_inter_token_latency_seconds_count"),
            inter_token_samples);
  EXPECT_EQ(Value(text, "pdworker_generation_tokens_total"), tokens);
  EXPECT_EQ(Value(text, "pdworker_prompt_tokens_total"), prompt_tokens);
  EXPECT_EQ(Value(text, "pdworker_requests_finished_total{reason=\"length\"}"),
            3);
  EXPECT_EQ(Value(text, "pdworker_requests_finished_total{reason=\"stop\"}"),
            0);

  // Milestones in order: queue + prefill = TTFT <= end to end, and decode
  // (first to last token) fits in end to end too.
  const double ttft =
      Value(text, "pdworker_request_time_to_first_token_seconds_sum");
  const double queue = Value(text, "pdworker_request_queue_time_seconds_sum");
  const double prefill =
      Value(text, "pdworker_request_prefill_time_seconds_sum");
  const double decode = Value(text, "pdworker_request_decode_time_seconds_sum");
  const double e2e = Value(text, "pdworker_request_e2e_latency_seconds_sum");
  EXPECT_GT(ttft, 0);
  EXPECT_NEAR(queue + prefill, ttft, 1e-6);
  EXPECT_LE(ttft + decode, e2e + 1e-6);
  // Everything ended: nothing running, waiting or queued.
  EXPECT_EQ(Value(text, "pdworker_requests_running"), 0);
  EXPECT_EQ(Value(text, "pdworker_requests_waiting"), 0);
  EXPECT_EQ(Value(text, "pdworker_waiting_prompt_tokens"), 0);
  EXPECT_EQ(Value(text, "pdworker_kv_cache_used_tokens"), 0);
}

TEST_F(EngineRequestMetricsTest, EndsAreCountedByReason) {
  // A stop token: the greedy run's second token ends the same prompt.
  const std::vector<int32_t> prompt = Prompt(8, 7);
  Generation greedy = PendingGeneration(engine(), Spec("g", prompt, 3)).Wait();
  ASSERT_TRUE(greedy.status.ok()) << greedy.status;
  RequestSpec stopping = Spec("s", prompt, 3);
  stopping.stop.stop_token_ids = {greedy.tokens[1]};
  const Generation stopped = PendingGeneration(engine(), stopping).Wait();
  ASSERT_EQ(stopped.finish_reason, FinishReason::kStop);

  // An abort and a cancellation before either ran: ends without a token.
  engine().Pause();
  auto aborted =
      std::make_unique<PendingGeneration>(engine(), Spec("a", Prompt(6, 1), 4));
  auto control = std::make_shared<CallControl>();
  auto cancelled = std::make_unique<PendingGeneration>(
      engine(), Spec("c", Prompt(6, 2), 4), control);
  ASSERT_TRUE(WaitForValue("pdworker_requests_waiting", 2));
  ASSERT_TRUE(engine_testing::Abort(engine(), {"a"}).ok());
  control->cancelled = true;
  engine().NotifyCancelled();
  EXPECT_EQ(aborted->Wait().finish_reason, FinishReason::kAbort);
  EXPECT_FALSE(cancelled->Wait().status.ok());
  engine().Resume();

  const std::string text = Text();
  EXPECT_EQ(Value(text, "pdworker_requests_finished_total{reason=\"length\"}"),
            1);
  EXPECT_EQ(Value(text, "pdworker_requests_finished_total{reason=\"stop\"}"),
            1);
  EXPECT_EQ(Value(text, "pdworker_requests_finished_total{reason=\"abort\"}"),
            2);
  EXPECT_EQ(Value(text, "pdworker_requests_finished_total{reason=\"error\"}"),
            0);
  // Four ended, two of them with tokens.
  EXPECT_EQ(Value(text, "pdworker_request_e2e_latency_seconds_count"), 4);
  EXPECT_EQ(Value(text, "pdworker_request_time_to_first_token_seconds_count"),
            2);
  EXPECT_EQ(Value(text, "pdworker_generation_tokens_total"),
            static_cast<double>(greedy.tokens.size() + stopped.tokens.size()));
}

TEST_F(EngineRequestMetricsTest, LoadGaugesFollowQueueBatchAndSequences) {
  // A step-level sequence of 10 tokens, kept.
  ASSERT_TRUE(engine_testing::Forward(engine(), "step", Prompt(10, 3),
                                      SequenceCreation::kMustBeNew)
                  .ok());
  std::string text = Text();
  EXPECT_EQ(Value(text, "pdworker_step_level_sequences"), 1);
  EXPECT_EQ(Value(text, "pdworker_kv_cache_used_tokens"), 10);
  EXPECT_EQ(Value(text, "pdworker_requests_running"), 0);

  // Two requests wait while the engine is paused: their prompts are the
  // waiting prompt tokens.
  engine().Pause();
  PendingGeneration first(engine(), Spec("p1", Prompt(7, 4), 2));
  PendingGeneration second(engine(), Spec("p2", Prompt(11, 5), 2));
  ASSERT_TRUE(WaitForValue("pdworker_requests_waiting", 2));
  text = Text();
  EXPECT_EQ(Value(text, "pdworker_waiting_prompt_tokens"), 18);
  EXPECT_EQ(Value(text, "pdworker_requests_running"), 0);
  EXPECT_EQ(Value(text, "pdworker_step_level_sequences"), 1);
  engine().Resume();
  ASSERT_TRUE(first.Wait().status.ok());
  ASSERT_TRUE(second.Wait().status.ok());

  // Done: only the step-level sequence holds KV.
  text = Text();
  EXPECT_EQ(Value(text, "pdworker_requests_waiting"), 0);
  EXPECT_EQ(Value(text, "pdworker_waiting_prompt_tokens"), 0);
  EXPECT_EQ(Value(text, "pdworker_kv_cache_used_tokens"), 10);
  EXPECT_EQ(Value(text, "pdworker_kv_cache_capacity_tokens"),
            t_->runner->kv_cache().Stats().total_blocks *
                t_->runner->kv_cache().block_size());
  ASSERT_TRUE(engine_testing::Forward(engine(), "step", {5},
                                      SequenceCreation::kMustExist,
                                      AfterStep::kRelease)
                  .ok());
  text = Text();
  EXPECT_EQ(Value(text, "pdworker_step_level_sequences"), 0);
  EXPECT_EQ(Value(text, "pdworker_kv_cache_used_tokens"), 0);
}

}  // namespace
}  // namespace pdworker
