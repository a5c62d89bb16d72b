#include "dispatcher/graph_stats.h"

#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

constexpr RuntimeMode kN = RuntimeMode::kNone;
constexpr RuntimeMode kP = RuntimeMode::kPiecewise;
constexpr RuntimeMode kF = RuntimeMode::kFull;

TEST(GraphStatsTest, EmptySnapshot) {
  GraphStats stats;
  EXPECT_THAT(stats.Snapshot(), IsEmpty());
  EXPECT_EQ(stats.TotalCount(), 0);
}

TEST(GraphStatsTest, AggregatesAndSortsByCountThenKey) {
  GraphStats stats;
  for (int i = 0; i < 3; ++i) stats.Record(64, 128, kF);
  stats.Record(200, 256, kP);
  stats.Record(5, 8, kF);
  for (int i = 0; i < 5; ++i) stats.Record(128, 128, kF);
  // Same sizes, different mode: a separate row.
  stats.Record(5, 8, kP);
  stats.Record(600, 600, kN);
  EXPECT_THAT(
      stats.Snapshot(),
      ElementsAre(GraphStatsRow{128, 128, 0, kF, 5},
                  GraphStatsRow{64, 128, 64, kF, 3},
                  // Ties (count 1) by (unpadded, padded, mode) ascending.
                  GraphStatsRow{5, 8, 3, kP, 1}, GraphStatsRow{5, 8, 3, kF, 1},
                  GraphStatsRow{200, 256, 56, kP, 1},
                  GraphStatsRow{600, 600, 0, kN, 1}));
  EXPECT_EQ(stats.TotalCount(), 12);
}

TEST(GraphStatsTest, ConcurrentRecordsSumExactly) {
  GraphStats stats;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 50000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&stats, t] {
      for (int i = 0; i < kPerThread; ++i) {
        // Every thread hits a shared key and a key of its own.
        if (i % 2 == 0) {
          stats.Record(7, 8, kF);
        } else {
          stats.Record(100 + t, 128, kP);
        }
      }
    });
  }
  // Read concurrently while writers run: must not crash or tear.
  for (int i = 0; i < 100; ++i) {
    int64_t sum = 0;
    for (const GraphStatsRow& row : stats.Snapshot()) sum += row.count;
    EXPECT_LE(sum, int64_t{kThreads} * kPerThread);
  }
  for (auto& thread : threads) thread.join();

  const std::vector<GraphStatsRow> rows = stats.Snapshot();
  ASSERT_EQ(rows.size(), 1u + kThreads);
  EXPECT_EQ(rows[0], (GraphStatsRow{7, 8, 1, kF, kThreads * kPerThread / 2}));
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(rows[1 + t],
              (GraphStatsRow{100 + t, 128, 28 - t, kP, kPerThread / 2}));
  }
  EXPECT_EQ(stats.TotalCount(), int64_t{kThreads} * kPerThread);
}

TEST(GraphStatsTest, RendersSeedTable) {
  GraphStats stats;
  for (int i = 0; i < 1000; ++i) stats.Record(128, 128, kF);
  for (int i = 0; i < 500; ++i) stats.Record(64, 128, kF);
  for (int i = 0; i < 100; ++i) stats.Record(200, 256, kP);
  const std::string expected =
      "CUDA graph stats (mode: FULL_AND_PIECEWISE, capture sizes: [64, 128, "
      "256])\n"
      "| Unpadded Tokens | Padded Tokens | Num Paddings | Runtime Mode | Count "
      "|\n"
      "|-----------------|---------------|--------------|--------------|-------"
      "|\n"
      "| 128             | 128           | 0            | FULL         | 1000  "
      "|\n"
      "| 64              | 128           | 64           | FULL         | 500   "
      "|\n"
      "| 200             | 256           | 56           | PIECEWISE    | 100   "
      "|\n";
  EXPECT_EQ(
      stats.RenderTable({CudaGraphMode::FullAndPiecewise(), {64, 128, 256}}),
      expected);
}

TEST(GraphStatsTest, RenderWidensColumnsForLongCells) {
  const std::string table = RenderGraphStatsTable(
      {CudaGraphMode::None(), {}}, {GraphStatsRow{1, 1, 0, kN, 12345678901}});
  EXPECT_EQ(table,
            "CUDA graph stats (mode: NONE, capture sizes: [])\n"
            "| Unpadded Tokens | Padded Tokens | Num Paddings | Runtime Mode | "
            "Count       |\n"
            "|-----------------|---------------|--------------|--------------|"
            "-------------|\n"
            "| 1               | 1             | 0            | NONE         | "
            "12345678901 |\n");
}

}  // namespace
}  // namespace pdworker
