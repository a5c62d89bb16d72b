// The pullers against a prefill worker that answers PullKv wrongly (a
// HostileKvSource over real loopback gRPC, a real paged cache on the CPU
// backend): what each refuses, and that a source predating token spans
// still hands its layer runs over. tests/fuzz/kv_stream_fuzz checks the
// invariants on arbitrary streams; these are the named cases.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/worker.grpc.pb.h"
#include "tests/transfer/hostile_kv_source.h"
#include "tests/transfer/test_kv_cache.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/runtime/cpu_device.h"
#include "worker/transfer/cuda_ipc.h"
#include "worker/transfer/cuda_ipc_puller.h"
#include "worker/transfer/grpc_kv_puller.h"
#include "worker/transfer/kv_span_staging.h"
#include "worker/transfer/peer_channels.h"

namespace pdworker {
namespace {

using ::testing::HasSubstr;

constexpr int kLayers = 2;
constexpr size_t kTokenBytes = 2 * 8 * sizeof(float);  // 2 KV heads x 8
constexpr int kBlockSize = 4;
constexpr int kNumBlocks = 8;
constexpr int kTokens = 6;

std::string Serialized(const v1::KvChunk& chunk) {
  std::string bytes;
  EXPECT_TRUE(chunk.SerializeToString(&bytes));
  return bytes;
}

v1::KvChunk Span(int first, int count, char fill) {
  v1::KvChunk c;
  c.set_chunk_layout(v1::KV_CHUNK_LAYOUT_TOKEN_SPAN);
  c.set_first_token(first);
  c.set_num_tokens(count);
  c.set_data(std::string(count * 2 * kLayers * kTokenBytes, fill));
  return c;
}

v1::KvChunk LayerRun(int layer, v1::KvChunk::Part part, int first, int count,
                     char fill) {
  v1::KvChunk c;
  c.set_layer(layer);
  c.set_part(part);
  c.set_first_token(first);
  c.set_num_tokens(count);
  c.set_data(std::string(count * kTokenBytes, fill));
  return c;
}

v1::KvChunk Export() {
  v1::KvChunk c;
  v1::CudaIpcExport* e = c.mutable_cuda_ipc();
  e->set_mem_handle(std::string(64, 'h'));
  e->set_allocation_bytes(2 * kLayers * kNumBlocks * kBlockSize * kTokenBytes);
  e->set_block_size(kBlockSize);
  e->add_blocks(0);
  e->add_blocks(1);
  e->set_num_tokens(kTokens);
  return c;
}

class HostileSourceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NE(source_->server, nullptr);
    handle_.set_source_address(source_->address);
    handle_.set_lease_id("0123456789abcdef0123456789abcdef");
    handle_.set_num_tokens(kTokens);
    destination_.blocks = {5, 2};
    destination_.num_tokens = kTokens;
  }

  KvPullParams Params(bool spans) {
    KvPullParams p;
    p.handle = &handle_;
    p.model_fingerprint = "test";
    p.view = &view_;
    p.destination = &destination_;
    p.stream = stream_.get();
    if (spans) p.span_stagings = &stagings_;
    const auto now = std::chrono::system_clock::now();
    p.call_deadline = now + std::chrono::seconds(20);
    p.pull_deadline = now + std::chrono::seconds(20);
    return p;
  }

  // Plays `chunks` then OK.
  void Answer(const std::vector<v1::KvChunk>& chunks) {
    testing::KvSourceScript script;
    for (const v1::KvChunk& c : chunks)
      script.messages.push_back(Serialized(c));
    source_->source.Set(std::move(script));
  }

  absl::Status PullGrpc(bool spans, KvPullStats* stats) {
    return PullKvOverGrpc(*peers_, Params(spans), stats);
  }

