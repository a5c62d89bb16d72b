// Each family added beyond Llama's layer, served end to end on the CPU
// backend: GetModelInfo names it, the request API's greedy tokens are the
// float64 numpy reference's (tests/reference/llama_reference.py), aggregated,
// with a prefix-cache hit and through P/D (prefill worker -> decode worker via
// kv_transfer_params_json, as SMG relays it), and another family's decode
// worker refuses its KV.
#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/vllm_engine.grpc.pb.h"
#include "tests/model/reference_runner.h"
#include "tests/server/server_test_util.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/model/model_config.h"

namespace pdworker {
namespace {

namespace vg = ::vllm::grpc::engine;
using ::testing::HasSubstr;

std::string ModelDir(TinyShape shape) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir =
      absl::StrCat(tmp ? tmp : "/tmp", "/family_", TinyShapeName(shape));
  TinyModelOptions options;
  options.shape = shape;
  options.seed = 11;
  const absl::Status written = WriteTinyModel(options, dir);
  EXPECT_TRUE(written.ok()) << written;
  return dir;
}

struct Outcome {
  grpc::Status status;
  vg::GenerateComplete complete;
};

// Greedy, exactly `max_tokens` outputs (EOS ignored), not streamed.
Outcome Generate(server_testing::TestWorker& worker, const std::string& id,
                 const std::vector<int32_t>& prompt, int max_tokens,
                 const std::optional<std::string>& kv_json = std::nullopt) {
  auto stub = vg::VllmEngine::NewStub(worker.channel);
  vg::GenerateRequest request;
  request.set_request_id(id);
  for (const int32_t t : prompt) request.mutable_tokenized()->add_input_ids(t);
  vg::SamplingParams* params = request.mutable_sampling_params();
  params->set_temperature(0);
  params->set_max_tokens(max_tokens);
  params->set_ignore_eos(true);
  if (kv_json.has_value()) request.set_kv_transfer_params_json(*kv_json);
  grpc::ClientContext context;
  server_testing::SetGenerousDeadline(&context);
  auto reader = stub->Generate(&context, request);
  Outcome outcome;
  vg::GenerateResponse response;
  while (reader->Read(&response)) {
    if (response.has_complete()) outcome.complete = response.complete();
  }
  outcome.status = reader->Finish();
  return outcome;
}

std::vector<int32_t> Tokens(const vg::GenerateComplete& complete) {
  return {complete.output_ids().begin(), complete.output_ids().end()};
}

class ModelFamilyServerTest : public ::testing::TestWithParam<TinyShape> {
 protected:
  std::unique_ptr<server_testing::TestWorker> Start(Role role,
                                                    const std::string& dir) {
    ModelRunnerOptions options = server_testing::SmallRunnerOptions();
    options.role = role;
    options.prefix_caching = PrefixCaching::kOn;
    WorkerServerOptions server;
    server.model_dir = dir;
    return server_testing::StartWorker(options, server, true, dir);
  }
};

TEST_P(ModelFamilyServerTest, GetModelInfoNamesTheFamily) {
  const std::string dir = ModelDir(GetParam());
  auto worker = Start(Role::kBoth, dir);
  ASSERT_NE(worker, nullptr);
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto stub = vg::VllmEngine::NewStub(worker->channel);
  grpc::ClientContext context;
  server_testing::SetGenerousDeadline(&context);
  vg::GetModelInfoResponse info;
  ASSERT_TRUE(
      stub->GetModelInfo(&context, vg::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.model_type(), ModelTypeName(config->architecture));
  ASSERT_EQ(info.architectures_size(), 1);
  EXPECT_EQ(info.architectures(0), ArchitectureName(config->architecture));
  EXPECT_EQ(info.vocab_size(), config->vocab_size);
  EXPECT_EQ(info.max_context_length(),
            server_testing::SmallRunnerOptions().max_model_len);
  EXPECT_THAT(info.eos_token_ids(),
              ::testing::ElementsAreArray(config->eos_token_ids));
}

TEST_P(ModelFamilyServerTest,
       GreedyTokensAreTheReferenceAggregatedCachedAndPd) {
  const std::string dir = ModelDir(GetParam());
  auto both = Start(Role::kBoth, dir);
  auto prefill = Start(Role::kPrefill, dir);
  auto decode = Start(Role::kDecode, dir);
  ASSERT_TRUE(both && prefill && decode);
  constexpr int kSteps = 8;
  // 11 tokens: two full blocks of 4 to share, and a tail.
  const std::vector<int32_t> prompt = {3,  14, 15, 92, 65, 35,
                                       89, 79, 32, 38, 46};
  auto expected = model_testing::RunReferenceGreedy(dir, prompt, kSteps);
  ASSERT_TRUE(expected.ok()) << expected.status();

  const Outcome cold = Generate(*both, "cold", prompt, kSteps);
  ASSERT_TRUE(cold.status.ok()) << cold.status.error_message();
  EXPECT_EQ(Tokens(cold.complete), *expected);
  EXPECT_EQ(cold.complete.cached_tokens(), 0u);
  // The same prompt again: its full blocks come from the prefix cache.
  const Outcome warm = Generate(*both, "warm", prompt, kSteps);
  ASSERT_TRUE(warm.status.ok()) << warm.status.error_message();
  EXPECT_EQ(Tokens(warm.complete), *expected);
  EXPECT_GE(warm.complete.cached_tokens(), 8u);

  // P/D: the prefill leg's one token, then the decode leg from its KV.
  const Outcome first = Generate(*prefill, "pd", prompt, 1);
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  ASSERT_TRUE(first.complete.has_kv_transfer_params_json());
  EXPECT_EQ(Tokens(first.complete), std::vector<int32_t>{(*expected)[0]});
  const Outcome rest = Generate(*decode, "pd", prompt, kSteps,
                                first.complete.kv_transfer_params_json());
  ASSERT_TRUE(rest.status.ok()) << rest.status.error_message();
  EXPECT_EQ(Tokens(rest.complete), *expected);
}

// The step-level Forward API: two prompts prefilled in one step, then
// decoded together one token per call, give the reference's greedy tokens.
TEST_P(ModelFamilyServerTest, ForwardStepsGiveTheReferenceTokens) {
  const std::string dir = ModelDir(GetParam());
  auto worker = Start(Role::kBoth, dir);
  ASSERT_NE(worker, nullptr);
  const std::vector<std::vector<int32_t>> prompts = {
      {7, 70, 170, 17, 71, 117, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13},
      {200, 100, 50, 25}};
  constexpr int kSteps = 6;
  std::vector<std::vector<int32_t>> expected;
  for (const auto& prompt : prompts) {
    auto tokens = model_testing::RunReferenceGreedy(dir, prompt, kSteps);
    ASSERT_TRUE(tokens.ok()) << tokens.status();
    expected.push_back(*tokens);
  }
  std::vector<std::vector<int32_t>> got(prompts.size());
  std::vector<std::vector<int32_t>> next = prompts;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<v1::SequenceInput> inputs;
    for (size_t i = 0; i < prompts.size(); ++i) {
      inputs.push_back(
          server_testing::Input(absl::StrCat("f", i), next[i], step == 0));
    }
    v1::ForwardResponse response;
    const grpc::Status status = server_testing::Forward(
        *worker->stub, server_testing::Request(std::move(inputs)), &response);
    ASSERT_TRUE(status.ok()) << step << ": " << status.error_message();
    ASSERT_EQ(response.sequences_size(), static_cast<int>(prompts.size()));
    for (size_t i = 0; i < prompts.size(); ++i) {
      const int32_t token = response.sequences(i).token_id();
      got[i].push_back(token);
      next[i] = {token};
    }
  }
  EXPECT_EQ(got, expected);
}

// A decode worker of another family (the Llama gqa shape) must not decode
// from this family's KV: the handle's model fingerprint differs.
TEST_P(ModelFamilyServerTest, AnotherFamilysDecodeWorkerRefusesTheKv) {
  const std::string dir = ModelDir(GetParam());
  auto prefill = Start(Role::kPrefill, dir);
  auto other = Start(Role::kDecode, ModelDir(TinyShape::kGqa));
  ASSERT_TRUE(prefill && other);
  const std::vector<int32_t> prompt = {5, 6, 7, 8, 9, 10};
  const Outcome first = Generate(*prefill, "x", prompt, 1);
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  const Outcome refused = Generate(*other, "x", prompt, 4,
                                   first.complete.kv_transfer_params_json());
  ASSERT_FALSE(refused.status.ok());
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << refused.status.error_message();
  EXPECT_THAT(refused.status.error_message(), HasSubstr("fingerprint"));
  EXPECT_EQ(other->server->engine().snapshot().kv.used_blocks, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Families, ModelFamilyServerTest,
    ::testing::Values(TinyShape::kQwen3, TinyShape::kPhi3, TinyShape::kGemma2,
                      TinyShape::kMistralWindow, TinyShape::kGemma3,
                      TinyShape::kGemma3Multimodal, TinyShape::kPhi4Mini),
    [](const ::testing::TestParamInfo<TinyShape>& info) {
      return std::string(TinyShapeName(info.param));
    });

}  // namespace
}  // namespace pdworker
