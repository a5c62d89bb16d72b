// The request-level API (vllm.grpc.engine.VllmEngine) from a client that is
// not ours: Python grpcio with stubs generated from proto/vllm_engine.proto
// (tests/server/vllm_engine_client.py) against an in-process worker over
// loopback gRPC. The client records what the worker answered; this test
// judges it against the model run step by step through ModelRunner::Execute
// (tokens, raw logprobs computed here from the logits), and checks that
// aborted, cancelled and finished requests left no KV behind.
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/server/server_test_util.h"
#include "tests/server/subprocess.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace pdworker {
namespace {

using Json = nlohmann::json;
using server_testing::RunfilePath;
using server_testing::Subprocess;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

std::string TmpPath(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/", name);
}

std::vector<int32_t> Prompt(int length, int seed) {
  std::vector<int32_t> p(length);
  for (int i = 0; i < length; ++i) p[i] = 3 + (seed * 37 + i * 11) % 250;
  return p;
}

// `prompt` alone through Execute: tokens, and each sample's raw logits row
// (teacher-forced without sampling masks: min_p and bans change the logits
// in place before sampling).
struct Reference {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;
};
Reference Generate(ModelRunner& r, const std::vector<int32_t>& prompt, int n,
                   const SamplingOptions& sampling = {},
                   const std::vector<int32_t>& banned = {}, int ban_until = 0) {
  Reference out;
  // The prompt in chunks of the step budget; its last chunk samples.
  const size_t budget = r.options().max_num_batched_tokens;
  size_t start = 0;
  for (; prompt.size() - start > budget; start += budget) {
    SequenceStep chunk = MakeSequenceStep(
        "ref", {prompt.begin() + start, prompt.begin() + start + budget},
        start == 0 ? SequenceCreation::kMustBeNew
                   : SequenceCreation::kMustExist);
    CHECK(r.Execute({&chunk, 1}).ok());
  }
  std::vector<int32_t> input(prompt.begin() + start, prompt.end());
  for (int i = 0; i < n; ++i) {
    SequenceStep step =
        MakeSequenceStep("ref", input,
                         i == 0 && start == 0 ? SequenceCreation::kMustBeNew
                                              : SequenceCreation::kMustExist);
    step.sampling = sampling;
    if (i < ban_until) step.banned_token_ids = banned;
    absl::StatusOr<StepResult> result = r.Execute({&step, 1});
    CHECK(result.ok()) << result.status();
    out.tokens.push_back(result->sequences[0].token_id);
    input = {out.tokens.back()};
  }
  CHECK(r.Release("ref").ok());
  // Again, feeding the sampled tokens, greedy and unmasked: the logits the
  // model gave for each output position.
  start = 0;
  for (; prompt.size() - start > budget; start += budget) {
    SequenceStep chunk = MakeSequenceStep(
        "raw", {prompt.begin() + start, prompt.begin() + start + budget},
        start == 0 ? SequenceCreation::kMustBeNew
                   : SequenceCreation::kMustExist);
    CHECK(r.Execute({&chunk, 1}).ok());
  }
  input.assign(prompt.begin() + start, prompt.end());
  for (int i = 0; i < n; ++i) {
    SequenceStep step =
        MakeSequenceStep("raw", input,
                         i == 0 && start == 0 ? SequenceCreation::kMustBeNew
                                              : SequenceCreation::kMustExist);
    CHECK(r.Execute({&step, 1}).ok());
    std::vector<float> row;
    CHECK(r.ReadLogits(1, &row).ok());
    out.logits.push_back(std::move(row));
    input = {out.tokens[i]};
  }
  CHECK(r.Release("raw").ok());
  return out;
}

double LogSoftmax(const std::vector<float>& row, int32_t token) {
  double max = -std::numeric_limits<double>::infinity();
  for (float v : row) max = std::max<double>(max, v);
  double sum = 0;
  for (float v : row) sum += std::exp(double{v} - max);
  return row[token] - max - std::log(sum);
}

std::vector<int32_t> Ints(const Json& j) {
  std::vector<int32_t> out;
  for (const Json& v : j) out.push_back(v.get<int32_t>());
  return out;
}

class VllmEngineApiTest : public ::testing::Test {
 protected:
  static constexpr int kMaxModelLen = 128;

