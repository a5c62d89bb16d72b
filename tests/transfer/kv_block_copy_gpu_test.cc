// The batched CUDA KV copy (CopyKvTokens on a CUDA stream: one launch per
// up to kKvBlockCopyMaxBlocks blocks instead of one cudaMemcpyAsync per
// block, layer and part) against the per-block copy and against the
// expected bytes computed on the host: random block tables, source and
// destination block sizes that differ, runs long enough to take several
// launches, and rows that are not whole 16-byte units (which fall back to
// per-block copies). Destination bytes outside the copied slots must keep
// their poison. The same for packed token spans (GatherKvSpan /
// ScatterKvSpan). Tag "gpu": skips without a usable GPU.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/runtime/device_factory.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace {

constexpr uint8_t kPoison = 0xAB;

struct Shape {
  int layers;
  size_t token_bytes;
  int src_block_size;
  int dst_block_size;
  int num_tokens;
};

// A paged cache of `num_blocks` blocks per layer part, parts laid out K0 V0
// K1 V1 ... in one allocation, with its host mirror.
struct Cache {
  DeviceMemory memory;
  KvCacheView view;
  std::vector<uint8_t> host;
};

Cache MakeCache(Device& device, const Shape& s, int block_size,
                int num_blocks) {
  Cache c;
  const size_t part =
      static_cast<size_t>(num_blocks) * block_size * s.token_bytes;
  c.memory = *device.Allocate(part * 2 * s.layers);
  c.view.layout = {s.layers, 1, static_cast<int32_t>(s.token_bytes / 2),
                   "bfloat16"};
  c.view.block_size = block_size;
  c.view.token_bytes = s.token_bytes;
  c.view.allocation = c.memory.buffer();
  for (int l = 0; l < s.layers; ++l) {
    c.view.keys.push_back(c.memory.buffer().Slice(2 * l * part, part));
    c.view.values.push_back(c.memory.buffer().Slice((2 * l + 1) * part, part));
  }
  return c;
}

SequenceKv RandomSequence(int num_tokens, int block_size, int num_blocks,
                          std::mt19937& rng) {
  std::vector<int32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  SequenceKv seq;
  seq.num_tokens = num_tokens;
  seq.blocks.assign(ids.begin(),
                    ids.begin() + (num_tokens + block_size - 1) / block_size);
  return seq;
}

// The cache slot (block id * block_size + offset) of token `t` of `seq`.
size_t Slot(const SequenceKv& seq, int block_size, int t) {
  return static_cast<size_t>(seq.blocks[t / block_size]) * block_size +
         t % block_size;
}

class KvBlockCopyGpuTest : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override {
    auto device = CreateDevice(DeviceKind::kCuda);
    if (!device.ok()) {
      GTEST_SKIP() << "CUDA backend not available here ("
                   << device.status().message() << ")";
    }
    device_ = *std::move(device);
    stream_ = *device_->CreateStream();
  }

  // A source cache of `num_blocks` blocks of s.src_block_size, filled with
  // random bytes (and its host mirror with the same).
  Cache RandomSourceCache(const Shape& s, int num_blocks, std::mt19937& rng) {
    Cache c = MakeCache(*device_, s, s.src_block_size, num_blocks);
    c.host.resize(c.memory.size_bytes());
    for (uint8_t& b : c.host) b = static_cast<uint8_t>(rng());
    EXPECT_TRUE(
        stream_->CopyToDevice(c.memory.buffer(), c.host.data(), c.host.size())
            .ok());
    return c;
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
};

