// Prefix caching through the gRPC worker: a Forward that starts a sequence
// reports the prompt tokens it found cached (and samples what an uncached
// run samples), GetStatus shows the cache, and FlushCache empties it (or is
// refused when caching is off).
#include <grpcpp/grpcpp.h>

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

constexpr int kBs = 4;  // SmallRunnerOptions' block size

std::vector<int32_t> Prompt(int n, int first) {
  std::vector<int32_t> tokens(n);
  for (int i = 0; i < n; ++i) tokens[i] = (first + 29 * i) % 256;
  return tokens;
}

grpc::Status Flush(v1::Worker::Stub& stub, v1::FlushCacheResponse* response) {
  grpc::ClientContext context;
  server_testing::SetGenerousDeadline(&context);
  return stub.FlushCache(&context, v1::FlushCacheRequest(), response);
}

v1::SequenceOutput Start(v1::Worker::Stub& stub, const std::string& id,
                         const std::vector<int32_t>& prompt) {
  v1::ForwardResponse response;
  const grpc::Status status =
      Forward(stub, Request({Input(id, prompt, /*start=*/true)}), &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.sequences_size(), 1);
  return response.sequences_size() == 1 ? response.sequences(0)
                                        : v1::SequenceOutput();
}

TEST(PrefixCacheServerTest, ForwardReportsCachedTokensAndFlushClears) {
  ModelRunnerOptions options = SmallRunnerOptions();
  options.prefix_caching = PrefixCaching::kOn;
  auto w = StartWorker(options);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const std::vector<int32_t> prompt = Prompt(22, 3);

  const v1::SequenceOutput a = Start(*w->stub, "a", prompt);
  EXPECT_EQ(a.cached_tokens(), 0);
  EXPECT_EQ(a.num_tokens(), 22);
  // Same prompt: every full block but the one holding the last token.
  const v1::SequenceOutput b = Start(*w->stub, "b", prompt);
  EXPECT_EQ(b.cached_tokens(), 21 / kBs * kBs);
  EXPECT_EQ(b.num_tokens(), 22);
  EXPECT_EQ(b.token_id(), a.token_id());
  EXPECT_EQ(b.logprob(), a.logprob());

  v1::WorkerStatus status = w->Status();
  EXPECT_TRUE(status.prefix_caching());
  EXPECT_EQ(status.kv_blocks_cached(), 22 / kBs);

  v1::FlushCacheResponse flushed;
  const grpc::Status flush = Flush(*w->stub, &flushed);
  ASSERT_TRUE(flush.ok()) << flush.error_message();
  EXPECT_EQ(flushed.cleared_blocks(), 22 / kBs);
  // GetStatus reads the engine's snapshot, republished right after the
  // flush ran (the reply may overtake it).
  EXPECT_TRUE(server_testing::WaitFor(
      [&] { return w->Status().kv_blocks_cached() == 0; }));
  // Nothing cached: computed in full, same sample.
  const v1::SequenceOutput c = Start(*w->stub, "c", prompt);
  EXPECT_EQ(c.cached_tokens(), 0);
  EXPECT_EQ(c.token_id(), a.token_id());
  EXPECT_EQ(c.logprob(), a.logprob());
  // c's blocks are cached again; a and b's stay unshared.
  EXPECT_TRUE(server_testing::WaitFor(
      [&] { return w->Status().kv_blocks_cached() == 22 / kBs; }));
}

TEST(PrefixCacheServerTest, AChunkedPromptFindsItsWholeCachedPrefix) {
  // 100 tokens through a 64-token step budget: two chunks. The lookup
  // covers the whole prompt: 24 blocks (99 / 4), not the first chunk's 15.
  ModelRunnerOptions options = SmallRunnerOptions();
  options.prefix_caching = PrefixCaching::kOn;
  auto w = StartWorker(options);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const std::vector<int32_t> prompt = Prompt(100, 5);
  const v1::SequenceOutput a = Start(*w->stub, "a", prompt);
  EXPECT_EQ(a.cached_tokens(), 0);
  const v1::SequenceOutput b = Start(*w->stub, "b", prompt);
  EXPECT_EQ(b.cached_tokens(), 99 / kBs * kBs);
  EXPECT_EQ(b.num_tokens(), 100);
  EXPECT_EQ(b.token_id(), a.token_id());
  EXPECT_EQ(b.logprob(), a.logprob());
  // The next step continues b as if it had computed everything.
  v1::ForwardResponse next_a, next_b;
  ASSERT_TRUE(
      Forward(*w->stub, Request({Input("a", {a.token_id()}, false)}), &next_a)
          .ok());
  ASSERT_TRUE(
      Forward(*w->stub, Request({Input("b", {b.token_id()}, false)}), &next_b)
          .ok());
  EXPECT_EQ(next_b.sequences(0).token_id(), next_a.sequences(0).token_id());
  EXPECT_EQ(next_b.sequences(0).logprob(), next_a.sequences(0).logprob());
  EXPECT_EQ(next_b.sequences(0).num_tokens(), 101);
}

TEST(PrefixCacheServerTest, FlushCacheIsRefusedWhenCachingIsOff) {
  ModelRunnerOptions options = SmallRunnerOptions();
  options.prefix_caching = PrefixCaching::kOff;
  auto w = StartWorker(options);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  EXPECT_FALSE(w->Status().prefix_caching());
  v1::FlushCacheResponse flushed;
  const grpc::Status flush = Flush(*w->stub, &flushed);
  EXPECT_EQ(flush.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(flush.error_message(), HasSubstr("enable_prefix_caching"));
  EXPECT_EQ(Start(*w->stub, "a", Prompt(10, 1)).cached_tokens(), 0);
  EXPECT_EQ(Start(*w->stub, "b", Prompt(10, 1)).cached_tokens(), 0);
}

}  // namespace
}  // namespace pdworker
