// Prefix-aware routing (Router with route_by_prefix): two real workers with
// prefix caching publish vLLM-format KV events on ZMQ (bound ipc:// sockets
// with replay), the router's PrefixIndex follows them, and each prompt goes
// to the worker holding its longest prefix, ties to the least loaded. The
// worker's own cached_tokens confirms every prediction. A unit part feeds
// the index hand-made batches from a ZMQ PUB and checks the scoring against
// BlockHasher.
#include <stdlib.h>

#include <chrono>
#include <functional>
#include <memory>
#include <msgpack.hpp>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/router/router_test_util.h"
#include "tests/server/server_test_util.h"
#include "tools/router/prefix_index.h"
#include "tools/router/router.h"
#include "worker/kv_cache/block_hash.h"

namespace pdworker::router {
namespace {

using router_testing::Address;
using router_testing::Prompt;
using server_testing::TestWorker;

constexpr int kBs = 4;  // SmallRunnerOptions' block size

// Polls `done` for up to 10 s.
bool WaitUntil(const std::function<bool()>& done) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

std::vector<int32_t> Join(std::vector<int32_t> a,
                          const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A directory for ipc:// sockets: a sockaddr_un holds 108 bytes, and
// TEST_TMPDIR paths are longer.
std::string SocketDir() {
  char dir[] = "/tmp/pdw_prefix_route_XXXXXX";
  EXPECT_NE(mkdtemp(dir), nullptr);
  return dir;
}

// ---- the index against hand-made events ----

// One batch [ts, events, 0]; each event {"type", "block_hashes"} as a map,
// or ["type", hashes] when `array`.
std::string Batch(
    const std::vector<std::pair<std::string, std::vector<uint64_t>>>& events,
    bool array) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_array(3);
  pk.pack_double(1.5);
  pk.pack_array(static_cast<uint32_t>(events.size()));
  for (const auto& [type, hashes] : events) {
    if (array) {
      pk.pack_array(2);
      pk.pack(type);
      pk.pack(hashes);
    } else {
      pk.pack_map(2);
      pk.pack(std::string("type"));
      pk.pack(type);
      pk.pack(std::string("block_hashes"));
      pk.pack(hashes);
    }
  }
  pk.pack(0);
  return std::string(buffer.data(), buffer.size());
}

TEST(PrefixIndexTest, ScoresTheLongestHeldPrefixFromEvents) {
  const std::string dir = SocketDir();
  zmq::context_t context(1);
  zmq::socket_t pub(context, zmq::socket_type::pub);
  pub.set(zmq::sockopt::linger, 0);
  const std::string endpoint = absl::StrCat("ipc://", dir, "/pub");
  pub.bind(endpoint);
  auto index = PrefixIndex::Create({{"w", {endpoint, ""}}});
  ASSERT_TRUE(index.ok()) << index.status();
  const std::string fingerprint(64, 'a');
  (*index)->SetModel("w", fingerprint, kBs, /*prefix_caching=*/true);

  const BlockHasher hasher(fingerprint, kBs);
  const std::vector<int32_t> prompt = Prompt(30, 7);  // 7 full blocks
  std::vector<BlockHash> digests;
  hasher.HashFullBlocks(prompt, &digests);
  std::vector<uint64_t> hashes;
  for (const BlockHash& d : digests) hashes.push_back(BlockHasher::External(d));

  uint64_t seq = 0;
  auto publish = [&](const std::string& payload) {
    uint8_t be[8];
    for (int i = 0; i < 8; ++i)
      be[i] = static_cast<uint8_t>(seq >> (56 - 8 * i));
    ++seq;
    pub.send(zmq::buffer(std::string("kv")), zmq::send_flags::sndmore);
    pub.send(zmq::buffer(be, 8), zmq::send_flags::sndmore);
    pub.send(zmq::buffer(payload), zmq::send_flags::none);
  };
  // Blocks 0..4 stored (repeated until the SUB is connected: no replay).
  const std::string stored =
      Batch({{"BlockStored", {hashes.begin(), hashes.begin() + 5}}}, false);
  ASSERT_TRUE(WaitUntil([&] {
    publish(stored);
    return (*index)->NumBatches("w") > 0;
  }));
  // More copies of `stored` may still be on their way, and one arriving
  // after the removal below would count as its batch (seen once in CI) and
  // store block 2 again. One PUB to one SUB keeps order: once a marker sent
  // after them has arrived, so have they.
  constexpr uint64_t kMarker = 12345;  // no block of the prompt
  publish(Batch({{"BlockStored", {kMarker}}}, false));
  ASSERT_TRUE(WaitUntil([&] { return (*index)->NumBlocks("w") == 6; }));
  EXPECT_EQ((*index)->LongestPrefixTokens("w", prompt), 5 * kBs);
  // Capped at (n - 1) / block_size blocks: 20 tokens may hit 4 blocks.
  EXPECT_EQ((*index)->LongestPrefixTokens(
                "w", std::vector<int32_t>(prompt.begin(), prompt.begin() + 20)),
            4 * kBs);
  // Another salt, block size, or unknown worker: nothing.
  EXPECT_EQ((*index)->LongestPrefixTokens("other", prompt), 0);

  // Block 2 removed (array layout): the prefix ends before it.
  const int64_t before = (*index)->NumBatches("w");
  publish(Batch({{"BlockRemoved", {hashes[2]}}}, /*array=*/true));
  ASSERT_TRUE(WaitUntil([&] { return (*index)->NumBatches("w") > before; }));
  EXPECT_EQ((*index)->LongestPrefixTokens("w", prompt), 2 * kBs);
  (*index)->SetModel("w", std::string(64, 'b'), kBs, true);
  EXPECT_EQ((*index)->LongestPrefixTokens("w", prompt), 0);
  (*index)->SetModel("w", fingerprint, kBs, /*prefix_caching=*/false);
  EXPECT_EQ((*index)->LongestPrefixTokens("w", prompt), 0);
  (*index)->SetModel("w", fingerprint, kBs, true);

  publish(Batch({{"AllBlocksCleared", {}}}, false));
  ASSERT_TRUE(WaitUntil([&] { return (*index)->NumBlocks("w") == 0; }));
  EXPECT_EQ((*index)->LongestPrefixTokens("w", prompt), 0);
}

TEST(PrefixIndexTest, ParsesEndpointFlags) {
  std::map<std::string, KvEventEndpoints> out;
  ASSERT_TRUE(
      ParseKvEventEndpoints("a:1=tcp://a:5557,b:1=tcp://b:5557", false, &out)
          .ok());
  ASSERT_TRUE(ParseKvEventEndpoints("a:1=tcp://a:5558", true, &out).ok());
  EXPECT_EQ(out["a:1"].endpoint, "tcp://a:5557");
  EXPECT_EQ(out["a:1"].replay_endpoint, "tcp://a:5558");
  EXPECT_EQ(out["b:1"].replay_endpoint, "");
  EXPECT_FALSE(ParseKvEventEndpoints("a:1", false, &out).ok());
  EXPECT_FALSE(ParseKvEventEndpoints("a:1=x", false, &out).ok());  // twice
}

// ---- the router over real workers ----

// Forward with start and no release: a live sequence that holds KV.
void StartLive(TestWorker& w, const std::string& id,
               const std::vector<int32_t>& prompt) {
  v1::ForwardResponse response;
  const grpc::Status status = server_testing::Forward(
      *w.stub,
      server_testing::Request({server_testing::Input(id, prompt, true)}),
      &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
}

TEST(PrefixRoutingTest, RoutesToTheLongestCachedPrefixTiesByLoad) {
  const std::string dir = SocketDir();
  ModelRunnerOptions options = router_testing::RunnerOptions(Role::kBoth);
  options.prefix_caching = PrefixCaching::kOn;
  std::vector<std::unique_ptr<TestWorker>> workers;
  RouterOptions router_options;
  router_options.route_by_prefix = true;
  for (int i = 0; i < 2; ++i) {
    WorkerServerOptions server_options;
    KvEventPublisherOptions events;
    events.endpoint = absl::StrCat("ipc://", dir, "/w", i, ".pub");
    events.replay_endpoint = absl::StrCat("ipc://", dir, "/w", i, ".rep");
    events.topic = absl::StrCat("kv@w", i, "@tiny");
    server_options.kv_events_zmq = events;
    workers.push_back(server_testing::StartWorker(options, server_options));
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    router_options.aggregated_addresses.push_back(Address(*workers.back()));
    router_options.kv_events[Address(*workers.back())] = {
        events.endpoint, events.replay_endpoint};
  }
  TestWorker& w0 = *workers[0];
  const std::string a0 = Address(*workers[0]), a1 = Address(*workers[1]);
  // w0 is the loaded one: a live 64-token sequence (16 blocks) of prompt H,
  // started before the router exists, so its first pick sees it.
  const std::vector<int32_t> h = Prompt(64, 50);
  StartLive(w0, "hog", h);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());

  auto created = Router::Create(router_options);
  ASSERT_TRUE(created.ok()) << created.status();
  Router& router = **created;
  PrefixIndex& index = *router.prefix_index();
  // The index learns H (through replay: it joined after H was stored).
  ASSERT_TRUE(WaitUntil([&] { return index.NumBlocks(a0) >= 16; }));

  int next_id = 0;
  auto generate = [&](const std::vector<int32_t>& prompt) {
    GenerationRequest request;
    request.request_id = absl::StrCat("r", next_id++);
    request.prompt = prompt;
    request.max_tokens = 2;
    absl::StatusOr<GenerationResult> result = router.Generate(request);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : GenerationResult();
  };

  // Nothing shared: the least loaded (w1), nothing predicted or cached.
  GenerationResult r = generate(Prompt(30, 1));
  EXPECT_EQ(r.prefill_address, a1);
  EXPECT_EQ(r.predicted_cached_tokens, 0);
  EXPECT_EQ(r.cached_tokens, 0);

  // System prompt A (40 tokens = 10 blocks): by load to w1 first, then
  // every A request follows its cache there.
  const std::vector<int32_t> a = Prompt(40, 2);
  r = generate(Join(a, Prompt(6, 10)));
  EXPECT_EQ(r.prefill_address, a1);
  ASSERT_TRUE(WaitUntil(
      [&] { return index.LongestPrefixTokens(a1, Join(a, {1})) == 40; }));
  for (int i = 0; i < 3; ++i) {
    r = generate(Join(a, Prompt(6, 11 + i)));
    EXPECT_EQ(r.prefill_address, a1) << i;
    EXPECT_EQ(r.predicted_cached_tokens, 40) << i;
    EXPECT_EQ(r.cached_tokens, 40) << i;
  }

  // H's prefix wins over load: w0 holds it (and is still the busier one).
  r = generate(
      Join(std::vector<int32_t>(h.begin(), h.begin() + 32), Prompt(5, 12)));
  EXPECT_EQ(r.prefill_address, a0);
  EXPECT_EQ(r.predicted_cached_tokens, 32);
  EXPECT_EQ(r.cached_tokens, 32);

  // FlushCache on w1: the index drops its hashes (AllBlocksCleared), and
  // the next A request is routed by load alone, predicting nothing. (Which
  // worker load picks depends on whether the pool's 50 ms status cache
  // refreshed since the placements above, so it is not asserted.)
  {
    grpc::ClientContext context;
    server_testing::SetGenerousDeadline(&context);
    v1::FlushCacheResponse flushed;
    ASSERT_TRUE(
        workers[1]
            ->stub->FlushCache(&context, v1::FlushCacheRequest(), &flushed)
            .ok());
  }
  ASSERT_TRUE(WaitUntil([&] { return index.NumBlocks(a1) == 0; }));
  r = generate(Join(a, Prompt(6, 20)));
  EXPECT_EQ(r.predicted_cached_tokens, 0);
  EXPECT_EQ(r.cached_tokens, 0);

  v1::ReleaseResponse released;
  grpc::ClientContext context;
  server_testing::SetGenerousDeadline(&context);
  v1::ReleaseRequest release;
  release.add_sequence_ids("hog");
  ASSERT_TRUE(w0.stub->Release(&context, release, &released).ok());
}

}  // namespace
}  // namespace pdworker::router
