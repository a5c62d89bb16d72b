// Fuzz target: a KV handle as another worker hands it to us — the binary
// v1::KvHandle of ImportKv (first byte even) or the request-level API's
// kv_transfer_params_json (first byte odd; the rest is its text).
// A handle is refused with INVALID_ARGUMENT or FAILED_PRECONDITION, or it
// passes the importer's checks (ValidateKvHandle) and then names a source,
// a lease and 1..max_model_len tokens of our model and layout. Parsed JSON
// serializes back to the same handle and first token.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "glog/logging.h"
#include "google/protobuf/util/message_differencer.h"
#include "proto/worker.pb.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/transfer/kv_importer.h"
#include "worker/transfer/kv_transfer_params.h"

namespace pdworker {
namespace {

// The checking worker: the tiny models' layout and a fingerprint of the
// shape the seeds use.
constexpr int kMaxModelLen = 128;
constexpr absl::string_view kFingerprint = "a1b2c3d4e5f60718-0123456789abcdef";

void CheckValidated(const v1::KvHandle& handle) {
  const KvLayoutInfo ours{2, 2, 8, "float32"};
  const absl::Status valid =
      ValidateKvHandle(handle, std::string(kFingerprint), ours, kMaxModelLen);
  if (!valid.ok()) {
    CHECK(valid.code() == absl::StatusCode::kInvalidArgument ||
          valid.code() == absl::StatusCode::kFailedPrecondition)
        << valid;
    CHECK(!valid.message().empty());
    return;
  }
  CHECK(!handle.source_address().empty());
  CHECK(!handle.lease_id().empty());
  CHECK_GE(handle.num_tokens(), 1);
  CHECK_LE(handle.num_tokens(), kMaxModelLen);
  CHECK_EQ(handle.model_fingerprint(), kFingerprint);
  CHECK_EQ(handle.layout().num_layers(), ours.num_layers);
  CHECK_EQ(handle.layout().num_kv_heads(), ours.num_kv_heads);
  CHECK_EQ(handle.layout().head_dim(), ours.head_dim);
  CHECK_EQ(handle.layout().dtype(), ours.dtype);
}

}  // namespace
}  // namespace pdworker

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pdworker;
  if (size == 0) return 0;
  const absl::string_view rest(reinterpret_cast<const char*>(data) + 1,
                               size - 1);
  if (data[0] % 2 == 0) {
    v1::KvHandle handle;
    if (!handle.ParseFromArray(rest.data(), static_cast<int>(rest.size()))) {
      return 0;  // the RPC layer refuses it (parsed_call.h)
    }
    CheckValidated(handle);
    return 0;
  }
  auto params = ParseKvTransferParamsJson(rest);
  if (!params.ok()) {
    CHECK(params.status().code() == absl::StatusCode::kInvalidArgument)
        << params.status();
    CHECK(params.status().message().find("kv_transfer_params") !=
          std::string::npos)
        << params.status();
    return 0;
  }
  CHECK_EQ(params->handle.version(), kKvHandleVersion);
  CHECK_GE(params->first_token.token_id, 0);
  CheckValidated(params->handle);
  const std::string json = ToKvTransferParamsJson(*params);
  auto again = ParseKvTransferParamsJson(json);
  CHECK(again.ok()) << json << ": " << again.status();
  CHECK(google::protobuf::util::MessageDifferencer::Equals(again->handle,
                                                           params->handle))
      << json;
  CHECK_EQ(again->first_token.token_id, params->first_token.token_id);
  CHECK_EQ(again->first_token.top_logprobs.size(),
           params->first_token.top_logprobs.size());
  return 0;
}
