#include "metrics/graph_stats_collector.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/string_view.h"
#include "dispatcher/cudagraph_mode.h"
#include "prometheus/client_metric.h"
#include "prometheus/metric_type.h"

namespace pdworker {
namespace {

constexpr std::array<RuntimeMode, kNumRuntimeModes> kModes = {
    RuntimeMode::kNone, RuntimeMode::kPiecewise, RuntimeMode::kFull};

std::string ModeLabel(RuntimeMode mode) {
  const absl::string_view name = RuntimeModeName(mode);
  return {name.data(), name.size()};
}

std::string ModeLabel(int mode) {
  return ModeLabel(static_cast<RuntimeMode>(mode));
}

std::string TokensLabel(int tokens, int above_max) {
  return tokens == above_max ? kAboveMaxLabel : std::to_string(tokens);
}

prometheus::MetricFamily Family(const char* name, const char* help,
                                prometheus::MetricType type) {
  prometheus::MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = type;
  return family;
}

// Labels in name order, as prometheus-cpp's own families emit them.
prometheus::ClientMetric StepSeries(const std::string& mode,
                                    const std::string& padded,
                                    const std::string& unpadded,
                                    int64_t count) {
  prometheus::ClientMetric metric;
  metric.label = {
      {"mode", mode}, {"padded_tokens", padded}, {"unpadded_tokens", unpadded}};
  metric.counter.value = static_cast<double>(count);
  return metric;
}

prometheus::ClientMetric ModeCounter(RuntimeMode mode, double value) {
  prometheus::ClientMetric metric;
  metric.label = {{"mode", ModeLabel(mode)}};
  metric.counter.value = value;
  return metric;
}

}  // namespace

GraphStatsCollector::GraphStatsCollector(const GraphStats* stats,
                                         const GraphStatsHeader& header,
                                         int max_table_rows)
    : max_capture_size_(header.capture_sizes.empty()
                            ? 0
                            : *std::max_element(header.capture_sizes.begin(),
                                                header.capture_sizes.end())),
      max_table_rows_(std::max(0, max_table_rows)),
      stats_(stats) {}

GraphStatsCollector::SeriesKey GraphStatsCollector::KeyFor(
    const GraphStatsRow& row) const {
  const int mode = static_cast<int>(row.mode);
  // Only eager rows can exceed the largest capture size (a graph's padded
  // size is a capture size), and only they are unbounded.
  if (row.mode == RuntimeMode::kNone &&
      row.unpadded_tokens > max_capture_size_) {
    return {mode, kAboveMax, kAboveMax};
  }
  return {mode, row.unpadded_tokens, row.padded_tokens};
}

void GraphStatsCollector::Detach() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = nullptr;
  detached_ = true;
}

std::vector<prometheus::MetricFamily> GraphStatsCollector::Collect() const {
  // One lock around snapshot + admission: two concurrent scrapes must not
  // publish an older snapshot after a newer one, and admission decisions
  // must be made in one order.
  std::lock_guard<std::mutex> lock(mu_);
  if (detached_) return {};
  const std::vector<GraphStatsRow> rows =
      stats_ == nullptr ? std::vector<GraphStatsRow>() : stats_->Snapshot();

  std::map<SeriesKey, int64_t> series;
  std::array<int64_t, kNumRuntimeModes> other{};
  std::array<bool, kNumRuntimeModes> has_other{};
  // Token sums are exact in int64 far beyond any realistic uptime; doubles
  // only at the end.
  std::array<int64_t, kNumRuntimeModes> unpadded_tokens{};
  std::array<int64_t, kNumRuntimeModes> padded_tokens{};

  // Snapshot() orders rows by count descending, so while slots are free the
  // busiest rows get them first.
  for (const GraphStatsRow& row : rows) {
    const int mode = static_cast<int>(row.mode);
    if (mode < 0 || mode >= kNumRuntimeModes) continue;
    unpadded_tokens[mode] += row.count * row.unpadded_tokens;
    padded_tokens[mode] += row.count * row.padded_tokens;
    const SeriesKey key = KeyFor(row);
    bool admitted = admitted_.count(key) > 0;
    if (!admitted && admitted_.size() < static_cast<size_t>(max_table_rows_)) {
      admitted_.insert(key);
      admitted = true;
    }
    if (admitted) {
      series[key] += row.count;
    } else {
      other[mode] += row.count;
      has_other[mode] = true;
    }
  }

  prometheus::MetricFamily steps =
      Family("pdworker_cudagraph_steps_total",
             "Model steps by runtime mode, unpadded and padded token count "
             "(the CUDA graph statistics table). Eager steps above the "
             "largest capture size are labelled above_max; rows beyond the "
             "export cap are folded into unpadded_tokens=\"other\".",
             prometheus::MetricType::Counter);
  auto it = series.begin();
  for (RuntimeMode m : kModes) {
    const int mode = static_cast<int>(m);
    for (; it != series.end() && std::get<0>(it->first) == mode; ++it) {
      const auto& [key_mode, unpadded, padded] = it->first;
      steps.metric.push_back(
          StepSeries(ModeLabel(key_mode), TokensLabel(padded, kAboveMax),
                     TokensLabel(unpadded, kAboveMax), it->second));
    }
    if (has_other[mode]) {
      steps.metric.push_back(
          StepSeries(ModeLabel(mode), kOtherLabel, kOtherLabel, other[mode]));
    }
  }

  prometheus::MetricFamily unpadded =
      Family("pdworker_cudagraph_unpadded_tokens_total",
             "Real (unpadded) tokens processed, by runtime mode.",
             prometheus::MetricType::Counter);
  prometheus::MetricFamily padded =
      Family("pdworker_cudagraph_padded_tokens_total",
             "Tokens executed including graph padding, by runtime mode "
             "(equal to the unpadded tokens for eager steps).",
             prometheus::MetricType::Counter);
  for (RuntimeMode m : kModes) {
    const int mode = static_cast<int>(m);
    unpadded.metric.push_back(
        ModeCounter(m, static_cast<double>(unpadded_tokens[mode])));
    padded.metric.push_back(
        ModeCounter(m, static_cast<double>(padded_tokens[mode])));
  }

  prometheus::MetricFamily table_rows =
      Family("pdworker_cudagraph_table_rows",
             "Distinct (unpadded, padded, mode) rows in the statistics table, "
             "before above_max/other folding.",
             prometheus::MetricType::Gauge);
  table_rows.metric.emplace_back();
  table_rows.metric.back().gauge.value = static_cast<double>(rows.size());

  std::vector<prometheus::MetricFamily> families;
  families.push_back(std::move(steps));
  families.push_back(std::move(unpadded));
  families.push_back(std::move(padded));
  families.push_back(std::move(table_rows));
  return families;
}

}  // namespace pdworker
