#include "worker/rpc/status_mapping.h"

#include <string>

namespace pdworker {

// Both enums spell the canonical codes 0..16 with the same numbers (the
// asserts keep the cast below honest), and absl::Status already turns any
// other number into UNKNOWN.
static_assert(static_cast<int>(absl::StatusCode::kInvalidArgument) ==
              static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
static_assert(static_cast<int>(absl::StatusCode::kResourceExhausted) ==
              static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));
static_assert(static_cast<int>(absl::StatusCode::kUnauthenticated) ==
              static_cast<int>(grpc::StatusCode::UNAUTHENTICATED));

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string{status.message()});
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

}  // namespace pdworker
