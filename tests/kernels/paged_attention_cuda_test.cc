// Paged attention on CUDA vs the CPU kernels, on the same bf16-representable
// query and KV cache, for varlen (prefill / mixed) and uniform decode
// (split-K: CudaDecodeNumSplits CTAs per request and kv head, each taking an
// even share of the context), plus graph replay vs eager.
//
// Tolerance: outputs are convex combinations of values in [-1, 1]. Scores,
// softmax and accumulation are fp32 on both backends (different summation
// orders: ~1e-6); the GPU rounds the output to bf16 (<= 2^-9 relative, at
// most 0.002 here). Bound: 2^-8 · |cpu| + 2^-8. A masking, indexing or
// split-merging bug moves outputs by O(0.1).
//
// Unwritten cache positions hold NaN on both backends and unused block-table
// entries point at a block of large values, so reading anything a request
// does not own shows up as NaN or a large error.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tests/kernels/cuda_kernel_test_util.h"
#include "worker/kernels/paged_attention.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::Backend;
using testing::CudaKernelTest;
using testing::ExpectClose;
using testing::SameBits;

static_assert(kCudaPagedAttentionCGSupport == AttentionCGSupport::kAlways,
              "the CUDA kernels read all step metadata on the device");

constexpr double kRel = 1.0 / 256;
constexpr double kAbs = 1.0 / 256;
constexpr int kMaxNumSeqs = 8;
constexpr int kMaxTokens = 32;
constexpr int kContext = 1600;  // default max context: up to 50 splits
constexpr int32_t kJunkBlock = 0;

struct AttentionConfig {
  int heads;
  int kv_heads;
  int head_dim;
  int block_size;
  int max_context = kContext;  // tokens a block-table row can hold
};

std::string Name(const ::testing::TestParamInfo<AttentionConfig>& info) {
  const AttentionConfig& c = info.param;
  return "h" + std::to_string(c.heads) + "_kv" + std::to_string(c.kv_heads) +
         "_d" + std::to_string(c.head_dim) + "_bs" +
         std::to_string(c.block_size) + "_ctx" + std::to_string(c.max_context);
}

struct Request {
  int q_len;
  int seq_len;  // context including this step's q_len tokens
};

struct Batch {
  std::vector<Request> requests;  // real requests
  int num_tokens;                 // padded
  int uniform_query_len;          // 0: varlen
};

// Host copy of one step's inputs (fp32 values, all bf16-representable).
struct HostStep {
  std::vector<float> query, key_cache, value_cache;
  std::vector<int32_t> seq_lens, query_start_loc, block_tables;
  int32_t num_reqs = 0;
};

