// Stateless request checks and the status mapping.
#include "worker/server/request_validation.h"

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/rpc/status_mapping.h"

namespace pdworker {
namespace {

using ::testing::HasSubstr;

const RequestLimits kLimits{/*max_num_seqs=*/4, /*vocab_size=*/256,
                            /*max_model_len=*/64};

v1::ForwardRequest OneSequence(const std::string& id, bool start) {
  v1::ForwardRequest r;
  v1::SequenceInput* s = r.add_sequences();
  s->set_sequence_id(id);
  s->add_token_ids(1);
  s->add_token_ids(2);
  s->set_start(start);
  return r;
}

TEST(RequestValidationTest, GoodRequestBecomesSteps) {
  v1::ForwardRequest r = OneSequence("a", true);
  v1::SequenceInput* b = r.add_sequences();
  b->set_sequence_id("b");
  b->add_token_ids(255);
  b->set_release_after_step(true);
  b->mutable_sampling()->set_temperature(0.7f);
  b->mutable_sampling()->set_top_k(5);
  b->mutable_sampling()->set_seed(9);
  auto spec = ValidateForwardRequest(r, kLimits);
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_EQ(spec->sequences.size(), 2u);
  EXPECT_EQ(spec->total_tokens, 3);
  const SequenceStep& a = spec->sequences[0];
  EXPECT_EQ(a.creation, SequenceCreation::kMustBeNew);
  EXPECT_EQ(a.token_ids, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(a.sampling.temperature, 0.0f);
  EXPECT_EQ(a.sampling.top_p, 1.0f);  // proto default 0 means off
  EXPECT_EQ(a.sampling.seed, DefaultSeed("a"));
  EXPECT_EQ(spec->after_step[0], AfterStep::kKeep);
  const SequenceStep& bs = spec->sequences[1];
  EXPECT_EQ(bs.creation, SequenceCreation::kMustExist);
  EXPECT_EQ(bs.sampling.seed, 9u);
  EXPECT_EQ(bs.sampling.top_k, 5);
  EXPECT_EQ(spec->after_step[1], AfterStep::kRelease);
}

TEST(RequestValidationTest, DefaultSeedIsStableAndPerSequence) {
  // FNV-1a 64 of "a": fixed forever, so re-runs reproduce tokens anywhere.
  EXPECT_EQ(DefaultSeed("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_NE(DefaultSeed("a"), DefaultSeed("b"));
}

TEST(RequestValidationTest, ErrorsNameTheField) {
  struct Case {
    std::function<void(v1::ForwardRequest*)> mutate;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](v1::ForwardRequest* r) { r->clear_sequences(); },
       absl::StatusCode::kInvalidArgument, "sequences is empty"},
      {[](v1::ForwardRequest* r) {
         for (int i = 0; i < 4; ++i) {
           *r->add_sequences() =
               OneSequence("s" + std::to_string(i), true).sequences(0);
         }
       },
       absl::StatusCode::kInvalidArgument,
       "sequences has 5 entries; max_num_seqs=4"},
      {[](v1::ForwardRequest* r) {
         r->mutable_sequences(0)->set_sequence_id(std::string(129, 'x'));
       },
       absl::StatusCode::kInvalidArgument,
       "sequences[0].sequence_id is 129 bytes"},
      {[](v1::ForwardRequest* r) {
         r->mutable_sequences(0)->set_sequence_id("\x01request#0");
       },
       absl::StatusCode::kInvalidArgument,
       "sequences[0].sequence_id begins with byte 0x01"},
      {[](v1::ForwardRequest* r) {
         r->mutable_sequences(0)->set_token_ids(1, 256);
       },
       absl::StatusCode::kInvalidArgument,
       "sequences[0].token_ids[1]=256 is outside the vocabulary [0, 256)"},
      {[](v1::ForwardRequest* r) {
         for (int i = 0; i < 63; ++i) r->mutable_sequences(0)->add_token_ids(0);
       },
       absl::StatusCode::kInvalidArgument, "token_ids has 65 tokens"},
      {[](v1::ForwardRequest* r) {
         r->mutable_sequences(0)->mutable_sampling()->set_temperature(
             std::nanf(""));
       },
       absl::StatusCode::kInvalidArgument, "sequences[0].sampling.temperature"},
      {[](v1::ForwardRequest* r) {
         r->mutable_sequences(0)->mutable_sampling()->set_temperature(INFINITY);
       },
       absl::StatusCode::kInvalidArgument, "temperature=inf"},
      {[](v1::ForwardRequest* r) {
         r->mutable_sequences(0)->mutable_sampling()->set_top_p(-0.1f);
       },
       absl::StatusCode::kInvalidArgument, "top_p=-0.1"},
      {[](v1::ForwardRequest* r) {
         r->mutable_sequences(0)->set_hold_for_handoff(true);
         r->mutable_sequences(0)->set_release_after_step(true);
       },
       absl::StatusCode::kInvalidArgument,
       "sequences[0]: hold_for_handoff and release_after_step exclude"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    v1::ForwardRequest r = OneSequence("a", true);
    cases[i].mutate(&r);
    auto spec = ValidateForwardRequest(r, kLimits);
    EXPECT_EQ(spec.status().code(), cases[i].code) << i << spec.status();
    EXPECT_THAT(std::string(spec.status().message()),
                HasSubstr(cases[i].message))
        << i;
  }
}

TEST(RequestValidationTest, ReleaseRequests) {
  v1::ReleaseRequest r;
  EXPECT_EQ(ValidateReleaseRequest(r).status().code(),
            absl::StatusCode::kInvalidArgument);
  r.add_sequence_ids("a");
  r.add_sequence_ids("b");
  auto ids = ValidateReleaseRequest(r);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, (std::vector<std::string>{"a", "b"}));
  r.add_sequence_ids("a");
  EXPECT_THAT(std::string(ValidateReleaseRequest(r).status().message()),
              HasSubstr("sequence_ids[2] 'a' repeats sequence_ids[0]"));
}

TEST(StatusMappingTest, KeepsCodeAndMessage) {
  for (int code = 0; code <= 16; ++code) {
    const absl::Status s(static_cast<absl::StatusCode>(code), "why");
    const grpc::Status g = ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), code);
    EXPECT_EQ(g.error_message(), code == 0 ? "" : "why");
  }
  // absl itself turns an out-of-range code into UNKNOWN.
  const grpc::Status odd =
      ToGrpcStatus(absl::Status(static_cast<absl::StatusCode>(99), "x"));
  EXPECT_EQ(odd.error_code(), grpc::StatusCode::UNKNOWN);
  EXPECT_EQ(odd.error_message(), "x");
}

}  // namespace
}  // namespace pdworker
