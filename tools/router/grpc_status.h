// The router's one conversion from gRPC statuses to absl::Status: the code is
// kept (a router's caller retries on UNAVAILABLE, gives up on
// INVALID_ARGUMENT), and the message says which call on which worker failed.
#ifndef PDWORKER_TOOLS_ROUTER_GRPC_STATUS_H_
#define PDWORKER_TOOLS_ROUTER_GRPC_STATUS_H_

#include <grpcpp/grpcpp.h>

#include <chrono>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace pdworker::router {

// OK stays OK; otherwise "<what> on <address>: <worker's message>".
absl::Status FromGrpc(const grpc::Status& status, absl::string_view what,
                      absl::string_view address);

// Sets `context`'s deadline `timeout` from now.
void SetTimeout(grpc::ClientContext* context,
                std::chrono::milliseconds timeout);

}  // namespace pdworker::router

#endif  // PDWORKER_TOOLS_ROUTER_GRPC_STATUS_H_
