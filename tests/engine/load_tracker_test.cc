// LoadTracker's two windows on their own, with time points chosen here:
// the hit rate over the last 64 requests that started, and the tokens
// sampled over the last 2 s, as GetLoads reports them.
#include "worker/engine/load_tracker.h"

#include <chrono>

#include "gtest/gtest.h"

namespace pdworker {
namespace {

using Clock = LoadTracker::Clock;
using std::chrono::milliseconds;

TEST(LoadTrackerTest, NothingRecordedReadsZero) {
  LoadTracker tracker;
  const LoadTracker::Reading r = tracker.Read(Clock::now());
  EXPECT_EQ(r.cache_hit_rate, 0.0);
  EXPECT_EQ(r.gen_throughput, 0.0);
}

TEST(LoadTrackerTest, HitRateIsCachedOverPromptTokens) {
  LoadTracker tracker;
  tracker.RecordStart(22, 0);
  EXPECT_EQ(tracker.Read(Clock::now()).cache_hit_rate, 0.0);
  tracker.RecordStart(22, 20);
  EXPECT_DOUBLE_EQ(tracker.Read(Clock::now()).cache_hit_rate, 20.0 / 44);
  // An empty prompt is no sample; a cached count past the prompt is capped.
  tracker.RecordStart(0, 0);
  tracker.RecordStart(10, 12);
  EXPECT_DOUBLE_EQ(tracker.Read(Clock::now()).cache_hit_rate, 30.0 / 54);
}

TEST(LoadTrackerTest, HitRateForgetsAllButTheLast64Requests) {
  LoadTracker tracker;
  // One fully cached request, then 63 uncached ones: still in the window.
  tracker.RecordStart(100, 100);
  for (int i = 0; i < LoadTracker::kHitRateRequests - 1; ++i) {
    tracker.RecordStart(10, 0);
  }
  EXPECT_DOUBLE_EQ(tracker.Read(Clock::now()).cache_hit_rate,
                   100.0 / (100 + 63 * 10));
  // The 65th pushes the cached one out.
  tracker.RecordStart(10, 0);
  EXPECT_EQ(tracker.Read(Clock::now()).cache_hit_rate, 0.0);
  tracker.RecordStart(10, 5);
  EXPECT_DOUBLE_EQ(tracker.Read(Clock::now()).cache_hit_rate, 5.0 / 640);
}

TEST(LoadTrackerTest, ThroughputIsTokensOfTheLastTwoSecondsPerSecond) {
  LoadTracker tracker;
  const Clock::time_point t0 = Clock::now();
  tracker.RecordGenerated(3, t0);
  tracker.RecordGenerated(2, t0);  // the same step
  tracker.RecordGenerated(5, t0 + milliseconds(500));
  tracker.RecordGenerated(0, t0 + milliseconds(600));  // nothing
  EXPECT_DOUBLE_EQ(tracker.Read(t0 + milliseconds(500)).gen_throughput,
                   10 / 2.0);
  // t0's tokens are in the window up to t0 + 2 s, out after it.
  EXPECT_DOUBLE_EQ(tracker.Read(t0 + milliseconds(2000)).gen_throughput,
                   10 / 2.0);
  EXPECT_DOUBLE_EQ(tracker.Read(t0 + milliseconds(2001)).gen_throughput,
                   5 / 2.0);
  EXPECT_EQ(tracker.Read(t0 + milliseconds(2501)).gen_throughput, 0.0);
  // Recording later drops what fell out; the rest still counts.
  tracker.RecordGenerated(4, t0 + milliseconds(2400));
  EXPECT_DOUBLE_EQ(tracker.Read(t0 + milliseconds(2400)).gen_throughput,
                   9 / 2.0);
}

}  // namespace
}  // namespace pdworker
