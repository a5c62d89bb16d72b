// The NCCL transport between two GPUs of this machine: a source thread on
// GPU 1 (rank 1 sends) and the puller on GPU 0 (rank 0 receives), each with
// its NcclCommCache over NCCL's factory, as two workers have; a source
// cache with known bytes and a destination with another block size; the
// received tokens must be exactly the sent ones, over one communicator kept
// for both transfers. Skips without two GPUs or without NCCL.
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/runtime/device_factory.h"
#include "worker/runtime/stream.h"
#include "worker/transfer/nccl_comm_cache.h"
#include "worker/transfer/nccl_transfer.h"

namespace pdworker {
namespace {

constexpr int kLayers = 3;
constexpr size_t kTokenBytes = 8 * 64 * 2;  // 8 KV heads x 64 dims, bf16
constexpr int kTokens = 45;

struct GpuCache {
  std::unique_ptr<Device> device;
  DeviceMemory memory;
  KvCacheView view;
  SequenceKv seq;
};

absl::Status MakeCache(int ordinal, int block_size, std::vector<int32_t> blocks,
                       GpuCache* c) {
  DeviceOptions options;
  options.cuda_ordinal = ordinal;
  auto device = CreateDevice(DeviceKind::kCuda, options);
  if (!device.ok()) return device.status();
  c->device = *std::move(device);
  const int num_blocks = 8;
  const size_t part = num_blocks * block_size * kTokenBytes;
  auto memory = c->device->Allocate(part * 2 * kLayers);
  if (!memory.ok()) return memory.status();
  c->memory = *std::move(memory);
  c->view.layout = {kLayers, 8, 64, "bfloat16"};
  c->view.block_size = block_size;
  c->view.token_bytes = kTokenBytes;
  c->view.allocation = c->memory.buffer();
  for (int l = 0; l < kLayers; ++l) {
    c->view.keys.push_back(c->memory.buffer().Slice(2 * l * part, part));
    c->view.values.push_back(
        c->memory.buffer().Slice((2 * l + 1) * part, part));
  }
  c->seq.blocks = std::move(blocks);
  c->seq.num_tokens = kTokens;
  return absl::OkStatus();
}

std::vector<uint8_t> Pattern(int layer, KvCachePart part, int salt) {
  std::vector<uint8_t> bytes(kTokens * kTokenBytes);
  for (size_t i = 0; i < bytes.size(); ++i) {
    bytes[i] = static_cast<uint8_t>(i * 13 + layer * 7 + salt +
                                    (part == KvCachePart::kKey ? 0 : 91));
  }
  return bytes;
}

// NCCL's factory, counting joins (one per rank per communicator made).
class CountingFactory final : public NcclCommFactory {
 public:
  absl::StatusOr<std::string> NewUniqueId() override {
    return nccl_->NewUniqueId();
  }
  absl::StatusOr<std::unique_ptr<NcclComm>> Join(
      const std::string& unique_id, NcclRank rank,
      const NcclWait& wait) override {
    ++joins_;
    return nccl_->Join(unique_id, rank, wait);
  }
  int joins() const { return joins_.load(); }

