// TableLogger: logs the CUDA graph statistics table (LOG(INFO)) every
// interval while traffic changes it, like vLLM's --cudagraph-metrics, so the
// table is visible without a Prometheus server.
#ifndef PDWORKER_METRICS_TABLE_LOGGER_H_
#define PDWORKER_METRICS_TABLE_LOGGER_H_

#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "dispatcher/graph_stats.h"

namespace pdworker {

// Owns one background thread. Every `interval` it compares the table's total
// step count with the one it last logged and, when it changed, logs the
// whole (cumulative) table; idle workers log nothing. The destructor wakes
// the thread and joins it at once, without waiting out the interval.
class TableLogger {
 public:
  // `stats` must outlive this object. A null `stats` or a non-positive
  // `interval` disables logging (no thread), so a flag value of 0 can mean
  // "off".
  TableLogger(const GraphStats* stats, GraphStatsHeader header,
              absl::Duration interval);
  ~TableLogger();

  TableLogger(const TableLogger&) = delete;
  TableLogger& operator=(const TableLogger&) = delete;

 private:
  void Run();

  const GraphStats* const stats_;
  const GraphStatsHeader header_;
  const absl::Duration interval_;

  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts after everything it reads
};

}  // namespace pdworker

#endif  // PDWORKER_METRICS_TABLE_LOGGER_H_
