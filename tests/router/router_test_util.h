// Helpers for the router tests: in-process workers (tests/server's
// StartWorker) addressed the way the router sees them, and the reference
// token sequence of a request computed by plain Forward calls.
#ifndef PDWORKER_TESTS_ROUTER_ROUTER_TEST_UTIL_H_
#define PDWORKER_TESTS_ROUTER_ROUTER_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/worker.grpc.pb.h"
#include "tests/server/server_test_util.h"
#include "tools/router/router.h"

namespace pdworker::router_testing {

using server_testing::TestWorker;

// "127.0.0.1:<port>".
std::string Address(const TestWorker& worker);

// SmallRunnerOptions with the given role.
ModelRunnerOptions RunnerOptions(Role role);

// A started, serving worker (ASSERTs inside; check HasFatalFailure()).
std::unique_ptr<TestWorker> StartRoleWorker(Role role);

// What the request must generate: the prompt's Forward (start) and then one
// Forward per token, each alone, through `stub`, with the request id as the
// sequence id, stopping at max_tokens or EOS; frees the sequence after.
absl::StatusOr<std::vector<int32_t>> ReferenceTokens(
    v1::Worker::Stub& stub, const router::GenerationRequest& request);

// 2 prefill + 2 decode workers with a P/D router over them, and one
// aggregated worker (role both) with its own router, for comparing tokens.
struct PdCluster {
  std::vector<std::unique_ptr<TestWorker>> prefill;
  std::vector<std::unique_ptr<TestWorker>> decode;
  std::unique_ptr<TestWorker> aggregated;
  std::unique_ptr<router::Router> pd_router;
  std::unique_ptr<router::Router> aggregated_router;
};
// nullptr (after a test failure) when a worker or router did not start.
std::unique_ptr<PdCluster> StartPdCluster();

// Expects the worker idle: every KV block free, no sequence, no lease.
void ExpectIdle(TestWorker& worker, const std::string& name);

// A prompt of `n` ids in [0, 256) derived from `salt`.
std::vector<int32_t> Prompt(int n, int salt);

}  // namespace pdworker::router_testing

#endif  // PDWORKER_TESTS_ROUTER_ROUTER_TEST_UTIL_H_
