// `promtool check metrics` (Prometheus's own lint: naming, units, _total
// suffixes, help text) reports nothing for a fully populated worker
// registry, as scraped over HTTP from the real MetricsServer.
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "dispatcher/cudagraph_dispatcher.h"
#include "dispatcher/cudagraph_mode.h"
#include "dispatcher/graph_stats.h"
#include "gtest/gtest.h"
#include "metrics/metrics_server.h"
#include "metrics/worker_metrics.h"
#include "tests/metrics/metrics_test_util.h"
#include "tests/metrics/subprocess.h"
#include "worker/runtime/capture_session.h"

namespace pdworker {
namespace {

constexpr char kPromtool[] = "/usr/bin/promtool";

// Scrapes a fully populated worker registry over HTTP from the real
// MetricsServer and runs `promtool check metrics` on it.
struct Linted {
  std::string scraped;
  int exit_code = -1;
  std::string output;
};
void ScrapeAndLint(VllmAliases aliases, Linted* linted) {
  ASSERT_EQ(access(kPromtool, X_OK), 0)
      << kPromtool
      << " is missing: run scripts/install-deps (Debian package "
         "'prometheus') to get promtool and the Prometheus server.";

  GraphStats stats;
  WorkerMetricsOptions options;
  options.max_table_rows = 3;  // so the "other" series appear too
  options.vllm_aliases = aliases;
  options.served_model_name = "tiny-llama";
  options.cache = {16, 1000, 1 << 20, true};
  WorkerMetrics metrics({"both", "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE",
                         "tiny-llama", "sha256:feed", "cuda:0 NVIDIA H100"},
                        &stats, {CudaGraphMode::FullAndPiecewise(), {1, 2, 4}},
                        options);
  RequestTimeline timeline;
  timeline.arrival = RequestTimeline::Clock::now();
  timeline.scheduled = timeline.arrival + std::chrono::milliseconds(2);
  timeline.first_token = timeline.arrival + std::chrono::milliseconds(9);
  timeline.last_token = timeline.arrival + std::chrono::milliseconds(40);
  metrics.ObserveFirstToken(timeline, 30, 1);
  metrics.ObserveNextTokens(0.004, 1);
  metrics.ObserveRequestEnd(timeline, RequestEnd::kLength, timeline.last_token);
  EngineLoad load;
  load.running_requests = 1;
  load.waiting_prompt_tokens = 12;
  load.used_blocks = 3;
  load.free_blocks = 997;
  load.used_tokens = 40;
  load.preemptions = 1;
  metrics.SetEngineLoad(load);
  // The three busiest label sets get the 3 slots; the rest fold to "other".
  for (int i = 0; i < 3; ++i) stats.Record(100, 100, RuntimeMode::kNone);
  for (int i = 0; i < 2; ++i) stats.Record(1, 1, RuntimeMode::kFull);
  for (int i = 0; i < 2; ++i) stats.Record(3, 4, RuntimeMode::kPiecewise);
  stats.Record(2, 2, RuntimeMode::kNone);
  stats.Record(2, 2, RuntimeMode::kPiecewise);
  metrics.ObserveStep(testing::Step(RuntimeMode::kFull, FallbackReason::kNone,
                                    1, 1, 1, 1, 0.0002));
  metrics.ObserveStep(testing::Step(RuntimeMode::kNone,
                                    FallbackReason::kAboveMaxCaptureSize, 100,
                                    100, 3, 2, 0.05));
  metrics.ObserveForwardCall(absl::StatusCode::kOk, 0.01);
  metrics.ObserveForwardCall(absl::StatusCode::kResourceExhausted, 0.001);
  metrics.SetKvBlocks(10, 90);
  metrics.SetQueueDepth(2);
  CaptureSummary summary;
  summary.modes.push_back({RuntimeMode::kPiecewise, 3, 3, 0.7, 4096});
  summary.modes.push_back({RuntimeMode::kFull, 3, 3, 0.2, 2048});
  metrics.SetCaptureSummary(summary, 9);
  metrics.ObserveKvTransfer(KvTransport::kGrpc, KvTransferDirection::kReceive,
                            KvTransferOutcome::kOk, 65536, 0.003);
  metrics.ObserveKvTransfer(KvTransport::kGrpc, KvTransferDirection::kSend,
                            KvTransferOutcome::kCancelled, 100, 0.003);
  metrics.IncrementKvLeaseExpiries();
  metrics.SetKvLeases(1);

  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", metrics.registry());
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<testing::HttpResponse> scraped =
      testing::HttpGet((*server)->port(), "/metrics");
  ASSERT_TRUE(scraped.ok()) << scraped.status();
  ASSERT_EQ(scraped->status, 200);
  // Sanity: the folded series are in what promtool checks.
  ASSERT_NE(scraped->body.find("unpadded_tokens=\"other\""), std::string::npos);
  ASSERT_NE(scraped->body.find("unpadded_tokens=\"above_max\""),
            std::string::npos);

  const std::string dir = testing::TestTmpDir();
  const std::string input = dir + "/scraped_metrics.txt";
  std::ofstream(input) << scraped->body;
  absl::StatusOr<testing::CommandResult> result =
      testing::RunCommand({kPromtool, "check", "metrics"}, input,
                          dir + "/promtool_output.txt", absl::Seconds(60));
  ASSERT_TRUE(result.ok()) << result.status();
  linted->scraped = scraped->body;
  linted->exit_code = result->exit_code;
  linted->output = result->output;
}

TEST(PromtoolCheckTest, ScrapedWorkerMetricsAreLintClean) {
  Linted linted;
  ScrapeAndLint(VllmAliases::kOff, &linted);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  EXPECT_EQ(linted.exit_code, 0) << linted.output;
  EXPECT_EQ(linted.output, "") << "scraped text:\n" << linted.scraped;
}

// With --metrics_vllm_aliases the only findings are about the vllm: names
// themselves (promtool flags the colon, reserved for recording rules).
TEST(PromtoolCheckTest, OnlyTheVllmAliasNamesAreFlagged) {
  Linted linted;
  ScrapeAndLint(VllmAliases::kOn, &linted);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  ASSERT_NE(linted.scraped.find("vllm:num_requests_waiting"),
            std::string::npos);
  for (absl::string_view line :
       absl::StrSplit(linted.output, '\n', absl::SkipEmpty())) {
    EXPECT_TRUE(absl::StartsWith(line, "vllm:") &&
                absl::StrContains(line, "should not contain ':'"))
        << line;
  }
}

}  // namespace
}  // namespace pdworker