  void SetUp() override {
    dir_ = TmpPath("vllm_api_model");
    TinyModelOptions tiny;
    tiny.shape = TinyShape::kGqa;
    tiny.seed = 7;
    ASSERT_TRUE(WriteTinyModel(tiny, dir_).ok());
    std::ofstream(dir_ + "/tokenizer.json") << R"({"version": "1.0"})";
    options_ = server_testing::SmallRunnerOptions();
    options_.max_num_seqs = 16;
    // The reference: its own runner, eager, inline stream.
    auto none = ParseCompilationConfig(R"({"cudagraph_mode":"NONE"})");
    ASSERT_TRUE(none.ok());
    ModelRunnerOptions ref_options = options_;
    ref_options.compilation = *none;
    auto ref = ModelRunner::Create(ref_device_, dir_, ref_options);
    ASSERT_TRUE(ref.ok()) << ref.status();
    reference_ = *std::move(ref);
  }

  // Starts the worker (after the model directory is final).
  void StartWorker() {
    WorkerServerOptions server_options;
    server_options.model_dir = dir_;
    server_options.served_model_name = "tiny";
    worker_ = server_testing::StartWorker(options_, server_options, true, dir_);
    ASSERT_NE(worker_, nullptr);
  }

  Json RunClient(const Json& scenarios) {
    const std::string in = TmpPath("scenarios.json");
    const std::string out = TmpPath("results.json");
    std::ofstream(in) << scenarios.dump();
    auto client = Subprocess::Start(
        {"/usr/bin/python3", RunfilePath("tests/server/vllm_engine_client.py"),
         absl::StrCat("--target=127.0.0.1:", worker_->server->port()),
         "--scenarios=" + in, "--out=" + out},
        TmpPath("vllm_client.log"),
        {absl::StrCat("PYTHONPATH=", RunfilePath(""))});
    CHECK(client.ok()) << client.status();
    auto code = (*client)->Wait(absl::Seconds(300));
    CHECK(code.ok()) << code.status();
    EXPECT_EQ(*code, 0) << (*client)->Output();
    std::ifstream results(out);
    if (!results) return Json();
    return Json::parse(results);
  }