 private:
  const std::unique_ptr<NcclCommFactory> nccl_ = NewNcclCommFactory();
  std::atomic<int> joins_{0};
};

// Skips (returns false) without two GPUs or without NCCL.
bool HaveTwoGpusWithNccl() {
  auto probe = CreateDevice(DeviceKind::kCuda);
  if (!probe.ok() || !NcclTransportAvailable(**probe)) return false;
  DeviceOptions second;
  second.cuda_ordinal = 1;
  return CreateDevice(DeviceKind::kCuda, second).ok();
}

absl::Status WritePattern(GpuCache& c, int salt) {
  auto stream = c.device->CreateStream();
  if (!stream.ok()) return stream.status();
  for (int l = 0; l < kLayers; ++l) {
    for (KvCachePart part : {KvCachePart::kKey, KvCachePart::kValue}) {
      const std::vector<uint8_t> bytes = Pattern(l, part, salt);
      absl::Status w = WriteKvTokens(**stream, c.view, c.seq,
                                     {l, part, 0, kTokens}, bytes.data());
      if (!w.ok()) return w;
    }
  }
  return (*stream)->Synchronize();
}

NcclKvParams ParamsFor(GpuCache& c, int first_token,
                       std::chrono::steady_clock::time_point deadline) {
  NcclKvParams p;
  p.device = c.device.get();
  p.view = &c.view;
  p.seq = &c.seq;
  p.num_tokens = kTokens;
  p.first_token = first_token;
  p.deadline = deadline;
  return p;
}

// Two pulls over one pair, as PullKvOverNccl and PullKv do them: the
// first makes the communicator (both ranks join), the second reuses it
// (the puller names its generation, no unique id, nobody joins again) and
// moves only the tokens from first_token on.
TEST(NcclTransferGpuTest, TwoTransfersReuseOneCommunicator) {
  if (!HaveTwoGpusWithNccl()) GTEST_SKIP() << "needs two GPUs and NCCL";
  GpuCache src;
  ASSERT_TRUE(MakeCache(1, 16, {3, 0, 5}, &src).ok());
  GpuCache dst;
  ASSERT_TRUE(MakeCache(0, 8, {7, 1, 2, 6, 4, 0}, &dst).ok());
  CountingFactory nccl;
  NcclCommCache source_comms(nccl, 2);
  NcclCommCache puller_comms(nccl, 2);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(60);

  for (const int first_token : {0, 20}) {
    SCOPED_TRACE(first_token);
    ASSERT_TRUE(WritePattern(src, first_token).ok());
    absl::StatusOr<NcclCommCache::Lease> pull =
        puller_comms.Acquire("gpu1-worker:50051", "epoch", deadline);
    ASSERT_TRUE(pull.ok()) << pull.status();
    EXPECT_EQ(pull->joined(), first_token != 0);
    const int64_t generation = pull->generation();
    const std::string unique_id = pull->joined() ? "" : pull->unique_id();
    auto sent = std::async(std::launch::async, [&]() -> absl::Status {
      absl::StatusOr<NcclCommCache::Lease> serve =
          source_comms.Open("gpu0-worker", generation, unique_id);
      if (!serve.ok()) return serve.status();
      return NcclSendKv(ParamsFor(src, first_token, deadline), *serve);
    });
    const absl::Status received =
        NcclRecvKv(ParamsFor(dst, first_token, deadline), *pull);
    const absl::Status sent_status = sent.get();
    ASSERT_TRUE(sent_status.ok()) << sent_status;
    ASSERT_TRUE(received.ok()) << received;

    auto stream = dst.device->CreateStream();
    ASSERT_TRUE(stream.ok());
    for (int l = 0; l < kLayers; ++l) {
      for (KvCachePart part : {KvCachePart::kKey, KvCachePart::kValue}) {
        const int n = kTokens - first_token;
        std::vector<uint8_t> got(n * kTokenBytes);
        ASSERT_TRUE(ReadKvTokens(**stream, dst.view, dst.seq,
                                 {l, part, first_token, n}, got.data())
                        .ok());
        const std::vector<uint8_t> want = Pattern(l, part, first_token);
        EXPECT_EQ(got,
                  std::vector<uint8_t>(want.begin() + first_token * kTokenBytes,
                                       want.end()))
            << "layer " << l;
      }
    }
  }
  EXPECT_EQ(nccl.joins(), 2);  // one communicator, both ranks, once
  EXPECT_EQ(source_comms.size(), 1);
  EXPECT_EQ(puller_comms.size(), 1);
}

// After a good transfer, the source stops sending (it died): the puller's
// receive on the kept communicator gives up at its deadline (the
// communicator is aborted, which stops the waiting kernel) and the pair is
// dropped, so the next pull makes a new one.
TEST(NcclTransferGpuTest, SilentPeerOnAKeptCommunicatorFailsAtTheDeadline) {
  if (!HaveTwoGpusWithNccl()) GTEST_SKIP() << "needs two GPUs and NCCL";
  GpuCache src;
  ASSERT_TRUE(MakeCache(1, 16, {3, 0, 5}, &src).ok());
  GpuCache dst;
  ASSERT_TRUE(MakeCache(0, 8, {7, 1, 2, 6, 4, 0}, &dst).ok());
  ASSERT_TRUE(WritePattern(src, 0).ok());
  CountingFactory nccl;
  NcclCommCache source_comms(nccl, 2);
  NcclCommCache puller_comms(nccl, 2);
  const auto far = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  {
    absl::StatusOr<NcclCommCache::Lease> pull =
        puller_comms.Acquire("gpu1-worker:50051", "epoch", far);
    ASSERT_TRUE(pull.ok());
    const std::string unique_id = pull->unique_id();
    const int64_t generation = pull->generation();
    auto sent = std::async(std::launch::async, [&]() -> absl::Status {
      absl::StatusOr<NcclCommCache::Lease> serve =
          source_comms.Open("gpu0-worker", generation, unique_id);
      if (!serve.ok()) return serve.status();
      return NcclSendKv(ParamsFor(src, 0, far), *serve);
    });
    ASSERT_TRUE(NcclRecvKv(ParamsFor(dst, 0, far), *pull).ok());
    ASSERT_TRUE(sent.get().ok());
  }
  const auto start = std::chrono::steady_clock::now();
  {
    absl::StatusOr<NcclCommCache::Lease> pull =
        puller_comms.Acquire("gpu1-worker:50051", "epoch", far);
    ASSERT_TRUE(pull.ok());
    ASSERT_TRUE(pull->joined());
    const absl::Status received =
        NcclRecvKv(ParamsFor(dst, 0, start + std::chrono::seconds(2)), *pull);
    EXPECT_EQ(received.code(), absl::StatusCode::kUnavailable) << received;
    EXPECT_FALSE(pull->joined());
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(puller_comms.size(), 0);
}

// A peer that never joins: the receive gives up at its deadline and the
// half-made pair is not kept.
TEST(NcclTransferGpuTest, AbsentPeerFailsAtTheDeadline) {
  {
    auto probe = CreateDevice(DeviceKind::kCuda);
    if (!probe.ok()) GTEST_SKIP() << "no GPU: " << probe.status();
    if (!NcclTransportAvailable(**probe)) GTEST_SKIP() << "built without NCCL";
  }
  GpuCache dst;
  ASSERT_TRUE(MakeCache(0, 8, {7, 1, 2, 6, 4, 0}, &dst).ok());
  CountingFactory nccl;
  NcclCommCache puller_comms(nccl, 2);
  const auto start = std::chrono::steady_clock::now();
  {
    absl::StatusOr<NcclCommCache::Lease> pull = puller_comms.Acquire(
        "gone:50051", "epoch", start + std::chrono::seconds(60));
    ASSERT_TRUE(pull.ok()) << pull.status();
    const absl::Status received =
        NcclRecvKv(ParamsFor(dst, 0, start + std::chrono::seconds(2)), *pull);
    EXPECT_EQ(received.code(), absl::StatusCode::kUnavailable) << received;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(puller_comms.size(), 0);
}

}  // namespace
}  // namespace pdworker
