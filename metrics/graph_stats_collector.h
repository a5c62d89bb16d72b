// GraphStatsCollector: exports the CUDA graph statistics table (GraphStats)
// to Prometheus from a snapshot taken at scrape time, so /metrics and the
// logged table never disagree and the step path pays nothing extra.
//
// Families (see metrics/README.md for the full contract):
//   pdworker_cudagraph_steps_total{mode, unpadded_tokens, padded_tokens}
//   pdworker_cudagraph_unpadded_tokens_total{mode}
//   pdworker_cudagraph_padded_tokens_total{mode}
//   pdworker_cudagraph_table_rows
//
// Label cardinality is bounded two ways:
//  1. Eager (NONE) rows whose unpadded token count is above the largest
//     capture size are labelled unpadded_tokens="above_max",
//     padded_tokens="above_max" (their sizes are unbounded; every other row
//     has unpadded <= padded <= largest capture size).
//  2. At most `max_table_rows` distinct label sets are exported. Admission is
//     sticky: a label set, once exported, stays exported, and rows that find
//     no free slot are added to their mode's unpadded_tokens="other",
//     padded_tokens="other" series for good. Table counts only grow, so every
//     exported series (the "other" ones included) is monotonic -- a row never
//     moves out of "other", which would look like a counter reset.
// Hence at most max_table_rows + 3 (one "other" per mode) step series.
#ifndef PDWORKER_METRICS_GRAPH_STATS_COLLECTOR_H_
#define PDWORKER_METRICS_GRAPH_STATS_COLLECTOR_H_

#include <limits>
#include <mutex>
#include <set>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "dispatcher/graph_stats.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace pdworker {

// Label values of the folded series.
inline constexpr char kAboveMaxLabel[] = "above_max";
inline constexpr char kOtherLabel[] = "other";

inline constexpr int kDefaultMaxTableRows = 1000;

// Thread-safe: Collect() may run concurrently on several exposer threads
// (serialized internally so concurrent scrapes see monotonic values) and
// concurrently with GraphStats::Record() and Detach().
class GraphStatsCollector : public prometheus::Collectable {
 public:
  // `stats` may be null (nothing recorded yet: zero token totals, no step
  // series); otherwise it must stay alive until Detach() returns or this
  // object is destroyed. `max_table_rows` < 0 is treated as 0.
  GraphStatsCollector(const GraphStats* stats, const GraphStatsHeader& header,
                      int max_table_rows = kDefaultMaxTableRows);

  std::vector<prometheus::MetricFamily> Collect() const override
      ABSL_LOCKS_EXCLUDED(mu_);

  // Stops reading `stats` (waits for an in-flight Collect()); afterwards
  // Collect() returns no families, so the series go stale instead of
  // dropping to zero (which Prometheus would read as a counter reset).
  void Detach() ABSL_LOCKS_EXCLUDED(mu_);

  // The largest capture size; eager rows above it are "above_max".
  int max_capture_size() const { return max_capture_size_; }
  int max_table_rows() const { return max_table_rows_; }

 private:
  // (mode, unpadded, padded), with kAboveMax for "above_max" so those rows
  // sort after the numeric ones.
  using SeriesKey = std::tuple<int, int, int>;
  static constexpr int kAboveMax = std::numeric_limits<int>::max();

  SeriesKey KeyFor(const GraphStatsRow& row) const;

  const int max_capture_size_;
  const int max_table_rows_;

  mutable std::mutex mu_;
  const GraphStats* stats_ ABSL_GUARDED_BY(mu_);
  bool detached_ ABSL_GUARDED_BY(mu_) = false;
  // Label sets that own a series (never shrinks; at most max_table_rows_).
  mutable std::set<SeriesKey> admitted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdworker

#endif  // PDWORKER_METRICS_GRAPH_STATS_COLLECTOR_H_