TEST_P(KvBlockCopyGpuTest, MatchesTheHostAndThePerBlockCopy) {
  const Shape s = GetParam();
  std::mt19937 rng(s.num_tokens + s.src_block_size);
  // Twice the blocks a sequence needs, so the tables skip some.
  const int src_blocks = 2 * (s.num_tokens / s.src_block_size + 1);
  const int dst_blocks = 2 * (s.num_tokens / s.dst_block_size + 1);
  Cache src = RandomSourceCache(s, src_blocks, rng);
  Cache batched = MakeCache(*device_, s, s.dst_block_size, dst_blocks);
  Cache per_block = MakeCache(*device_, s, s.dst_block_size, dst_blocks);
  const std::vector<uint8_t> poison(batched.memory.size_bytes(), kPoison);
  for (Cache* c : {&batched, &per_block}) {
    ASSERT_TRUE(
        stream_->CopyToDevice(c->memory.buffer(), poison.data(), poison.size())
            .ok());
  }
  const SequenceKv from =
      RandomSequence(s.num_tokens, s.src_block_size, src_blocks, rng);
  const SequenceKv to =
      RandomSequence(s.num_tokens, s.dst_block_size, dst_blocks, rng);

  ASSERT_TRUE(CopyKvTokens(*stream_, src.view, from, batched.view, to,
                           s.num_tokens, KvCopyMethod::kAuto)
                  .ok());
  ASSERT_TRUE(CopyKvTokens(*stream_, src.view, from, per_block.view, to,
                           s.num_tokens, KvCopyMethod::kPerBlock)
                  .ok());
  ASSERT_TRUE(stream_->Synchronize().ok());

  // The expected destination: poison, with each copied token's row in
  // place.
  std::vector<uint8_t> want = poison;
  const size_t src_part =
      static_cast<size_t>(src_blocks) * s.src_block_size * s.token_bytes;
  const size_t dst_part =
      static_cast<size_t>(dst_blocks) * s.dst_block_size * s.token_bytes;
  for (int part = 0; part < 2 * s.layers; ++part) {
    for (int t = 0; t < s.num_tokens; ++t) {
      const size_t from_slot = Slot(from, s.src_block_size, t);
      const size_t to_slot = Slot(to, s.dst_block_size, t);
      std::copy_n(
          src.host.begin() + part * src_part + from_slot * s.token_bytes,
          s.token_bytes,
          want.begin() + part * dst_part + to_slot * s.token_bytes);
    }
  }
  for (Cache* c : {&batched, &per_block}) {
    std::vector<uint8_t> got(c->memory.size_bytes());
    ASSERT_TRUE(
        stream_->CopyToHost(got.data(), c->memory.buffer(), got.size()).ok());
    const auto mismatch =
        std::mismatch(got.begin(), got.end(), want.begin()).first;
    EXPECT_TRUE(mismatch == got.end())
        << (c == &batched ? "batched" : "per-block") << " copy differs at byte "
        << (mismatch - got.begin()) << " of " << got.size();
  }
}

