// Every kind of bad Forward call gets its documented status code and a
// message naming the problem, and changes nothing: GetStatus (free KV blocks,
// live sequences) is the same after each, and the live sequence still
// continues from where it was.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"

namespace pdworker {
namespace {

using server_testing::Forward;
using server_testing::Input;
using server_testing::Request;
using server_testing::SmallRunnerOptions;
using server_testing::StartWorker;
using ::testing::HasSubstr;

std::vector<int32_t> Tokens(int n) {
  std::vector<int32_t> tokens(n);
  for (int i = 0; i < n; ++i) tokens[i] = (11 * i + 3) % 256;
  return tokens;
}

v1::SequenceInput WithSampling(v1::SequenceInput in, float temperature,
                               int top_k, float top_p) {
  in.mutable_sampling()->set_temperature(temperature);
  in.mutable_sampling()->set_top_k(top_k);
  in.mutable_sampling()->set_top_p(top_p);
  return in;
}

struct BadCase {
  std::string name;
  v1::ForwardRequest request;
  grpc::StatusCode code;
  std::string message;  // a substring of the error message
};

std::vector<BadCase> Cases() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  v1::SequenceInput handoff = Input("h", {1}, true);
  handoff.set_hold_for_handoff(true);
  handoff.set_release_after_step(true);
  std::vector<v1::SequenceInput> five;
  five.reserve(5);
  for (int i = 0; i < 5; ++i)
    five.push_back(Input("s" + std::to_string(i), {1}, true));
  return {
      {"empty batch", Request({}), grpc::StatusCode::INVALID_ARGUMENT,
       "sequences is empty"},
      {"duplicate sequence",
       Request({Input("x", {1}, true), Input("x", {2}, true)}),
       grpc::StatusCode::INVALID_ARGUMENT,
       "sequences[1].sequence_id 'x' repeats sequences[0]"},
      {"token id >= vocab", Request({Input("x", {1, 2, 3, 4, 5, 999}, true)}),
       grpc::StatusCode::INVALID_ARGUMENT,
       "sequences[0].token_ids[5]=999 is outside the vocabulary [0, 256)"},
      {"negative token id", Request({Input("x", {-1}, true)}),
       grpc::StatusCode::INVALID_ARGUMENT, "token_ids[0]=-1"},
      {"unknown sequence", Request({Input("ghost", {1}, false)}),
       grpc::StatusCode::NOT_FOUND, "unknown sequence 'ghost'"},
      {"start for a live id", Request({Input("live", {1}, true)}),
       grpc::StatusCode::ALREADY_EXISTS, "'live' already exists"},
      {"live sequence past max_model_len",
       Request({Input("live", Tokens(60), false)}),
       grpc::StatusCode::INVALID_ARGUMENT, "max_model_len=64"},
      {"call longer than max_model_len",
       Request({Input("x", Tokens(65), true)}),
       grpc::StatusCode::INVALID_ARGUMENT,
       "sequences[0].token_ids has 65 tokens"},
      {"too many sequences", Request(five), grpc::StatusCode::INVALID_ARGUMENT,
       "max_num_seqs=4"},
      {"NaN temperature",
       Request({WithSampling(Input("x", {1}, true), nan, 0, 0)}),
       grpc::StatusCode::INVALID_ARGUMENT, "sequences[0].sampling.temperature"},
      {"negative temperature",
       Request({WithSampling(Input("x", {1}, true), -0.5f, 0, 0)}),
       grpc::StatusCode::INVALID_ARGUMENT, "sampling.temperature=-0.5"},
      {"top_p above 1",
       Request({WithSampling(Input("x", {1}, true), 1, 0, 1.5f)}),
       grpc::StatusCode::INVALID_ARGUMENT, "sampling.top_p=1.5"},
      {"NaN top_p", Request({WithSampling(Input("x", {1}, true), 1, 0, nan)}),
       grpc::StatusCode::INVALID_ARGUMENT, "sampling.top_p"},
      {"negative top_k",
       Request({WithSampling(Input("x", {1}, true), 1, -3, 0)}),
       grpc::StatusCode::INVALID_ARGUMENT, "sampling.top_k=-3"},
      {"empty sequence_id", Request({Input("", {1}, true)}),
       grpc::StatusCode::INVALID_ARGUMENT, "sequences[0].sequence_id is empty"},
      {"sequence_id over 128 bytes",
       Request({Input(std::string(129, 'z'), {1}, true)}),
       grpc::StatusCode::INVALID_ARGUMENT, "is 129 bytes; the limit is 128"},
      {"no tokens", Request({Input("x", {}, true)}),
       grpc::StatusCode::INVALID_ARGUMENT, "sequences[0].token_ids is empty"},
      {"hold_for_handoff with release_after_step", Request({handoff}),
       grpc::StatusCode::INVALID_ARGUMENT,
       "hold_for_handoff and release_after_step exclude each other"},
      // A good sequence merged with a bad one: the whole call fails and the
      // good one is not created.
      {"one unknown sequence among good ones",
       Request({Input("fresh", {1, 2}, true), Input("ghost", {3}, false)}),
       grpc::StatusCode::NOT_FOUND, "ghost"},
      // Chunked (180 tokens, 64 per step); the third chunk finds the KV
      // cache full. The two chunks that ran are rolled back: a, b, c are
      // released again.
      {"KV cache full in a later chunk",
       Request({Input("a", Tokens(60), true), Input("b", Tokens(60), true),
                Input("c", Tokens(60), true)}),
       grpc::StatusCode::RESOURCE_EXHAUSTED, "KV cache full"},
      // Same, continuing the live sequence: it is truncated back to 10
      // tokens.
      {"KV cache full after a continued sequence advanced",
       Request({Input("live", Tokens(40), false), Input("z", Tokens(60), true),
                Input("y", Tokens(60), true)}),
       grpc::StatusCode::RESOURCE_EXHAUSTED, "KV cache full"},
      // Larger than --max_message_bytes (64 KiB): refused by gRPC itself.
      {"oversized message",
       Request({Input("x", std::vector<int32_t>(40000, 200), true)}),
       grpc::StatusCode::RESOURCE_EXHAUSTED, ""},
  };
}

TEST(BadInputTest, EveryBadCallGetsItsCodeAndChangesNothing) {
  ModelRunnerOptions options = SmallRunnerOptions();
  options.max_num_seqs = 4;
  options.max_num_batched_tokens = 64;
  options.max_model_len = 64;
  options.kv_cache_bytes = int64_t{40} * 1024;  // 40 blocks of 4 tokens
  WorkerServerOptions server_options;
  server_options.max_receive_message_bytes = 64 << 10;
  auto w = StartWorker(options, server_options);
  ASSERT_NE(w, nullptr);

  v1::ForwardResponse response;
  ASSERT_TRUE(
      Forward(*w->stub, Request({Input("live", Tokens(10), true)}), &response)
          .ok());
  const v1::WorkerStatus before = w->Status();
  ASSERT_EQ(before.num_sequences(), 1);
  ASSERT_EQ(before.kv_blocks_free(), 37);

  for (const BadCase& c : Cases()) {
    SCOPED_TRACE(c.name);
    v1::ForwardResponse out;
    const grpc::Status status = Forward(*w->stub, c.request, &out);
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(c.message));
    const v1::WorkerStatus after = w->Status();
    EXPECT_EQ(after.kv_blocks_free(), before.kv_blocks_free());
    EXPECT_EQ(after.num_sequences(), before.num_sequences());
  }

  // The live sequence is exactly where it was (10 tokens), and none of the
  // refused ids exists.
  ASSERT_TRUE(
      Forward(*w->stub, Request({Input("live", {7}, false)}), &response).ok());
  EXPECT_EQ(response.sequences(0).num_tokens(), 11);
  for (const std::string id : {"x", "fresh", "a", "b", "c", "y", "z", "h"}) {
    EXPECT_TRUE(
        Forward(*w->stub, Request({Input(id, {1}, true)}), &response).ok())
        << id;
  }
}

}  // namespace
}  // namespace pdworker
