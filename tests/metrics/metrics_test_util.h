// Helpers for the metrics tests: exposition-text parsing, a tiny HTTP/1.0
// client, and temp paths.
#ifndef PDWORKER_TESTS_METRICS_METRICS_TEST_UTIL_H_
#define PDWORKER_TESTS_METRICS_METRICS_TEST_UTIL_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "dispatcher/step_info.h"
#include "prometheus/collectable.h"

namespace pdworker::testing {

// A StepInfo with the fields WorkerMetrics::ObserveStep reads.
inline StepInfo Step(RuntimeMode mode, FallbackReason reason,
                     int unpadded_tokens, int padded_tokens, int num_sequences,
                     int num_calls, double device_seconds) {
  StepInfo step;
  step.mode = mode;
  step.fallback_reason = reason;
  step.unpadded_tokens = unpadded_tokens;
  step.padded_tokens = padded_tokens;
  step.num_sequences = num_sequences;
  step.num_calls = num_calls;
  step.device_seconds = device_seconds;
  return step;
}

// The Prometheus text exposition of everything `collectable` collects.
std::string Serialize(const prometheus::Collectable& collectable);

// The sample lines ("name{labels} value") of metric `name` exactly (for a
// histogram pass "x_bucket", "x_sum" or "x_count"), in exposition order.
std::vector<std::string> Samples(const std::string& text,
                                 const std::string& name);

struct HttpResponse {
  int status = 0;
  std::string body;
};

// GET http://127.0.0.1:<port><target> over HTTP/1.0 (no chunked bodies).
absl::StatusOr<HttpResponse> HttpGet(int port, const std::string& target);

// Sends `raw` as is and reads the response until the server closes.
absl::StatusOr<HttpResponse> HttpExchange(int port, const std::string& raw);

// A connected TCP socket to 127.0.0.1:<port> (caller closes), or -1.
int ConnectLoopback(int port);

// A TCP port on 127.0.0.1 that was free a moment ago (for programs that
// cannot report the port they bound).
absl::StatusOr<int> PickFreePort();

// $TEST_TMPDIR, or gtest's temp dir outside Bazel.
std::string TestTmpDir();

}  // namespace pdworker::testing

#endif  // PDWORKER_TESTS_METRICS_METRICS_TEST_UTIL_H_
