#include "metrics/table_logger.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <utility>

#include "glog/logging.h"

namespace pdworker {

TableLogger::TableLogger(const GraphStats* stats, GraphStatsHeader header,
                         absl::Duration interval)
    : stats_(stats), header_(std::move(header)), interval_(interval) {
  if (stats_ != nullptr && interval_ > absl::ZeroDuration()) {
    thread_ = std::thread(&TableLogger::Run, this);
  }
}

TableLogger::~TableLogger() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void TableLogger::Run() {
  // wait_for adds the interval to now(): keep it far from overflowing (an
  // InfiniteDuration flag would otherwise wrap around and spin).
  const std::chrono::nanoseconds interval =
      absl::ToChronoNanoseconds(std::min(interval_, absl::Hours(24)));
  int64_t logged_total = 0;
  std::unique_lock<std::mutex> lock(mu_);
  // wait_for returns the predicate: true means we were asked to stop.
  while (!wake_.wait_for(lock, interval, [this] { return stop_; })) {
    // Counts only grow, so an unchanged total means an unchanged table.
    const int64_t total = stats_->TotalCount();
    if (total == logged_total) continue;
    logged_total = total;
    // Render and log without the lock so the destructor never waits on it.
    lock.unlock();
    // Leading newline: the table's columns line up in the log.
    LOG(INFO) << "\n" << stats_->RenderTable(header_);
    lock.lock();
  }
}

}  // namespace pdworker
