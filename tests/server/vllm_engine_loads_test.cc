// GetLoads (vllm.grpc.engine.VllmEngine) under traffic that moves each
// SchedulerLoad field, read over loopback gRPC from an in-process worker on
// the CPU backend: requests through Generate, held KV through the Worker
// service's Forward, queues made deterministic with Engine::Pause(). Each
// field is checked against the tokens and blocks the traffic counts.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/vllm_engine.grpc.pb.h"
#include "tests/server/server_test_util.h"
#include "worker/engine/engine.h"

namespace pdworker {
namespace {

namespace vg = ::vllm::grpc::engine;
using server_testing::Forward;
using server_testing::Input;
using server_testing::Request;
using server_testing::SmallRunnerOptions;
using server_testing::StartWorker;
using server_testing::WaitFor;

constexpr int kBs = 4;  // SmallRunnerOptions' block size

std::vector<int32_t> Prompt(int n, int first) {
  std::vector<int32_t> tokens(n);
  for (int i = 0; i < n; ++i) tokens[i] = (first + 29 * i) % 256;
  return tokens;
}

class LoadsTest : public ::testing::Test {
 protected:
  void Start(PrefixCaching caching) {
    ModelRunnerOptions options = SmallRunnerOptions();
    options.prefix_caching = caching;
    w_ = StartWorker(options);
    ASSERT_NE(w_, nullptr);
    stub_ = vg::VllmEngine::NewStub(w_->channel);
  }

