// P/D through the request-level API, driven the way SMG's sequential P/D
// relay drives vLLM workers, by a Python grpcio client
// (tests/server/vllm_pd_client.py): 100 prompts go to a prefill worker
// (max_tokens 1) and, with the kv_transfer_params_json it returns, to a
// decode worker; each must give exactly the aggregated worker's tokens and
// logprobs, broken handoffs are refused, and no KV is left on any worker.
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/server/server_test_util.h"
#include "tests/server/subprocess.h"

namespace pdworker {
namespace {

using Json = nlohmann::json;
using server_testing::RunfilePath;
using server_testing::Subprocess;
using ::testing::HasSubstr;

std::string TmpPath(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/", name);
}

std::vector<int32_t> Prompt(int length, int seed) {
  std::vector<int32_t> p(length);
  for (int i = 0; i < length; ++i) p[i] = 3 + (seed * 29 + i * 13) % 250;
  return p;
}

// A worker of `role`; `speculative` turns n-gram speculation on (k = 3).
std::unique_ptr<server_testing::TestWorker> Start(Role role,
                                                  bool speculative = false) {
  ModelRunnerOptions options = server_testing::SmallRunnerOptions();
  options.role = role;
  auto config =
      ParseCompilationConfig(R"({"cudagraph_capture_sizes":[1,2,4,8]})");
  CHECK(config.ok());
  options.compilation = *config;
  WorkerServerOptions server;
  server.model_dir = server_testing::TinyModelDir();
  // A prefill leg nobody pulls frees its KV soon.
  server.kv_lease_ttl = std::chrono::milliseconds(2000);
  if (speculative) {
    options.uniform_decode_query_len = 4;
    server.engine.speculative.method = SpeculativeMethod::kNgram;
    server.engine.speculative.num_speculative_tokens = 3;
    server.engine.speculative.prompt_lookup_min = 1;
    server.engine.speculative.prompt_lookup_max = 3;
  }
  return server_testing::StartWorker(options, server);
}

int64_t Held(server_testing::TestWorker& w) {
  const EngineSnapshot s = w.server->engine().snapshot();
  return s.kv.used_blocks + s.running_requests + s.waiting_requests +
         static_cast<int64_t>(w.server->leases().size());
}

// Within 30 s neither worker holds KV, requests or leases (a prefill leg
// nobody pulled expires after the 2 s lease).
void ExpectNothingHeldSoon(server_testing::TestWorker& prefill,
                           server_testing::TestWorker& decode) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while ((Held(prefill) > 0 || Held(decode) > 0) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(Held(prefill), 0);
  EXPECT_EQ(Held(decode), 0);
}

// Prompt i of the client's results: both the P/D relay and the aggregated
// worker answered OK, with the same tokens and logprobs.
void ExpectRelayEqualsAggregated(const Json& r, int i) {
  const Json& pd = r["pd"][i];
  const Json& agg = r["aggregated"][i];
  ASSERT_EQ(pd["code"], "OK")
      << i << " " << pd["stage"] << ": " << pd["message"];
  ASSERT_EQ(agg["code"], "OK") << i << ": " << agg["message"];
  EXPECT_EQ(pd["tokens"], agg["tokens"]) << i;
  ASSERT_EQ(pd["logprobs"].size(), agg["logprobs"].size()) << i;
  for (size_t t = 0; t < pd["logprobs"].size(); ++t) {
    EXPECT_FLOAT_EQ(pd["logprobs"][t].get<float>(),
                    agg["logprobs"][t].get<float>())
        << i << " token " << t;
  }
}

// Runs tests/server/vllm_pd_client.py over `scenarios` against the three
// workers and returns its results (ASSERTs inside).
void RunRelay(server_testing::TestWorker& prefill,
              server_testing::TestWorker& decode,
              server_testing::TestWorker& aggregated, const Json& scenarios,
              const std::string& tag, Json* results) {
  const std::string in = TmpPath(tag + "_scenarios.json");
  const std::string out = TmpPath(tag + "_results.json");
  std::ofstream(in) << scenarios.dump();
  auto client = Subprocess::Start(
      {"/usr/bin/python3", RunfilePath("tests/server/vllm_pd_client.py"),
       absl::StrCat("--prefill=127.0.0.1:", prefill.server->port()),
       absl::StrCat("--decode=127.0.0.1:", decode.server->port()),
       absl::StrCat("--aggregated=127.0.0.1:", aggregated.server->port()),
       "--scenarios=" + in, "--out=" + out},
      TmpPath(tag + "_client.log"),
      {absl::StrCat("PYTHONPATH=", RunfilePath(""))});
  ASSERT_TRUE(client.ok()) << client.status();
  auto code = (*client)->Wait(absl::Seconds(300));
  ASSERT_TRUE(code.ok()) << code.status();
  ASSERT_EQ(*code, 0) << (*client)->Output();
  std::ifstream results_file(out);
  *results = Json::parse(results_file);
}

TEST(VllmPdTest, SequentialRelayEqualsAggregatedAndLeavesNothing) {
  auto prefill = Start(Role::kPrefill);
  auto decode = Start(Role::kDecode);
  auto aggregated = Start(Role::kBoth);
  ASSERT_TRUE(prefill && decode && aggregated);

  Json scenarios;
  for (int i = 0; i < 100; ++i) {
    Json s = {{"id", absl::StrCat("pd", i)},
              {"prompt", Prompt(1 + (i * 37) % 100, i)},
              {"max_tokens", 1 + i % 12}};
    if (i % 3 == 1) {  // seeded sampling continues across the handoff
      s["temperature"] = 0.8;
      s["seed"] = 1000 + i;
      s["top_k"] = 50;
    }
    if (i % 5 == 2) s["logprobs"] = 2;
    scenarios["prompts"].push_back(s);
  }
  scenarios["broken"] = {{"id", "broken"}, {"prompt", Prompt(9, 1)}};

  Json r;
  RunRelay(*prefill, *decode, *aggregated, scenarios, "pd", &r);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());

