// CaptureSummary: what capturing the dispatcher's graphs cost, per runtime
// mode (the startup capture session fills it; metrics export it).
#ifndef PDWORKER_DISPATCHER_CAPTURE_SUMMARY_H_
#define PDWORKER_DISPATCHER_CAPTURE_SUMMARY_H_

#include <cstdint>
#include <vector>

#include "dispatcher/cudagraph_mode.h"

namespace pdworker {

// Cost of capturing one runtime mode's graphs.
struct ModeCaptureSummary {
  RuntimeMode mode = RuntimeMode::kNone;
  int num_graphs = 0;
  int num_warmup_runs = 0;
  double seconds = 0.0;
  // Device memory in use after minus before (bytes; may be negative). On the
  // CPU backend graphs live in host memory outside the device accounting, so
  // this is 0 unless something allocated device memory.
  int64_t memory_delta_bytes = 0;
};

struct CaptureSummary {
  std::vector<ModeCaptureSummary> modes;  // In capture order.
  double total_seconds = 0.0;
  int64_t total_memory_delta_bytes = 0;
  int total_graphs = 0;
};

}  // namespace pdworker

#endif  // PDWORKER_DISPATCHER_CAPTURE_SUMMARY_H_
