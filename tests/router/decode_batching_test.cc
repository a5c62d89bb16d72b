// Decode batching: concurrent requests on one worker share one Forward call
// per iteration, with the same tokens as when each runs alone; iterations
// split at the worker's per-call limit; and when a batched call fails, its
// sequences are retried alone so only the one at fault fails.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/router/router_test_util.h"
#include "tests/server/server_test_util.h"
#include "tools/router/decode_batcher.h"
#include "tools/router/router.h"
#include "tools/router/worker_pool.h"

namespace pdworker::router {
namespace {

using router_testing::Address;
using router_testing::ExpectIdle;
using router_testing::Prompt;
using router_testing::ReferenceTokens;
using router_testing::StartRoleWorker;
using server_testing::Forward;
using server_testing::Input;
using server_testing::Request;
using server_testing::TestWorker;
using ::testing::ElementsAreArray;

class DecodeBatchingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    worker_ = StartRoleWorker(Role::kBoth).release();
  }
  static void TearDownTestSuite() { delete worker_; }
  void SetUp() override { ASSERT_NE(worker_, nullptr); }
  void TearDown() override { ExpectIdle(*worker_, "worker"); }

  std::unique_ptr<Router> MakeRouter() {
    RouterOptions options;
    options.aggregated_addresses = {Address(*worker_)};
    auto router = Router::Create(options);
    EXPECT_TRUE(router.ok()) << router.status();
    return router.ok() ? *std::move(router) : nullptr;
  }

  // Requests with different prompt lengths and sampling.
  static std::vector<GenerationRequest> Requests(int n, int max_tokens) {
    std::vector<GenerationRequest> requests;
    for (int i = 0; i < n; ++i) {
      GenerationRequest r;
      r.request_id = "batch-" + std::to_string(i);
      r.prompt = Prompt(3 + 5 * i, i);
      r.max_tokens = max_tokens - i % 3;
      if (i % 2 == 1) {
        r.sampling.temperature = 0.8f;
        r.sampling.seed = 100 + i;
      }
      requests.push_back(std::move(r));
    }
    return requests;
  }

