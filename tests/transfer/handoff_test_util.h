// RPC helpers shared by the KV handoff tests (in-process workers and real
// pdworker processes alike: they take a Worker stub).
#ifndef PDWORKER_TESTS_TRANSFER_HANDOFF_TEST_UTIL_H_
#define PDWORKER_TESTS_TRANSFER_HANDOFF_TEST_UTIL_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <string>
#include <vector>

#include "proto/worker.grpc.pb.h"

namespace pdworker::handoff_testing {

// start + hold_for_handoff of `prompt` (EXPECTs the call to succeed); the
// response carries the first token and the KV handle.
v1::ForwardResponse Hold(v1::Worker::Stub& prefill, const std::string& id,
                         const std::vector<int32_t>& prompt,
                         const v1::SamplingParams& sampling = {});

// The handle of Hold's response (empty when the call failed).
v1::KvHandle HandleOf(const v1::ForwardResponse& response);

// ImportKv of `handle` as sequence `id`, with a deadline only a hung worker
// reaches.
grpc::Status Import(v1::Worker::Stub& decode, const std::string& id,
                    const v1::KvHandle& handle,
                    v1::ImportKvResponse* response = nullptr);

// No KV block used, no sequence, lease or import.
bool HoldsNothing(const v1::WorkerStatus& status);

}  // namespace pdworker::handoff_testing

#endif  // PDWORKER_TESTS_TRANSFER_HANDOFF_TEST_UTIL_H_
