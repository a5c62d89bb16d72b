// WorkerMetrics: after a known sequence of calls the exposition text holds
// exactly the expected samples. Expected values are worked out by hand from
// the inputs.
#include "metrics/worker_metrics.h"

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "dispatcher/cudagraph_dispatcher.h"
#include "dispatcher/cudagraph_mode.h"
#include "dispatcher/graph_stats.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/metrics/metrics_test_util.h"
#include "worker/runtime/capture_session.h"

namespace pdworker {
namespace {

using ::pdworker::testing::Samples;
using ::pdworker::testing::Serialize;
using ::testing::Contains;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::UnorderedElementsAre;
using ::testing::UnorderedElementsAreArray;

WorkerInfo DecodeInfo() {
  return {"decode",     "FULL_DECODE_ONLY", "FULL_DECODE_ONLY",
          "tiny-llama", "sha256:0123abcd",  "cpu"};
}

GraphStatsHeader Header() {
  return {CudaGraphMode::FullAndPiecewise(), {1, 2, 4, 8}};
}

std::string Text(const WorkerMetrics& metrics) {
  return Serialize(*metrics.registry());
}

TEST(WorkerMetricsTest, InfoMetricCarriesTheWorkerIdentity) {
  WorkerMetrics metrics(DecodeInfo(), nullptr, Header());
  EXPECT_THAT(Samples(Text(metrics), "pdworker_worker_info"),
              UnorderedElementsAre(
                  "pdworker_worker_info{configured_mode=\"FULL_DECODE_ONLY\","
                  "device=\"cpu\",model=\"tiny-llama\","
                  "model_fingerprint=\"sha256:0123abcd\","
                  "resolved_mode=\"FULL_DECODE_ONLY\",role=\"decode\"} 1"));
}

TEST(WorkerMetricsTest, InfoLabelValuesAreEscaped) {
  WorkerInfo info = DecodeInfo();
  info.model = "a \"quoted\" \\ name";
  WorkerMetrics metrics(info, nullptr, Header());
  const std::vector<std::string> lines =
      Samples(Text(metrics), "pdworker_worker_info");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("model=\"a \\\"quoted\\\" \\\\ name\""),
            std::string::npos)
      << lines[0];
}

TEST(WorkerMetricsTest, TableIsExportedFromTheSnapshotAtScrapeTime) {
  GraphStats stats;
  WorkerMetrics metrics(DecodeInfo(), &stats, Header());
  // Capture sizes {1, 2, 4, 8}: the largest is 8.
  for (int i = 0; i < 3; ++i) stats.Record(1, 1, RuntimeMode::kFull);
  for (int i = 0; i < 2; ++i) stats.Record(3, 4, RuntimeMode::kFull);
  stats.Record(5, 8, RuntimeMode::kPiecewise);
  stats.Record(6, 6, RuntimeMode::kNone);  // eager below the max: exact
  stats.Record(8, 8, RuntimeMode::kNone);  // == max: still exact
  stats.Record(9, 9, RuntimeMode::kNone);  // above the max: folded
  for (int i = 0; i < 2; ++i) stats.Record(100, 100, RuntimeMode::kNone);

  std::string text = Text(metrics);
  EXPECT_THAT(
      Samples(text, "pdworker_cudagraph_steps_total"),
      UnorderedElementsAre(
          "pdworker_cudagraph_steps_total{mode=\"FULL\",padded_tokens=\"1\","
          "unpadded_tokens=\"1\"} 3",
          "pdworker_cudagraph_steps_total{mode=\"FULL\",padded_tokens=\"4\","
          "unpadded_tokens=\"3\"} 2",
          "pdworker_cudagraph_steps_total{mode=\"PIECEWISE\","
          "padded_tokens=\"8\",unpadded_tokens=\"5\"} 1",
          "pdworker_cudagraph_steps_total{mode=\"NONE\",padded_tokens=\"6\","
          "unpadded_tokens=\"6\"} 1",
          "pdworker_cudagraph_steps_total{mode=\"NONE\",padded_tokens=\"8\","
          "unpadded_tokens=\"8\"} 1",
          "pdworker_cudagraph_steps_total{mode=\"NONE\","
          "padded_tokens=\"above_max\",unpadded_tokens=\"above_max\"} 3"));
  // FULL: 3*1 + 2*3 = 9 real, 3*1 + 2*4 = 11 run. PIECEWISE: 5 and 8.
  // NONE: 6 + 8 + 9 + 2*100 = 223 both.
  EXPECT_THAT(Samples(text, "pdworker_cudagraph_unpadded_tokens_total"),
              UnorderedElementsAre(
                  "pdworker_cudagraph_unpadded_tokens_total{mode=\"FULL\"} 9",
                  "pdworker_cudagraph_unpadded_tokens_total{mode=\"PIECEWISE\"}"
                  " 5",
                  "pdworker_cudagraph_unpadded_tokens_total{mode=\"NONE\"} "
                  "223"));
  EXPECT_THAT(Samples(text, "pdworker_cudagraph_padded_tokens_total"),
              UnorderedElementsAre(
                  "pdworker_cudagraph_padded_tokens_total{mode=\"FULL\"} 11",
                  "pdworker_cudagraph_padded_tokens_total{mode=\"PIECEWISE\"} "
                  "8",
                  "pdworker_cudagraph_padded_tokens_total{mode=\"NONE\"} 223"));
  EXPECT_THAT(Samples(text, "pdworker_cudagraph_table_rows"),
              UnorderedElementsAre("pdworker_cudagraph_table_rows 7"));

  // No caching: the next scrape sees the next step.
  stats.Record(3, 4, RuntimeMode::kFull);
  text = Text(metrics);
  EXPECT_THAT(Samples(text, "pdworker_cudagraph_steps_total"),
              Contains("pdworker_cudagraph_steps_total{mode=\"FULL\","
                       "padded_tokens=\"4\",unpadded_tokens=\"3\"} 3"));
  EXPECT_THAT(Samples(text, "pdworker_cudagraph_padded_tokens_total"),
              Contains("pdworker_cudagraph_padded_tokens_total{mode=\"FULL\"} "
                       "15"));
}

TEST(WorkerMetricsTest, TableCapIsConfigurable) {
  GraphStats stats;
  WorkerMetricsOptions options;
  options.max_table_rows = 1;
  WorkerMetrics metrics(DecodeInfo(), &stats, Header(), options);
  for (int i = 0; i < 2; ++i) stats.Record(1, 1, RuntimeMode::kFull);
  stats.Record(2, 2, RuntimeMode::kFull);
  EXPECT_THAT(
      Samples(Text(metrics), "pdworker_cudagraph_steps_total"),
      UnorderedElementsAre(
          "pdworker_cudagraph_steps_total{mode=\"FULL\",padded_tokens=\"1\","
          "unpadded_tokens=\"1\"} 2",
          "pdworker_cudagraph_steps_total{mode=\"FULL\","
          "padded_tokens=\"other\",unpadded_tokens=\"other\"} 1"));
}

TEST(WorkerMetricsTest, WithoutGraphStatsTheTableIsZero) {
  WorkerMetrics metrics(DecodeInfo(), nullptr, Header());
  const std::string text = Text(metrics);
  EXPECT_THAT(Samples(text, "pdworker_cudagraph_steps_total"), IsEmpty());
  EXPECT_THAT(Samples(text, "pdworker_cudagraph_padded_tokens_total"),
              UnorderedElementsAre(
                  "pdworker_cudagraph_padded_tokens_total{mode=\"NONE\"} 0",
                  "pdworker_cudagraph_padded_tokens_total{mode=\"PIECEWISE\"} "
                  "0",
                  "pdworker_cudagraph_padded_tokens_total{mode=\"FULL\"} 0"));
  EXPECT_THAT(Samples(text, "pdworker_cudagraph_table_rows"),
              UnorderedElementsAre("pdworker_cudagraph_table_rows 0"));
}

TEST(WorkerMetricsTest, FallbackReasonsArePreInitialisedToZero) {
  WorkerMetrics metrics(DecodeInfo(), nullptr, Header());
  // Every reason except kNone ("a graph was dispatched" is no fallback).
  EXPECT_THAT(
      Samples(Text(metrics), "pdworker_cudagraph_fallbacks_total"),
      UnorderedElementsAre(
          "pdworker_cudagraph_fallbacks_total{reason=\"mode_none\"} 0",
          "pdworker_cudagraph_fallbacks_total{reason=\"above_max_capture_"
          "size\"} 0",
          "pdworker_cudagraph_fallbacks_total{reason=\"no_key_for_batch_"
          "shape\"} 0",
          "pdworker_cudagraph_fallbacks_total{reason=\"capture_disabled\"} 0",
          "pdworker_cudagraph_fallbacks_total{reason=\"still_capturing\"} 0"));
}

TEST(WorkerMetricsTest, ObserveStepCountsFallbacksLatencyAndBatchSizes) {
  WorkerMetrics metrics(DecodeInfo(), nullptr, Header());
  metrics.ObserveStep(
      testing::Step(RuntimeMode::kFull, FallbackReason::kNone, 3, 4,
                    /*num_sequences=*/2, /*num_calls=*/1, 0.0003));
  metrics.ObserveStep(
      testing::Step(RuntimeMode::kNone, FallbackReason::kAboveMaxCaptureSize,
                    100, 100, /*num_sequences=*/5, /*num_calls=*/3, 0.02));
  metrics.ObserveStep(testing::Step(RuntimeMode::kNone,
                                    FallbackReason::kStillCapturing, 6, 6,
                                    /*num_sequences=*/1, /*num_calls=*/1, 2.0));
  const std::string text = Text(metrics);

  EXPECT_THAT(
      Samples(text, "pdworker_cudagraph_fallbacks_total"),
      UnorderedElementsAre(
          "pdworker_cudagraph_fallbacks_total{reason=\"mode_none\"} 0",
          "pdworker_cudagraph_fallbacks_total{reason=\"above_max_capture_"
          "size\"} 1",
          "pdworker_cudagraph_fallbacks_total{reason=\"no_key_for_batch_"
          "shape\"} 0",
          "pdworker_cudagraph_fallbacks_total{reason=\"capture_disabled\"} 0",
          "pdworker_cudagraph_fallbacks_total{reason=\"still_capturing\"} 1"));

  EXPECT_THAT(Samples(text, "pdworker_step_duration_seconds_count"),
              UnorderedElementsAre(
                  "pdworker_step_duration_seconds_count{mode=\"FULL\"} 1",
                  "pdworker_step_duration_seconds_count{mode=\"PIECEWISE\"} 0",
                  "pdworker_step_duration_seconds_count{mode=\"NONE\"} 2"));
  const std::vector<std::string> buckets =
      Samples(text, "pdworker_step_duration_seconds_bucket");
  // 16 bounds + Inf, for each of the 3 modes.
  EXPECT_EQ(buckets.size(), 3u * 17u);
  // 300 us lands in (250 us, 500 us].
  EXPECT_THAT(buckets,
              Contains("pdworker_step_duration_seconds_bucket{mode=\"FULL\","
                       "le=\"0.00025\"} 0"));
  EXPECT_THAT(buckets,
              Contains("pdworker_step_duration_seconds_bucket{mode=\"FULL\","
                       "le=\"0.0005\"} 1"));
  EXPECT_THAT(buckets,
              Contains("pdworker_step_duration_seconds_bucket{mode=\"NONE\","
                       "le=\"0.0001\"} 0"));
  // 20 ms and 2 s: one in (10 ms, 25 ms], one in (1 s, 2.5 s].
  EXPECT_THAT(buckets,
              Contains("pdworker_step_duration_seconds_bucket{mode=\"NONE\","
                       "le=\"0.01\"} 0"));
  EXPECT_THAT(buckets,
              Contains("pdworker_step_duration_seconds_bucket{mode=\"NONE\","
                       "le=\"0.025\"} 1"));
  EXPECT_THAT(buckets,
              Contains("pdworker_step_duration_seconds_bucket{mode=\"NONE\","
                       "le=\"1\"} 1"));
  EXPECT_THAT(buckets,
              Contains("pdworker_step_duration_seconds_bucket{mode=\"NONE\","
                       "le=\"2.5\"} 2"));
  EXPECT_THAT(buckets,
              Contains("pdworker_step_duration_seconds_bucket{mode=\"NONE\","
                       "le=\"10\"} 2"));
  EXPECT_THAT(buckets,
              Contains("pdworker_step_duration_seconds_bucket{mode=\"NONE\","
                       "le=\"+Inf\"} 2"));

  // Sequences 2, 5, 1; calls 1, 3, 1; tokens 3, 100, 6.
  EXPECT_THAT(Samples(text, "pdworker_step_sequences_sum"),
              UnorderedElementsAre("pdworker_step_sequences_sum 8"));
  EXPECT_THAT(Samples(text, "pdworker_step_sequences_count"),
              UnorderedElementsAre("pdworker_step_sequences_count 3"));
  EXPECT_THAT(Samples(text, "pdworker_step_sequences_bucket"),
              UnorderedElementsAreArray({
                  "pdworker_step_sequences_bucket{le=\"1\"} 1",
                  "pdworker_step_sequences_bucket{le=\"2\"} 2",
                  "pdworker_step_sequences_bucket{le=\"4\"} 2",
                  "pdworker_step_sequences_bucket{le=\"8\"} 3",
                  "pdworker_step_sequences_bucket{le=\"16\"} 3",
                  "pdworker_step_sequences_bucket{le=\"32\"} 3",
                  "pdworker_step_sequences_bucket{le=\"64\"} 3",
                  "pdworker_step_sequences_bucket{le=\"128\"} 3",
                  "pdworker_step_sequences_bucket{le=\"256\"} 3",
                  "pdworker_step_sequences_bucket{le=\"512\"} 3",
                  "pdworker_step_sequences_bucket{le=\"1024\"} 3",
                  "pdworker_step_sequences_bucket{le=\"+Inf\"} 3",
              }));
  EXPECT_THAT(Samples(text, "pdworker_step_calls_sum"),
              UnorderedElementsAre("pdworker_step_calls_sum 5"));
  EXPECT_THAT(Samples(text, "pdworker_step_calls_bucket"),
              Contains("pdworker_step_calls_bucket{le=\"2\"} 2"));
  EXPECT_THAT(Samples(text, "pdworker_step_calls_bucket"),
              Contains("pdworker_step_calls_bucket{le=\"4\"} 3"));
  EXPECT_THAT(Samples(text, "pdworker_step_tokens_sum"),
              UnorderedElementsAre("pdworker_step_tokens_sum 109"));
  EXPECT_THAT(Samples(text, "pdworker_step_tokens_bucket"),
              Contains("pdworker_step_tokens_bucket{le=\"64\"} 2"));
  EXPECT_THAT(Samples(text, "pdworker_step_tokens_bucket"),
              Contains("pdworker_step_tokens_bucket{le=\"128\"} 3"));
}

TEST(WorkerMetricsTest, ForwardCallsByStatusCodeWithEveryCodePresent) {
  WorkerMetrics metrics(DecodeInfo(), nullptr, Header());
  metrics.ObserveForwardCall(absl::StatusCode::kOk, 0.001);
  metrics.ObserveForwardCall(absl::StatusCode::kOk, 0.002);
  metrics.ObserveForwardCall(absl::StatusCode::kInvalidArgument, 0.0001);
  metrics.ObserveForwardCall(absl::StatusCode::kResourceExhausted, 45.0);
  // Not a canonical code: counted as UNKNOWN rather than a new label.
  metrics.ObserveForwardCall(static_cast<absl::StatusCode>(99), 0.5);
  const std::string text = Text(metrics);

  EXPECT_THAT(
      Samples(text, "pdworker_forward_requests_total"),
      UnorderedElementsAreArray({
          "pdworker_forward_requests_total{code=\"OK\"} 2",
          "pdworker_forward_requests_total{code=\"CANCELLED\"} 0",
          "pdworker_forward_requests_total{code=\"UNKNOWN\"} 1",
          "pdworker_forward_requests_total{code=\"INVALID_ARGUMENT\"} 1",
          "pdworker_forward_requests_total{code=\"DEADLINE_EXCEEDED\"} 0",
          "pdworker_forward_requests_total{code=\"NOT_FOUND\"} 0",
          "pdworker_forward_requests_total{code=\"ALREADY_EXISTS\"} 0",
          "pdworker_forward_requests_total{code=\"PERMISSION_DENIED\"} 0",
          "pdworker_forward_requests_total{code=\"RESOURCE_EXHAUSTED\"} 1",
          "pdworker_forward_requests_total{code=\"FAILED_PRECONDITION\"} 0",
          "pdworker_forward_requests_total{code=\"ABORTED\"} 0",
          "pdworker_forward_requests_total{code=\"OUT_OF_RANGE\"} 0",
          "pdworker_forward_requests_total{code=\"UNIMPLEMENTED\"} 0",
          "pdworker_forward_requests_total{code=\"INTERNAL\"} 0",
          "pdworker_forward_requests_total{code=\"UNAVAILABLE\"} 0",
          "pdworker_forward_requests_total{code=\"DATA_LOSS\"} 0",
          "pdworker_forward_requests_total{code=\"UNAUTHENTICATED\"} 0",
      }));
  EXPECT_THAT(Samples(text, "pdworker_forward_request_duration_seconds_count"),
              UnorderedElementsAre(
                  "pdworker_forward_request_duration_seconds_count 5"));
  // 45 s is past the step buckets' 10 s but inside the request buckets' 60 s.
  const std::vector<std::string> buckets =
      Samples(text, "pdworker_forward_request_duration_seconds_bucket");
  EXPECT_THAT(buckets,
              Contains("pdworker_forward_request_duration_seconds_bucket{"
                       "le=\"30\"} 4"));
  EXPECT_THAT(buckets,
              Contains("pdworker_forward_request_duration_seconds_bucket{"
                       "le=\"60\"} 5"));
}

TEST(WorkerMetricsTest, StatusCodeLabelsAreGrpcNames) {
  EXPECT_EQ(StatusCodeLabel(absl::StatusCode::kOk), "OK");
  EXPECT_EQ(StatusCodeLabel(absl::StatusCode::kFailedPrecondition),
            "FAILED_PRECONDITION");
  EXPECT_EQ(StatusCodeLabel(absl::StatusCode::kUnauthenticated),
            "UNAUTHENTICATED");
  EXPECT_EQ(StatusCodeLabel(static_cast<absl::StatusCode>(-1)), "UNKNOWN");
}

TEST(WorkerMetricsTest, KvBlocksAndUsageRatio) {
  WorkerMetrics metrics(DecodeInfo(), nullptr, Header());
  metrics.SetKvBlocks(/*used=*/30, /*free=*/10);
  std::string text = Text(metrics);
  EXPECT_THAT(
      Samples(text, "pdworker_kv_cache_blocks"),
      UnorderedElementsAre("pdworker_kv_cache_blocks{state=\"used\"} 30",
                           "pdworker_kv_cache_blocks{state=\"free\"} "
                           "10"));
  EXPECT_THAT(Samples(text, "pdworker_kv_cache_usage_ratio"),
              UnorderedElementsAre("pdworker_kv_cache_usage_ratio 0.75"));

  // An empty pool is 0 % used, not NaN.
  metrics.SetKvBlocks(0, 0);
  EXPECT_THAT(Samples(Text(metrics), "pdworker_kv_cache_usage_ratio"),
              UnorderedElementsAre("pdworker_kv_cache_usage_ratio 0"));
}

TEST(WorkerMetricsTest, PrefixCacheCountersAdvanceByTheTotals) {
  WorkerMetrics metrics(DecodeInfo(), nullptr, Header());
  metrics.SetPrefixCache(/*query_tokens=*/100, /*hit_tokens=*/64,
                         /*evictions=*/2, /*cached_blocks=*/9);
  metrics.SetPrefixCache(150, 96, 2, 7);
  const std::string text = Text(metrics);
  EXPECT_THAT(Samples(text, "pdworker_prefix_cache_queries_total"),
              UnorderedElementsAre("pdworker_prefix_cache_queries_total 150"));
  EXPECT_THAT(Samples(text, "pdworker_prefix_cache_hits_total"),
              UnorderedElementsAre("pdworker_prefix_cache_hits_total 96"));
  EXPECT_THAT(Samples(text, "pdworker_prefix_cache_evictions_total"),
              UnorderedElementsAre("pdworker_prefix_cache_evictions_total 2"));
  EXPECT_THAT(Samples(text, "pdworker_prefix_cache_blocks"),
              UnorderedElementsAre("pdworker_prefix_cache_blocks 7"));
}

TEST(WorkerMetricsTest, QueueDepthIsAGauge) {
  WorkerMetrics metrics(DecodeInfo(), nullptr, Header());
  metrics.SetQueueDepth(7);
  metrics.SetQueueDepth(4);
  EXPECT_THAT(Samples(Text(metrics), "pdworker_executor_queue_depth"),
              UnorderedElementsAre("pdworker_executor_queue_depth 4"));
}

TEST(WorkerMetricsTest, CaptureSummaryPerModeAndResetOnRecapture) {
  WorkerMetrics metrics(DecodeInfo(), nullptr, Header());
  std::string text = Text(metrics);
  // Present (as 0) before any capture.
  EXPECT_THAT(
      Samples(text, "pdworker_cudagraph_graphs"),
      UnorderedElementsAre("pdworker_cudagraph_graphs{mode=\"FULL\"} 0",
                           "pdworker_cudagraph_graphs{mode=\"PIECEWISE\"}"
                           " 0"));

  CaptureSummary summary;
  summary.modes.push_back({RuntimeMode::kPiecewise, /*num_graphs=*/4,
                           /*num_warmup_runs=*/4,
                           /*seconds=*/1.5, /*memory_delta_bytes=*/1048576});
  summary.modes.push_back({RuntimeMode::kFull, /*num_graphs=*/3,
                           /*num_warmup_runs=*/3, /*seconds=*/0.5,
                           /*memory_delta_bytes=*/-4096});
  // 4 PIECEWISE keys of 3 pieces each + 3 FULL graphs.
  metrics.SetCaptureSummary(summary, /*graphs_captured=*/15);
  text = Text(metrics);
  EXPECT_THAT(
      Samples(text, "pdworker_cudagraph_graphs"),
      UnorderedElementsAre("pdworker_cudagraph_graphs{mode=\"FULL\"} 3",
                           "pdworker_cudagraph_graphs{mode=\"PIECEWISE\"}"
                           " 4"));
  EXPECT_THAT(
      Samples(text, "pdworker_cudagraph_capture_seconds"),
      UnorderedElementsAre(
          "pdworker_cudagraph_capture_seconds{mode=\"FULL\"} 0.5",
          "pdworker_cudagraph_capture_seconds{mode=\"PIECEWISE\"} 1.5"));
  EXPECT_THAT(
      Samples(text, "pdworker_cudagraph_capture_memory_bytes"),
      UnorderedElementsAre(
          "pdworker_cudagraph_capture_memory_bytes{mode=\"FULL\"} -4096",
          "pdworker_cudagraph_capture_memory_bytes{mode=\"PIECEWISE\"} "
          "1048576"));
  EXPECT_THAT(Samples(text, "pdworker_cudagraph_graph_objects"),
              UnorderedElementsAre("pdworker_cudagraph_graph_objects 15"));

  // A recapture of FULL only: PIECEWISE no longer holds graphs.
  CaptureSummary full_only;
  full_only.modes.push_back({RuntimeMode::kFull, 2, 2, 0.25, 2048});
  metrics.SetCaptureSummary(full_only, 2);
  text = Text(metrics);
  EXPECT_THAT(
      Samples(text, "pdworker_cudagraph_graphs"),
      UnorderedElementsAre("pdworker_cudagraph_graphs{mode=\"FULL\"} 2",
                           "pdworker_cudagraph_graphs{mode=\"PIECEWISE\"}"
                           " 0"));
  EXPECT_THAT(
      Samples(text, "pdworker_cudagraph_capture_memory_bytes"),
      UnorderedElementsAre(
          "pdworker_cudagraph_capture_memory_bytes{mode=\"FULL\"} 2048",
          "pdworker_cudagraph_capture_memory_bytes{mode=\"PIECEWISE\"} 0"));
}

TEST(WorkerMetricsTest, KvTransfersAndLeases) {
  WorkerMetrics metrics(DecodeInfo(), nullptr, Header());
  metrics.ObserveKvTransfer(KvTransport::kGrpc, KvTransferDirection::kReceive,
                            KvTransferOutcome::kOk, 1000, 0.01);
  metrics.ObserveKvTransfer(KvTransport::kGrpc, KvTransferDirection::kReceive,
                            KvTransferOutcome::kSourceUnreachable, 200, 0.5);
  metrics.ObserveKvTransfer(KvTransport::kNccl, KvTransferDirection::kSend,
                            KvTransferOutcome::kOk, 4096, 0.002);
  metrics.IncrementKvLeaseExpiries();
  metrics.IncrementKvLeaseExpiries();
  metrics.SetKvLeases(3);
  const std::string text = Text(metrics);

  const std::vector<std::string> transfers =
      Samples(text, "pdworker_kv_transfers_total");
  EXPECT_EQ(transfers.size(), 6u);  // 3 transports x 2 directions
  EXPECT_THAT(transfers, Contains("pdworker_kv_transfers_total{direction="
                                  "\"receive\",transport=\"grpc\"} 2"));
  EXPECT_THAT(transfers, Contains("pdworker_kv_transfers_total{direction="
                                  "\"send\",transport=\"nccl\"} 1"));
  EXPECT_THAT(transfers, Contains("pdworker_kv_transfers_total{direction="
                                  "\"send\",transport=\"cuda_ipc\"} 0"));
  const std::vector<std::string> failures =
      Samples(text, "pdworker_kv_transfer_failures_total");
  EXPECT_EQ(failures.size(), 66u);  // x 11 reasons
  EXPECT_THAT(failures, Contains("pdworker_kv_transfer_failures_total{"
                                 "direction=\"receive\",reason=\"source_"
                                 "unreachable\",transport=\"grpc\"} 1"));
  EXPECT_THAT(failures, Contains("pdworker_kv_transfer_failures_total{"
                                 "direction=\"receive\",reason=\"transport_"
                                 "error\",transport=\"grpc\"} 0"));
  EXPECT_THAT(failures, Contains("pdworker_kv_transfer_failures_total{"
                                 "direction=\"receive\",reason=\"lease_"
                                 "expired\",transport=\"grpc\"} 0"));
  EXPECT_THAT(failures, Contains("pdworker_kv_transfer_failures_total{"
                                 "direction=\"receive\",reason=\"lease_not_"
                                 "found\",transport=\"grpc\"} 0"));
  EXPECT_THAT(failures, Contains("pdworker_kv_transfer_failures_total{"
                                 "direction=\"send\",reason=\"cancelled\","
                                 "transport=\"nccl\"} 0"));
  EXPECT_THAT(Samples(text, "pdworker_kv_transfer_bytes_total"),
              Contains("pdworker_kv_transfer_bytes_total{direction="
                       "\"receive\",transport=\"grpc\"} 1200"));
  EXPECT_THAT(Samples(text, "pdworker_kv_transfer_duration_seconds_count"),
              Contains("pdworker_kv_transfer_duration_seconds_count{direction="
                       "\"receive\",transport=\"grpc\"} 2"));
  EXPECT_THAT(Samples(text, "pdworker_kv_lease_expiries_total"),
              UnorderedElementsAre("pdworker_kv_lease_expiries_total 2"));
  EXPECT_THAT(Samples(text, "pdworker_kv_leases"),
              UnorderedElementsAre("pdworker_kv_leases 3"));
}

TEST(WorkerMetricsTest, SequencesExpiredStartsAtZeroAndCounts) {
  WorkerMetrics metrics(DecodeInfo(), nullptr, Header());
  // Exported before the first expiry, so rate() and alerts see a series.
  EXPECT_THAT(Samples(Text(metrics), "pdworker_sequences_expired_total"),
              UnorderedElementsAre("pdworker_sequences_expired_total 0"));
  metrics.IncrementSequencesExpired();
  metrics.IncrementSequencesExpired();
  metrics.IncrementSequencesExpired();
  EXPECT_THAT(Samples(Text(metrics), "pdworker_sequences_expired_total"),
              UnorderedElementsAre("pdworker_sequences_expired_total 3"));
}

TEST(WorkerMetricsTest, RegistryOutlivesMetricsAndGraphStats) {
  std::shared_ptr<prometheus::Registry> registry;
  {
    GraphStats stats;
    WorkerMetrics metrics(DecodeInfo(), &stats, Header());
    stats.Record(1, 1, RuntimeMode::kFull);
    metrics.SetQueueDepth(2);
    registry = metrics.registry();
    EXPECT_THAT(Samples(Serialize(*registry), "pdworker_cudagraph_steps_total"),
                Not(IsEmpty()));
  }
  // GraphStats is gone: the table families disappear (stale, not reset to
  // zero); the rest keeps its last values. ASan catches any read of `stats`.
  const std::string text = Serialize(*registry);
  EXPECT_THAT(Samples(text, "pdworker_cudagraph_steps_total"), IsEmpty());
  EXPECT_THAT(Samples(text, "pdworker_cudagraph_padded_tokens_total"),
              IsEmpty());
  EXPECT_EQ(text.find("pdworker_cudagraph_steps_total"), std::string::npos);
  EXPECT_THAT(Samples(text, "pdworker_executor_queue_depth"),
              UnorderedElementsAre("pdworker_executor_queue_depth 2"));
}

namespace request_metrics {

using Clock = RequestTimeline::Clock;

Clock::time_point At(Clock::time_point t0, int ms) {
  return t0 + std::chrono::milliseconds(ms);
}

// One histogram's _count and _sum samples.
std::vector<std::string> CountAndSum(const std::string& text,
                                     const std::string& name) {
  std::vector<std::string> lines = Samples(text, name + "_count");
  for (std::string& line : Samples(text, name + "_sum")) {
    lines.push_back(std::move(line));
  }
  return lines;
}

TEST(WorkerMetricsTest, RequestLatenciesComeFromTheTimeline) {
  WorkerMetrics metrics(DecodeInfo(), nullptr, Header());
  const Clock::time_point t0 = Clock::now();
  RequestTimeline timeline;
  timeline.arrival = t0;
  timeline.scheduled = At(t0, 10);
  timeline.first_token = At(t0, 30);
  metrics.ObserveFirstToken(timeline, /*prefilled_tokens=*/20,
                            /*num_tokens=*/1);
  timeline.last_token = At(t0, 130);
  metrics.ObserveNextTokens(0.05, 2);
  metrics.ObserveNextTokens(0.05, 1);
  metrics.ObserveRequestEnd(timeline, RequestEnd::kStop, At(t0, 200));
  // A request aborted while it waited: an end, no token.
  RequestTimeline waited;
  waited.arrival = t0;
  metrics.ObserveRequestEnd(waited, RequestEnd::kAbort, At(t0, 300));

  const std::string text = Text(metrics);
  EXPECT_THAT(CountAndSum(text, "pdworker_request_time_to_first_token_seconds"),
              UnorderedElementsAre(
                  "pdworker_request_time_to_first_token_seconds_count 1",
                  "pdworker_request_time_to_first_token_seconds_sum 0.03"));
  EXPECT_THAT(
      CountAndSum(text, "pdworker_request_queue_time_seconds"),
      UnorderedElementsAre("pdworker_request_queue_time_seconds_count 1",
                           "pdworker_request_queue_time_seconds_sum 0.01"));
  EXPECT_THAT(
      CountAndSum(text, "pdworker_request_prefill_time_seconds"),
      UnorderedElementsAre("pdworker_request_prefill_time_seconds_count 1",
                           "pdworker_request_prefill_time_seconds_sum 0.02"));
  EXPECT_THAT(CountAndSum(text, "pdworker_request_inter_token_latency_seconds"),
              UnorderedElementsAre(
                  "pdworker_request_inter_token_latency_seconds_count 2",
                  "pdworker_request_inter_token_latency_seconds_sum 0.1"));
  EXPECT_THAT(
      CountAndSum(text, "pdworker_request_decode_time_seconds"),
      UnorderedElementsAre("pdworker_request_decode_time_seconds_count 1",
                           "pdworker_request_decode_time_seconds_sum 0.1"));
  EXPECT_THAT(
      CountAndSum(text, "pdworker_request_e2e_latency_seconds"),
      UnorderedElementsAre("pdworker_request_e2e_latency_seconds_count 2",
                           "pdworker_request_e2e_latency_seconds_sum 0.5"));
  EXPECT_THAT(Samples(text, "pdworker_prompt_tokens_total"),
              UnorderedElementsAre("pdworker_prompt_tokens_total 20"));
  EXPECT_THAT(Samples(text, "pdworker_generation_tokens_total"),
              UnorderedElementsAre("pdworker_generation_tokens_total 4"));
  EXPECT_THAT(Samples(text, "pdworker_requests_finished_total"),
              UnorderedElementsAre(
                  "pdworker_requests_finished_total{reason=\"stop\"} 1",
                  "pdworker_requests_finished_total{reason=\"length\"} 0",
                  "pdworker_requests_finished_total{reason=\"abort\"} 1",
                  "pdworker_requests_finished_total{reason=\"error\"} 0"));
}

TEST(WorkerMetricsTest, ADecodeLegsFirstTokenHasNoPrefill) {
  WorkerMetrics metrics(DecodeInfo(), nullptr, Header());
  const Clock::time_point t0 = Clock::now();
  // Arrived, imported its KV for 40 ms, started and emitted the prefill
  // worker's token at once.
  RequestTimeline timeline;
  timeline.arrival = t0;
  timeline.scheduled = At(t0, 40);
  timeline.first_token = At(t0, 40);
  metrics.ObserveFirstToken(timeline, /*prefilled_tokens=*/0, 1);
  const std::string text = Text(metrics);
  EXPECT_THAT(Samples(text, "pdworker_request_time_to_first_token_seconds_sum"),
              UnorderedElementsAre(
                  "pdworker_request_time_to_first_token_seconds_sum 0.04"));
  EXPECT_THAT(
      Samples(text, "pdworker_request_prefill_time_seconds_sum"),
      UnorderedElementsAre("pdworker_request_prefill_time_seconds_sum 0"));
  EXPECT_THAT(Samples(text, "pdworker_prompt_tokens_total"),
              UnorderedElementsAre("pdworker_prompt_tokens_total 0"));
}

EngineLoad Load() {
  EngineLoad load;
  load.running_requests = 3;
  load.waiting_requests = 2;
  load.kv_imports_waiting = 6;
  load.step_level_sequences = 4;
  load.queued_calls = 5;
  load.waiting_prompt_tokens = 700;
  load.used_blocks = 30;
  load.free_blocks = 10;
  load.used_tokens = 111;
  load.preemptions = 5;
  return load;
}

TEST(WorkerMetricsTest, EngineLoadSetsTheGaugesAndAdvancesPreemptions) {
  WorkerMetricsOptions options;
  options.cache = {/*block_size=*/16, /*num_blocks=*/40,
                   /*kv_cache_bytes=*/655360, /*prefix_caching=*/true};
  WorkerMetrics metrics(DecodeInfo(), nullptr, Header(), options);
  metrics.SetEngineLoad(Load());
  EngineLoad later = Load();
  later.preemptions = 3;  // never backwards
  metrics.SetEngineLoad(later);
  later.preemptions = 8;
  metrics.SetEngineLoad(later);
  const std::string text = Text(metrics);
  for (const auto& [name, value] : std::vector<std::pair<std::string, int>>{
           {"pdworker_requests_running", 3},
           {"pdworker_requests_waiting", 2},
           {"pdworker_kv_imports_waiting", 6},
           {"pdworker_step_level_sequences", 4},
           {"pdworker_executor_queue_depth", 5},
           {"pdworker_waiting_prompt_tokens", 700},
           {"pdworker_kv_cache_used_tokens", 111},
           {"pdworker_kv_cache_capacity_tokens", 640},
           {"pdworker_request_preemptions_total", 8}}) {
    EXPECT_THAT(Samples(text, name),
                UnorderedElementsAre(absl::StrCat(name, " ", value)));
  }
  EXPECT_THAT(Samples(text, "pdworker_kv_cache_usage_ratio"),
              UnorderedElementsAre("pdworker_kv_cache_usage_ratio 0.75"));
  EXPECT_THAT(Samples(text, "pdworker_cache_config_info"),
              UnorderedElementsAre(
                  "pdworker_cache_config_info{block_size=\"16\","
                  "enable_prefix_caching=\"True\",kv_cache_bytes=\"655360\","
                  "num_gpu_blocks=\"40\"} 1"));
  // No vLLM names unless asked for.
  EXPECT_EQ(text.find("vllm:"), std::string::npos);
}

TEST(WorkerMetricsTest, VllmAliasesCarryTheSameValues) {
  WorkerMetricsOptions options;
  options.vllm_aliases = VllmAliases::kOn;
  options.served_model_name = "tiny";
  options.cache = {16, 40, 655360, false};
  WorkerMetrics metrics(DecodeInfo(), nullptr, Header(), options);
  metrics.SetEngineLoad(Load());
  const std::string text = Text(metrics);
  // Running: 3 requests + 4 step-level sequences; waiting: 2 requests + 5
  // queued calls + 6 KV imports; usage 30 / 40.
  EXPECT_THAT(Samples(text, "vllm:num_requests_running"),
              UnorderedElementsAre("vllm:num_requests_running{engine=\"0\","
                                   "model_name=\"tiny\"} 7"));
  EXPECT_THAT(Samples(text, "vllm:num_requests_waiting"),
              UnorderedElementsAre("vllm:num_requests_waiting{engine=\"0\","
                                   "model_name=\"tiny\"} 13"));
  EXPECT_THAT(Samples(text, "vllm:kv_cache_usage_perc"),
              UnorderedElementsAre("vllm:kv_cache_usage_perc{engine=\"0\","
                                   "model_name=\"tiny\"} 0.75"));
  EXPECT_THAT(Samples(text, "vllm:gpu_cache_usage_perc"),
              UnorderedElementsAre("vllm:gpu_cache_usage_perc{engine=\"0\","
                                   "model_name=\"tiny\"} 0.75"));
  EXPECT_THAT(
      Samples(text, "vllm:cache_config_info"),
      UnorderedElementsAre("vllm:cache_config_info{block_size=\"16\","
                           "enable_prefix_caching=\"False\",engine=\"0\","
                           "num_gpu_blocks=\"40\"} 1"));
  // Typed gauges: an endpoint picker reads untyped families as 0.
  EXPECT_NE(text.find("# TYPE vllm:num_requests_waiting gauge"),
            std::string::npos);
}

}  // namespace request_metrics

}  // namespace
}  // namespace pdworker
