// KV cache events end to end: two workers with prefix caching publish
// vLLM-format events on ZMQ (bound ipc:// sockets, with replay) while a
// Python consumer that is not ours (pyzmq + msgpack + grpcio) follows them
// the way llm-d's indexer does. It joins after the first traffic (and
// rebuilds it through the replay socket), follows the rest live (evictions
// and a FlushCache included), checks SMG's SubscribeKvEvents carries the
// same batches, and scores probe prompts per worker by their longest stored
// prefix. Each score must equal the cached_tokens that worker then reports
// for the probe.
#include <stdlib.h>

#include <fstream>
#include <string>
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
using server_testing::Forward;
using server_testing::Input;
using server_testing::Request;
using server_testing::RunfilePath;
using server_testing::SmallRunnerOptions;
using server_testing::Subprocess;

constexpr int kBs = 4;  // SmallRunnerOptions' block size

std::string TmpPath(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
}

std::vector<int32_t> Tokens(int seed, int n) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (seed * 53 + i * 31 + 7) % 256;
  return t;
}

std::vector<int32_t> Join(std::vector<int32_t> a,
                          const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// One prompt through Forward (start, released after); its cached_tokens.
int32_t RunPrompt(server_testing::TestWorker& w, const std::string& id,
                  const std::vector<int32_t>& prompt) {
  v1::SequenceInput input = Input(id, prompt, /*start=*/true);
  input.set_release_after_step(true);
  v1::ForwardResponse response;
  const grpc::Status status = Forward(*w.stub, Request({input}), &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return response.sequences_size() == 1 ? response.sequences(0).cached_tokens()
                                        : -1;
}

TEST(KvEventsE2eTest, ARouterScoringEventsPredictsCachedTokens) {
  ModelRunnerOptions options = SmallRunnerOptions();
  options.prefix_caching = PrefixCaching::kOn;
  // 48 blocks: the traffic below evicts on worker 0.
  options.kv_cache_bytes = 48 * 1024;
  std::vector<std::unique_ptr<server_testing::TestWorker>> workers;
  Json config;
  // ipc:// paths must fit in a sockaddr_un (108 bytes): TEST_TMPDIR does
  // not.
  char sockets[] = "/tmp/pdw_kv_events_XXXXXX";
  ASSERT_NE(mkdtemp(sockets), nullptr);
  for (int i = 0; i < 2; ++i) {
    WorkerServerOptions server_options;
    KvEventPublisherOptions events;
    events.endpoint = absl::StrCat("ipc://", sockets, "/w", i, ".pub");
    events.replay_endpoint = absl::StrCat("ipc://", sockets, "/w", i, ".rep");
    events.topic = absl::StrCat("kv@w", i, "@tiny");
    // The array layout on one worker, vLLM's maps on the other.
    events.format.layout =
        i == 0 ? KvEventLayout::kTaggedMap : KvEventLayout::kPositional;
    server_options.kv_events_zmq = events;
    workers.push_back(server_testing::StartWorker(options, server_options));
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    config["workers"].push_back(
        {{"endpoint", events.endpoint},
         {"replay_endpoint", events.replay_endpoint},
         {"topic", events.topic},
         {"grpc_target",
          absl::StrCat("127.0.0.1:", workers.back()->server->port())}});
  }
  server_testing::TestWorker& w0 = *workers[0];
  server_testing::TestWorker& w1 = *workers[1];
  const std::string fingerprint = w0.Status().model_fingerprint();
  ASSERT_EQ(fingerprint, w1.Status().model_fingerprint());

  // Before the consumer joins: system prompt A on worker 0, B on worker 1.
  const std::vector<int32_t> a = Tokens(1, 40), b = Tokens(2, 24);
  for (int i = 0; i < 3; ++i) {
    RunPrompt(w0, absl::StrCat("a", i), Join(a, Tokens(10 + i, 6)));
    RunPrompt(w1, absl::StrCat("b", i), Join(b, Tokens(20 + i, 6)));
  }

  config["fingerprint"] = fingerprint;
  config["block_size"] = kBs;
  const std::vector<std::vector<int32_t>> probes = {
      Join(a, Tokens(90, 5)),              // A: worker 0 (if kept)
      Join(b, Tokens(91, 5)),              // B: flushed, then again
      Join(Tokens(3, 20), Tokens(92, 3)),  // C: worker 1 only
      Tokens(93, 30),                      // nothing
      Join(std::vector<int32_t>(a.begin(), a.begin() + 12), Tokens(94, 9)),
  };
  for (const auto& p : probes) config["probes"].push_back(p);
  const std::string config_path = TmpPath("router_config.json");
  const std::string done_path = TmpPath("traffic_done");
  const std::string out_path = TmpPath("router_out.json");
  std::ofstream(config_path) << config.dump();
  auto router = Subprocess::Start(
      {"/usr/bin/python3", RunfilePath("tests/server/kv_events_router.py"),
       "--config=" + config_path, "--done=" + done_path, "--out=" + out_path},
      TmpPath("router.log"), {absl::StrCat("PYTHONPATH=", RunfilePath(""))});
  ASSERT_TRUE(router.ok()) << router.status();
  ASSERT_TRUE((*router)->WaitForOutput("ready", absl::Seconds(60)).ok())
      << (*router)->Output();

  // Live traffic: distinct prompts through worker 0 until it evicts; B is
  // flushed from worker 1 and C cached there.
  for (int i = 0; i < 8; ++i) {
    RunPrompt(w0, absl::StrCat("x", i), Tokens(100 + i, 24));
  }
  RunPrompt(w0, "a_again", Join(a, Tokens(15, 6)));
  v1::FlushCacheResponse flushed;
  {
    grpc::ClientContext context;
    server_testing::SetGenerousDeadline(&context);
    ASSERT_TRUE(
        w1.stub->FlushCache(&context, v1::FlushCacheRequest(), &flushed).ok());
  }
  EXPECT_GT(flushed.cleared_blocks(), 0);
  RunPrompt(w1, "c", Join(Tokens(3, 20), Tokens(30, 2)));
  std::ofstream(done_path) << "done";

  auto code = (*router)->Wait(absl::Seconds(120));
  ASSERT_TRUE(code.ok()) << code.status();
  ASSERT_EQ(*code, 0) << (*router)->Output();
  std::ifstream out(out_path);
  const Json result = Json::parse(out);
  // It joined late (replayed) and followed live batches, on both workers.
  for (int i = 0; i < 2; ++i) {
    EXPECT_GT(result["replayed"][i].get<int>(), 0) << i;
    EXPECT_GT(result["live"][i].get<int>(), 0) << i;
  }

  // Routed as a cache-aware router routes (the best score; ties: worker
  // 0), each probe reports exactly the score its worker got. Only one
  // worker runs each probe: running it caches its blocks, which would
  // change the other worker's answer for later probes sharing a prefix.
  int positive = 0;
  for (size_t p = 0; p < probes.size(); ++p) {
    const int s0 = result["scores"][p][0].get<int>();
    const int s1 = result["scores"][p][1].get<int>();
    positive += (s0 > 0) + (s1 > 0);
    const int best = s1 > s0 ? 1 : 0;
    const int reported =
        RunPrompt(*workers[best], absl::StrCat("probe", p), probes[p]);
    EXPECT_EQ(reported, best == 0 ? s0 : s1) << "probe " << p;
  }
  EXPECT_GE(positive, 3);
  EXPECT_EQ(result["scores"][3], Json::array({0, 0}));
  // A was run again last on worker 0: all 10 of its blocks; worker 1 never
  // saw it. B was flushed from worker 1 (AllBlocksCleared).
  EXPECT_EQ(result["scores"][0], Json::array({40, 0}));
  EXPECT_EQ(result["scores"][1], Json::array({0, 0}));
  // C is only on worker 1 (cap: 22 tokens -> 5 blocks, all 20 shared
  // tokens).
  EXPECT_EQ(result["scores"][2], Json::array({0, 20}));
}

}  // namespace
}  // namespace pdworker