// Packed token spans (the gRPC stream's chunks, the NCCL payload) through
// the same kernel with shifted token indices: spans starting anywhere in a
// block, gathered into a poisoned buffer ([layer][K, V][token] rows, bytes
// after the span untouched), then scattered into another cache, whose
// tokens outside the span keep their poison.
TEST_P(KvBlockCopyGpuTest, SpansGatherAndScatterLikeTheHost) {
  const Shape s = GetParam();
  std::mt19937 rng(7 * s.num_tokens + s.dst_block_size);
  const int src_blocks = 2 * (s.num_tokens / s.src_block_size + 1);
  const int dst_blocks = 2 * (s.num_tokens / s.dst_block_size + 1);
  Cache src = RandomSourceCache(s, src_blocks, rng);
  Cache dst = MakeCache(*device_, s, s.dst_block_size, dst_blocks);
  const SequenceKv from =
      RandomSequence(s.num_tokens, s.src_block_size, src_blocks, rng);
  const SequenceKv to =
      RandomSequence(s.num_tokens, s.dst_block_size, dst_blocks, rng);
  const size_t src_part =
      static_cast<size_t>(src_blocks) * s.src_block_size * s.token_bytes;
  const size_t dst_part =
      static_cast<size_t>(dst_blocks) * s.dst_block_size * s.token_bytes;
  const std::vector<uint8_t> poison(dst.memory.size_bytes(), kPoison);
  ASSERT_TRUE(
      stream_->CopyToDevice(dst.memory.buffer(), poison.data(), poison.size())
          .ok());
  std::vector<uint8_t> want_dst = poison;

  // Spans of odd lengths from an odd start, to the end.
  const int first = std::min(s.num_tokens - 1, 3 + s.src_block_size / 2);
  const int span = std::max(1, s.num_tokens / 5 + 1);
  for (int t0 = first; t0 < s.num_tokens; t0 += span) {
    const int count = std::min(span, s.num_tokens - t0);
    SCOPED_TRACE(testing::Message() << "span " << t0 << "+" << count);
    const size_t bytes =
        static_cast<size_t>(2 * s.layers) * count * s.token_bytes;
    DeviceMemory packed = *device_->Allocate(bytes + 256);
    const std::vector<uint8_t> packed_poison(bytes + 256, kPoison);
    ASSERT_TRUE(stream_
                    ->CopyToDevice(packed.buffer(), packed_poison.data(),
                                   packed_poison.size())
                    .ok());
    ASSERT_TRUE(GatherKvSpan(*stream_, src.view, from, t0, count,
                             packed.buffer().Slice(0, bytes))
                    .ok());
    std::vector<uint8_t> want = packed_poison;
    for (int part = 0; part < 2 * s.layers; ++part) {
      for (int i = 0; i < count; ++i) {
        const int t = t0 + i;
        const size_t from_slot = Slot(from, s.src_block_size, t);
        const size_t to_slot = Slot(to, s.dst_block_size, t);
        const auto row =
            src.host.begin() + part * src_part + from_slot * s.token_bytes;
        std::copy_n(row, s.token_bytes,
                    want.begin() + (static_cast<size_t>(part) * count + i) *
                                       s.token_bytes);
        std::copy_n(
            row, s.token_bytes,
            want_dst.begin() + part * dst_part + to_slot * s.token_bytes);
      }
    }
    std::vector<uint8_t> got(want.size());
    ASSERT_TRUE(
        stream_->CopyToHost(got.data(), packed.buffer(), got.size()).ok());
    const auto mismatch =
        std::mismatch(got.begin(), got.end(), want.begin()).first;
    ASSERT_TRUE(mismatch == got.end())
        << "gathered span differs at byte " << (mismatch - got.begin())
        << " of " << got.size();
    ASSERT_TRUE(ScatterKvSpan(*stream_, packed.buffer().Slice(0, bytes),
                              dst.view, to, t0, count)
                    .ok());
    ASSERT_TRUE(stream_->Synchronize().ok());
  }
  std::vector<uint8_t> got(dst.memory.size_bytes());
  ASSERT_TRUE(
      stream_->CopyToHost(got.data(), dst.memory.buffer(), got.size()).ok());
  const auto mismatch =
      std::mismatch(got.begin(), got.end(), want_dst.begin()).first;
  EXPECT_TRUE(mismatch == got.end())
      << "scattered cache differs at byte " << (mismatch - got.begin())
      << " of " << got.size();
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, KvBlockCopyGpuTest,
    ::testing::Values(
        // Llama-3.2-1B: 16 layers, 1 KiB rows, 2,048 tokens, same blocks.
        Shape{16, 1024, 16, 16, 2048},
        // Block sizes that differ and a run that is not whole blocks.
        Shape{3, 256, 16, 32, 1001},
        // 4,999 tokens in blocks of 4: 1,250 source blocks, two launches.
        Shape{2, 64, 4, 16, 4999},
        // Rows of 24 bytes: not whole 16-byte units, per-block copies.
        Shape{2, 24, 8, 16, 333}),
    [](const ::testing::TestParamInfo<Shape>& info) {
      const Shape& s = info.param;
      return "l" + std::to_string(s.layers) + "_row" +
             std::to_string(s.token_bytes) + "_bs" +
             std::to_string(s.src_block_size) + "to" +
             std::to_string(s.dst_block_size) + "_n" +
             std::to_string(s.num_tokens);
    });

}  // namespace
}  // namespace pdworker
