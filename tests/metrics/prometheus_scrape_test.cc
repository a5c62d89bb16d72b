// End to end with a real Prometheus server (Debian's "prometheus" package):
// it scrapes the worker's MetricsServer every second, and its query API
// must return the statistics table's rows with the recorded counts, then
// the new counts after more steps.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "dispatcher/cudagraph_dispatcher.h"
#include "dispatcher/cudagraph_mode.h"
#include "dispatcher/graph_stats.h"
#include "gtest/gtest.h"
#include "metrics/metrics_server.h"
#include "metrics/worker_metrics.h"
#include "nlohmann/json.hpp"
#include "tests/metrics/metrics_test_util.h"
#include "tests/metrics/subprocess.h"

namespace pdworker {
namespace {

using ::pdworker::testing::HttpGet;
using ::pdworker::testing::HttpResponse;
using ::pdworker::testing::Subprocess;

constexpr char kPrometheus[] = "/usr/bin/prometheus";
// Bounded waits (the test's own limit is the "medium" size, 300 s).
constexpr absl::Duration kStartTimeout = absl::Seconds(30);
constexpr absl::Duration kScrapeTimeout = absl::Seconds(30);

// A Prometheus server on a free port, stopped on destruction.
class PrometheusServer {
 public:
  static absl::StatusOr<std::unique_ptr<PrometheusServer>> Start(
      int target_port) {
    const std::string dir = testing::TestTmpDir();
    const std::string config = dir + "/prometheus.yml";
    std::ofstream(config) << "global:\n"
                             "  scrape_interval: 1s\n"
                             "  scrape_timeout: 1s\n"
                             "  evaluation_interval: 1s\n"
                             "scrape_configs:\n"
                             "  - job_name: pdworker\n"
                             "    static_configs:\n"
                             "      - targets: ['127.0.0.1:"
                          << target_port << "']\n";
    absl::Status last = absl::UnavailableError("not started");
    // The free port may be taken before Prometheus binds it: retry.
    for (int attempt = 0; attempt < 3; ++attempt) {
      absl::StatusOr<int> port = testing::PickFreePort();
      if (!port.ok()) return port.status();
      const std::string log =
          absl::StrCat(dir, "/prometheus_", attempt, ".log");
      absl::StatusOr<std::unique_ptr<Subprocess>> child = Subprocess::Start(
          {kPrometheus, "--config.file=" + config,
           absl::StrCat("--storage.tsdb.path=", dir, "/tsdb_", attempt),
           absl::StrCat("--web.listen-address=127.0.0.1:", *port)},
          log);
      if (!child.ok()) return child.status();
      std::unique_ptr<PrometheusServer> server(
          new PrometheusServer(std::move(*child), *port));
      last = server->WaitReady();
      if (last.ok()) return server;
    }
    return last;
  }

  // Best effort on early test failure; the test checks Stop() itself.
  ~PrometheusServer() { Stop().IgnoreError(); }

  // Stops it with SIGTERM; OK when it exited cleanly (status 0).
  absl::Status Stop() {
    if (child_ == nullptr) return absl::OkStatus();
    const int status = child_->Stop(absl::Seconds(20));
    const std::string output = child_->Output();
    child_.reset();
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
      return absl::OkStatus();
    }
    return absl::InternalError(
        absl::StrCat("prometheus did not exit cleanly (wait status ", status,
                     "):\n", output));
  }

  // The instant vector for `query`, as JSON "result" entries.
  absl::StatusOr<nlohmann::json> Query(const std::string& query) const {
    absl::StatusOr<HttpResponse> response =
        HttpGet(port_, "/api/v1/query?query=" + query);
    if (!response.ok()) return response.status();
    if (response->status != 200) {
      return absl::UnavailableError(absl::StrCat(
          "query status ", response->status, ": ", response->body));
    }
    nlohmann::json json = nlohmann::json::parse(response->body, nullptr,
                                                /*allow_exceptions=*/false);
    if (json.is_discarded() || json.value("status", "") != "success") {
      return absl::DataLossError("bad query response: " + response->body);
    }
    return json["data"]["result"];
  }

  std::string Log() const { return child_ ? child_->Output() : ""; }

 private:
  PrometheusServer(std::unique_ptr<Subprocess> child, int port)
      : child_(std::move(child)), port_(port) {}

