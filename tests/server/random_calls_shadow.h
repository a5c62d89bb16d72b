// The shadow model of random_calls_client (private to it): what a client
// believes the worker holds for each of its sequences, what the contract
// (proto/worker.proto) says a call does in that state, and descriptions for
// the log. random_calls_shadow.cc also defines Sampling and Oracle.
#ifndef PDWORKER_TESTS_SERVER_RANDOM_CALLS_SHADOW_H_
#define PDWORKER_TESTS_SERVER_RANDOM_CALLS_SHADOW_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "proto/worker.grpc.pb.h"
#include "tests/server/random_calls_client.h"

namespace pdworker::random_calls {

// What the contract says a Forward call does in the shadow's state.
struct Expectation {
  grpc::StatusCode code = grpc::StatusCode::OK;
  bool chunked = false;
  // RESOURCE_EXHAUSTED is acceptable as well: a call that would succeed, or
  // a chunked call whose earlier chunk can run out of blocks before the
  // chunk with its error runs.
  bool may_exhaust = false;
};

struct Seq {
  std::vector<int32_t> history;  // tokens in the worker's KV cache
  int32_t next_token = 0;        // last sampled token: the next to feed
  Sampling sampling;
};

// A sequence's possible state after a call whose outcome is unknown.
struct Candidate {
  bool present = false;
  std::vector<int32_t> history;
  Sampling sampling;
};

enum class Timing { kNormal, kDeadline, kCancel };

const char* TimingName(Timing t);

inline int BlocksFor(int tokens) {
  return (tokens + kBlockSize - 1) / kBlockSize;
}

// The status the contract gives `request` when the worker holds `live`.
Expectation Expect(const v1::ForwardRequest& request,
                   const std::map<std::string, Seq>& live);

std::string CodeName(grpc::StatusCode code);

// For the log of a client's last calls and failure messages.
std::string Describe(const v1::ForwardRequest& request,
                     const std::map<std::string, Seq>& live);
std::string Describe(const Candidate& c);
// "N tokens (not run) or unknown (ran)".
std::string Describe(const Candidate& not_run, const Candidate& ran);

}  // namespace pdworker::random_calls

#endif  // PDWORKER_TESTS_SERVER_RANDOM_CALLS_SHADOW_H_
