// Load mode: an open-loop load generator over a Router. N requests arrive as
// a Poisson process at a given rate (fixed RNG seed, so runs are comparable),
// run concurrently (their decode steps batch), and the run is summarized as
// TTFT and inter-token latency percentiles, output throughput, and TTFT split
// into prefill, KV transfer and first decode step.
#ifndef PDWORKER_TOOLS_ROUTER_LOAD_H_
#define PDWORKER_TOOLS_ROUTER_LOAD_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tools/router/router.h"

namespace pdworker::router {

struct LoadOptions {
  int num_requests = 100;
  // Mean arrivals per second; <= 0: every request at once.
  double rate = 20.0;
  // Prompt lengths, uniform in [min, max] (equal: fixed).
  int prompt_len_min = 32;
  int prompt_len_max = 32;
  int max_tokens = 16;
  std::optional<int32_t> eos_token_id;
  // Prompt token ids are uniform in [0, vocab_size).
  int vocab_size = 256;
  Sampling sampling;
  // Seeds the arrivals and the prompts.
  uint64_t seed = 1;
  std::string request_id_prefix = "load";
  // Requests in flight at most (threads); later arrivals wait and count as
  // late starts.
  int max_concurrency = 256;
};

// The requests and their arrival offsets (seconds from the start), as the
// options and seed determine them.
struct LoadPlan {
  std::vector<GenerationRequest> requests;
  std::vector<double> arrival_seconds;  // ascending
};
LoadPlan MakeLoadPlan(const LoadOptions& options);

// mean / p50 / p99 of one quantity, in milliseconds.
struct LatencySummary {
  int64_t count = 0;
  double mean_ms = 0;
  double p50_ms = 0;
  double p99_ms = 0;
};
// Nearest-rank percentiles of microsecond samples.
LatencySummary Summarize(std::vector<int64_t> micros);

struct LoadReport {
  int requests = 0;
  int succeeded = 0;
  int failed = 0;
  std::vector<std::string> first_errors;  // up to 5
  // Requests that started more than 10 ms after their arrival time (the
  // concurrency cap was reached).
  int late_starts = 0;
  double wall_seconds = 0;  // first arrival -> last completion
  int64_t output_tokens = 0;
  double output_tokens_per_second = 0;
  LatencySummary ttft;
  LatencySummary inter_token;
  LatencySummary prefill;
  LatencySummary transfer;
  LatencySummary first_decode_step;

  // A plain-text table.
  std::string Format() const;
};

// Runs the plan through `router` and measures it. INVALID_ARGUMENT for bad
// options; failed requests are counted, not returned.
absl::StatusOr<LoadReport> RunLoad(Router& router, const LoadOptions& options);

}  // namespace pdworker::router

#endif  // PDWORKER_TOOLS_ROUTER_LOAD_H_