class PagedAttentionCudaTest
    : public CudaKernelTest,
      public ::testing::WithParamInterface<AttentionConfig> {
 protected:
  void SetUp() override {
    CudaKernelTest::SetUp();
    if (IsSkipped()) return;
    c_ = GetParam();
    max_blocks_per_seq_ = c_.max_context / c_.block_size;
    // Room for the batches below (half the requests at the default longest
    // context, or two at this config's), + the junk block.
    num_blocks_ = std::max(kMaxNumSeqs * (kContext / c_.block_size) / 2,
                           2 * max_blocks_per_seq_) +
                  1;
    cpu_ = MakeParams(cpu(), DType::kFloat32);
    gpu_ = MakeParams(gpu(), DType::kBFloat16);
  }

  size_t CacheElements() const {
    return static_cast<size_t>(num_blocks_) * c_.block_size * c_.kv_heads *
           c_.head_dim;
  }
  size_t RowElements() const {
    return static_cast<size_t>(c_.heads) * c_.head_dim;
  }

  PagedAttentionParams MakeParams(Backend& b, DType dtype) {
    const size_t e = DTypeSize(dtype);
    PagedAttentionParams p;
    p.num_reqs = b.Alloc(sizeof(int32_t));
    p.query_start_loc = b.Alloc(sizeof(int32_t) * (kMaxNumSeqs + 1));
    p.seq_lens = b.Alloc(sizeof(int32_t) * kMaxNumSeqs);
    p.block_tables =
        b.Alloc(sizeof(int32_t) * kMaxNumSeqs * max_blocks_per_seq_);
    p.query = b.Alloc(e * kMaxTokens * RowElements());
    p.key_cache = b.Alloc(e * CacheElements());
    p.value_cache = b.Alloc(e * CacheElements());
    p.output = b.Alloc(e * kMaxTokens * RowElements());
    p.max_num_seqs = kMaxNumSeqs;
    p.num_heads = c_.heads;
    p.num_kv_heads = c_.kv_heads;
    p.head_dim = c_.head_dim;
    p.block_size = c_.block_size;
    p.num_blocks = num_blocks_;
    p.max_blocks_per_seq = max_blocks_per_seq_;
    p.dtype = dtype;
    if (dtype == DType::kBFloat16) {
      p.workspace = b.Alloc(
          PagedAttentionWorkspaceBytes(kMaxTokens, c_.heads, c_.head_dim,
                                       max_blocks_per_seq_, c_.block_size));
    }
    return p;
  }

  // Random inputs for `batch` (seeded), written into both backends.
  HostStep WriteStep(const Batch& batch, uint32_t seed) {
    HostStep s;
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    const int kv_width = c_.kv_heads * c_.head_dim;
    s.key_cache.assign(CacheElements(),
                       std::numeric_limits<float>::quiet_NaN());
    s.value_cache = s.key_cache;
    // The junk block: large values that would dominate any output.
    for (int i = 0; i < c_.block_size * kv_width; ++i) {
      s.key_cache[i] = 50.0f + (i % 7);
      s.value_cache[i] = 60.0f - (i % 5);
    }
    std::vector<int32_t> free_blocks(num_blocks_ - 1);
    std::iota(free_blocks.begin(), free_blocks.end(), 1);
    std::shuffle(free_blocks.begin(), free_blocks.end(), rng);
    size_t next_block = 0;
    s.seq_lens.assign(kMaxNumSeqs, 0);
    s.query_start_loc.assign(kMaxNumSeqs + 1, 0);
    s.block_tables.assign(kMaxNumSeqs * max_blocks_per_seq_, kJunkBlock);
    int tokens = 0;
    for (size_t r = 0; r < batch.requests.size(); ++r) {
      const Request& req = batch.requests[r];
      s.seq_lens[r] = req.seq_len;
      s.query_start_loc[r] = tokens;
      tokens += req.q_len;
      const int blocks = (req.seq_len + c_.block_size - 1) / c_.block_size;
      for (int b = 0; b < blocks; ++b) {
        const int32_t block = free_blocks.at(next_block++);
        s.block_tables[r * max_blocks_per_seq_ + b] = block;
        const int valid =
            std::min(c_.block_size, req.seq_len - b * c_.block_size);
        for (size_t i = 0; i < static_cast<size_t>(valid) * kv_width; ++i) {
          const size_t at =
              static_cast<size_t>(block) * c_.block_size * kv_width + i;
          s.key_cache[at] = dist(rng);
          s.value_cache[at] = dist(rng);
        }
      }
    }
    s.num_reqs = static_cast<int32_t>(batch.requests.size());
    for (int r = s.num_reqs; r <= kMaxNumSeqs; ++r) {
      s.query_start_loc[r] = tokens;
    }
    if (batch.uniform_query_len > 0) {
      for (int r = s.num_reqs; r <= batch.num_tokens / batch.uniform_query_len;
           ++r) {
        s.query_start_loc[r] = r * batch.uniform_query_len;
      }
    }
    EXPECT_LE(tokens, batch.num_tokens);
    s.query.resize(kMaxTokens * RowElements());
    for (float& v : s.query) v = dist(rng);
    s.query = testing::RoundToBf16(s.query);
    s.key_cache = testing::RoundToBf16(s.key_cache);
    s.value_cache = testing::RoundToBf16(s.value_cache);

    WriteInto(cpu(), cpu_, s, /*bf16=*/false);
    WriteInto(gpu(), gpu_, s, /*bf16=*/true);
    return s;
  }

  void WriteInto(Backend& b, const PagedAttentionParams& p, const HostStep& s,
                 bool bf16) {
    b.Write(p.num_reqs, std::vector<int32_t>{s.num_reqs});
    b.Write(p.query_start_loc, s.query_start_loc);
    b.Write(p.seq_lens, s.seq_lens);
    b.Write(p.block_tables, s.block_tables);
    if (bf16) {
      b.Write(p.query, testing::ToBf16Bits(s.query));
      b.Write(p.key_cache, testing::ToBf16Bits(s.key_cache));
      b.Write(p.value_cache, testing::ToBf16Bits(s.value_cache));
      // Stale results must not survive: NaN everywhere.
      b.Write(p.output, std::vector<uint16_t>(kMaxTokens * RowElements(),
                                              uint16_t{0xFFFF}));
    } else {
      b.Write(p.query, s.query);
      b.Write(p.key_cache, s.key_cache);
      b.Write(p.value_cache, s.value_cache);
      b.Write(p.output,
              std::vector<float>(kMaxTokens * RowElements(),
                                 std::numeric_limits<float>::quiet_NaN()));
    }
  }

  static PagedAttentionParams For(PagedAttentionParams p, const Batch& b) {
    p.num_tokens = b.num_tokens;
    p.uniform_query_len = b.uniform_query_len;
    return p;
  }

  absl::Status Run(Backend& b, const PagedAttentionParams& p,
                   const Batch& batch) {
    return batch.uniform_query_len > 0
               ? LaunchPagedAttentionUniformDecode(*b.stream, For(p, batch))
               : LaunchPagedAttention(*b.stream, For(p, batch));
  }

  std::vector<float> CpuOutput(const Batch& b) {
    return cpu().Read<float>(cpu_.output, b.num_tokens * RowElements());
  }
  std::vector<float> GpuOutput(const Batch& b) {
    return ReadGpuBf16(gpu_.output, b.num_tokens * RowElements());
  }

  // Runs `batch` on both backends and compares.
  std::vector<float> ExpectGpuMatchesCpu(const Batch& batch, uint32_t seed,
                                         const std::string& what) {
    WriteStep(batch, seed);
    EXPECT_TRUE(Run(cpu(), cpu_, batch).ok());
    const absl::Status status = Run(gpu(), gpu_, batch);
    EXPECT_TRUE(status.ok()) << status;
    const std::vector<float> want = CpuOutput(batch);
    const std::vector<float> got = GpuOutput(batch);
    ExpectClose(got, want, kRel, kAbs, what);
    return got;
  }

  AttentionConfig c_{};
  int max_blocks_per_seq_ = 0;
  int num_blocks_ = 0;
  PagedAttentionParams cpu_, gpu_;
};

