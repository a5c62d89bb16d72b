// A rolling update under load, the first thing an SRE tries: while the
// reference router runs requests over 2 prefill + 2 decode workers, one
// worker of each role drains (what SIGTERM does). No request fails: the
// draining decode worker finishes the generations it holds, the draining
// prefill worker's held prompts are still pulled, and new requests go to
// the other workers (a refusal from a worker that no longer serves is
// retried elsewhere). Every request's tokens equal an aggregated worker's,
// both drains end, and the surviving workers end idle.
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
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
using server_testing::WaitFor;
using ::testing::ElementsAreArray;

constexpr int kRequests = 120;
constexpr int kConcurrency = 8;
// Requests finished before the two workers start draining.
constexpr int kDrainAfter = 20;

std::vector<GenerationRequest> MakeRequests() {
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < kRequests; ++i) {
    GenerationRequest r;
    r.request_id = "roll-" + std::to_string(i);
    r.prompt = Prompt(1 + (i * 11) % 40, i);
    r.max_tokens = 4 + (i * 7) % 20;
    if (i % 2 == 1) {  // sampled, seeded
      r.sampling.temperature = 0.9f;
      r.sampling.top_k = 40;
      r.sampling.seed = 500 + i;
    }
    requests.push_back(std::move(r));
  }
  return requests;
}

TEST(RollingUpdateTest, DrainingOneWorkerPerRoleFailsNoRequest) {
  std::unique_ptr<router_testing::PdCluster> cluster =
      router_testing::StartPdCluster();
  ASSERT_NE(cluster, nullptr);
  // References, not a structured binding: lambdas below capture them.
  auto& prefill = cluster->prefill;
  auto& decode = cluster->decode;
  auto& pd_router = cluster->pd_router;
  auto& agg_router = cluster->aggregated_router;

  const std::vector<GenerationRequest> requests = MakeRequests();
  std::vector<absl::StatusOr<GenerationResult>> pd(
      requests.size(), absl::UnknownError("not run"));
  std::atomic<size_t> next{0};
  std::atomic<int> finished{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < kConcurrency; ++t) {
    clients.emplace_back([&] {
      for (size_t i = next++; i < requests.size(); i = next++) {
        pd[i] = pd_router->Generate(requests[i]);
        ++finished;
      }
    });
  }
  // Mid-load: "SIGTERM" one worker of each role.
  ASSERT_TRUE(WaitFor([&] { return finished >= kDrainAfter; }));
  auto prefill_drained =
      std::async(std::launch::async, [&] { prefill[0]->server->Drain(); });
  auto decode_drained =
      std::async(std::launch::async, [&] { decode[0]->server->Drain(); });
  const int finished_at_drain = finished;
  for (std::thread& t : clients) t.join();
  EXPECT_LT(finished_at_drain, kRequests - kConcurrency)
      << "the drain began too late to matter";
  prefill_drained.get();
  decode_drained.get();

  int failures = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::string& id = requests[i].request_id;
    if (!pd[i].ok()) {
      if (++failures <= 5) ADD_FAILURE() << id << ": " << pd[i].status();
      continue;
    }
    const absl::StatusOr<GenerationResult> reference =
        agg_router->Generate(requests[i]);
    ASSERT_TRUE(reference.ok()) << id << ": " << reference.status();
    EXPECT_THAT(pd[i]->tokens, ElementsAreArray(reference->tokens)) << id;
  }
  EXPECT_EQ(failures, 0);

  // The drained workers stopped listening; the others hold nothing (a
  // lease release may trail ImportKv's answer: wait for it, bounded).
  EXPECT_TRUE(server_testing::Gone(*prefill[0]->stub));
  EXPECT_TRUE(server_testing::Gone(*decode[0]->stub));
  ASSERT_TRUE(WaitFor([&] {
    for (TestWorker* w : {prefill[1].get(), decode[1].get()}) {
      const v1::WorkerStatus s = w->Status();
      if (s.kv_blocks_free() != s.kv_blocks_total() || s.kv_leases() != 0 ||
          s.num_sequences() != 0) {
        return false;
      }
    }
    return true;
  }));
  ExpectIdle(*prefill[1], "prefill 1");
  ExpectIdle(*decode[1], "decode 1");
  ExpectIdle(*cluster->aggregated, "aggregated");
}

}  // namespace
}  // namespace pdworker::router
