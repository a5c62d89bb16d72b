// End to end P/D (issue 7): 2 prefill + 2 decode workers and 1 aggregated
// worker on loopback. 200 requests (varied prompt lengths, max_tokens,
// greedy and sampled, seeded and not) run 16 at a time through the P/D
// router (prefill Forward with hold_for_handoff -> ImportKv on a decode
// worker -> batched decode steps) and through the aggregated router; every
// request gets identical tokens both ways, and afterwards every worker is
// idle: all KV blocks free, no sequence, no lease.
#include <atomic>
#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/router/router_test_util.h"
#include "tests/server/server_test_util.h"
#include "tools/router/router.h"

namespace pdworker::router {
namespace {

using router_testing::ExpectIdle;
using router_testing::Prompt;
using server_testing::TestWorker;
using ::testing::ElementsAreArray;

constexpr int kRequests = 200;
constexpr int kConcurrency = 16;

std::vector<GenerationRequest> MakeRequests() {
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < kRequests; ++i) {
    GenerationRequest r;
    r.request_id = "e2e-" + std::to_string(i);
    // 1..61 prompt tokens: single blocks, partial blocks, many blocks.
    r.prompt = Prompt(1 + (i * 7) % 61, i);
    // Mostly several decode steps; every 10th ends with the prefill's token
    // (the lease is abandoned with ReleaseKv instead of imported).
    r.max_tokens = i % 10 == 0 ? 1 : 2 + (i * 5) % 15;
    switch (i % 4) {
      case 0:  // greedy
        break;
      case 1:  // sampled, seeded
        r.sampling.temperature = 0.8f;
        r.sampling.top_k = 50;
        r.sampling.seed = 1000 + i;
        break;
      case 2:  // sampled, seed derived from the request id by each worker
        r.sampling.temperature = 1.0f;
        r.sampling.top_p = 0.9f;
        break;
      case 3:  // greedy with an EOS that may or may not come
        r.eos_token_id = (i * 13) % 256;
        break;
    }
    requests.push_back(std::move(r));
  }
  return requests;
}

std::vector<absl::StatusOr<GenerationResult>> RunAll(
    Router& router, const std::vector<GenerationRequest>& requests) {
  std::vector<absl::StatusOr<GenerationResult>> results(
      requests.size(), absl::UnknownError("not run"));
  std::atomic<size_t> next{0};
  std::vector<std::thread> threads;
  threads.reserve(kConcurrency);
  for (int t = 0; t < kConcurrency; ++t) {
    threads.emplace_back([&] {
      for (size_t i = next++; i < requests.size(); i = next++) {
        results[i] = router.Generate(requests[i]);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

// Every worker ends idle: all KV blocks free, no sequence, lease or import.
// A decode worker may tell the prefill worker to release a lease just after
// the import returned: wait (bounded) for every worker to settle.
void ExpectClusterIdle(router_testing::PdCluster& cluster) {
  std::vector<std::pair<std::string, TestWorker*>> all;
  for (int i = 0; i < 2; ++i) {
    all.emplace_back("prefill " + std::to_string(i), cluster.prefill[i].get());
    all.emplace_back("decode " + std::to_string(i), cluster.decode[i].get());
  }
  all.emplace_back("aggregated", cluster.aggregated.get());
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto settled = [&] {
    for (auto& [name, w] : all) {
      const v1::WorkerStatus s = w->Status();
      if (s.kv_blocks_free() != s.kv_blocks_total() || s.num_sequences() != 0 ||
          s.kv_leases() != 0 || s.kv_imports() != 0) {
        return false;
      }
    }
    return true;
  };
  while (!settled() && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (auto& [name, w] : all) ExpectIdle(*w, name);
}

TEST(PdEndToEndTest, DisaggregatedTokensEqualAggregatedAndNothingLeaks) {
  std::unique_ptr<router_testing::PdCluster> cluster =
      router_testing::StartPdCluster();
  ASSERT_NE(cluster, nullptr);
  auto& [prefill, decode, aggregated, pd_router, agg_router] = *cluster;
  EXPECT_EQ(prefill[0]->Status().role(), "prefill");
  EXPECT_EQ(decode[0]->Status().role(), "decode");

  const std::vector<GenerationRequest> requests = MakeRequests();
  const auto pd = RunAll(*pd_router, requests);
  const auto agg = RunAll(*agg_router, requests);

  std::set<std::string> prefill_used;
  std::set<std::string> decode_used;
  int failures = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::string& id = requests[i].request_id;
    if (!pd[i].ok() || !agg[i].ok()) {
      // Report a few, not 200.
      if (++failures <= 5) {
        ADD_FAILURE() << id << ": P/D " << pd[i].status() << ", aggregated "
                      << agg[i].status();
      }
      continue;
    }
    EXPECT_THAT(pd[i]->tokens, ElementsAreArray(agg[i]->tokens)) << id;
    EXPECT_EQ(pd[i]->finish_reason, agg[i]->finish_reason) << id;
    prefill_used.insert(pd[i]->prefill_address);
    if (pd[i]->tokens.size() > 1) {
      decode_used.insert(pd[i]->decode_address);
      EXPECT_GT(pd[i]->timings.transfer_us, 0) << id;
      EXPECT_GT(pd[i]->timings.first_decode_step_us, 0) << id;
    }
  }
  EXPECT_EQ(failures, 0);
  // Least-loaded picking spread the load over both workers of each role.
  EXPECT_EQ(prefill_used.size(), 2u);
  EXPECT_EQ(decode_used.size(), 2u);
  EXPECT_GE(pd_router->decode_stats().max_sequences_per_call, 2);

  ExpectClusterIdle(*cluster);
}

// The same requests through the request-level API only (vllm.grpc.engine
// .VllmEngine, as SMG drives vLLM workers): P/D by relaying
// kv_transfer_params_json, and aggregated. Same tokens as the step-level
// router's; nothing left on any worker.
TEST(PdEndToEndTest, RequestLevelApiGivesTheStepLevelTokens) {
  std::unique_ptr<router_testing::PdCluster> cluster =
      router_testing::StartPdCluster();
  ASSERT_NE(cluster, nullptr);
  auto& [prefill, decode, aggregated, pd_router, agg_router] = *cluster;
  RouterOptions pd_options;
  RouterOptions agg_options;
  pd_options.api = agg_options.api = RouterApi::kRequestLevel;
  for (int i = 0; i < 2; ++i) {
    pd_options.prefill_addresses.push_back(
        router_testing::Address(*prefill[i]));
    pd_options.decode_addresses.push_back(router_testing::Address(*decode[i]));
  }
  agg_options.aggregated_addresses = {router_testing::Address(*aggregated)};
  auto request_pd = Router::Create(pd_options);
  auto request_agg = Router::Create(agg_options);
  ASSERT_TRUE(request_pd.ok() && request_agg.ok());

  const std::vector<GenerationRequest> requests = MakeRequests();
  const auto step = RunAll(*agg_router, requests);
  const auto pd = RunAll(**request_pd, requests);
  const auto agg = RunAll(**request_agg, requests);
  int failures = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::string& id = requests[i].request_id;
    if (!step[i].ok() || !pd[i].ok() || !agg[i].ok()) {
      if (++failures <= 5) {
        ADD_FAILURE() << id << ": step " << step[i].status() << ", P/D "
                      << pd[i].status() << ", aggregated " << agg[i].status();
      }
      continue;
    }
    EXPECT_THAT(pd[i]->tokens, ElementsAreArray(step[i]->tokens)) << id;
    EXPECT_THAT(agg[i]->tokens, ElementsAreArray(step[i]->tokens)) << id;
    EXPECT_EQ(pd[i]->finish_reason, step[i]->finish_reason) << id;
    EXPECT_EQ(agg[i]->finish_reason, step[i]->finish_reason) << id;
  }
  EXPECT_EQ(failures, 0);

  ExpectClusterIdle(*cluster);
}

}  // namespace
}  // namespace pdworker::router