  // Starts the request's sequence on the worker with its prompt, as the
  // router would; returns the job for its decode steps.
  DecodeJob Start(const GenerationRequest& r) {
    DecodeJob job;
    job.sequence_id = r.request_id;
    job.tokens_to_generate = r.max_tokens - 1;
    job.sampling.set_temperature(r.sampling.temperature);
    if (r.sampling.seed) job.sampling.set_seed(*r.sampling.seed);
    v1::SequenceInput input = Input(r.request_id, r.prompt, true);
    *input.mutable_sampling() = job.sampling;
    v1::ForwardResponse response;
    const grpc::Status status =
        Forward(*worker_->stub, Request({input}), &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    job.last_token = status.ok() ? response.sequences(0).token_id() : -1;
    return job;
  }

  void ReleaseIfLive(const std::string& id) {
    grpc::ClientContext context;
    server_testing::SetGenerousDeadline(&context);
    v1::ReleaseRequest r;
    r.add_sequence_ids(id);
    v1::ReleaseResponse response;
    (void)worker_->stub->Release(&context, r, &response);
  }

  static std::vector<int32_t> Drain(DecodeStream& stream) {
    std::vector<int32_t> tokens;
    while (auto token = stream.Next()) tokens.push_back(token->id);
    return tokens;
  }

  static TestWorker* worker_;
};

TestWorker* DecodeBatchingTest::worker_ = nullptr;

TEST_F(DecodeBatchingTest, ConcurrentRequestsShareStepsAndMatchSoloRuns) {
  const std::vector<GenerationRequest> requests = Requests(6, 20);
  std::vector<std::vector<int32_t>> solo;
  {
    auto router = MakeRouter();
    ASSERT_NE(router, nullptr);
    for (const GenerationRequest& r : requests) {
      auto result = router->Generate(r);
      ASSERT_TRUE(result.ok()) << result.status();
      solo.push_back(result->tokens);
    }
    EXPECT_EQ(router->decode_stats().max_sequences_per_call, 1);
  }

  auto router = MakeRouter();
  ASSERT_NE(router, nullptr);
  std::vector<absl::StatusOr<GenerationResult>> results(
      requests.size(), absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back(
        [&, i] { results[i] = router->Generate(requests[i]); });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    EXPECT_THAT(results[i]->tokens, ElementsAreArray(solo[i]))
        << requests[i].request_id;
  }
  const DecodeBatcherStats stats = router->decode_stats();
  // Six requests of ~19 decode steps each overlap for most of their steps.
  EXPECT_GE(stats.max_sequences_per_call, 2);
  EXPECT_LT(stats.forward_calls, stats.sequence_steps);
  EXPECT_EQ(stats.solo_retries, 0);
}

TEST_F(DecodeBatchingTest, JoinedTogetherMeansOneCallPerIteration) {
  PoolWorker worker;
  worker.address = Address(*worker_);
  worker.channel = worker_->channel;
  worker.worker = v1::Worker::NewStub(worker.channel);
  const std::vector<GenerationRequest> requests = Requests(5, 8);
  std::vector<DecodeJob> jobs;
  for (const GenerationRequest& r : requests) jobs.push_back(Start(r));
  std::vector<std::vector<int32_t>> got(jobs.size());
  DecodeBatcherStats stats;
  {
    // At most 2 per call: 5 sequences are 3 calls per iteration.
    DecodeBatcherOptions options;
    options.max_sequences_per_call = 2;
    DecodeBatcher batcher(worker, options);
    auto streams = batcher.Join(jobs);
    for (size_t i = 0; i < streams.size(); ++i) {
      got[i] = Drain(*streams[i]);
      ASSERT_TRUE(streams[i]->status().ok()) << streams[i]->status();
      EXPECT_TRUE(streams[i]->released());
    }
    stats = batcher.stats();
  }
  // The longest request has 7 decode steps; all started in iteration one.
  EXPECT_EQ(stats.iterations, 7);
  EXPECT_EQ(stats.max_sequences_per_call, 2);
  // 5 iterations of all five (3 calls), one of four (2), one of two (1).
  EXPECT_EQ(stats.forward_calls, 3 * 5 + 2 + 1);
  for (size_t i = 0; i < requests.size(); ++i) {
    auto reference = ReferenceTokens(*worker_->stub, requests[i]);
    ASSERT_TRUE(reference.ok()) << reference.status();
    ASSERT_EQ(got[i].size() + 1, reference->size());
    EXPECT_THAT(got[i],
                ElementsAreArray(reference->begin() + 1, reference->end()));
  }
}

TEST_F(DecodeBatchingTest, AFailingSequenceFailsAloneAfterTheRetry) {
  PoolWorker worker;
  worker.address = Address(*worker_);
  worker.channel = worker_->channel;
  worker.worker = v1::Worker::NewStub(worker.channel);
  // "long" reaches max_model_len (128) on its third decode step; the others
  // are fine.
  std::vector<GenerationRequest> requests = Requests(2, 7);
  GenerationRequest long_one;
  long_one.request_id = "long";
  long_one.prompt = Prompt(126, 9);
  long_one.max_tokens = 7;
  requests.insert(requests.begin() + 1, long_one);
  std::vector<DecodeJob> jobs;
  for (const GenerationRequest& r : requests) jobs.push_back(Start(r));
  std::vector<std::vector<int32_t>> got(jobs.size());
  std::vector<absl::Status> statuses(jobs.size());
  DecodeBatcherStats stats;
  {
    DecodeBatcher batcher(worker, DecodeBatcherOptions{});
    auto streams = batcher.Join(jobs);
    for (size_t i = 0; i < streams.size(); ++i) {
      got[i] = Drain(*streams[i]);
      statuses[i] = streams[i]->status();
    }
    stats = batcher.stats();
  }
  EXPECT_EQ(statuses[1].code(), absl::StatusCode::kInvalidArgument)
      << statuses[1];
  EXPECT_EQ(got[1].size(), 2u);
  ReleaseIfLive("long");  // the caller's job after a failure
  EXPECT_EQ(stats.solo_retries, 3);
  for (size_t i : {0, 2}) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i];
    auto reference = ReferenceTokens(*worker_->stub, requests[i]);
    ASSERT_TRUE(reference.ok()) << reference.status();
    EXPECT_THAT(got[i],
                ElementsAreArray(reference->begin() + 1, reference->end()));
  }
}

}  // namespace
}  // namespace pdworker::router