  for (int i = 0; i < 100; ++i) {
    ExpectRelayEqualsAggregated(r, i);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    const Json& pd = r["pd"][i];
    EXPECT_EQ(pd["tokens"].size(), scenarios["prompts"][i]["max_tokens"]);
    // The prefill leg's one token is the decode leg's first output.
    EXPECT_EQ(pd["prefill_tokens"].size(), 1u) << i;
    EXPECT_EQ(pd["prefill_tokens"][0], pd["tokens"][0]) << i;
    EXPECT_EQ(pd["prefill_finish_reason"], "length") << i;
    EXPECT_EQ(pd["finish_reason"], "length") << i;
    // The handle is v2 and names the prompt it holds.
    const Json handoff = Json::parse(pd["kv_json"].get<std::string>());
    EXPECT_EQ(handoff["pdworker_kv_handle"]["version"], 2) << i;
    EXPECT_EQ(handoff["pdworker_kv_handle"]["prompt_token_ids"],
              scenarios["prompts"][i]["prompt"])
        << i;
  }

  const Json& b = r["broken"];
  EXPECT_EQ(b["other_prompt"]["code"], "INVALID_ARGUMENT");
  EXPECT_THAT(b["other_prompt"]["message"].get<std::string>(),
              HasSubstr("another prompt"));
  EXPECT_EQ(b["not_json"]["code"], "INVALID_ARGUMENT");
  EXPECT_EQ(b["unknown_key"]["code"], "INVALID_ARGUMENT");
  EXPECT_THAT(b["unknown_key"]["message"].get<std::string>(),
              HasSubstr("remote_host"));
  EXPECT_EQ(b["unknown_lease"]["code"], "NOT_FOUND")
      << b["unknown_lease"]["message"];
  EXPECT_EQ(b["old_version"]["code"], "INVALID_ARGUMENT");
  EXPECT_THAT(b["old_version"]["message"].get<std::string>(),
              HasSubstr("version"));
  EXPECT_EQ(b["handle_to_prefill"]["code"], "FAILED_PRECONDITION");
  EXPECT_THAT(b["handle_to_prefill"]["message"].get<std::string>(),
              HasSubstr("prefill worker"));
  EXPECT_EQ(b["hint_to_prefill"]["code"], "OK");
  for (const char* to :
       {"number_overflow_to_decode", "number_overflow_to_prefill"}) {
    EXPECT_EQ(b[to]["code"], "INVALID_ARGUMENT") << to;
    EXPECT_THAT(b[to]["message"].get<std::string>(),
                HasSubstr("number overflow"))
        << to;
  }
  ASSERT_EQ(b["good"]["code"], "OK") << b["good"]["message"];
  EXPECT_EQ(b["good"]["tokens"].size(), 4u);

  // Nothing held anywhere: the decode workers released every lease they
  // pulled, and the one prefill leg nobody pulled expired.
  ExpectNothingHeldSoon(*prefill, *decode);
  EXPECT_EQ(Held(*aggregated), 0);
}

// The decode worker speculates (n-gram, k = 3) on the decode legs it
// imports: the prompt it drafts from comes with the request, the KV with
// the import. Every relay's tokens and logprobs equal an aggregated worker
// without speculation, drafts were accepted, and nothing is held after.
TEST(VllmPdTest, ASpeculatingDecodeWorkerEqualsAggregated) {
  auto prefill = Start(Role::kPrefill);
  auto decode = Start(Role::kDecode, /*speculative=*/true);
  auto aggregated = Start(Role::kBoth);
  ASSERT_TRUE(prefill && decode && aggregated);
  Json scenarios;
  for (int i = 0; i < 24; ++i) {
    // Prompts that repeat a short motif: lookups find drafts.
    const std::vector<int32_t> motif = Prompt(3 + i % 4, i);
    std::vector<int32_t> prompt;
    for (int r = 0; r < 4; ++r) {
      prompt.insert(prompt.end(), motif.begin(), motif.end());
    }
    Json s = {{"id", absl::StrCat("spec", i)},
              {"prompt", prompt},
              {"max_tokens", 8 + i % 20}};
    if (i % 3 == 1) {
      s["temperature"] = 0.8;
      s["seed"] = 2000 + i;
    }
    scenarios["prompts"].push_back(s);
  }
  scenarios["broken"] = {{"id", "broken"}, {"prompt", Prompt(9, 1)}};
  Json r;
  RunRelay(*prefill, *decode, *aggregated, scenarios, "spec", &r);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  for (int i = 0; i < 24; ++i) ExpectRelayEqualsAggregated(r, i);
  EXPECT_GT(decode->server->engine().snapshot().spec_accepted_tokens, 0);
  ExpectNothingHeldSoon(*prefill, *decode);
}

}  // namespace
}  // namespace pdworker
