// Token-level KV copies between paged caches (what every transport does on
// arrival), from a first token on (a prefix-cache hit), the NCCL transport's
// packing, and the checks on a CUDA IPC export before it is trusted. On the
// CPU backend; the CUDA IPC mapping and NCCL itself need GPUs.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "worker/runtime/cpu_device.h"
#include "worker/runtime/stream.h"
#include "worker/transfer/cuda_ipc_puller.h"
#include "worker/transfer/kv_cache_view.h"
#include "worker/transfer/nccl_transfer.h"

namespace pdworker {
namespace {

constexpr int kLayers = 2;
constexpr size_t kTokenBytes = 2 * 4 * sizeof(float);  // 2 KV heads x 4

// A cache of `num_blocks` blocks of `block_size` tokens per layer part, in
// one allocation laid out K0 V0 K1 V1.
struct Cache {
  DeviceMemory memory;
  KvCacheView view;
};

Cache MakeCache(Device& device, int num_blocks, int block_size) {
  Cache c;
  const size_t part_bytes = num_blocks * block_size * kTokenBytes;
  c.memory = *device.Allocate(part_bytes * 2 * kLayers);
  std::memset(c.memory.data(), 0, c.memory.size_bytes());
  c.view.layout = {kLayers, 2, 4, "float32"};
  c.view.block_size = block_size;
  c.view.token_bytes = kTokenBytes;
  c.view.allocation = c.memory.buffer();
  for (int l = 0; l < kLayers; ++l) {
    c.view.keys.push_back(
        c.memory.buffer().Slice(2 * l * part_bytes, part_bytes));
    c.view.values.push_back(
        c.memory.buffer().Slice((2 * l + 1) * part_bytes, part_bytes));
  }
  return c;
}

SequenceKv Seq(std::vector<int32_t> blocks, int32_t tokens) {
  SequenceKv s;
  s.blocks = std::move(blocks);
  s.num_tokens = tokens;
  return s;
}

// Every (layer, part) of `seq` read back token by token.
std::vector<uint8_t> ReadAll(Stream& stream, const KvCacheView& view,
                             const SequenceKv& seq) {
  std::vector<uint8_t> out(seq.num_tokens * kTokenBytes * 2 * kLayers);
  size_t at = 0;
  for (int l = 0; l < kLayers; ++l) {
    for (KvCachePart part : {KvCachePart::kKey, KvCachePart::kValue}) {
      EXPECT_TRUE(ReadKvTokens(stream, view, seq, {l, part, 0, seq.num_tokens},
                               out.data() + at)
                      .ok());
      at += seq.num_tokens * kTokenBytes;
    }
  }
  return out;
}

class KvCopyTest : public ::testing::Test {
 protected:
  void SetUp() override { stream_ = *device_.CreateStream(); }
  CpuDevice device_;
  std::unique_ptr<Stream> stream_;
};

TEST_F(KvCopyTest, CopiesBetweenDifferentBlockSizes) {
  Cache src = MakeCache(device_, 8, 4);
  Cache dst = MakeCache(device_, 4, 8);
  const SequenceKv from = Seq({5, 1, 7, 2}, 13);  // 4 blocks of 4
  const SequenceKv to = Seq({3, 0}, 13);          // 2 blocks of 8
  // Distinct bytes per (layer, part, token).
  std::vector<uint8_t> pattern(13 * kTokenBytes);
  for (int l = 0; l < kLayers; ++l) {
    for (KvCachePart part : {KvCachePart::kKey, KvCachePart::kValue}) {
      for (size_t i = 0; i < pattern.size(); ++i) {
        pattern[i] = static_cast<uint8_t>(
            i * 7 + l * 31 + (part == KvCachePart::kKey ? 0 : 101));
      }
      ASSERT_TRUE(WriteKvTokens(*stream_, src.view, from, {l, part, 0, 13},
                                pattern.data())
                      .ok());
    }
  }
  ASSERT_TRUE(CopyKvTokens(*stream_, src.view, from, dst.view, to, 13).ok());
  EXPECT_EQ(ReadAll(*stream_, dst.view, to), ReadAll(*stream_, src.view, from));
  // Blocks outside `to` were not touched.
  std::vector<uint8_t> block1(8 * kTokenBytes);
  ASSERT_TRUE(
      stream_
          ->CopyToHost(block1.data(),
                       dst.view.keys[0].Slice(8 * kTokenBytes, block1.size()),
                       block1.size())
          .ok());
  EXPECT_EQ(block1, std::vector<uint8_t>(block1.size(), 0));

  EXPECT_EQ(CopyKvTokens(*stream_, src.view, from, dst.view, to, 14).code(),
            absl::StatusCode::kInvalidArgument);
  KvCacheView other = dst.view;
  other.layout.dtype = "bfloat16";
  EXPECT_EQ(CopyKvTokens(*stream_, src.view, from, other, to, 13).code(),
            absl::StatusCode::kFailedPrecondition);
}

// Writes distinct bytes into every (layer, part, token) of `seq`.
void Fill(Stream& stream, const KvCacheView& view, const SequenceKv& seq,
          int salt) {
  std::vector<uint8_t> pattern(seq.num_tokens * kTokenBytes);
  for (int l = 0; l < kLayers; ++l) {
    for (KvCachePart part : {KvCachePart::kKey, KvCachePart::kValue}) {
      for (size_t i = 0; i < pattern.size(); ++i) {
        pattern[i] = static_cast<uint8_t>(
            i * 7 + l * 31 + (part == KvCachePart::kKey ? 0 : 101) + salt);
      }
      ASSERT_TRUE(WriteKvTokens(stream, view, seq, {l, part, 0, seq.num_tokens},
                                pattern.data())
                      .ok());
    }
  }
}

// Tokens [first, seq.num_tokens) of every (layer, part), in that order.
std::vector<uint8_t> ReadFrom(Stream& stream, const KvCacheView& view,
                              const SequenceKv& seq, int32_t first) {
  const int32_t n = seq.num_tokens - first;
  std::vector<uint8_t> out(n * kTokenBytes * 2 * kLayers);
  size_t at = 0;
  for (int l = 0; l < kLayers; ++l) {
    for (KvCachePart part : {KvCachePart::kKey, KvCachePart::kValue}) {
      EXPECT_TRUE(
          ReadKvTokens(stream, view, seq, {l, part, first, n}, out.data() + at)
              .ok());
      at += n * kTokenBytes;
    }
  }
  return out;
}

// A decode worker with the first tokens cached copies only the rest; the
// tokens before first_token stay as they were.
TEST_F(KvCopyTest, CopiesFromFirstTokenOnly) {
  Cache src = MakeCache(device_, 8, 4);
  Cache dst = MakeCache(device_, 4, 8);
  const SequenceKv from = Seq({5, 1, 7, 2}, 13);
  const SequenceKv to = Seq({3, 0}, 13);
  Fill(*stream_, src.view, from, 0);
  Fill(*stream_, dst.view, to, 50);  // the "cached" prefix
  const std::vector<uint8_t> cached = ReadAll(*stream_, dst.view, to);
  ASSERT_TRUE(CopyKvTokens(*stream_, src.view, from, dst.view, to, 13,
                           KvCopyMethod::kAuto, 5)
                  .ok());
  EXPECT_EQ(ReadFrom(*stream_, dst.view, to, 5),
            ReadFrom(*stream_, src.view, from, 5));
  const std::vector<uint8_t> after = ReadAll(*stream_, dst.view, to);
  for (int part = 0; part < 2 * kLayers; ++part) {
    const size_t begin = part * 13 * kTokenBytes;
    EXPECT_TRUE(std::equal(cached.begin() + begin,
                           cached.begin() + begin + 5 * kTokenBytes,
                           after.begin() + begin))
        << "part " << part;
  }
  for (const int bad : {13, -1}) {
    EXPECT_EQ(CopyKvTokens(*stream_, src.view, from, dst.view, to, 13,
                           KvCopyMethod::kAuto, bad)
                  .code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

// The NCCL transport's staging layout, on the CPU: packing tokens [5, 13)
// fills exactly the payload ([layer][K, V][token], contiguous) after the
// lead, and unpacking a copy of the payload (what ncclRecv delivers)
// restores those tokens in a cache of another block size, leaving the
// tokens before 5 alone.
TEST_F(KvCopyTest, NcclStagingPacksTheTokensFromFirstToken) {
  Cache src = MakeCache(device_, 8, 4);
  Cache dst = MakeCache(device_, 4, 8);
  const SequenceKv from = Seq({5, 1, 7, 2}, 13);
  const SequenceKv to = Seq({3, 0}, 13);
  Fill(*stream_, src.view, from, 0);
  for (const int first : {0, 5, 12}) {
    SCOPED_TRACE(first);
    Fill(*stream_, dst.view, to, 50 + first);
    const std::vector<uint8_t> before = ReadAll(*stream_, dst.view, to);
    const size_t lead = NcclPayloadOffset(src.view, first);
    const size_t payload = src.view.BytesFor(13 - first);
    EXPECT_EQ(lead, first * kTokenBytes);
    DeviceMemory sent = *device_.Allocate(lead + payload);
    DeviceMemory received = *device_.Allocate(lead + payload);
    std::memset(sent.data(), 0xEE, sent.size_bytes());
    std::memset(received.data(), 0xEE, received.size_bytes());
    const SequenceKv packed_seq = Seq({0}, 13);
    ASSERT_TRUE(CopyKvTokens(*stream_, src.view, from,
                             NcclPackedView(src.view, sent.buffer(), first, 13),
                             packed_seq, 13, KvCopyMethod::kAuto, first)
                    .ok());
    const uint8_t* bytes = static_cast<const uint8_t*>(sent.data());
    EXPECT_EQ(std::vector<uint8_t>(bytes, bytes + lead),
              std::vector<uint8_t>(lead, 0xEE));
    EXPECT_EQ(std::vector<uint8_t>(bytes + lead, bytes + lead + payload),
              ReadFrom(*stream_, src.view, from, first));
    std::memcpy(static_cast<uint8_t*>(received.data()) + lead, bytes + lead,
                payload);
    ASSERT_TRUE(
        CopyKvTokens(*stream_,
                     NcclPackedView(src.view, received.buffer(), first, 13),
                     packed_seq, dst.view, to, 13, KvCopyMethod::kAuto, first)
            .ok());
    EXPECT_EQ(ReadFrom(*stream_, dst.view, to, first),
              ReadFrom(*stream_, src.view, from, first));
    const std::vector<uint8_t> after = ReadAll(*stream_, dst.view, to);
    for (int part = 0; part < 2 * kLayers; ++part) {
      const size_t begin = part * 13 * kTokenBytes;
      EXPECT_TRUE(std::equal(before.begin() + begin,
                             before.begin() + begin + first * kTokenBytes,
                             after.begin() + begin))
          << "part " << part;
    }
  }
}

// What a source puts into a CudaIpcExport, from its own view.
v1::CudaIpcExport Export(const KvCacheView& v, const SequenceKv& seq) {
  v1::CudaIpcExport e;
  e.set_allocation_bytes(v.allocation.size_bytes());
  const char* base = static_cast<const char*>(v.allocation.data());
  for (int l = 0; l < kLayers; ++l) {
    e.add_key_offsets(static_cast<const char*>(v.keys[l].data()) - base);
    e.add_value_offsets(static_cast<const char*>(v.values[l].data()) - base);
  }
  e.set_cache_bytes_per_layer(v.keys[0].size_bytes());
  e.set_block_size(v.block_size);
  for (int32_t b : seq.blocks) e.add_blocks(b);
  e.set_num_tokens(seq.num_tokens);
  return e;
}

TEST_F(KvCopyTest, IpcExportViewReadsTheSourceAndRejectsBadExports) {
  Cache src = MakeCache(device_, 8, 4);
  Cache dst = MakeCache(device_, 8, 4);
  const SequenceKv from = Seq({6, 2}, 7);
  std::vector<uint8_t> bytes(7 * kTokenBytes);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i);
  ASSERT_TRUE(WriteKvTokens(*stream_, src.view, from,
                            {1, KvCachePart::kValue, 0, 7}, bytes.data())
                  .ok());
  // The "mapping" is the source allocation itself (one process).
  const v1::CudaIpcExport good = Export(src.view, from);
  absl::StatusOr<KvCacheView> view =
      ViewOfExport(good, src.view.allocation, dst.view, 7);
  ASSERT_TRUE(view.ok()) << view.status();
  const SequenceKv to = Seq({0, 1}, 7);
  ASSERT_TRUE(CopyKvTokens(*stream_, *view, from, dst.view, to, 7).ok());
  EXPECT_EQ(ReadAll(*stream_, dst.view, to), ReadAll(*stream_, src.view, from));

  struct Case {
    const char* name;
    void (*mutate)(v1::CudaIpcExport*);
  };
  const Case cases[] = {
      {"block out of range", [](v1::CudaIpcExport* e) { e->set_blocks(0, 8); }},
      {"negative block", [](v1::CudaIpcExport* e) { e->set_blocks(1, -1); }},
      {"too few blocks",
       [](v1::CudaIpcExport* e) { e->mutable_blocks()->RemoveLast(); }},
      {"token count", [](v1::CudaIpcExport* e) { e->set_num_tokens(9); }},
      {"offset past the end",
       [](v1::CudaIpcExport* e) {
         e->set_value_offsets(1, e->allocation_bytes());
       }},
      {"missing layer",
       [](v1::CudaIpcExport* e) { e->mutable_key_offsets()->RemoveLast(); }},
      {"partial blocks",
       [](v1::CudaIpcExport* e) {
         e->set_cache_bytes_per_layer(e->cache_bytes_per_layer() - 1);
       }},
  };
  for (const Case& c : cases) {
    v1::CudaIpcExport bad = good;
    c.mutate(&bad);
    EXPECT_EQ(
        ViewOfExport(bad, src.view.allocation, dst.view, 7).status().code(),
        absl::StatusCode::kInvalidArgument)
        << c.name;
  }
}

}  // namespace
}  // namespace pdworker