// Prompts of several lengths (one longer than a key tile of 64), then
// padding tokens.
const Batch kPrefill = {{{7, 7}, {13, 13}, {1, 1}, {9, 70}}, 32, 0};
// Decodes with long contexts (many splits' worth, though varlen does not
// split), a chunk continuing a prompt mid-sequence, a fresh short
// prompt; 2 padding tokens.
const Batch kMixed = {{{1, 1100}, {5, 40}, {1, 3}, {6, 520}, {1, 512}}, 16, 0};
// One-token decodes of many lengths (1500: 32 splits of 47 keys, 513: 17
// splits of 32 with a 1-key tail, 64, 1), plus 2 padding requests (seq_len 0).
const Batch kDecodeK1 = {
    {{1, 1500}, {1, 1}, {1, 513}, {1, 512}, {1, 1024}, {1, 64}}, 8, 1};
// Three-token (speculative) decodes, whose query tokens may land in different
// splits (positions 511..513), one padding request.
const Batch kDecodeK3 = {{{3, 3}, {3, 514}, {3, 1200}}, 12, 3};

TEST_P(PagedAttentionCudaTest, VarlenPrefillMatchesCpu) {
  const std::vector<float> got =
      ExpectGpuMatchesCpu(kPrefill, 100, "varlen prefill");
  // Padding rows (tokens 30, 31) are exactly zero.
  for (size_t i = 30 * RowElements(); i < got.size(); ++i) {
    ASSERT_EQ(got[i], 0.0f) << i;
  }
}

