// The NCCL transport between two GPUs of this machine: one thread per GPU
// (rank 0 receives, rank 1 sends), a source cache with known bytes and a
// destination with another block size; the received tokens must be exactly
// the sent ones. Skips without two GPUs or without NCCL.
#include <future>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "worker/runtime/device_factory.h"
#include "worker/runtime/stream.h"
#include "worker/transfer/kv_cache_view.h"
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

std::vector<uint8_t> Pattern(int layer, KvCachePart part) {
  std::vector<uint8_t> bytes(kTokens * kTokenBytes);
  for (size_t i = 0; i < bytes.size(); ++i) {
    bytes[i] = static_cast<uint8_t>(i * 13 + layer * 7 +
                                    (part == KvCachePart::kKey ? 0 : 91));
  }
  return bytes;
}

TEST(NcclTransferGpuTest, SendsEveryTokenBetweenTwoGpus) {
  {
    auto probe = CreateDevice(DeviceKind::kCuda);
    if (!probe.ok()) GTEST_SKIP() << "no GPU: " << probe.status();
    if (!NcclTransportAvailable(**probe)) GTEST_SKIP() << "built without NCCL";
  }
  DeviceOptions second;
  second.cuda_ordinal = 1;
  if (!CreateDevice(DeviceKind::kCuda, second).ok()) {
    GTEST_SKIP() << "needs two GPUs";
  }
  absl::StatusOr<std::string> id = NewNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(60);

  auto sender = std::async(std::launch::async, [&]() -> absl::Status {
    GpuCache src;
    absl::Status made = MakeCache(1, 16, {3, 0, 5}, &src);
    if (!made.ok()) return made;
    auto stream = src.device->CreateStream();
    if (!stream.ok()) return stream.status();
    for (int l = 0; l < kLayers; ++l) {
      for (KvCachePart part : {KvCachePart::kKey, KvCachePart::kValue}) {
        const std::vector<uint8_t> bytes = Pattern(l, part);
        absl::Status w = WriteKvTokens(**stream, src.view, src.seq,
                                       {l, part, 0, kTokens}, bytes.data());
        if (!w.ok()) return w;
      }
    }
    if (absl::Status s = (*stream)->Synchronize(); !s.ok()) return s;
    NcclKvParams p{src.device.get(), &src.view, &src.seq,
                   kTokens,          *id,       deadline};
    return NcclSendKv(p);
  });
  GpuCache dst;
  ASSERT_TRUE(MakeCache(0, 8, {7, 1, 2, 6, 4, 0}, &dst).ok());
  NcclKvParams p{dst.device.get(), &dst.view, &dst.seq, kTokens, *id, deadline};
  const absl::Status received = NcclRecvKv(p);
  const absl::Status sent = sender.get();
  ASSERT_TRUE(sent.ok()) << sent;
  ASSERT_TRUE(received.ok()) << received;

  auto stream = dst.device->CreateStream();
  ASSERT_TRUE(stream.ok());
  for (int l = 0; l < kLayers; ++l) {
    for (KvCachePart part : {KvCachePart::kKey, KvCachePart::kValue}) {
      std::vector<uint8_t> got(kTokens * kTokenBytes);
      ASSERT_TRUE(ReadKvTokens(**stream, dst.view, dst.seq,
                               {l, part, 0, kTokens}, got.data())
                      .ok());
      EXPECT_EQ(got, Pattern(l, part)) << "layer " << l;
    }
  }
}

// A peer that never joins: the receive gives up at its deadline.
TEST(NcclTransferGpuTest, AbsentPeerFailsAtTheDeadline) {
  auto probe = CreateDevice(DeviceKind::kCuda);
  if (!probe.ok()) GTEST_SKIP() << "no GPU: " << probe.status();
  if (!NcclTransportAvailable(**probe)) GTEST_SKIP() << "built without NCCL";
  probe->reset();
  GpuCache dst;
  ASSERT_TRUE(MakeCache(0, 8, {7, 1, 2, 6, 4, 0}, &dst).ok());
  absl::StatusOr<std::string> id = NewNcclUniqueId();
  ASSERT_TRUE(id.ok());
  const auto start = std::chrono::steady_clock::now();
  NcclKvParams p{dst.device.get(), &dst.view, &dst.seq,
                 kTokens,          *id,       start + std::chrono::seconds(2)};
  const absl::Status received = NcclRecvKv(p);
  EXPECT_EQ(received.code(), absl::StatusCode::kUnavailable) << received;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

}  // namespace
}  // namespace pdworker
