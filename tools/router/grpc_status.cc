#include "tools/router/grpc_status.h"

#include "absl/strings/str_cat.h"

namespace pdworker::router {

absl::Status FromGrpc(const grpc::Status& status, absl::string_view what,
                      absl::string_view address) {
  if (status.ok()) return absl::OkStatus();
  // grpc::StatusCode and absl::StatusCode share the canonical numbering.
  return absl::Status(
      static_cast<absl::StatusCode>(status.error_code()),
      absl::StrCat(what, " on ", address, ": ", status.error_message()));
}

void SetTimeout(grpc::ClientContext* context,
                std::chrono::milliseconds timeout) {
  context->set_deadline(std::chrono::system_clock::now() + timeout);
}

}  // namespace pdworker::router