  absl::Status WaitReady() {
    const absl::Time deadline = absl::Now() + kStartTimeout;
    while (absl::Now() < deadline) {
      if (!child_->Running()) {
        return absl::UnavailableError("prometheus exited during startup:\n" +
                                      child_->Output());
      }
      absl::StatusOr<HttpResponse> ready = HttpGet(port_, "/-/ready");
      if (ready.ok() && ready->status == 200) return absl::OkStatus();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return absl::DeadlineExceededError("prometheus not ready:\n" +
                                       child_->Output());
  }

  std::unique_ptr<Subprocess> child_;
  int port_;
};

using Row = std::tuple<std::string, std::string, std::string>;  // mode,
                                                                // unpadded,
                                                                // padded

// pdworker_cudagraph_steps_total as Prometheus stored it.
std::map<Row, double> StepsSeen(const nlohmann::json& result) {
  std::map<Row, double> rows;
  for (const nlohmann::json& sample : result) {
    const nlohmann::json& m = sample["metric"];
    double value = -1;
    if (!absl::SimpleAtod(sample["value"][1].get<std::string>(), &value)) {
      ADD_FAILURE() << "bad value in " << sample.dump();
    }
    rows[{m.value("mode", ""), m.value("unpadded_tokens", ""),
          m.value("padded_tokens", "")}] = value;
  }
  return rows;
}

// Polls the query until `done(result)` or the bounded wait ends; returns
// the last result.
template <typename Done>
nlohmann::json PollQuery(const PrometheusServer& prometheus,
                         const std::string& query, Done done) {
  nlohmann::json last = nlohmann::json::array();
  const absl::Time deadline = absl::Now() + kScrapeTimeout;
  while (absl::Now() < deadline) {
    absl::StatusOr<nlohmann::json> result = prometheus.Query(query);
    if (result.ok()) {
      last = *result;
      if (done(last)) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return last;
}

TEST(PrometheusScrapeTest, RealPrometheusScrapesTheStatisticsTable) {
  ASSERT_EQ(access(kPrometheus, X_OK), 0)
      << kPrometheus
      << " is missing: run scripts/install-deps (Debian package "
         "'prometheus'); CI installs it. This test needs a real Prometheus.";

  GraphStats stats;
  WorkerMetrics metrics({"decode", "FULL_DECODE_ONLY", "FULL_DECODE_ONLY",
                         "tiny-llama", "sha256:0123", "cpu"},
                        &stats, {CudaGraphMode::FullDecodeOnly(), {1, 2, 4}});
  for (int i = 0; i < 7; ++i) stats.Record(1, 1, RuntimeMode::kFull);
  for (int i = 0; i < 3; ++i) stats.Record(3, 4, RuntimeMode::kFull);
  stats.Record(2, 2, RuntimeMode::kNone);
  for (int i = 0; i < 2; ++i) stats.Record(40, 40, RuntimeMode::kNone);
  metrics.ObserveStep(testing::Step(RuntimeMode::kNone,
                                    FallbackReason::kNoKeyForBatchShape, 40, 40,
                                    2, 2, 0.01));

  absl::StatusOr<std::unique_ptr<MetricsServer>> exporter =
      MetricsServer::Start("127.0.0.1:0", metrics.registry());
  ASSERT_TRUE(exporter.ok()) << exporter.status();

  absl::StatusOr<std::unique_ptr<PrometheusServer>> prometheus =
      PrometheusServer::Start((*exporter)->port());
  ASSERT_TRUE(prometheus.ok()) << prometheus.status();

  const std::map<Row, double> expected = {
      {{"FULL", "1", "1"}, 7},
      {{"FULL", "3", "4"}, 3},
      {{"NONE", "2", "2"}, 1},
      {{"NONE", "above_max", "above_max"}, 2},
  };
  nlohmann::json result = PollQuery(
      **prometheus, "pdworker_cudagraph_steps_total",
      [&](const nlohmann::json& r) { return StepsSeen(r) == expected; });
  EXPECT_EQ(StepsSeen(result), expected)
      << result.dump(2) << "\nprometheus log:\n"
      << (*prometheus)->Log();
  for (const nlohmann::json& sample : result) {
    EXPECT_EQ(sample["metric"].value("job", ""), "pdworker");
    EXPECT_EQ(sample["metric"].value("instance", ""),
              absl::StrCat("127.0.0.1:", (*exporter)->port()));
  }

  // The rest of the registry arrives in the same scrape.
  absl::StatusOr<nlohmann::json> info =
      (*prometheus)->Query("pdworker_worker_info");
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->size(), 1u) << info->dump(2);
  EXPECT_EQ((*info)[0]["metric"].value("role", ""), "decode");
  EXPECT_EQ((*info)[0]["metric"].value("model_fingerprint", ""), "sha256:0123");
  EXPECT_EQ((*info)[0]["value"][1], "1");
  absl::StatusOr<nlohmann::json> fallbacks =
      (*prometheus)->Query("pdworker_cudagraph_fallbacks_total");
  ASSERT_TRUE(fallbacks.ok()) << fallbacks.status();
  EXPECT_EQ(fallbacks->size(), 5u) << fallbacks->dump(2);
  for (const nlohmann::json& sample : *fallbacks) {
    EXPECT_EQ(sample["value"][1],
              sample["metric"].value("reason", "") == "no_key_for_batch_shape"
                  ? "1"
                  : "0")
        << sample.dump();
  }

  // More steps: the next scrapes carry the new counts.
  for (int i = 0; i < 5; ++i) stats.Record(3, 4, RuntimeMode::kFull);
  std::map<Row, double> updated = expected;
  updated[{"FULL", "3", "4"}] = 8;
  result = PollQuery(
      **prometheus, "pdworker_cudagraph_steps_total",
      [&](const nlohmann::json& r) { return StepsSeen(r) == updated; });
  EXPECT_EQ(StepsSeen(result), updated) << result.dump(2);

  absl::StatusOr<nlohmann::json> up = (*prometheus)->Query("up");
  ASSERT_TRUE(up.ok()) << up.status();
  ASSERT_EQ(up->size(), 1u) << up->dump(2);
  EXPECT_EQ((*up)[0]["value"][1], "1");

  // Prometheus keeps its scrape connection alive (scrapes 1 s apart, well
  // inside the exposer's idle timeout), so the scrapes so far share
  // connections instead of opening one each.
  const MetricsServerStats served = (*exporter)->stats();
  EXPECT_GE(served.requests_answered, 2u);
  EXPECT_LT(served.connections_accepted, served.requests_answered)
      << served.connections_accepted << " connections for "
      << served.requests_answered << " scrapes";

  EXPECT_TRUE((*prometheus)->Stop().ok());
}

}  // namespace
}  // namespace pdworker
