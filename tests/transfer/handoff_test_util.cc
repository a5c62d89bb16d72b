#include "tests/transfer/handoff_test_util.h"

#include <chrono>

#include "gtest/gtest.h"

namespace pdworker::handoff_testing {
namespace {

void SetDeadline(grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::seconds(60));
}

}  // namespace

v1::ForwardResponse Hold(v1::Worker::Stub& prefill, const std::string& id,
                         const std::vector<int32_t>& prompt,
                         const v1::SamplingParams& sampling) {
  v1::ForwardRequest request;
  v1::SequenceInput* in = request.add_sequences();
  in->set_sequence_id(id);
  for (const int32_t t : prompt) in->add_token_ids(t);
  in->set_start(true);
  in->set_hold_for_handoff(true);
  *in->mutable_sampling() = sampling;
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::ForwardResponse response;
  const grpc::Status s = prefill.Forward(&context, request, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return response;
}

v1::KvHandle HandleOf(const v1::ForwardResponse& response) {
  return response.sequences_size() == 1 ? response.sequences(0).kv_handle()
                                        : v1::KvHandle();
}

grpc::Status Import(v1::Worker::Stub& decode, const std::string& id,
                    const v1::KvHandle& handle,
                    v1::ImportKvResponse* response) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::ImportKvRequest request;
  request.set_sequence_id(id);
  *request.mutable_handle() = handle;
  v1::ImportKvResponse ignored;
  return decode.ImportKv(&context, request,
                         response != nullptr ? response : &ignored);
}

bool HoldsNothing(const v1::WorkerStatus& s) {
  return s.kv_blocks_free() == s.kv_blocks_total() && s.num_sequences() == 0 &&
         s.kv_leases() == 0 && s.kv_imports() == 0;
}

}  // namespace pdworker::handoff_testing
