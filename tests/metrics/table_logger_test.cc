// TableLogger: logs the table every interval while it changes, stays quiet
// while idle, and stops at once on destruction.
#include "metrics/table_logger.h"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "dispatcher/cudagraph_mode.h"
#include "dispatcher/graph_stats.h"
#include "glog/logging.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

// Collects the table messages TableLogger sends to glog.
class TableSink : public google::LogSink {
 public:
  TableSink() { google::AddLogSink(this); }
  ~TableSink() override { google::RemoveLogSink(this); }

  using google::LogSink::send;
  void send(google::LogSeverity severity, const char* /*full_filename*/,
            const char* /*base_filename*/, int /*line*/,
            const google::LogMessageTime& /*time*/, const char* message,
            size_t message_len) override {
    const std::string text(message, message_len);
    if (severity != google::GLOG_INFO ||
        !absl::StrContains(text, "CUDA graph stats")) {
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    messages_.push_back(text);
    changed_.notify_all();
  }

  // Waits (bounded) until at least `n` tables were logged.
  bool WaitFor(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    return changed_.wait_for(lock, std::chrono::seconds(30),
                             [&] { return messages_.size() >= n; });
  }

  std::vector<std::string> messages() {
    std::lock_guard<std::mutex> lock(mu_);
    return messages_;
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<std::string> messages_;
};

GraphStatsHeader Header() { return {CudaGraphMode::Full(), {1, 2, 4}}; }

std::string Trimmed(const std::string& s) {
  return std::string(absl::StripAsciiWhitespace(s));
}

TEST(TableLoggerTest, LogsTheTableWhileTrafficChangesIt) {
  TableSink sink;
  GraphStats stats;
  stats.Record(1, 1, RuntimeMode::kFull);
  TableLogger logger(&stats, Header(), absl::Milliseconds(10));

  ASSERT_TRUE(sink.WaitFor(1));
  EXPECT_EQ(Trimmed(sink.messages()[0]), Trimmed(stats.RenderTable(Header())));

  // Idle for many intervals: nothing new to say, nothing logged.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(sink.messages().size(), 1u);

  // New traffic: the next interval logs the updated table.
  stats.Record(3, 4, RuntimeMode::kFull);
  stats.Record(3, 4, RuntimeMode::kFull);
  ASSERT_TRUE(sink.WaitFor(2));
  EXPECT_EQ(Trimmed(sink.messages()[1]), Trimmed(stats.RenderTable(Header())));
  EXPECT_TRUE(absl::StrContains(sink.messages()[1], "| 2     |"))
      << sink.messages()[1];

  // Steady traffic keeps logging.
  for (size_t want = 3; want <= 5; ++want) {
    stats.Record(1, 1, RuntimeMode::kFull);
    ASSERT_TRUE(sink.WaitFor(want));
  }
}

TEST(TableLoggerTest, StopsPromptlyOnDestruction) {
  TableSink sink;
  GraphStats stats;
  stats.Record(1, 1, RuntimeMode::kFull);
  const auto start = std::chrono::steady_clock::now();
  { TableLogger logger(&stats, Header(), absl::Hours(1)); }
  // Without the wake-up the destructor would wait out the hour (and the
  // test's timeout).
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_TRUE(sink.messages().empty());
}

TEST(TableLoggerTest, NonPositiveIntervalOrNoStatsDisablesLogging) {
  TableSink sink;
  GraphStats stats;
  stats.Record(1, 1, RuntimeMode::kFull);
  {
    TableLogger zero(&stats, Header(), absl::ZeroDuration());
    TableLogger no_stats(nullptr, Header(), absl::Milliseconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(sink.messages().empty());
}

}  // namespace
}  // namespace pdworker
