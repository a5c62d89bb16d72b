// A gRPC pull that fails after it queued writes into the destination
// blocks (a source whose stream turns malformed half way) returns only once
// those writes have run: the importer frees the blocks right after, and the
// engine may hand them to another sequence at its next step. The puller's
// stream is a threaded CPU stream held by a gate, so the writes are surely
// still queued when the malformed chunk arrives.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "proto/worker.grpc.pb.h"
#include "tests/transfer/hostile_kv_source.h"
#include "tests/transfer/test_kv_cache.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/runtime/cpu_device.h"
#include "worker/runtime/testing/stream_gate.h"
#include "worker/transfer/grpc_kv_puller.h"
#include "worker/transfer/peer_channels.h"

namespace pdworker {
namespace {

constexpr int kLayers = 2;
constexpr size_t kTokenBytes = 2 * 8 * sizeof(float);  // 2 KV heads x 8
constexpr int kBlockSize = 4;
constexpr int kNumBlocks = 8;
constexpr int kTokens = 6;

std::string LayerRun(int first, int count, char fill) {
  v1::KvChunk c;
  c.set_layer(0);
  c.set_part(v1::KvChunk::PART_KEY);
  c.set_first_token(first);
  c.set_num_tokens(count);
  c.set_data(std::string(count * kTokenBytes, fill));
  std::string bytes;
  EXPECT_TRUE(c.SerializeToString(&bytes));
  return bytes;
}

CpuDeviceOptions ThreadedStreams() {
  CpuDeviceOptions options;
  options.stream_execution = CpuStreamExecution::kThreaded;
  return options;
}

TEST(FailedPullTest, LayerRunWritesHaveRunWhenAMalformedPullReturns) {
  auto source = testing::StartHostileKvServer();
  ASSERT_NE(source->server, nullptr);
  // Layer 0's K for tokens [0, 4), then a chunk that repeats token 0 where
  // token 4 must come: malformed after one write was queued.
  testing::KvSourceScript script;
  script.messages = {LayerRun(0, 4, 'a'), LayerRun(0, 2, 'b')};
  source->source.Set(std::move(script));

  CpuDevice device(ThreadedStreams());
  testing::TestKvCache cache = testing::MakeTestKvCache(
      device, {kLayers, 2, 8, "float32"}, kBlockSize, kNumBlocks);
  std::unique_ptr<Stream> stream = *device.CreateStream();
  PeerChannels peers(PeerTls{}, 64 << 20);
  v1::KvHandle handle;
  handle.set_source_address(source->address);
  handle.set_lease_id("0123456789abcdef0123456789abcdef");
  handle.set_num_tokens(kTokens);
  SequenceKv destination;
  destination.blocks = {5, 2};
  destination.num_tokens = kTokens;
  KvPullParams p;
  p.handle = &handle;
  p.model_fingerprint = "test";
  p.view = &cache.view;
  p.destination = &destination;
  p.stream = stream.get();
  const auto now = std::chrono::system_clock::now();
  p.call_deadline = now + std::chrono::seconds(20);
  p.pull_deadline = now + std::chrono::seconds(20);

  testing::Gate gate;
  std::atomic<bool> held{true};
  ASSERT_TRUE(stream
                  ->Launch("hold",
                           [&](const OpContext&) {
                             gate.Wait();
                             held.store(false);
                           })
                  .ok());
  // Opens once the pull has surely queued its write and read the bad chunk.
  testing::DelayedOpener opener(gate, std::chrono::milliseconds(500));
  KvPullStats stats;
  const absl::Status pulled = PullKvOverGrpc(peers, p, &stats);
  EXPECT_EQ(pulled.code(), absl::StatusCode::kInternal) << pulled;
  EXPECT_EQ(stats.outcome, KvTransferOutcome::kMalformedStream);
  EXPECT_FALSE(held.load());
}

}  // namespace
}  // namespace pdworker
