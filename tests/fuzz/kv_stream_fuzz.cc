// Fuzz target: the KV stream a prefill worker sends a decode worker
// (PullKv's KvChunk messages over the gRPC transport), from a hostile or
// broken source. A real gRPC server on loopback plays the source: it
// writes whatever messages the input holds (not necessarily KvChunks) and
// ends with the input's status; the real puller (PullKvOverGrpc) writes
// them into a real paged KV cache on the CPU backend.
//
// Whatever the source sends, the puller
//   - writes only into the destination's blocks, and never into the tokens
//     before first_token (a prefix-cache hit the puller already holds);
//   - succeeds only for a stream that carried every token it expected.
//
// Input: [num_tokens][first_token][block order][status code, bit 7: the
// puller asks for token spans][message length][message] then messages,
// each [length: 2 bytes][bytes].
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "glog/logging.h"
#include "proto/worker.grpc.pb.h"
#include "tests/transfer/hostile_kv_source.h"
#include "tests/transfer/test_kv_cache.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/runtime/cpu_device.h"
#include "worker/transfer/grpc_kv_puller.h"
#include "worker/transfer/kv_span_staging.h"
#include "worker/transfer/peer_channels.h"

namespace pdworker {
namespace {

constexpr int kLayers = 2;
constexpr size_t kTokenBytes = 2 * 8 * sizeof(float);  // 2 KV heads x 8
constexpr int kBlockSize = 4;
constexpr int kNumBlocks = 16;
constexpr uint8_t kUntouched = 0xA5;

struct Harness {
  std::unique_ptr<testing::HostileKvServer> source =
      testing::StartHostileKvServer();
  std::unique_ptr<PeerChannels> peers =
      std::make_unique<PeerChannels>(PeerTls{}, 64 << 20);
  CpuDevice device;
  testing::TestKvCache cache = testing::MakeTestKvCache(
      device, {kLayers, 2, 8, "float32"}, kBlockSize, kNumBlocks);
  const KvCacheView& view = cache.view;
  DeviceMemory& memory = cache.memory;
  std::unique_ptr<Stream> stream = *device.CreateStream();
  // Starts at 3 tokens' spans: a source's larger chunks grow it.
  KvSpanStagingPool span_stagings{device, view, 3 * 2 * kLayers* kTokenBytes,
                                  1};

  Harness() { CHECK(source->server != nullptr); }
};

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t Byte() { return at_ < size_ ? data_[at_++] : 0; }
  std::string Take(size_t n) {
    n = std::min(n, size_ - at_);
    std::string out(reinterpret_cast<const char*>(data_ + at_), n);
    at_ += n;
    return out;
  }
  bool empty() const { return at_ >= size_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

// Whether token `t` of `seq` is kUntouched in every layer part.
bool TokenUntouched(const Harness& h, const SequenceKv& seq, int32_t t) {
  const size_t offset =
      (static_cast<size_t>(seq.blocks[t / kBlockSize]) * kBlockSize +
       t % kBlockSize) *
      kTokenBytes;
  for (int l = 0; l < kLayers; ++l) {
    for (const DeviceBuffer& part : {h.view.keys[l], h.view.values[l]}) {
      const uint8_t* row = part.as<uint8_t>() + offset;
      for (size_t i = 0; i < kTokenBytes; ++i) {
        if (row[i] != kUntouched) return false;
      }
    }
  }
  return true;
}

}  // namespace
}  // namespace pdworker

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pdworker;
  static Harness* h = new Harness;
  Reader in(data, size);
  const int32_t num_tokens = in.Byte() % 32 + 1;
  const int32_t first_token = in.Byte() % num_tokens;
  // The destination: ceil(num_tokens / 4) of the 16 blocks, in an order
  // the input picks (block tables are not sorted).
  std::vector<int32_t> blocks(kNumBlocks);
  std::iota(blocks.begin(), blocks.end(), 0);
  const uint8_t order = in.Byte();
  std::rotate(blocks.begin(), blocks.begin() + order % kNumBlocks,
              blocks.end());
  if (order & 0x80) std::reverse(blocks.begin(), blocks.end());
  blocks.resize((num_tokens + kBlockSize - 1) / kBlockSize);
  SequenceKv destination;
  destination.blocks = blocks;
  destination.num_tokens = num_tokens;

  testing::KvSourceScript script;
  // Bit 7: the puller asks for token spans (it has a staging pool); the
  // source may still send layer runs, as one that predates spans does.
  const uint8_t code_byte = in.Byte();
  const bool spans = (code_byte & 0x80) != 0;
  const auto code = static_cast<grpc::StatusCode>((code_byte & 0x7f) % 17);
  const std::string message = in.Take(in.Byte());
  script.status =
      grpc::Status(code, code == grpc::StatusCode::OK ? "" : message);
  while (!in.empty()) {
    const size_t n = in.Byte() | (size_t{in.Byte()} << 8);
    script.messages.push_back(in.Take(n));
  }
  h->source->source.Set(std::move(script));

  std::memset(h->memory.data(), kUntouched, h->memory.size_bytes());
  v1::KvHandle handle;
  handle.set_source_address(h->source->address);
  handle.set_lease_id("0123456789abcdef0123456789abcdef");
  handle.set_num_tokens(num_tokens);
  KvPullParams params;
  params.handle = &handle;
  params.model_fingerprint = "fuzz";
  params.view = &h->view;
  params.destination = &destination;
  params.first_token = first_token;
  params.stream = h->stream.get();
  if (spans) params.span_stagings = &h->span_stagings;
  const auto now = std::chrono::system_clock::now();
  params.call_deadline = now + std::chrono::seconds(20);
  params.pull_deadline = now + std::chrono::seconds(20);
  KvPullStats stats;
  const absl::Status pulled = PullKvOverGrpc(*h->peers, params, &stats);
  // PDW_FUZZ_VERBOSE=1: what each input got (to see which seeds pass).
  static const bool verbose = std::getenv("PDW_FUZZ_VERBOSE") != nullptr;
  if (verbose)
    LOG(INFO) << "pull: " << pulled << ", " << stats.bytes << " bytes";
  CHECK(pulled.ok() == (stats.outcome == KvTransferOutcome::kOk)) << pulled;
  if (!pulled.ok()) CHECK(!pulled.message().empty());
  // Success means every token [first_token, num_tokens) of every layer's K
  // and V arrived, once.
  if (pulled.ok()) {
    CHECK_EQ(stats.bytes, h->view.BytesFor(num_tokens - first_token));
  }

  // Nothing outside the destination's blocks was written...
  std::vector<bool> ours(kNumBlocks, false);
  for (const int32_t b : blocks) ours[b] = true;
  const size_t block_bytes = kBlockSize * kTokenBytes;
  for (int l = 0; l < kLayers; ++l) {
    for (const DeviceBuffer& part : {h->view.keys[l], h->view.values[l]}) {
      for (int b = 0; b < kNumBlocks; ++b) {
        if (ours[b]) continue;
        const uint8_t* p = part.as<uint8_t>() + b * block_bytes;
        CHECK(std::all_of(p, p + block_bytes,
                          [](uint8_t v) { return v == kUntouched; }))
            << "the pull wrote into block " << b << ", not the destination's";
      }
    }
  }
  // ...nor into the tokens the puller already had.
  for (int32_t t = 0; t < first_token; ++t) {
    CHECK(TokenUntouched(*h, destination, t))
        << "the pull overwrote token " << t << " < first_token " << first_token;
  }
  return 0;
}
