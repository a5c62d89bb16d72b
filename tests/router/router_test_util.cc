#include "tests/router/router_test_util.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace pdworker::router_testing {

std::string Address(const TestWorker& worker) {
  return absl::StrCat("127.0.0.1:", worker.server->port());
}

ModelRunnerOptions RunnerOptions(Role role) {
  ModelRunnerOptions options = server_testing::SmallRunnerOptions();
  options.role = role;
  return options;
}

std::unique_ptr<TestWorker> StartRoleWorker(Role role) {
  return server_testing::StartWorker(RunnerOptions(role));
}

std::unique_ptr<PdCluster> StartPdCluster() {
  auto c = std::make_unique<PdCluster>();
  router::RouterOptions pd_options;
  for (int i = 0; i < 2; ++i) {
    c->prefill.push_back(StartRoleWorker(Role::kPrefill));
    c->decode.push_back(StartRoleWorker(Role::kDecode));
    if (c->prefill.back() == nullptr || c->decode.back() == nullptr) {
      ADD_FAILURE() << "a worker did not start";
      return nullptr;
    }
    pd_options.prefill_addresses.push_back(Address(*c->prefill.back()));
    pd_options.decode_addresses.push_back(Address(*c->decode.back()));
  }
  c->aggregated = StartRoleWorker(Role::kBoth);
  if (c->aggregated == nullptr) {
    ADD_FAILURE() << "the aggregated worker did not start";
    return nullptr;
  }
  auto pd_router = router::Router::Create(pd_options);
  router::RouterOptions aggregated_options;
  aggregated_options.aggregated_addresses = {Address(*c->aggregated)};
  auto aggregated_router = router::Router::Create(aggregated_options);
  if (!pd_router.ok() || !aggregated_router.ok()) {
    ADD_FAILURE() << pd_router.status() << "; " << aggregated_router.status();
    return nullptr;
  }
  c->pd_router = *std::move(pd_router);
  c->aggregated_router = *std::move(aggregated_router);
  return c;
}

absl::StatusOr<std::vector<int32_t>> ReferenceTokens(
    v1::Worker::Stub& stub, const router::GenerationRequest& request) {
  std::vector<int32_t> tokens;
  bool live = false;
  auto release = [&] {
    if (!live) return;
    grpc::ClientContext context;
    server_testing::SetGenerousDeadline(&context);
    v1::ReleaseRequest r;
    r.add_sequence_ids(request.request_id);
    v1::ReleaseResponse response;
    (void)stub.Release(&context, r, &response);
  };
  while (static_cast<int>(tokens.size()) < request.max_tokens) {
    v1::ForwardRequest forward;
    v1::SequenceInput* input = forward.add_sequences();
    input->set_sequence_id(request.request_id);
    if (tokens.empty()) {
      for (const int32_t t : request.prompt) input->add_token_ids(t);
      input->set_start(true);
    } else {
      input->add_token_ids(tokens.back());
    }
    v1::SamplingParams* sampling = input->mutable_sampling();
    sampling->set_temperature(request.sampling.temperature);
    sampling->set_top_k(request.sampling.top_k);
    sampling->set_top_p(request.sampling.top_p);
    if (request.sampling.seed) sampling->set_seed(*request.sampling.seed);
    v1::ForwardResponse response;
    const grpc::Status status =
        server_testing::Forward(stub, forward, &response);
    if (!status.ok()) {
      release();
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          status.error_message());
    }
    live = true;
    tokens.push_back(response.sequences(0).token_id());
    if (request.eos_token_id && tokens.back() == *request.eos_token_id) break;
  }
  release();
  return tokens;
}

void ExpectIdle(TestWorker& worker, const std::string& name) {
  const v1::WorkerStatus status = worker.Status();
  EXPECT_EQ(status.kv_blocks_free(), status.kv_blocks_total()) << name;
  EXPECT_EQ(status.num_sequences(), 0) << name;
  EXPECT_EQ(status.kv_leases(), 0) << name;
}

std::vector<int32_t> Prompt(int n, int salt) {
  std::vector<int32_t> tokens(n);
  for (int i = 0; i < n; ++i) tokens[i] = (salt * 31 + 37 * i + 11) % 256;
  return tokens;
}

}  // namespace pdworker::router_testing
