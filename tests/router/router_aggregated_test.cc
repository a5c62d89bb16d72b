// Router in aggregated mode against one in-process worker (role both): the
// tokens equal what the same steps give through plain Forward calls, greedy
// and sampled; EOS and max_tokens stop it; tokens stream through the
// callback; bad requests and mid-decode errors return the worker's code and
// leave nothing behind.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/router/router_test_util.h"
#include "tests/server/server_test_util.h"
#include "tools/router/router.h"

namespace pdworker::router {
namespace {

using router_testing::Address;
using router_testing::ExpectIdle;
using router_testing::Prompt;
using router_testing::ReferenceTokens;
using router_testing::StartRoleWorker;
using server_testing::TestWorker;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

class RouterAggregatedTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    worker_ = StartRoleWorker(Role::kBoth).release();
  }
  static void TearDownTestSuite() { delete worker_; }

  void SetUp() override {
    ASSERT_NE(worker_, nullptr);
    RouterOptions options;
    options.aggregated_addresses = {Address(*worker_)};
    auto router = Router::Create(options);
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = *std::move(router);
    ASSERT_FALSE(router_->disaggregated());
  }
  void TearDown() override { ExpectIdle(*worker_, "worker"); }

  // Generates through the router, checks the streamed tokens, then the
  // reference (same id, so the same derived seed) and compares.
  GenerationResult ExpectLikeReference(const GenerationRequest& request) {
    std::vector<int32_t> streamed;
    auto result = router_->Generate(
        request, [&](int32_t token) { streamed.push_back(token); });
    EXPECT_TRUE(result.ok()) << result.status();
    if (!result.ok()) return {};
    EXPECT_EQ(streamed, result->tokens);
    auto reference = ReferenceTokens(*worker_->stub, request);
    EXPECT_TRUE(reference.ok()) << reference.status();
    if (reference.ok()) {
      EXPECT_THAT(result->tokens, ElementsAreArray(*reference))
          << request.request_id;
    }
    return *result;
  }

  GenerationRequest MakeRequest(const std::string& id, int prompt_len,
                                int max_tokens) {
    GenerationRequest request;
    request.request_id = id;
    request.prompt = Prompt(prompt_len, static_cast<int>(id.size()));
    request.max_tokens = max_tokens;
    return request;
  }

  static TestWorker* worker_;
  std::unique_ptr<Router> router_;
};

TestWorker* RouterAggregatedTest::worker_ = nullptr;

TEST_F(RouterAggregatedTest, GreedyTokensEqualPlainForwardSteps) {
  const GenerationRequest request = MakeRequest("greedy", 10, 12);
  const GenerationResult result = ExpectLikeReference(request);
  EXPECT_EQ(result.tokens.size(), 12u);
  EXPECT_EQ(result.finish_reason, FinishReason::kLength);
  EXPECT_EQ(result.prefill_address, Address(*worker_));
  EXPECT_EQ(result.decode_address, Address(*worker_));
  EXPECT_GT(result.timings.ttft_us, 0);
  EXPECT_GT(result.timings.prefill_us, 0);
  EXPECT_GE(result.timings.ttft_us, result.timings.prefill_us);
  EXPECT_EQ(result.timings.transfer_us, 0);
  EXPECT_GT(result.timings.first_decode_step_us, 0);
  EXPECT_EQ(result.timings.inter_token_us.size(), 11u);
}

TEST_F(RouterAggregatedTest, SampledTokensEqualPlainForwardSteps) {
  GenerationRequest seeded = MakeRequest("sampled-seeded", 7, 10);
  seeded.sampling.temperature = 0.9f;
  seeded.sampling.top_k = 40;
  seeded.sampling.top_p = 0.95f;
  seeded.sampling.seed = 1234;
  ExpectLikeReference(seeded);
  // No seed: the worker derives it from the id, the same for both runs.
  GenerationRequest unseeded = MakeRequest("sampled-unseeded", 5, 10);
  unseeded.sampling.temperature = 1.0f;
  ExpectLikeReference(unseeded);
}

TEST_F(RouterAggregatedTest, LongPromptIsChunkedLikePlainForward) {
  // 100 tokens > the worker's 64-token step budget.
  ExpectLikeReference(MakeRequest("long", 100, 6));
}

