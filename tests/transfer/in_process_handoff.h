// The in-process worker setups and steps the P/D handoff tests share
// (server_testing workers over loopback gRPC; the RPC helpers that also
// serve real processes are in handoff_test_util.h).
#ifndef PDWORKER_TESTS_TRANSFER_IN_PROCESS_HANDOFF_H_
#define PDWORKER_TESTS_TRANSFER_IN_PROCESS_HANDOFF_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "proto/worker.grpc.pb.h"
#include "tests/server/server_test_util.h"

namespace pdworker::handoff_testing {

// The small tiny model in `role`'s default graph mode, capture sizes 1-16.
ModelRunnerOptions Options(Role role);

WorkerServerOptions ServerOptions(
    std::chrono::milliseconds lease_ttl = std::chrono::milliseconds(30000));

// `n` token ids that differ by `salt`.
std::vector<int32_t> Prompt(int n, int salt);

// Forward one sequence; returns the response (EXPECTs OK).
v1::ForwardResponse Step(server_testing::TestWorker& w, v1::SequenceInput in);

// The prefill half: start + hold. Returns the first token and the handle.
std::pair<int32_t, v1::KvHandle> Prefill(server_testing::TestWorker& prefill,
                                         const std::string& id,
                                         const std::vector<int32_t>& prompt,
                                         const v1::SamplingParams& sampling);

// `steps` decode steps of `id` on `w` starting from `token`; returns the
// sampled tokens (releasing the sequence with the last step).
std::vector<int32_t> Decode(server_testing::TestWorker& w,
                            const std::string& id, int32_t token, int steps,
                            const v1::SamplingParams& sampling);

// ASSERTs that `w` comes to hold no KV block, sequence, lease or import.
void ExpectNothingHeld(server_testing::TestWorker& w, const std::string& who);

}  // namespace pdworker::handoff_testing

#endif  // PDWORKER_TESTS_TRANSFER_IN_PROCESS_HANDOFF_H_
