// Token-level KV copies between paged caches (what every transport does on
// arrival), from a first token on (a prefix-cache hit), packed token spans
// (the gRPC stream's chunks and the NCCL payload), and the checks on a CUDA IPC
// export before it is trusted. On the CPU backend; the CUDA IPC mapping and
// NCCL itself need GPUs.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tests/transfer/test_kv_cache.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/runtime/cpu_device.h"
#include "worker/runtime/stream.h"
#include "worker/transfer/cuda_ipc_puller.h"
#include "worker/transfer/kv_span_staging.h"

namespace pdworker {
namespace {

constexpr int kLayers = 2;
constexpr size_t kTokenBytes = 2 * 4 * sizeof(float);  // 2 KV heads x 4

using Cache = testing::TestKvCache;

Cache MakeCache(Device& device, int num_blocks, int block_size) {
  return testing::MakeTestKvCache(device, {kLayers, 2, 4, "float32"},
                                  block_size, num_blocks);
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

// A packed span (a token-span chunk, the NCCL payload) on the CPU: packing
// tokens [first, first + count) fills exactly view.BytesFor(count) bytes,
// [layer][K, V][token] back to back, and nothing after them; unpacking a
// copy (what the wire delivers) into a cache of another block size and
// another block order restores those tokens and leaves every other token
// alone. Spans straddle block boundaries on both sides.
TEST_F(KvCopyTest, SpansPackAndUnpackEveryLayerOfARunOfTokens) {
  Cache src = MakeCache(device_, 8, 4);
  Cache dst = MakeCache(device_, 4, 8);
  const SequenceKv from = Seq({5, 1, 7, 2}, 13);
  const SequenceKv to = Seq({3, 0}, 13);
  Fill(*stream_, src.view, from, 0);
  const std::vector<uint8_t> source = ReadAll(*stream_, src.view, from);
  for (const auto& [first, count] : std::vector<std::pair<int, int>>{
           {0, 13}, {5, 8}, {3, 6}, {12, 1}, {7, 2}}) {
    SCOPED_TRACE(::testing::Message() << first << "+" << count);
    Fill(*stream_, dst.view, to, 50 + first);
    const std::vector<uint8_t> before = ReadAll(*stream_, dst.view, to);
    const size_t payload = src.view.BytesFor(count);
    DeviceMemory sent = *device_.Allocate(payload + 64);
    std::memset(sent.data(), 0xEE, sent.size_bytes());
    ASSERT_TRUE(GatherKvSpan(*stream_, src.view, from, first, count,
                             sent.buffer().Slice(0, payload))
                    .ok());
    ASSERT_TRUE(stream_->Synchronize().ok());
    const uint8_t* bytes = static_cast<const uint8_t*>(sent.data());
    // [layer][K, V][token]: part p's rows are tokens [first, first + count)
    // of ReadAll's part p (13 tokens per part).
    std::vector<uint8_t> expected;
    for (int part = 0; part < 2 * kLayers; ++part) {
      const size_t at = (part * 13 + first) * kTokenBytes;
      expected.insert(expected.end(), source.begin() + at,
                      source.begin() + at + count * kTokenBytes);
    }
    EXPECT_EQ(std::vector<uint8_t>(bytes, bytes + payload), expected);
    EXPECT_EQ(std::vector<uint8_t>(bytes + payload, bytes + payload + 64),
              std::vector<uint8_t>(64, 0xEE));

    DeviceMemory received = *device_.Allocate(payload);
    std::memcpy(received.data(), bytes, payload);
    ASSERT_TRUE(
        ScatterKvSpan(*stream_, received.buffer(), dst.view, to, first, count)
            .ok());
    const std::vector<uint8_t> after = ReadAll(*stream_, dst.view, to);
    for (int part = 0; part < 2 * kLayers; ++part) {
      for (int t = 0; t < 13; ++t) {
        const size_t at = (part * 13 + t) * kTokenBytes;
        const std::vector<uint8_t>& want =
            t >= first && t < first + count ? source : before;
        EXPECT_TRUE(std::equal(want.begin() + at,
                               want.begin() + at + kTokenBytes,
                               after.begin() + at))
            << "part " << part << " token " << t;
      }
    }
  }
}

// Spans outside the sequence or its block table, and buffers too small,
// are refused before anything is copied.
TEST_F(KvCopyTest, SpansRefuseBadRangesAndSmallBuffers) {
  Cache src = MakeCache(device_, 8, 4);
  const SequenceKv from = Seq({5, 1, 7, 2}, 13);
  Fill(*stream_, src.view, from, 0);
  const std::vector<uint8_t> before = ReadAll(*stream_, src.view, from);
  DeviceMemory buffer = *device_.Allocate(src.view.BytesFor(13));
  std::memset(buffer.data(), 0xEE, buffer.size_bytes());
  const std::vector<uint8_t> poison(buffer.size_bytes(), 0xEE);
  struct Bad {
    int first, count;
    int64_t bytes;
    SequenceKv seq;
  };
  const std::vector<Bad> bad = {
      {-1, 2, src.view.BytesFor(2), from},
      {12, 2, src.view.BytesFor(2), from},
      {0, 0, src.view.BytesFor(1), from},
      {3, 4, src.view.BytesFor(4) - 1, from},
      {8, 5, src.view.BytesFor(5), Seq({5, 1}, 13)},  // table too short
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(::testing::Message() << b.first << "+" << b.count);
    EXPECT_EQ(
        GatherKvSpan(*stream_, src.view, b.seq, b.first, b.count,
                     buffer.buffer().Slice(0, static_cast<size_t>(b.bytes)))
            .code(),
        absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(
        ScatterKvSpan(*stream_,
                      buffer.buffer().Slice(0, static_cast<size_t>(b.bytes)),
                      src.view, b.seq, b.first, b.count)
            .code(),
        absl::StatusCode::kInvalidArgument);
  }
  ASSERT_TRUE(stream_->Synchronize().ok());
  const uint8_t* bytes = static_cast<const uint8_t*>(buffer.data());
  EXPECT_EQ(std::vector<uint8_t>(bytes, bytes + buffer.size_bytes()), poison);
  EXPECT_EQ(ReadAll(*stream_, src.view, from), before);
}

// KvSpanStaging end to end, as a token-span stream uses it: the source
// gathers span after span into its pinned buffer (each chunk's bytes taken
// before the next gather), the puller scatters them through a staging that
// starts too small and grows, and the pool lends idle stagings again.
TEST_F(KvCopyTest, SpanStagingMovesASequenceChunkByChunk) {
  Cache src = MakeCache(device_, 8, 4);
  Cache dst = MakeCache(device_, 4, 8);
  const SequenceKv from = Seq({5, 1, 7, 2}, 13);
  const SequenceKv to = Seq({3, 0}, 13);
  Fill(*stream_, src.view, from, 0);
  Fill(*stream_, dst.view, to, 77);
  const std::vector<uint8_t> before = ReadAll(*stream_, dst.view, to);

  // 3 tokens' spans (and not 4) fit; the puller starts at 1.
  KvSpanStagingPool sources(device_, src.view, src.view.BytesFor(4) - 1,
                            /*max_idle=*/1);
  KvSpanStagingPool pullers(device_, src.view, 1, /*max_idle=*/1);
  EXPECT_EQ(sources.span_tokens(), 3);
  EXPECT_EQ(sources.capacity_bytes(), src.view.BytesFor(3));
  EXPECT_EQ(pullers.span_tokens(), 1);
  absl::StatusOr<KvSpanStagingPool::Lease> out = sources.Acquire();
  absl::StatusOr<KvSpanStagingPool::Lease> in = pullers.Acquire();
  ASSERT_TRUE(out.ok() && in.ok());
  const int first = 2;
  for (int t = first; t < 13; t += 3) {
    const int count = std::min(3, 13 - t);
    ASSERT_TRUE((*out)->Gather(src.view, from, t, count).ok());
    absl::StatusOr<const char*> bytes = (*out)->Gathered();
    ASSERT_TRUE(bytes.ok());
    const std::string chunk(*bytes, src.view.BytesFor(count));
    ASSERT_TRUE((*in)->Scatter(chunk, dst.view, to, t, count).ok());
  }
  EXPECT_GE((*in)->capacity_bytes(), src.view.BytesFor(3));
  ASSERT_TRUE((*in)->Synchronize().ok());
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

  // Too large a span for the source's staging, and bytes that are not the
  // span's size, are refused.
  EXPECT_EQ((*out)->Gather(src.view, from, 0, 4).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*in)->Scatter(std::string(5, 'x'), dst.view, to, 0, 1).code(),
            absl::StatusCode::kInvalidArgument);

  // Returned stagings are lent again, up to max_idle of them.
  const KvSpanStaging* first_out = out->get();
  out->reset();
  EXPECT_EQ(sources.idle(), 1);
  absl::StatusOr<KvSpanStagingPool::Lease> again = sources.Acquire();
  absl::StatusOr<KvSpanStagingPool::Lease> extra = sources.Acquire();
  ASSERT_TRUE(again.ok() && extra.ok());
  EXPECT_EQ(again->get(), first_out);
  EXPECT_NE(extra->get(), first_out);
  again->reset();
  extra->reset();
  EXPECT_EQ(sources.idle(), 1);
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