TEST_P(PagedAttentionCudaTest, VarlenMixedMatchesCpu) {
  ExpectGpuMatchesCpu(kMixed, 200, "varlen mixed");
}

TEST_P(PagedAttentionCudaTest, SplitKDecodeMatchesCpu) {
  const std::vector<float> got =
      ExpectGpuMatchesCpu(kDecodeK1, 300, "split-K decode, k=1");
  for (size_t i = 6 * RowElements(); i < got.size(); ++i) {
    ASSERT_EQ(got[i], 0.0f) << "padding request row, element " << i;
  }
  // The varlen routine on the same (uniform) batch: same math, another
  // summation order, so equal within tolerance (not bit for bit).
  ASSERT_TRUE(LaunchPagedAttention(*gpu().stream, For(gpu_, kDecodeK1)).ok());
  ExpectClose(GpuOutput(kDecodeK1), got, kRel, kAbs, "varlen vs split-K");
}

TEST_P(PagedAttentionCudaTest, SplitKDecodeWithThreeQueryTokensMatchesCpu) {
  const std::vector<float> got =
      ExpectGpuMatchesCpu(kDecodeK3, 400, "split-K decode, k=3");
  for (size_t i = 9 * RowElements(); i < got.size(); ++i) {
    ASSERT_EQ(got[i], 0.0f) << i;
  }
}

// Contexts of 16k+ tokens: each split CTA takes hundreds of keys (many
// tiles).
TEST_P(PagedAttentionCudaTest, LongContextDecodeSpansManyTiles) {
  if (c_.max_context < 17000) GTEST_SKIP() << "needs a 17k-token context";
  const Batch longest = {{{1, 17000}, {1, 16385}, {1, 1}}, 4, 1};
  ExpectGpuMatchesCpu(longest, 450, "split-K decode, 17k context");
}

TEST_P(PagedAttentionCudaTest, AllPaddingDecodeBatchIsZeros) {
  const Batch empty = {{}, 4, 1};
  WriteStep(empty, 500);
  ASSERT_TRUE(Run(gpu(), gpu_, empty).ok());
  for (float v : GpuOutput(empty)) ASSERT_EQ(v, 0.0f);
}

// A graph captured for one batch and replayed after another batch of the
// same padded shape was written into the static buffers equals an eager run
// on the new batch, bit for bit (the kernels are deterministic and read all
// metadata on the device).
TEST_P(PagedAttentionCudaTest, DecodeGraphReplayIsBitIdenticalToEager) {
  WriteStep(kDecodeK1, 600);
  Stream& stream = *gpu().stream;
  ASSERT_TRUE(Run(gpu(), gpu_, kDecodeK1).ok());  // warm-up
  ASSERT_TRUE(stream.BeginCapture().ok());
  ASSERT_TRUE(Run(gpu(), gpu_, kDecodeK1).ok());
  auto graph = stream.EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();

  // Fewer requests, other lengths (one grows past 1500), other blocks.
  const Batch next = {{{1, 30}, {1, 1537}, {1, 16}}, 8, 1};
  WriteStep(next, 601);
  ASSERT_TRUE((*graph)->Replay().ok());
  const std::vector<float> replayed = GpuOutput(next);
  ASSERT_TRUE(Run(cpu(), cpu_, next).ok());
  ExpectClose(replayed, CpuOutput(next), kRel, kAbs, "decode replay vs cpu");
  WriteStep(next, 601);  // resets the output to NaN
  ASSERT_TRUE(Run(gpu(), gpu_, next).ok());
  EXPECT_TRUE(SameBits(GpuOutput(next), replayed));
}

TEST_P(PagedAttentionCudaTest, VarlenGraphReplayIsBitIdenticalToEager) {
  Batch mixed = kMixed;
  mixed.num_tokens = kPrefill.num_tokens;  // same padded key
  WriteStep(kPrefill, 700);
  Stream& stream = *gpu().stream;
  ASSERT_TRUE(Run(gpu(), gpu_, kPrefill).ok());
  ASSERT_TRUE(stream.BeginCapture().ok());
  ASSERT_TRUE(Run(gpu(), gpu_, kPrefill).ok());
  auto graph = stream.EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();

  WriteStep(mixed, 701);
  ASSERT_TRUE((*graph)->Replay().ok());
  const std::vector<float> replayed = GpuOutput(mixed);
  ASSERT_TRUE(Run(cpu(), cpu_, mixed).ok());
  ExpectClose(replayed, CpuOutput(mixed), kRel, kAbs, "varlen replay vs cpu");
  WriteStep(mixed, 701);
  ASSERT_TRUE(Run(gpu(), gpu_, mixed).ok());
  EXPECT_TRUE(SameBits(GpuOutput(mixed), replayed));
}

