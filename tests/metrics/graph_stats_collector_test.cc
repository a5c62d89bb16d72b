// GraphStatsCollector: bounded label cardinality ("above_max" and "other"
// folding), sticky admission keeping every series monotonic, and concurrent
// scrapes against a recording thread.
#include "metrics/graph_stats_collector.h"

#include <atomic>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"
#include "dispatcher/cudagraph_mode.h"
#include "dispatcher/graph_stats.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/metrics/metrics_test_util.h"

namespace pdworker {
namespace {

using ::pdworker::testing::Samples;
using ::pdworker::testing::Serialize;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

constexpr char kSteps[] = "pdworker_cudagraph_steps_total";

GraphStatsHeader Header(std::vector<int> sizes) {
  return {CudaGraphMode::FullAndPiecewise(), std::move(sizes)};
}

// "series labels" -> value for one family.
std::map<std::string, double> Values(const std::string& text,
                                     const std::string& name) {
  std::map<std::string, double> out;
  for (const std::string& line : Samples(text, name)) {
    const size_t space = line.rfind(' ');
    double value = 0;
    EXPECT_TRUE(absl::SimpleAtod(line.substr(space + 1), &value)) << line;
    out[line.substr(0, space)] = value;
  }
  return out;
}

TEST(GraphStatsCollectorTest, EagerRowsAboveTheLargestCaptureSizeFold) {
  GraphStats stats;
  GraphStatsCollector collector(&stats, Header({1, 2, 4, 8}));
  EXPECT_EQ(collector.max_capture_size(), 8);
  stats.Record(8, 8, RuntimeMode::kNone);
  stats.Record(9, 9, RuntimeMode::kNone);
  stats.Record(4096, 4096, RuntimeMode::kNone);
  stats.Record(7, 8, RuntimeMode::kPiecewise);
  EXPECT_THAT(
      Samples(Serialize(collector), kSteps),
      UnorderedElementsAre(
          "pdworker_cudagraph_steps_total{mode=\"NONE\",padded_tokens=\"8\","
          "unpadded_tokens=\"8\"} 1",
          "pdworker_cudagraph_steps_total{mode=\"NONE\","
          "padded_tokens=\"above_max\",unpadded_tokens=\"above_max\"} 2",
          "pdworker_cudagraph_steps_total{mode=\"PIECEWISE\","
          "padded_tokens=\"8\",unpadded_tokens=\"7\"} 1"));
}

TEST(GraphStatsCollectorTest, WithoutCaptureSizesEveryEagerStepIsAboveMax) {
  GraphStats stats;
  GraphStatsCollector collector(&stats, {CudaGraphMode::None(), {}});
  for (int tokens = 1; tokens <= 50; ++tokens) {
    stats.Record(tokens, tokens, RuntimeMode::kNone);
  }
  EXPECT_THAT(
      Samples(Serialize(collector), kSteps),
      UnorderedElementsAre(
          "pdworker_cudagraph_steps_total{mode=\"NONE\","
          "padded_tokens=\"above_max\",unpadded_tokens=\"above_max\"} 50"));
}

TEST(GraphStatsCollectorTest, RowsBeyondTheCapFoldIntoOtherPerMode) {
  GraphStats stats;
  GraphStatsCollector collector(&stats, Header({1, 2, 4, 8}),
                                /*max_table_rows=*/2);
  for (int i = 0; i < 5; ++i) stats.Record(1, 1, RuntimeMode::kFull);
  for (int i = 0; i < 4; ++i) stats.Record(2, 2, RuntimeMode::kFull);
  for (int i = 0; i < 3; ++i) stats.Record(3, 4, RuntimeMode::kPiecewise);
  for (int i = 0; i < 2; ++i) stats.Record(5, 5, RuntimeMode::kNone);
  stats.Record(6, 6, RuntimeMode::kNone);
  const std::string text = Serialize(collector);
  // The two busiest rows get the slots; the rest fold per mode.
  EXPECT_THAT(
      Samples(text, kSteps),
      UnorderedElementsAre(
          "pdworker_cudagraph_steps_total{mode=\"FULL\",padded_tokens=\"1\","
          "unpadded_tokens=\"1\"} 5",
          "pdworker_cudagraph_steps_total{mode=\"FULL\",padded_tokens=\"2\","
          "unpadded_tokens=\"2\"} 4",
          "pdworker_cudagraph_steps_total{mode=\"PIECEWISE\","
          "padded_tokens=\"other\",unpadded_tokens=\"other\"} 3",
          "pdworker_cudagraph_steps_total{mode=\"NONE\","
          "padded_tokens=\"other\",unpadded_tokens=\"other\"} 3"));
  // Folding never loses tokens: PIECEWISE 3*3 real, 3*4 run.
  EXPECT_THAT(
      Samples(text, "pdworker_cudagraph_padded_tokens_total"),
      UnorderedElementsAre(
          "pdworker_cudagraph_padded_tokens_total{mode=\"NONE\"} 16",
          "pdworker_cudagraph_padded_tokens_total{mode=\"PIECEWISE\"} 12",
          "pdworker_cudagraph_padded_tokens_total{mode=\"FULL\"} 13"));
  EXPECT_THAT(Samples(text, "pdworker_cudagraph_table_rows"),
              UnorderedElementsAre("pdworker_cudagraph_table_rows 5"));
}

TEST(GraphStatsCollectorTest, ZeroCapExportsOnlyOther) {
  GraphStats stats;
  GraphStatsCollector collector(&stats, Header({8}), /*max_table_rows=*/0);
  stats.Record(3, 8, RuntimeMode::kFull);
  stats.Record(20, 20, RuntimeMode::kNone);
  EXPECT_THAT(Samples(Serialize(collector), kSteps),
              UnorderedElementsAre(
                  "pdworker_cudagraph_steps_total{mode=\"FULL\","
                  "padded_tokens=\"other\",unpadded_tokens=\"other\"} 1",
                  "pdworker_cudagraph_steps_total{mode=\"NONE\","
                  "padded_tokens=\"other\",unpadded_tokens=\"other\"} 1"));
}

TEST(GraphStatsCollectorTest, AboveMaxRowsShareOneSlot) {
  GraphStats stats;
  GraphStatsCollector collector(&stats, Header({8}), /*max_table_rows=*/1);
  for (int tokens = 9; tokens < 30; ++tokens) {
    stats.Record(tokens, tokens, RuntimeMode::kNone);
  }
  EXPECT_THAT(
      Samples(Serialize(collector), kSteps),
      UnorderedElementsAre(
          "pdworker_cudagraph_steps_total{mode=\"NONE\","
          "padded_tokens=\"above_max\",unpadded_tokens=\"above_max\"} 21"));
}

TEST(GraphStatsCollectorTest, AdmissionIsStickySoSeriesStayMonotonic) {
  GraphStats stats;
  GraphStatsCollector collector(&stats, Header({1, 2, 4, 8}),
                                /*max_table_rows=*/2);
  stats.Record(1, 1, RuntimeMode::kFull);
  stats.Record(2, 2, RuntimeMode::kFull);
  std::map<std::string, double> first = Values(Serialize(collector), kSteps);
  ASSERT_EQ(first.size(), 2u);

  // A new row, soon the busiest, finds no free slot: it goes to "other" and
  // stays there, and the admitted rows keep their series.
  for (int i = 0; i < 100; ++i) stats.Record(3, 4, RuntimeMode::kFull);
  std::map<std::string, double> second = Values(Serialize(collector), kSteps);
  EXPECT_EQ(second, (std::map<std::string, double>{
                        {"pdworker_cudagraph_steps_total{mode=\"FULL\","
                         "padded_tokens=\"1\",unpadded_tokens=\"1\"}",
                         1},
                        {"pdworker_cudagraph_steps_total{mode=\"FULL\","
                         "padded_tokens=\"2\",unpadded_tokens=\"2\"}",
                         1},
                        {"pdworker_cudagraph_steps_total{mode=\"FULL\","
                         "padded_tokens=\"other\",unpadded_tokens=\"other\"}",
                         100},
                    }));
}

// Random traffic: the number of step series never exceeds cap + 3, every
// series is monotonic from scrape to scrape, and the step series always sum
// to the table's total.
TEST(GraphStatsCollectorTest, CardinalityBoundAndMonotonicityUnderRandomLoad) {
  constexpr int kCap = 20;
  GraphStats stats;
  GraphStatsCollector collector(&stats, Header({1, 2, 4, 8, 16, 32}), kCap);
  std::mt19937 rng(12345);
  std::uniform_int_distribution<int> tokens(1, 4096);
  std::uniform_int_distribution<int> mode_pick(0, 2);
  std::map<std::string, double> previous;
  for (int scrape = 0; scrape < 30; ++scrape) {
    for (int step = 0; step < 50; ++step) {
      const int n = tokens(rng);
      const auto mode = static_cast<RuntimeMode>(mode_pick(rng));
      if (mode == RuntimeMode::kNone || n > 32) {
        stats.Record(n, n, RuntimeMode::kNone);
      } else {
        int padded = 1;
        while (padded < n) padded *= 2;
        stats.Record(n, padded, mode);
      }
    }
    const std::map<std::string, double> now =
        Values(Serialize(collector), kSteps);
    EXPECT_LE(now.size(), static_cast<size_t>(kCap + 3));
    double sum = 0;
    for (const auto& [series, value] : now) sum += value;
    EXPECT_EQ(sum, static_cast<double>(stats.TotalCount()));
    for (const auto& [series, value] : previous) {
      ASSERT_TRUE(now.count(series)) << series << " disappeared";
      EXPECT_GE(now.at(series), value) << series << " decreased";
    }
    previous = now;
  }
}

TEST(GraphStatsCollectorTest, NegativeCapMeansZero) {
  GraphStatsCollector collector(nullptr, Header({8}), -5);
  EXPECT_EQ(collector.max_table_rows(), 0);
}

TEST(GraphStatsCollectorTest, DetachedCollectorExportsNothing) {
  GraphStats stats;
  GraphStatsCollector collector(&stats, Header({8}));
  stats.Record(1, 8, RuntimeMode::kFull);
  EXPECT_FALSE(collector.Collect().empty());
  collector.Detach();
  EXPECT_THAT(collector.Collect(), IsEmpty());
}

// Scrapes on two threads while the engine records: each scraper sees
// every series monotonic (TSan checks the locking).
TEST(GraphStatsCollectorTest, ConcurrentScrapesWhileRecording) {
  GraphStats stats;
  GraphStatsCollector collector(&stats, Header({1, 2, 4, 8}),
                                /*max_table_rows=*/4);
  std::atomic<bool> done{false};
  std::thread recorder([&] {
    for (int i = 0; i < 20000; ++i) {
      const int n = 1 + i % 12;
      if (n > 8) {
        stats.Record(n, n, RuntimeMode::kNone);
      } else {
        stats.Record(n, 8, RuntimeMode::kPiecewise);
      }
    }
    done.store(true);
  });
  auto scrape = [&] {
    std::map<std::string, double> previous;
    int scrapes = 0;
    // At least a few scrapes, then until the recorder is done.
    while (scrapes < 5 || !done.load()) {
      const std::map<std::string, double> now =
          Values(Serialize(collector), kSteps);
      EXPECT_LE(now.size(), 4u + 3u);
      for (const auto& [series, value] : previous) {
        EXPECT_GE(now.count(series) ? now.at(series) : -1, value) << series;
      }
      previous = now;
      ++scrapes;
    }
  };
  std::thread scraper1(scrape);
  std::thread scraper2(scrape);
  recorder.join();
  scraper1.join();
  scraper2.join();
  double sum = 0;
  for (const auto& [series, value] : Values(Serialize(collector), kSteps)) {
    sum += value;
  }
  EXPECT_EQ(sum, 20000);
}

}  // namespace
}  // namespace pdworker
