// Forward with SequenceInput.num_samples (issue 42, item 5): a step-level
// router sends 1 + k tokens per sequence and gets a sample after each of
// them (prior_token_ids, then token_id), over real gRPC: the rows equal
// what one-token calls sample at those positions, for a new sequence (also
// chunked over several steps, and with the prefix cache holding its
// prompt) and for a live one verifying drafts; bad values are refused by
// field and change nothing.
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
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr int kSamples = 4;  // uniform_decode_query_len: 1 + 3 drafts

class ForwardSamplesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ModelRunnerOptions options = server_testing::SmallRunnerOptions();
    options.uniform_decode_query_len = kSamples;
    options.prefix_caching = PrefixCaching::kOn;
    worker_ = server_testing::StartWorker(options);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
  }

  // `prompt` started as `id`, then its last `n - 1` tokens fed one call at
  // a time: the n samples one-token calls give after its last n tokens.
  std::vector<int32_t> OneTokenCalls(const std::string& id,
                                     const std::vector<int32_t>& prompt,
                                     int n) {
    std::vector<int32_t> samples;
    const std::vector<int32_t> head(prompt.begin(), prompt.end() - (n - 1));
    v1::ForwardResponse response;
    EXPECT_TRUE(
        Forward(*worker_->stub, Request({Input(id, head, true)}), &response)
            .ok());
    samples.push_back(response.sequences(0).token_id());
    for (size_t i = head.size(); i < prompt.size(); ++i) {
      EXPECT_TRUE(Forward(*worker_->stub,
                          Request({Input(id, {prompt[i]}, false)}), &response)
                      .ok());
      samples.push_back(response.sequences(0).token_id());
    }
    return samples;
  }

  // One call of `tokens` for `id` sampling `n` rows: prior_token_ids then
  // token_id.
  std::vector<int32_t> Sampled(const std::string& id,
                               const std::vector<int32_t>& tokens, bool start,
                               int n, v1::ForwardResponse* response) {
    v1::SequenceInput in = Input(id, tokens, start);
    in.set_num_samples(n);
    const grpc::Status status =
        Forward(*worker_->stub, Request({in}), response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    if (!status.ok()) return {};
    const v1::SequenceOutput& out = response->sequences(0);
    EXPECT_EQ(out.prior_logprobs_size(), n - 1);
    std::vector<int32_t> rows(out.prior_token_ids().begin(),
                              out.prior_token_ids().end());
    rows.push_back(out.token_id());
    return rows;
  }

  std::unique_ptr<server_testing::TestWorker> worker_;
};

TEST_F(ForwardSamplesTest, RowsEqualOneTokenCalls) {
  std::vector<int32_t> prompt;
  for (int i = 0; i < 9; ++i) prompt.push_back((29 * i + 5) % 256);
  const std::vector<int32_t> want = OneTokenCalls("ref", prompt, kSamples);
  v1::ForwardResponse response;
  EXPECT_THAT(Sampled("v", prompt, true, kSamples, &response),
              ElementsAreArray(want));
  EXPECT_EQ(response.sequences(0).num_tokens(), 9);

  // A live sequence verifying drafts: its last sample, then three drafts
  // (the reference's next tokens); the rows are the reference's next four.
  std::vector<int32_t> ref_tokens = prompt;
  ref_tokens.push_back(want.back());
  for (int i = 0; i < 3; ++i) ref_tokens.push_back((7 * i + 1) % 256);
  const std::vector<int32_t> next = OneTokenCalls("ref2", ref_tokens, kSamples);
  const std::vector<int32_t> verify(ref_tokens.end() - kSamples,
                                    ref_tokens.end());
  EXPECT_THAT(Sampled("v", verify, false, kSamples, &response),
              ElementsAreArray(next));
  EXPECT_EQ(response.sequences(0).num_tokens(), 13);
}

// A prompt over the step budget (64 tokens) runs in chunks; the last one
// holds the sampled tokens. The same prompt again finds its blocks in the
// prefix cache, all but the sampled tokens'.
TEST_F(ForwardSamplesTest, ChunkedAndCachedPrompts) {
  std::vector<int32_t> prompt;
  for (int i = 0; i < 66; ++i) prompt.push_back((13 * i + 3) % 256);
  // First, with nothing cached yet.
  v1::ForwardResponse response;
  const std::vector<int32_t> chunked =
      Sampled("chunked", prompt, true, kSamples, &response);
  EXPECT_GT(response.num_steps(), 1);
  EXPECT_EQ(response.sequences(0).cached_tokens(), 0);
  const std::vector<int32_t> want = OneTokenCalls("ref", prompt, kSamples);
  EXPECT_THAT(chunked, ElementsAreArray(want));
  EXPECT_THAT(Sampled("cached", prompt, true, kSamples, &response),
              ElementsAreArray(want));
  // 66 tokens, 4 sampled: at most 62 from the cache, whole blocks of 4.
  EXPECT_EQ(response.sequences(0).cached_tokens(), 60);
}

TEST_F(ForwardSamplesTest, BadValuesAreRefusedByField) {
  v1::ForwardResponse response;
  ASSERT_TRUE(
      Forward(*worker_->stub, Request({Input("s", {1, 2, 3}, true)}), &response)
          .ok());
  for (const auto& [tokens, n] :
       std::vector<std::pair<std::vector<int32_t>, int>>{
           {{4, 5, 6, 7, 8}, kSamples + 1},  // above 1 + num_speculative_tokens
           {{4, 5}, 3},                      // above its tokens
           {{4}, -1}}) {
    v1::SequenceInput in = Input("s", tokens, false);
    in.set_num_samples(n);
    const grpc::Status status =
        Forward(*worker_->stub, Request({in}), &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << n;
    EXPECT_THAT(status.error_message(), HasSubstr("sequences[0].num_samples"));
  }
  // The sequence is unchanged: its next call continues at length 3.
  ASSERT_TRUE(
      Forward(*worker_->stub, Request({Input("s", {9}, false)}), &response)
          .ok());
  EXPECT_EQ(response.sequences(0).num_tokens(), 4);
}

}  // namespace
}  // namespace pdworker