// The tensor-core split kernel (decode_kernel kTensorCores) against the
// CPU on the decode batches above (k = 1 and 3, padding requests, contexts
// of 1 to 1,500 tokens, 17k where the config allows), against the CUDA-core
// split kernel within tolerance, and graph replay bit-identical to eager.
// Configs it does not cover (head_dim other than 64 / 128, more than 16
// query rows per kv head) are refused with InvalidArgument, output
// untouched.
TEST_P(PagedAttentionCudaTest, TensorCoreSplitKDecodeMatchesCpu) {
  gpu_.decode_kernel = DecodeAttentionKernel::kTensorCores;
  const int group = c_.heads / c_.kv_heads;
  for (const Batch& batch : {kDecodeK1, kDecodeK3}) {
    SCOPED_TRACE(::testing::Message()
                 << "uniform_query_len " << batch.uniform_query_len);
    const bool covered = (c_.head_dim == 64 || c_.head_dim == 128) &&
                         group * batch.uniform_query_len <= 16;
    if (!covered) {
      WriteStep(batch, 800);
      const absl::Status status = Run(gpu(), gpu_, batch);
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      for (float v : GpuOutput(batch)) ASSERT_TRUE(std::isnan(v));
      continue;
    }
    const std::vector<float> got =
        ExpectGpuMatchesCpu(batch, 810, "tensor-core split-K decode");
    const int real_rows =
        static_cast<int>(batch.requests.size()) * batch.uniform_query_len;
    for (size_t i = real_rows * RowElements(); i < got.size(); ++i) {
      ASSERT_EQ(got[i], 0.0f) << "padding request row, element " << i;
    }
    gpu_.decode_kernel = DecodeAttentionKernel::kCudaCores;
    ASSERT_TRUE(Run(gpu(), gpu_, batch).ok());
    ExpectClose(GpuOutput(batch), got, kRel, kAbs,
                "CUDA cores vs tensor cores");
    gpu_.decode_kernel = DecodeAttentionKernel::kTensorCores;
  }
  if (!(c_.head_dim == 64 || c_.head_dim == 128) || group > 16) return;
  if (c_.max_context >= 17000) {
    const Batch longest = {{{1, 17000}, {1, 16385}, {1, 1}}, 4, 1};
    ExpectGpuMatchesCpu(longest, 820, "tensor-core split-K, 17k context");
  }
  // Graph replay on another batch of the same shape == eager, bit for bit.
  WriteStep(kDecodeK1, 830);
  Stream& stream = *gpu().stream;
  ASSERT_TRUE(Run(gpu(), gpu_, kDecodeK1).ok());
  ASSERT_TRUE(stream.BeginCapture().ok());
  ASSERT_TRUE(Run(gpu(), gpu_, kDecodeK1).ok());
  auto graph = stream.EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();
  const Batch next = {{{1, 30}, {1, 1537}, {1, 16}}, 8, 1};
  WriteStep(next, 831);
  ASSERT_TRUE((*graph)->Replay().ok());
  const std::vector<float> replayed = GpuOutput(next);
  ASSERT_TRUE(Run(cpu(), cpu_, next).ok());
  ExpectClose(replayed, CpuOutput(next), kRel, kAbs, "replay vs cpu");
  WriteStep(next, 831);
  ASSERT_TRUE(Run(gpu(), gpu_, next).ok());
  EXPECT_TRUE(SameBits(GpuOutput(next), replayed));
}

