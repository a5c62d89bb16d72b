// `promtool check metrics` (Prometheus's own lint: naming, units, _total
// suffixes, help text) reports nothing for a fully populated worker
// registry, as scraped over HTTP from the real MetricsServer.
#include <unistd.h>

#include <fstream>
#include <memory>
#include <string>

#include "absl/status/status.h"
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

TEST(PromtoolCheckTest, ScrapedWorkerMetricsAreLintClean) {
  ASSERT_EQ(access(kPromtool, X_OK), 0)
      << kPromtool
      << " is missing: run scripts/install-deps (Debian package "
         "'prometheus') to get promtool and the Prometheus server.";

  GraphStats stats;
  WorkerMetricsOptions options;
  options.max_table_rows = 3;  // so the "other" series appear too
  WorkerMetrics metrics({"both", "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE",
                         "tiny-llama", "sha256:feed", "cuda:0 NVIDIA H100"},
                        &stats, {CudaGraphMode::FullAndPiecewise(), {1, 2, 4}},
                        options);
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
  EXPECT_EQ(result->exit_code, 0) << result->output;
  EXPECT_EQ(result->output, "") << "scraped text:\n" << scraped->body;
}

}  // namespace
}  // namespace pdworker