  std::string dir_;
  ModelRunnerOptions options_;
  CpuDevice ref_device_;
  std::unique_ptr<ModelRunner> reference_;
  std::unique_ptr<server_testing::TestWorker> worker_;
};

TEST_F(VllmEngineApiTest, AGrpcioClientDrivesEveryRpc) {
  // A stop id that first appears at output k of a greedy run, and an EOS
  // (generation_config.json) that first appears at output e of another.
  const std::vector<int32_t> stop_prompt = Prompt(9, 1);
  const Reference stop_ref = Generate(*reference_, stop_prompt, 16);
  int k = 2;
  while (std::find(stop_ref.tokens.begin(), stop_ref.tokens.begin() + k,
                   stop_ref.tokens[k]) != stop_ref.tokens.begin() + k) {
    ++k;
  }
  const std::vector<int32_t> eos_prompt = Prompt(13, 2);
  const Reference eos_ref = Generate(*reference_, eos_prompt, 16);
  int e = 1;
  while (std::find(eos_ref.tokens.begin(), eos_ref.tokens.begin() + e,
                   eos_ref.tokens[e]) != eos_ref.tokens.begin() + e) {
    ++e;
  }
  const int32_t eos = eos_ref.tokens[e];
  std::ofstream(dir_ + "/generation_config.json")
      << "{\"eos_token_id\": [" << eos << "]}";
  ASSERT_NO_FATAL_FAILURE(StartWorker());

  Json scenarios;
  Json& gen = scenarios["generate"];
  const std::vector<int> lengths = {1, 7, 30, 64, 100};
  for (size_t i = 0; i < lengths.size(); ++i) {
    for (bool stream : {false, true}) {
      gen.push_back({{"id", absl::StrCat("greedy", i, stream ? "s" : "")},
                     {"prompt", Prompt(lengths[i], 10 + i)},
                     {"stream", stream},
                     {"params", {{"temperature", 0.0}, {"max_tokens", 8}}}});
    }
  }
  // Sampling with every knob, raw logprobs with 3 alternatives.
  gen.push_back({{"id", "sampled"},
                 {"prompt", Prompt(11, 3)},
                 {"params",
                  {{"temperature", 0.8},
                   {"top_k", 40},
                   {"top_p", 0.9},
                   {"min_p", 0.02},
                   {"seed", 7},
                   {"logprobs", 3},
                   {"max_tokens", 6}}}});
  gen.push_back({{"id", "sampled_stream"},
                 {"prompt", Prompt(11, 3)},
                 {"stream", true},
                 {"params",
                  {{"temperature", 0.8},
                   {"top_k", 40},
                   {"top_p", 0.9},
                   {"min_p", 0.02},
                   {"seed", 7},
                   {"logprobs", 0},
                   {"max_tokens", 6}}}});
  // Temperature unset means 1.0 (vLLM), not greedy.
  gen.push_back({{"id", "default_temperature"},
                 {"prompt", Prompt(11, 4)},
                 {"params", {{"seed", 3}, {"max_tokens", 6}}}});
  gen.push_back({{"id", "stop_id"},
                 {"prompt", stop_prompt},
                 {"params",
                  {{"temperature", 0.0},
                   {"max_tokens", 16},
                   {"stop_token_ids", {250, stop_ref.tokens[k]}}}}});
  gen.push_back({{"id", "min_tokens"},
                 {"prompt", stop_prompt},
                 {"params",
                  {{"temperature", 0.0},
                   {"max_tokens", 16},
                   {"min_tokens", k + 3},
                   {"stop_token_ids", {stop_ref.tokens[k]}}}}});
  gen.push_back(
      {{"id", "eos"},
       {"prompt", eos_prompt},
       {"params",
        {{"temperature", 0.0}, {"max_tokens", 16}, {"ignore_eos", false}}}});
  gen.push_back({{"id", "to_max_length"},
                 {"prompt", Prompt(kMaxModelLen - 5, 5)},
                 {"params", {{"temperature", 0.0}}}});
  gen.push_back({{"id", "truncated"},
                 {"prompt", Prompt(20, 6)},
                 {"params",
                  {{"temperature", 0.0},
                   {"max_tokens", 4},
                   {"truncate_prompt_tokens", 5}}}});
  // Refusals: each names what it refuses; nothing runs.
  const std::vector<std::tuple<std::string, Json, std::string, std::string>>
      bad = {
          {"text", {{"text", "hello"}}, "INVALID_ARGUMENT", "tokenize"},
          {"no_input", Json::object(), "INVALID_ARGUMENT", "input"},
          {"empty_prompt",
           {{"prompt", Json::array()}},
           "INVALID_ARGUMENT",
           "input_ids is empty"},
          {"vocab",
           {{"prompt", {1, 256}}},
           "INVALID_ARGUMENT",
           "input_ids[1]=256"},
          {"too_long",
           {{"prompt", Prompt(kMaxModelLen, 7)}},
           "INVALID_ARGUMENT",
           "maximum length"},
          {"max_tokens_0",
           {{"prompt", {1, 2}}, {"params", {{"max_tokens", 0}}}},
           "INVALID_ARGUMENT",
           "max_tokens"},
          {"nan_temperature",
           {{"prompt", {1, 2}}, {"params", {{"temperature", "nan"}}}},
           "INVALID_ARGUMENT",
           "temperature"},
          {"top_p",
           {{"prompt", {1, 2}}, {"params", {{"top_p", 1.5}}}},
           "INVALID_ARGUMENT",
           "top_p"},
          {"min_p",
           {{"prompt", {1, 2}}, {"params", {{"min_p", 2.0}}}},
           "INVALID_ARGUMENT",
           "min_p"},
          {"frequency_penalty",
           {{"prompt", {1, 2}}, {"params", {{"frequency_penalty", 0.5}}}},
           "UNIMPLEMENTED",
           "frequency_penalty"},
          {"presence_penalty",
           {{"prompt", {1, 2}}, {"params", {{"presence_penalty", -0.5}}}},
           "UNIMPLEMENTED",
           "presence_penalty"},
          {"repetition_penalty",
           {{"prompt", {1, 2}}, {"params", {{"repetition_penalty", 1.2}}}},
           "UNIMPLEMENTED",
           "repetition_penalty"},
          {"logit_bias",
           {{"prompt", {1, 2}}, {"params", {{"logit_bias", {{"5", 2.0}}}}}},
           "UNIMPLEMENTED",
           "logit_bias"},
          {"prompt_logprobs",
           {{"prompt", {1, 2}}, {"params", {{"prompt_logprobs", 1}}}},
           "UNIMPLEMENTED",
           "prompt_logprobs"},
          {"structured",
           {{"prompt", {1, 2}}, {"params", {{"regex", "a+"}}}},
           "UNIMPLEMENTED",
           "structured output"},
          {"multimodal",
           {{"prompt", {1, 2}}, {"mm_inputs", true}},
           "UNIMPLEMENTED",
           "mm_inputs"},
          {"n",
           {{"prompt", {1, 2}}, {"params", {{"n", 2}}}},
           "INVALID_ARGUMENT",
           "n=2"},
          {"logprobs",
           {{"prompt", {1, 2}}, {"params", {{"logprobs", 21}}}},
           "INVALID_ARGUMENT",
           "logprobs=21"},
          {"dp_rank",
           {{"prompt", {1, 2}}, {"data_parallel_rank", 1}},
           "INVALID_ARGUMENT",
           "data_parallel_rank=1"},
      };
  const size_t first_bad = gen.size();
  for (const auto& [name, spec, code, message] : bad) {
    Json s = spec;
    s["id"] = "bad_" + name;
    gen.push_back(s);
  }
  for (int i = 0; i < 64; ++i) {
    scenarios["concurrent"].push_back(
        {{"id", absl::StrCat("c", i)},
         {"prompt", Prompt(3 + i % 9, 100 + i)},
         {"stream", true},
         {"params", {{"temperature", 0.0}, {"max_tokens", 6}}}});
  }
  scenarios["abort"] = {
      {"id", "aborted"},
      {"prompt", Prompt(5, 8)},
      {"stream", true},
      {"params", {{"temperature", 0.0}, {"max_tokens", 120}}}};
  scenarios["disconnect"] = {
      {"id", "gone"},
      {"prompt", Prompt(5, 9)},
      {"stream", true},
      {"params", {{"temperature", 0.0}, {"max_tokens", 120}}}};

  const Json r = RunClient(scenarios);
  ASSERT_FALSE(r.is_null());

  // Management RPCs.
  EXPECT_EQ(r["model_info"]["model_path"], dir_);
  EXPECT_EQ(r["model_info"]["served_model_name"], "tiny");
  EXPECT_EQ(r["model_info"]["vocab_size"], 256);
  EXPECT_EQ(r["model_info"]["max_context_length"], kMaxModelLen);
  EXPECT_EQ(r["model_info"]["max_req_input_len"], kMaxModelLen - 1);
  EXPECT_EQ(r["model_info"]["architectures"],
            Json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(r["model_info"]["eos_token_ids"], Json::array({eos}));
  EXPECT_TRUE(r["health"]["healthy"].get<bool>()) << r["health"];
  EXPECT_TRUE(r["tokenizer"]["sha256_ok"].get<bool>());
  EXPECT_THAT(r["tokenizer"]["names"].get<std::vector<std::string>>(),
              ElementsAreArray(
                  {"tokenizer.json", "config.json", "generation_config.json"}));
  EXPECT_EQ(r["tokenizer"]["tokenizer_json"], R"({"version": "1.0"})");
  EXPECT_EQ(r["embed"], "UNIMPLEMENTED");
  EXPECT_EQ(r["kv_events"], "UNIMPLEMENTED");
  EXPECT_EQ(r["server_info"]["server_type"], "vllm-grpc");
  EXPECT_GT(r["server_info"]["uptime_seconds"].get<double>(), 0);
  EXPECT_GT(r["server_info"]["last_receive_timestamp"].get<double>(), 1.7e9);

  const Json& g = r["generate"];
  auto find = [&](const std::string& id) -> const Json& {
    for (size_t i = 0; i < gen.size(); ++i) {
      if (gen[i]["id"] == id) return g[i];
    }
    ADD_FAILURE() << "no scenario " << id;
    return g[0];
  };

  // Greedy, both ways, equals the prompt alone step by step.
  for (size_t i = 0; i < lengths.size(); ++i) {
    const Reference ref = Generate(*reference_, Prompt(lengths[i], 10 + i), 8);
    const Json& plain = find(absl::StrCat("greedy", i));
    ASSERT_EQ(plain["code"], "OK") << plain["message"];
    EXPECT_THAT(Ints(plain["complete"]["output_ids"]),
                ElementsAreArray(ref.tokens));
    EXPECT_EQ(plain["complete"]["finish_reason"], "length");
    EXPECT_EQ(plain["complete"]["completion_tokens"], 8);
    EXPECT_EQ(plain["complete"]["prompt_tokens"], lengths[i]);
    const Json& streamed = find(absl::StrCat("greedy", i, "s"));
    ASSERT_EQ(streamed["code"], "OK") << streamed["message"];
    std::vector<int32_t> tokens;
    for (const Json& chunk : streamed["chunks"]) {
      const std::vector<int32_t> delta = Ints(chunk["token_ids"]);
      EXPECT_EQ(chunk["completion_tokens"], delta.size());
      EXPECT_EQ(chunk["prompt_tokens"], lengths[i]);
      tokens.insert(tokens.end(), delta.begin(), delta.end());
    }
    EXPECT_THAT(tokens, ElementsAreArray(ref.tokens));
    // vLLM's servicer repeats the last chunk's tokens in `complete`.
    EXPECT_EQ(streamed["complete"]["output_ids"],
              streamed["chunks"].back()["token_ids"]);
    EXPECT_EQ(streamed["complete"]["finish_reason"], "length");
  }

  // Sampling with temperature, top-k, top-p, min_p and a seed equals the
  // same draw alone; raw logprobs are the model's log_softmax.
  SamplingOptions sampling;
  sampling.temperature = 0.8f;
  sampling.top_k = 40;
  sampling.top_p = 0.9f;
  sampling.min_p = 0.02f;
  sampling.seed = 7;
  const Reference sampled_ref =
      Generate(*reference_, Prompt(11, 3), 6, sampling);
  for (const std::string id : {"sampled", "sampled_stream"}) {
    const Json& s = find(id);
    ASSERT_EQ(s["code"], "OK") << s["message"];
    std::vector<int32_t> tokens;
    std::vector<Json> logprobs;
    if (id == "sampled") {
      tokens = Ints(s["complete"]["output_ids"]);
      logprobs.push_back(s["complete"]["logprobs"]);
    } else {
      for (const Json& chunk : s["chunks"]) {
        const std::vector<int32_t> delta = Ints(chunk["token_ids"]);
        tokens.insert(tokens.end(), delta.begin(), delta.end());
        logprobs.push_back(chunk["logprobs"]);
      }
    }
    EXPECT_THAT(tokens, ElementsAreArray(sampled_ref.tokens)) << id;
    size_t t = 0;
    for (const Json& lp : logprobs) {
      for (size_t j = 0; j < lp["token_ids"].size(); ++j, ++t) {
        ASSERT_LT(t, sampled_ref.tokens.size());
        EXPECT_EQ(lp["token_ids"][j], sampled_ref.tokens[t]);
        EXPECT_NEAR(lp["token_logprobs"][j].get<double>(),
                    LogSoftmax(sampled_ref.logits[t], sampled_ref.tokens[t]),
                    1e-5)
            << id << " token " << t;
        if (id == "sampled") {
          // The 3 largest raw logits, most likely first.
          const std::vector<float>& row = sampled_ref.logits[t];
          std::vector<int32_t> order(row.size());
          for (size_t v = 0; v < order.size(); ++v) order[v] = v;
          std::stable_sort(order.begin(), order.end(),
                           [&](int a, int b) { return row[a] > row[b]; });
          const Json& top = lp["top"][j];
          ASSERT_EQ(top["token_ids"].size(), 3u);
          for (int q = 0; q < 3; ++q) {
            EXPECT_EQ(top["token_ids"][q], order[q]);
            EXPECT_NEAR(top["values"][q].get<double>(),
                        LogSoftmax(row, order[q]), 1e-5);
          }
        } else {
          EXPECT_TRUE(lp["top"].empty());  // logprobs=0: no alternatives
        }
      }
    }
    EXPECT_EQ(t, sampled_ref.tokens.size()) << id;
  }
  SamplingOptions default_temperature;
  default_temperature.temperature = 1.0f;
  default_temperature.seed = 3;
  EXPECT_THAT(
      Ints(find("default_temperature")["complete"]["output_ids"]),
      ElementsAreArray(
          Generate(*reference_, Prompt(11, 4), 6, default_temperature).tokens));

  // Stop conditions.
  const Json& stop = find("stop_id")["complete"];
  EXPECT_EQ(stop["finish_reason"], "stop");
  EXPECT_EQ(stop["matched_token_id"], stop_ref.tokens[k]);
  EXPECT_THAT(Ints(stop["output_ids"]),
              ElementsAreArray(stop_ref.tokens.begin(),
                               stop_ref.tokens.begin() + k + 1));
  // EOS is ignored there (ignore_eos): only the stop id is masked for the
  // first min_tokens samples, and only it ends the request afterwards.
  const Reference masked =
      Generate(*reference_, stop_prompt, 16, {}, {stop_ref.tokens[k]}, k + 3);
  EXPECT_NE(masked.tokens, stop_ref.tokens);  // the mask changed something
  std::vector<int32_t> expected_min;
  for (int32_t t : masked.tokens) {
    expected_min.push_back(t);
    if (static_cast<int>(expected_min.size()) > k + 3 &&
        t == stop_ref.tokens[k]) {
      break;
    }
  }
  EXPECT_THAT(Ints(find("min_tokens")["complete"]["output_ids"]),
              ElementsAreArray(expected_min));
  const Json& eos_stop = find("eos")["complete"];
  EXPECT_EQ(eos_stop["finish_reason"], "stop");
  EXPECT_TRUE(eos_stop["matched_token_id"].is_null());  // vLLM: EOS has none
  EXPECT_THAT(
      Ints(eos_stop["output_ids"]),
      ElementsAreArray(eos_ref.tokens.begin(), eos_ref.tokens.begin() + e + 1));
  const Json& to_max = find("to_max_length")["complete"];
  EXPECT_EQ(to_max["finish_reason"], "length");
  EXPECT_EQ(to_max["completion_tokens"], 5);
  const std::vector<int32_t> long_prompt = Prompt(20, 6);
  EXPECT_THAT(
      Ints(find("truncated")["complete"]["output_ids"]),
      ElementsAreArray(
          Generate(
              *reference_,
              std::vector<int32_t>(long_prompt.end() - 5, long_prompt.end()), 4)
              .tokens));
  EXPECT_EQ(find("truncated")["complete"]["prompt_tokens"], 5);

  // Refusals.
  for (size_t i = 0; i < bad.size(); ++i) {
    const auto& [name, spec, code, message] = bad[i];
    const Json& b = g[first_bad + i];
    EXPECT_EQ(b["code"], code) << name << ": " << b["message"];
    EXPECT_THAT(b["message"].get<std::string>(), HasSubstr(message)) << name;
    EXPECT_TRUE(b["chunks"].empty()) << name;
  }

  // 64 concurrent streams, each whole and right.
  ASSERT_EQ(r["concurrent"].size(), 64u);
  for (int i = 0; i < 64; ++i) {
    const Json& c = r["concurrent"][i];
    ASSERT_EQ(c["code"], "OK") << c["message"];
    std::vector<int32_t> tokens;
    for (const Json& chunk : c["chunks"]) {
      const std::vector<int32_t> delta = Ints(chunk["token_ids"]);
      tokens.insert(tokens.end(), delta.begin(), delta.end());
    }
    EXPECT_THAT(
        tokens,
        ElementsAreArray(
            Generate(*reference_, Prompt(3 + i % 9, 100 + i), 6).tokens))
        << i;
  }

  // Abort mid-stream, unknown abort, disconnect: nothing left behind.
  EXPECT_EQ(r["abort"]["finish_reason"], "abort");
  EXPECT_LT(r["abort"]["tokens"].size(), 120u);
  EXPECT_EQ(r["abort_unknown"], "NOT_FOUND");
  EXPECT_GE(r["disconnect"]["tokens_before_cancel"].get<int>(), 2);
  EXPECT_EQ(r["loads"]["num_total_reqs"], 0);
  EXPECT_EQ(r["loads"]["num_used_tokens"], 0);
  EXPECT_EQ(r["loads"]["token_usage"], 0.0);
  EXPECT_EQ(r["loads"]["dp_rank_count"], 1);
  const EngineSnapshot s = worker_->server->engine().snapshot();
  EXPECT_EQ(s.kv.used_blocks, 0);
  EXPECT_EQ(s.kv.num_sequences, 0);
  EXPECT_EQ(r["loads"]["max_total_num_tokens"],
            int64_t{s.kv.total_blocks} * options_.block_size);
}

}  // namespace
}  // namespace pdworker
