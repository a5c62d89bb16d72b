// Load mode: the plan is a deterministic function of the options (Poisson
// arrivals, prompt lengths in range), percentiles are nearest-rank, and a
// small run against one worker completes every request and reports them.
#include "tools/router/load.h"

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/router/router_test_util.h"
#include "tests/server/server_test_util.h"

namespace pdworker::router {
namespace {

using ::testing::HasSubstr;

TEST(LoadPlanTest, DeterministicPoissonArrivalsAndPromptLengths) {
  LoadOptions options;
  options.num_requests = 4000;
  options.rate = 50;
  options.prompt_len_min = 3;
  options.prompt_len_max = 9;
  options.vocab_size = 100;
  options.seed = 42;
  const LoadPlan a = MakeLoadPlan(options);
  const LoadPlan b = MakeLoadPlan(options);
  ASSERT_EQ(a.requests.size(), 4000u);
  EXPECT_EQ(a.arrival_seconds, b.arrival_seconds);
  EXPECT_EQ(a.arrival_seconds[0], 0.0);
  bool saw_min = false;
  bool saw_max = false;
  for (size_t i = 0; i < a.requests.size(); ++i) {
    const GenerationRequest& r = a.requests[i];
    EXPECT_EQ(r.prompt, b.requests[i].prompt);
    EXPECT_EQ(r.request_id, "load-" + std::to_string(i));
    ASSERT_GE(r.prompt.size(), 3u);
    ASSERT_LE(r.prompt.size(), 9u);
    saw_min |= r.prompt.size() == 3;
    saw_max |= r.prompt.size() == 9;
    for (const int32_t t : r.prompt) {
      ASSERT_TRUE(t >= 0 && t < 100);
    }
    if (i > 0) {
      ASSERT_GE(a.arrival_seconds[i], a.arrival_seconds[i - 1]);
    }
  }
  EXPECT_TRUE(saw_min && saw_max);
  // Mean gap 1/rate = 20 ms; 4000 exponential gaps land within a few %.
  const double mean_gap = a.arrival_seconds.back() / 3999.0;
  EXPECT_NEAR(mean_gap, 0.020, 0.002);

  options.seed = 43;
  EXPECT_NE(MakeLoadPlan(options).arrival_seconds, a.arrival_seconds);
  options.rate = 0;  // all at once
  for (const double t : MakeLoadPlan(options).arrival_seconds) {
    EXPECT_EQ(t, 0.0);
  }
}

TEST(SummarizeTest, NearestRankPercentilesInMilliseconds) {
  std::vector<int64_t> micros;
  for (int i = 100; i >= 1; --i) micros.push_back(int64_t{i} * 1000);
  const LatencySummary s = Summarize(micros);
  EXPECT_EQ(s.count, 100);
  EXPECT_DOUBLE_EQ(s.mean_ms, 50.5);
  EXPECT_DOUBLE_EQ(s.p50_ms, 50);
  EXPECT_DOUBLE_EQ(s.p99_ms, 99);
  const LatencySummary one = Summarize({2500});
  EXPECT_DOUBLE_EQ(one.p50_ms, 2.5);
  EXPECT_DOUBLE_EQ(one.p99_ms, 2.5);
  EXPECT_EQ(Summarize({}).count, 0);
}

TEST(RunLoadTest, RunsEveryRequestAgainstAWorker) {
  std::unique_ptr<server_testing::TestWorker> worker =
      router_testing::StartRoleWorker(Role::kBoth);
  ASSERT_NE(worker, nullptr);
  RouterOptions router_options;
  router_options.aggregated_addresses = {router_testing::Address(*worker)};
  auto router = Router::Create(router_options);
  ASSERT_TRUE(router.ok()) << router.status();

  LoadOptions options;
  options.num_requests = 24;
  options.rate = 400;
  options.prompt_len_min = 4;
  options.prompt_len_max = 12;
  options.max_tokens = 5;
  auto report = RunLoad(**router, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->succeeded, 24) << report->Format();
  EXPECT_EQ(report->failed, 0);
  EXPECT_EQ(report->output_tokens, 24 * 5);
  EXPECT_GT(report->output_tokens_per_second, 0);
  EXPECT_EQ(report->ttft.count, 24);
  EXPECT_EQ(report->prefill.count, 24);
  EXPECT_EQ(report->transfer.count, 0);  // aggregated: no handoff
  EXPECT_EQ(report->first_decode_step.count, 24);
  EXPECT_EQ(report->inter_token.count, 24 * 4);
  EXPECT_LE(report->ttft.p50_ms, report->ttft.p99_ms);
  const std::string table = report->Format();
  EXPECT_THAT(table, HasSubstr("TTFT"));
  EXPECT_THAT(table, HasSubstr("inter-token"));
  EXPECT_THAT(table, HasSubstr("ok 24, failed 0"));
  router_testing::ExpectIdle(*worker, "worker");

  options.num_requests = 0;
  EXPECT_EQ(RunLoad(**router, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdworker::router