  std::unique_ptr<testing::HostileKvServer> source_ =
      testing::StartHostileKvServer();
  std::unique_ptr<PeerChannels> peers_ =
      std::make_unique<PeerChannels>(PeerTls{}, 64 << 20);
  v1::KvHandle handle_;
  CpuDevice device_;
  testing::TestKvCache cache_ = testing::MakeTestKvCache(
      device_, {kLayers, 2, 8, "float32"}, kBlockSize, kNumBlocks);
  const KvCacheView& view_ = cache_.view;
  std::unique_ptr<Stream> stream_ = *device_.CreateStream();
  SequenceKv destination_;
  KvSpanStagingPool stagings_{device_, view_, 1 << 20, /*max_idle=*/1};
};

// A CUDA IPC pull is answered with exactly one chunk, the export record: a
// second chunk, or a chunk that is not an export, is a malformed stream
// (refused before anything is mapped), not whatever the last chunk said.
TEST_F(HostileSourceTest, CudaIpcPullTakesExactlyOneExportRecord) {
  for (const auto& chunks :
       std::vector<std::vector<v1::KvChunk>>{{Export(), Export()},
                                             {Export(), Span(0, kTokens, 'x')},
                                             {Span(0, kTokens, 'x')}}) {
    Answer(chunks);
    CudaIpcMappings mappings;
    KvPullStats stats;
    const absl::Status s =
        PullKvOverCudaIpc(*peers_, mappings, Params(false), &stats);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_THAT(s.message(), HasSubstr("one export record")) << s;
    EXPECT_EQ(stats.outcome, KvTransferOutcome::kMalformedStream);
  }
}

// Token spans the puller did not ask for, spans with a gap or that mix
// layouts, are malformed streams.
TEST_F(HostileSourceTest, BadSpanStreamsAreMalformed) {
  struct Case {
    bool spans;  // the puller asked for token spans
    std::vector<v1::KvChunk> chunks;
    std::string says;
  };
  const std::vector<Case> cases = {
      {false, {Span(0, kTokens, 'a')}, "layer runs were asked for"},
      {true, {Span(0, 2, 'a'), Span(3, 3, 'b')}, "expected every layer from"},
      {true,
       {Span(0, 2, 'a'), LayerRun(0, v1::KvChunk::PART_KEY, 2, 4, 'b')},
       "in a stream of layout"},
      {true, {Span(0, kTokens + 1, 'a')}, "expected every layer from"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.says);
    Answer(c.chunks);
    KvPullStats stats;
    const absl::Status s = PullGrpc(c.spans, &stats);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.says)) << s;
    EXPECT_EQ(stats.outcome, KvTransferOutcome::kMalformedStream);
  }
}

// A source that predates token spans ignores chunk_layout and sends layer
// runs: the puller that asked for spans takes them, byte for byte.
TEST_F(HostileSourceTest, LayerRunsFromAnOlderSourceAreTaken) {
  std::vector<v1::KvChunk> runs;
  for (int layer = 0; layer < kLayers; ++layer) {
    for (const auto part : {v1::KvChunk::PART_KEY, v1::KvChunk::PART_VALUE}) {
      const char fill = static_cast<char>(
          'a' + 2 * layer + (part == v1::KvChunk::PART_KEY ? 0 : 1));
      runs.push_back(LayerRun(layer, part, 0, 4, fill));
      runs.push_back(LayerRun(layer, part, 4, 2, fill));
    }
  }
  Answer(runs);
  KvPullStats stats;
  const absl::Status s = PullGrpc(/*spans=*/true, &stats);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(stats.bytes, view_.BytesFor(kTokens));
  for (int layer = 0; layer < kLayers; ++layer) {
    for (const KvCachePart part : {KvCachePart::kKey, KvCachePart::kValue}) {
      std::string got(kTokens * kTokenBytes, '\0');
      ASSERT_TRUE(ReadKvTokens(*stream_, view_, destination_,
                               {layer, part, 0, kTokens}, got.data())
                      .ok());
      const char fill = static_cast<char>('a' + 2 * layer +
                                          (part == KvCachePart::kKey ? 0 : 1));
      EXPECT_EQ(got, std::string(kTokens * kTokenBytes, fill));
    }
  }
}

}  // namespace
}  // namespace pdworker