  vg::GetLoadsResponse Response() {
    grpc::ClientContext context;
    server_testing::SetGenerousDeadline(&context);
    vg::GetLoadsResponse response;
    const grpc::Status status =
        stub_->GetLoads(&context, vg::GetLoadsRequest(), &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }
  vg::SchedulerLoad Load() {
    const vg::GetLoadsResponse response = Response();
    EXPECT_EQ(response.loads_size(), 1);
    return response.loads_size() == 1 ? response.loads(0) : vg::SchedulerLoad();
  }

  // Greedy, exactly `max_tokens` outputs (EOS ignored), not streamed: the
  // final `complete`.
  vg::GenerateComplete Generate(const std::string& id,
                                const std::vector<int32_t>& prompt,
                                int max_tokens) {
    vg::GenerateRequest request;
    request.set_request_id(id);
    for (const int32_t t : prompt)
      request.mutable_tokenized()->add_input_ids(t);
    vg::SamplingParams* params = request.mutable_sampling_params();
    params->set_temperature(0);
    params->set_max_tokens(max_tokens);
    params->set_ignore_eos(true);
    grpc::ClientContext context;
    server_testing::SetGenerousDeadline(&context);
    std::unique_ptr<grpc::ClientReader<vg::GenerateResponse>> reader =
        stub_->Generate(&context, request);
    vg::GenerateResponse response;
    vg::GenerateComplete complete;
    while (reader->Read(&response)) {
      if (response.has_complete()) complete = response.complete();
    }
    const grpc::Status status = reader->Finish();
    EXPECT_TRUE(status.ok()) << id << ": " << status.error_message();
    EXPECT_EQ(complete.output_ids_size(), max_tokens) << id;
    return complete;
  }

  int32_t TotalBlocks() { return w_->Status().kv_blocks_total(); }

  std::unique_ptr<server_testing::TestWorker> w_;
  std::unique_ptr<vg::VllmEngine::Stub> stub_;
  // Contexts of streams still being read (they must outlive them).
  std::vector<std::unique_ptr<grpc::ClientContext>> long_contexts_;
};

TEST_F(LoadsTest, AnIdleWorkerReportsItsCapacityAndNoLoad) {
  Start(PrefixCaching::kOn);
  const vg::GetLoadsResponse response = Response();
  EXPECT_EQ(response.dp_rank_count(), 1);
  ASSERT_EQ(response.loads_size(), 1);
  const vg::SchedulerLoad& load = response.loads(0);
  EXPECT_EQ(load.dp_rank(), 0);
  EXPECT_EQ(load.num_running_reqs(), 0);
  EXPECT_EQ(load.num_waiting_reqs(), 0);
  EXPECT_EQ(load.num_total_reqs(), 0);
  EXPECT_EQ(load.num_used_tokens(), 0);
  EXPECT_EQ(load.max_total_num_tokens(), TotalBlocks() * kBs);
  EXPECT_GT(load.max_total_num_tokens(), 0);
  EXPECT_EQ(load.token_usage(), 0.0);
  EXPECT_EQ(load.utilization(), 0.0);
  EXPECT_EQ(load.gen_throughput(), 0.0);
  EXPECT_EQ(load.cache_hit_rate(), 0.0);
  EXPECT_EQ(load.max_running_requests(), SmallRunnerOptions().max_num_seqs);
  EXPECT_EQ(load.num_waiting_uncached_tokens(), 0);
}

// Cached over prompt tokens of the requests that started, exactly as their
// own completes report them.
TEST_F(LoadsTest, CacheHitRateIsCachedOverPromptTokensOfStartedRequests) {
  Start(PrefixCaching::kOn);
  const std::vector<int32_t> p = Prompt(22, 3);
  const vg::GenerateComplete a = Generate("a", p, 1);
  EXPECT_EQ(a.cached_tokens(), 0);
  EXPECT_EQ(Load().cache_hit_rate(), 0.0);

  // The same prompt: every full block but the one holding the last token.
  const vg::GenerateComplete b = Generate("b", p, 1);
  ASSERT_EQ(b.cached_tokens(), 21 / kBs * kBs);
  EXPECT_DOUBLE_EQ(Load().cache_hit_rate(), 20.0 / (22 + 22));

  // A prompt nothing shares lowers it.
  const vg::GenerateComplete c = Generate("c", Prompt(10, 100), 1);
  EXPECT_EQ(c.cached_tokens(), 0);
  EXPECT_DOUBLE_EQ(Load().cache_hit_rate(), 20.0 / (22 + 22 + 10));
}

TEST_F(LoadsTest, CacheHitRateStaysZeroWithPrefixCachingOff) {
  Start(PrefixCaching::kOff);
  const std::vector<int32_t> p = Prompt(22, 3);
  Generate("a", p, 1);
  EXPECT_EQ(Generate("b", p, 1).cached_tokens(), 0);
  EXPECT_EQ(Load().cache_hit_rate(), 0.0);
}

// Tokens sampled over the last 2 s, per second: every token of a request
// that ran inside the window, none once the window has passed.
TEST_F(LoadsTest, GenThroughputIsTokensOfTheLastTwoSecondsPerSecond) {
  Start(PrefixCaching::kOn);
  EXPECT_EQ(Load().gen_throughput(), 0.0);
  constexpr int kTokens = 16;
  const auto before = std::chrono::steady_clock::now();
  Generate("a", Prompt(8, 1), kTokens);
  const double throughput = Load().gen_throughput();
  const auto read = std::chrono::steady_clock::now();
  if (read - before <= std::chrono::seconds(2)) {
    EXPECT_EQ(throughput, kTokens / 2.0);
  } else {  // a slow machine: its first tokens may have left the window
    EXPECT_GT(throughput, 0.0);
    EXPECT_LE(throughput, kTokens / 2.0);
  }
  // Every token was sampled before `read`: 2 s later none is left.
  std::this_thread::sleep_until(read + std::chrono::milliseconds(2100));
  EXPECT_EQ(Load().gen_throughput(), 0.0);
}

// KV in use, counted in blocks: a live step-level sequence holds its
// blocks; once released they are free (cached, but free, as vLLM counts).
TEST_F(LoadsTest, TokenUsageAndUsedTokensFollowTheBlocksInUse) {
  Start(PrefixCaching::kOn);
  const int32_t total = TotalBlocks();
  v1::ForwardResponse forward;
  ASSERT_TRUE(Forward(*w_->stub, Request({Input("held", Prompt(22, 7), true)}),
                      &forward)
                  .ok());
  const int32_t blocks = (22 + kBs - 1) / kBs;
  ASSERT_EQ(w_->Status().kv_blocks_total() - w_->Status().kv_blocks_free(),
            blocks);
  vg::SchedulerLoad load = Load();
  EXPECT_EQ(load.num_used_tokens(), blocks * kBs);
  EXPECT_EQ(load.max_total_num_tokens(), total * kBs);
  EXPECT_DOUBLE_EQ(load.token_usage(), static_cast<double>(blocks) / total);
  EXPECT_EQ(load.utilization(), load.token_usage());
  // A step-level call is no engine-owned request; its sample counts as a
  // generated token.
  EXPECT_EQ(load.num_total_reqs(), 0);
  EXPECT_GT(load.gen_throughput(), 0.0);

  grpc::ClientContext context;
  server_testing::SetGenerousDeadline(&context);
  v1::ReleaseRequest release;
  release.add_sequence_ids("held");
  v1::ReleaseResponse released;
  ASSERT_TRUE(w_->stub->Release(&context, release, &released).ok());
  ASSERT_TRUE(WaitFor([&] { return Load().num_used_tokens() == 0; }));
  load = Load();
  EXPECT_EQ(load.token_usage(), 0.0);
  EXPECT_EQ(load.utilization(), 0.0);
  EXPECT_EQ(w_->Status().kv_blocks_cached(), 22 / kBs);
}

// Requests held in the queue by a paused engine: counted as waiting, with
// the prompt tokens the prefix cache does not hold for them; a running
// request counts as running. All of it drains once the engine resumes.
TEST_F(LoadsTest, WaitingRequestsAndTheirUncachedPromptTokens) {
  Start(PrefixCaching::kOn);
  const std::vector<int32_t> p = Prompt(22, 3);
  Generate("warm", p, 1);  // caches p's 5 full blocks

  // A request that is running when the engine pauses: paused after its
  // first token, it stays running unless its last step was already in
  // flight (a busy machine); then it is done and another one is tried.
  Engine& engine = w_->server->engine();
  std::unique_ptr<grpc::ClientReader<vg::GenerateResponse>> long_reader;
  for (int attempt = 0;; ++attempt) {
    ASSERT_LT(attempt, 10);
    vg::GenerateRequest long_request;
    long_request.set_request_id(absl::StrCat("running", attempt));
    for (const int32_t t : Prompt(8, 50)) {
      long_request.mutable_tokenized()->add_input_ids(t);
    }
    long_request.mutable_sampling_params()->set_temperature(0);
    long_request.mutable_sampling_params()->set_max_tokens(100);
    long_request.mutable_sampling_params()->set_ignore_eos(true);
    long_request.set_stream(true);
    auto context = std::make_unique<grpc::ClientContext>();
    server_testing::SetGenerousDeadline(context.get());
    auto reader = stub_->Generate(context.get(), long_request);
    vg::GenerateResponse first;
    ASSERT_TRUE(reader->Read(&first));
    engine.Pause();
    // Returns between steps with none in flight, the snapshot republished.
    ASSERT_TRUE(
        engine.RunExclusive([](ModelRunner&) { return absl::OkStatus(); })
            .ok());
    if (engine.snapshot().running_requests == 1) {
      long_contexts_.push_back(std::move(context));
      long_reader = std::move(reader);
      break;
    }
    engine.Resume();
    vg::GenerateResponse rest;
    while (reader->Read(&rest)) {
    }
    EXPECT_TRUE(reader->Finish().ok());
  }

  // Two more wait: p (20 of its 22 tokens cached) and a fresh 10-token one.
  std::vector<std::thread> clients;
  clients.emplace_back([&] { Generate("cached", p, 1); });
  clients.emplace_back([&] { Generate("fresh", Prompt(10, 100), 1); });
  const bool both_wait =
      WaitFor([&] { return Load().num_waiting_reqs() == 2; });
  const vg::SchedulerLoad load = Load();
  engine.Resume();
  for (std::thread& t : clients) t.join();
  ASSERT_TRUE(both_wait);
  EXPECT_EQ(load.num_running_reqs(), 1);
  EXPECT_EQ(load.num_waiting_reqs(), 2);
  EXPECT_EQ(load.num_total_reqs(), 3);
  // The running request's prompt is computed: only the waiting ones count.
  EXPECT_EQ(load.num_waiting_uncached_tokens(), (22 - 20) + 10);
  EXPECT_GT(load.num_used_tokens(), 0);

  vg::GenerateResponse response;
  while (long_reader->Read(&response)) {
  }
  EXPECT_TRUE(long_reader->Finish().ok());
  ASSERT_TRUE(WaitFor([&] { return Load().num_total_reqs() == 0; }));
  const vg::SchedulerLoad after = Load();
  EXPECT_EQ(after.num_waiting_reqs(), 0);
  EXPECT_EQ(after.num_waiting_uncached_tokens(), 0);
  EXPECT_EQ(after.num_used_tokens(), 0);
}

// Without a prefix cache nothing is held for a waiting request: its whole
// prompt is uncached work.
TEST_F(LoadsTest, WaitingPromptsCountInFullWithPrefixCachingOff) {
  Start(PrefixCaching::kOff);
  const std::vector<int32_t> p = Prompt(22, 3);
  Generate("warm", p, 1);
  Engine& engine = w_->server->engine();
  engine.Pause();
  std::thread client([&] { Generate("again", p, 1); });
  const bool waits = WaitFor([&] { return Load().num_waiting_reqs() == 1; });
  const int32_t uncached = Load().num_waiting_uncached_tokens();
  engine.Resume();
  client.join();
  ASSERT_TRUE(waits);
  EXPECT_EQ(uncached, 22);
  ASSERT_TRUE(WaitFor([&] { return Load().num_total_reqs() == 0; }));
  EXPECT_EQ(Load().num_waiting_uncached_tokens(), 0);
}

}  // namespace
}  // namespace pdworker