TEST_F(RouterAggregatedTest, EosStopsAndIsIncluded) {
  GenerationRequest request = MakeRequest("eos", 9, 12);
  auto full = ReferenceTokens(*worker_->stub, request);
  ASSERT_TRUE(full.ok()) << full.status();
  // The first token not seen before it, past the prompt's token.
  size_t k = 1;
  while (k < full->size() && std::find(full->begin(), full->begin() + k,
                                       (*full)[k]) != full->begin() + k) {
    ++k;
  }
  ASSERT_LT(k, full->size()) << "no usable EOS candidate";
  request.eos_token_id = (*full)[k];
  auto result = router_->Generate(request);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_THAT(result->tokens,
              ElementsAreArray(full->begin(), full->begin() + k + 1));
  EXPECT_EQ(result->finish_reason, FinishReason::kEos);
}

TEST_F(RouterAggregatedTest, EosAsFirstTokenReleasesAtOnce) {
  GenerationRequest request = MakeRequest("eos-first", 6, 8);
  auto full = ReferenceTokens(*worker_->stub, request);
  ASSERT_TRUE(full.ok()) << full.status();
  request.eos_token_id = (*full)[0];
  auto result = router_->Generate(request);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_THAT(result->tokens, ::testing::ElementsAre((*full)[0]));
  EXPECT_EQ(result->finish_reason, FinishReason::kEos);
  EXPECT_TRUE(result->timings.inter_token_us.empty());
}

TEST_F(RouterAggregatedTest, OneTokenIsJustThePromptStep) {
  const GenerationResult result = ExpectLikeReference(MakeRequest("one", 6, 1));
  EXPECT_EQ(result.tokens.size(), 1u);
  EXPECT_EQ(result.timings.first_decode_step_us, 0);
}

TEST_F(RouterAggregatedTest, BadRequestsAreInvalidArgument) {
  GenerationRequest no_id = MakeRequest("", 4, 4);
  EXPECT_EQ(router_->Generate(no_id).status().code(),
            absl::StatusCode::kInvalidArgument);
  GenerationRequest no_prompt = MakeRequest("no-prompt", 0, 4);
  EXPECT_EQ(router_->Generate(no_prompt).status().code(),
            absl::StatusCode::kInvalidArgument);
  GenerationRequest no_tokens = MakeRequest("no-tokens", 4, 0);
  EXPECT_EQ(router_->Generate(no_tokens).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The worker's own check, code kept and the worker named.
  GenerationRequest out_of_vocab = MakeRequest("oov", 4, 4);
  out_of_vocab.prompt[2] = 300;
  const absl::Status status = router_->Generate(out_of_vocab).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr(Address(*worker_)));
}

TEST_F(RouterAggregatedTest, DecodeErrorReleasesTheSequence) {
  // max_model_len is 128: the prompt's step leaves 126 tokens, decode steps
  // reach 127 and 128, and the next one is refused.
  GenerationRequest request = MakeRequest("too-long", 126, 10);
  std::vector<int32_t> streamed;
  auto result = router_->Generate(
      request, [&](int32_t token) { streamed.push_back(token); });
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(streamed.size(), 3u);
  // TearDown: nothing left on the worker.
}

TEST_F(RouterAggregatedTest, UnreachableWorkerIsUnavailable) {
  RouterOptions options;
  options.aggregated_addresses = {"127.0.0.1:1"};
  auto router = Router::Create(options);
  ASSERT_TRUE(router.ok());
  EXPECT_EQ((*router)->Generate(MakeRequest("x", 3, 3)).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST(RouterCreateTest, NeedsOneTopology) {
  RouterOptions none;
  EXPECT_EQ(Router::Create(none).status().code(),
            absl::StatusCode::kInvalidArgument);
  RouterOptions prefill_only;
  prefill_only.prefill_addresses = {"127.0.0.1:5"};
  EXPECT_EQ(Router::Create(prefill_only).status().code(),
            absl::StatusCode::kInvalidArgument);
  RouterOptions both;
  both.prefill_addresses = {"127.0.0.1:5"};
  both.decode_addresses = {"127.0.0.1:6"};
  both.aggregated_addresses = {"127.0.0.1:7"};
  EXPECT_EQ(Router::Create(both).status().code(),
            absl::StatusCode::kInvalidArgument);
  both.aggregated_addresses.clear();
  auto pd = Router::Create(both);
  ASSERT_TRUE(pd.ok()) << pd.status();
  EXPECT_TRUE((*pd)->disaggregated());
}

}  // namespace
}  // namespace pdworker::router