// Gemma 2's soft-cap and a sliding window (Mistral's, Gemma's local
// layers), written without a GPU (UnverifiedCudaKernels): every batch on the
// CUDA-core kernels (what kAuto picks for them) against the CPU kernel,
// each feature alone and both; a forced tensor-core kernel refuses them.
TEST_P(PagedAttentionCudaTest, SoftcapAndSlidingWindowMatchCpu) {
  struct Variant {
    float softcap;
    int window;
  };
  for (const Variant v : {Variant{2.0f, 0}, Variant{0.0f, 100},
                          Variant{0.0f, 7}, Variant{30.0f, 512}}) {
    SCOPED_TRACE(::testing::Message()
                 << "softcap " << v.softcap << ", window " << v.window);
    for (PagedAttentionParams* p : {&cpu_, &gpu_}) {
      p->softcap = v.softcap;
      p->sliding_window = v.window;
    }
    ExpectGpuMatchesCpu(kPrefill, 900, "varlen prefill");
    ExpectGpuMatchesCpu(kMixed, 901, "varlen mixed");
    ExpectGpuMatchesCpu(kDecodeK1, 902, "split-K decode, k=1");
    ExpectGpuMatchesCpu(kDecodeK3, 903, "split-K decode, k=3");
  }
  // Without them the same step gives other values: the test can fail.
  cpu_.softcap = gpu_.softcap = 0.0f;
  cpu_.sliding_window = gpu_.sliding_window = 7;
  WriteStep(kDecodeK1, 904);
  ASSERT_TRUE(Run(cpu(), cpu_, kDecodeK1).ok());
  const std::vector<float> windowed = CpuOutput(kDecodeK1);
  cpu_.sliding_window = 0;
  ASSERT_TRUE(Run(cpu(), cpu_, kDecodeK1).ok());
  double worst = 0;
  const std::vector<float> full = CpuOutput(kDecodeK1);
  for (size_t i = 0; i < full.size(); ++i) {
    worst = std::max(worst, std::abs(double{full[i]} - windowed[i]));
  }
  EXPECT_GT(worst, 1e-2);
  // The tensor-core kernels have neither: forced, they refuse.
  gpu_.sliding_window = 7;
  gpu_.decode_kernel = DecodeAttentionKernel::kTensorCores;
  EXPECT_FALSE(Run(gpu(), gpu_, kDecodeK1).ok());
  gpu_.decode_kernel = DecodeAttentionKernel::kAuto;
  gpu_.varlen_kernel = VarlenAttentionKernel::kTensorCores;
  EXPECT_FALSE(Run(gpu(), gpu_, kPrefill).ok());
  gpu_.varlen_kernel = VarlenAttentionKernel::kAuto;
  gpu_.sliding_window = 0;
}

// The launch needs (head_dim + 2) floats per (token, head, split); one
// float less is refused before anything runs.
TEST_P(PagedAttentionCudaTest, DecodeRefusesATooSmallWorkspace) {
  PagedAttentionParams p = For(gpu_, kDecodeK1);
  const int splits = CudaDecodeNumSplits(
      p.num_tokens, p.uniform_query_len, p.num_heads, p.num_kv_heads,
      static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size);
  const size_t needed =
      sizeof(float) * p.num_tokens * p.num_heads * splits * (p.head_dim + 2);
  ASSERT_LE(needed, p.workspace.size_bytes());
  p.workspace = p.workspace.Slice(0, needed - sizeof(float));
  const absl::Status status =
      LaunchPagedAttentionUniformDecode(*gpu().stream, p);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
}

INSTANTIATE_TEST_SUITE_P(
    Configs, PagedAttentionCudaTest,
    ::testing::Values(
        AttentionConfig{8, 2, 8, 4},     // the tiny gqa model: head_dim 8
        AttentionConfig{4, 4, 16, 16},   // MHA
        AttentionConfig{32, 8, 64, 16},  // Llama-3.2-1B
        AttentionConfig{4, 1, 128, 16},  // MQA, head_dim 128
        AttentionConfig{16, 1, 64, 16},  // GQA group 16 > 8 rows per CTA
        AttentionConfig{8, 4, 256, 8},   // the largest head_dim
        AttentionConfig{8, 2, 64, 16, 17408}),  // a 17k-token context
    Name);

}  // namespace
}  // namespace kernels
}  // namespace pdworker
