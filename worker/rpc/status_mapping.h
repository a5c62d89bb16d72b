// The one place where absl::Status becomes grpc::Status (DESIGN.md, "Errors
// and bad input"): every RPC handler finishes through it.
#ifndef PDWORKER_WORKER_RPC_STATUS_MAPPING_H_
#define PDWORKER_WORKER_RPC_STATUS_MAPPING_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace pdworker {

// Same code (absl and gRPC share the canonical code numbers 0..16) and the
// same message.
grpc::Status ToGrpcStatus(const absl::Status& status);
// The reverse, for statuses a peer worker returned.
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RPC_STATUS_MAPPING_H_
