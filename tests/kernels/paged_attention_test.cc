#include "worker/kernels/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "tests/kernels/kernel_test_util.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::BitIdentical;
using testing::IsInvalidArgumentMentioning;
using testing::KernelTest;
using testing::MaxAbsDiff;
using testing::RandomFloats;

static_assert(kCpuPagedAttentionCGSupport == AttentionCGSupport::kAlways,
              "the CPU kernels read all step metadata at run time");

// Outputs are convex combinations of values in [-1, 1] with fp32 scores and
// exponentials: observed errors are ~1e-7; 1e-5 flags any masking, scaling
// or indexing bug (those are O(0.1)).
constexpr double kTolerance = 1e-5;

constexpr int kMaxNumSeqs = 8;
constexpr int kBlockSize = 4;
constexpr int kMaxBlocksPerSeq = 8;  // contexts up to 32 tokens
constexpr int kNumBlocks = 48;
// Never assigned to a request: unused block-table entries point here, and it
// holds large values, so reading it shows up in the results.
constexpr int32_t kJunkBlock = 0;
constexpr int kMaxTokens = 32;

struct TestRequest {
  int q_len = 0;
  int seq_len = 0;  // context including this step's q_len tokens
};

struct TestBatch {
  std::vector<TestRequest> requests;  // the real requests
  int num_tokens = 0;                 // padded
  // Uniform decode: query tokens per request; padding requests (seq_len 0)
  // fill up to num_tokens / uniform_query_len.
  int uniform_query_len = 0;
};

// Host copy of everything written into the static buffers for one step.
struct HostStep {
  TestBatch batch;
  std::vector<float> query;
  std::vector<float> key_cache, value_cache;
  std::vector<int32_t> seq_lens, query_start_loc, block_tables;
  int32_t num_reqs = 0;
};

// Straightforward attention over contiguous K/V gathered position by
// position through the block table, in double.
// `scale` 0: 1/sqrt(head_dim); `softcap` > 0: scores s become
// softcap * tanh(s / softcap) (Gemma 2).
std::vector<double> ReferenceAttention(const HostStep& s, int heads,
                                       int kv_heads, int head_dim,
                                       double scale = 0, double softcap = 0,
                                       int window = 0) {
  const int width = heads * head_dim;
  const int kv_width = kv_heads * head_dim;
  std::vector<double> out(static_cast<size_t>(s.batch.num_tokens) * width, 0.0);
  if (scale == 0) scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  for (size_t r = 0; r < s.batch.requests.size(); ++r) {
    const TestRequest& req = s.batch.requests[r];
    const int start = s.query_start_loc[r];
    for (int j = 0; j < req.q_len; ++j) {
      const int position = req.seq_len - req.q_len + j;
      const int t = start + j;
      for (int h = 0; h < heads; ++h) {
        const int kv_head = h / (heads / kv_heads);
        std::vector<double> scores(position + 1);
        std::vector<const float*> values(position + 1);
        for (int pos = 0; pos <= position; ++pos) {
          if (window > 0 && pos <= position - window) {
            scores[pos] = -std::numeric_limits<double>::infinity();
            values[pos] = nullptr;
            continue;
          }
          const int block =
              s.block_tables[r * kMaxBlocksPerSeq + pos / kBlockSize];
          const size_t base =
              (static_cast<size_t>(block) * kBlockSize + pos % kBlockSize) *
                  kv_width +
              kv_head * head_dim;
          double dot = 0.0;
          for (int d = 0; d < head_dim; ++d) {
            dot += double{s.query[(t * heads + h) * head_dim + d]} *
                   s.key_cache[base + d];
          }
          scores[pos] = dot * scale;
          if (softcap > 0) {
            scores[pos] = softcap * std::tanh(scores[pos] / softcap);
          }
          values[pos] = &s.value_cache[base];
        }
        const double max = *std::max_element(scores.begin(), scores.end());
        double sum = 0.0;
        for (double& x : scores) sum += (x = std::exp(x - max));
        for (int d = 0; d < head_dim; ++d) {
          double acc = 0.0;
          for (int pos = 0; pos <= position; ++pos) {
            if (values[pos] != nullptr)
              acc += scores[pos] / sum * values[pos][d];
          }
          out[(t * heads + h) * head_dim + d] = acc;
        }
      }
    }
  }
  return out;
}

// (num_heads, num_kv_heads, head_dim)
class PagedAttentionTest
    : public KernelTest,
      public ::testing::WithParamInterface<std::tuple<int, int, int>> {
 protected:
  void SetUp() override {
    KernelTest::SetUp();
    std::tie(heads_, kv_heads_, head_dim_) = GetParam();
    const int cache_elements = kNumBlocks * kBlockSize * kv_heads_ * head_dim_;
    p_.num_reqs = AllocElements<int32_t>(1, "num_reqs");
    p_.query_start_loc = AllocElements<int32_t>(kMaxNumSeqs + 1);
    p_.seq_lens = AllocElements<int32_t>(kMaxNumSeqs);
    p_.block_tables = AllocElements<int32_t>(kMaxNumSeqs * kMaxBlocksPerSeq);
    p_.query = AllocElements<float>(kMaxTokens * heads_ * head_dim_);
    p_.key_cache = AllocElements<float>(cache_elements);
    p_.value_cache = AllocElements<float>(cache_elements);
    p_.output = AllocElements<float>(kMaxTokens * heads_ * head_dim_);
    p_.max_num_seqs = kMaxNumSeqs;
    p_.num_heads = heads_;
    p_.num_kv_heads = kv_heads_;
    p_.head_dim = head_dim_;
    p_.block_size = kBlockSize;
    p_.num_blocks = kNumBlocks;
    p_.max_blocks_per_seq = kMaxBlocksPerSeq;
  }

  // Builds a step for `batch` (random q and K/V, shuffled block ids) and
  // writes it into the static buffers, as the model runner would.
  HostStep WriteStep(const TestBatch& batch, uint32_t seed) {
    HostStep s;
    s.batch = batch;
    std::mt19937 rng(seed);
    const int kv_width = kv_heads_ * head_dim_;
    const size_t cache_elements =
        static_cast<size_t>(kNumBlocks) * kBlockSize * kv_width;
    // Unwritten cache positions hold NaN: reading one poisons the output.
    s.key_cache.assign(cache_elements, std::numeric_limits<float>::quiet_NaN());
    s.value_cache = s.key_cache;
    const std::vector<float> junk = RandomFloats(
        static_cast<size_t>(kBlockSize) * kv_width, seed + 1, 50.0f, 60.0f);
    std::copy(junk.begin(), junk.end(), s.key_cache.begin());
    std::copy(junk.begin(), junk.end(), s.value_cache.begin());

    std::vector<int32_t> free_blocks(kNumBlocks - 1);
    std::iota(free_blocks.begin(), free_blocks.end(), 1);
    std::shuffle(free_blocks.begin(), free_blocks.end(), rng);
    size_t next_block = 0;

    s.seq_lens.assign(kMaxNumSeqs, 0);
    s.query_start_loc.assign(kMaxNumSeqs + 1, 0);
    s.block_tables.assign(kMaxNumSeqs * kMaxBlocksPerSeq, kJunkBlock);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    int tokens = 0;
    for (size_t r = 0; r < batch.requests.size(); ++r) {
      const TestRequest& req = batch.requests[r];
      s.seq_lens[r] = req.seq_len;
      s.query_start_loc[r] = tokens;
      tokens += req.q_len;
      const int blocks = (req.seq_len + kBlockSize - 1) / kBlockSize;
      for (int b = 0; b < blocks; ++b) {
        const int32_t block = free_blocks.at(next_block++);
        s.block_tables[r * kMaxBlocksPerSeq + b] = block;
        const int valid = std::min(kBlockSize, req.seq_len - b * kBlockSize);
        for (size_t i = 0; i < static_cast<size_t>(valid) * kv_width; ++i) {
          const size_t at =
              static_cast<size_t>(block) * kBlockSize * kv_width + i;
          s.key_cache[at] = dist(rng);
          s.value_cache[at] = dist(rng);
        }
      }
    }
    s.num_reqs = static_cast<int32_t>(batch.requests.size());
    // Entries past num_reqs: the runner's padding convention (empty).
    for (int r = s.num_reqs; r <= kMaxNumSeqs; ++r) {
      s.query_start_loc[r] = tokens;
    }
    if (batch.uniform_query_len > 0) {
      // Padding requests own the padding tokens (seq_len stays 0).
      for (int r = s.num_reqs; r <= batch.num_tokens / batch.uniform_query_len;
           ++r) {
        s.query_start_loc[r] = r * batch.uniform_query_len;
      }
    }
    EXPECT_LE(tokens, batch.num_tokens);
    s.query = RandomFloats(
        static_cast<size_t>(batch.num_tokens) * heads_ * head_dim_, seed + 2);

    Write(p_.num_reqs, std::vector<int32_t>{s.num_reqs});
    Write(p_.query_start_loc, s.query_start_loc);
    Write(p_.seq_lens, s.seq_lens);
    Write(p_.block_tables, s.block_tables);
    Write(p_.query, s.query);
    Write(p_.key_cache, s.key_cache);
    Write(p_.value_cache, s.value_cache);
    // Stale results from an earlier step must not survive.
    Write(p_.output,
          std::vector<float>(kMaxTokens * heads_ * head_dim_,
                             std::numeric_limits<float>::quiet_NaN()));
    return s;
  }

  PagedAttentionParams ParamsFor(const TestBatch& batch) const {
    PagedAttentionParams p = p_;
    p.num_tokens = batch.num_tokens;
    p.uniform_query_len = batch.uniform_query_len;
    return p;
  }

  std::vector<float> Output(int num_tokens) {
    return Read<float>(p_.output,
                       static_cast<size_t>(num_tokens) * heads_ * head_dim_);
  }

  void ExpectMatchesReference(const HostStep& s) {
    const std::vector<float> out = Output(s.batch.num_tokens);
    for (float v : out) ASSERT_FALSE(std::isnan(v));
    EXPECT_LE(
        MaxAbsDiff(out, ReferenceAttention(s, heads_, kv_heads_, head_dim_)),
        kTolerance);
  }

  int heads_ = 0, kv_heads_ = 0, head_dim_ = 0;
  PagedAttentionParams p_;
};

// Several prompts of different lengths, then 5 padding tokens.
const TestBatch kPrefill = {{{5, 5}, {13, 13}, {1, 1}}, 24, 0};
// Two decodes, a chunk continuing a prompt from position 14 (context 0..13
// already cached), a short fresh prompt, another decode; 2 padding tokens.
const TestBatch kMixed = {{{1, 9}, {1, 17}, {6, 20}, {4, 4}, {1, 32}}, 15, 0};
// One-token decodes; 3 padding requests (seq_len 0).
const TestBatch kDecodeK1 = {{{1, 1}, {1, 7}, {1, 32}, {1, 12}, {1, 4}}, 8, 1};
// Three-token (speculative) decodes; one padding request.
const TestBatch kDecodeK3 = {{{3, 3}, {3, 10}, {3, 25}}, 12, 3};

TEST_P(PagedAttentionTest, PrefillOfSeveralRequests) {
  const HostStep s = WriteStep(kPrefill, 100);
  ASSERT_TRUE(LaunchPagedAttention(stream(), ParamsFor(kPrefill)).ok());
  ExpectMatchesReference(s);
  // Padding rows are zero.
  const std::vector<float> out = Output(kPrefill.num_tokens);
  for (size_t i = 19 * heads_ * head_dim_; i < out.size(); ++i) {
    ASSERT_EQ(out[i], 0.0f) << i;
  }
}

// Gemma 2's attention: another softmax scale and soft-capped scores, in
// both routines. The CPU backend's only (CUDA refuses a softcap).
TEST_P(PagedAttentionTest, ScaleAndSoftcapMatchTheReference) {
  if (stream().kind() != DeviceKind::kCpu) GTEST_SKIP() << "CPU only";
  for (const TestBatch& batch : {kMixed, kDecodeK1}) {
    const HostStep s = WriteStep(batch, 300);
    PagedAttentionParams p = ParamsFor(batch);
    p.scale = 1.5f;
    p.softcap = 1.25f;
    ASSERT_TRUE((batch.uniform_query_len > 0
                     ? LaunchPagedAttentionUniformDecode(stream(), p)
                     : LaunchPagedAttention(stream(), p))
                    .ok());
    const std::vector<float> out = Output(batch.num_tokens);
    EXPECT_LE(MaxAbsDiff(out, ReferenceAttention(s, heads_, kv_heads_,
                                                 head_dim_, 1.5, 1.25)),
              kTolerance);
    // Without the cap the same scores give other outputs: it was applied.
    EXPECT_GT(MaxAbsDiff(out, ReferenceAttention(s, heads_, kv_heads_,
                                                 head_dim_, 1.5, 0)),
              10 * kTolerance);
    p.softcap = -1.0f;
    EXPECT_THAT(LaunchPagedAttention(stream(), p),
                IsInvalidArgumentMentioning("softcap"));
  }
}

// A sliding window (Mistral's, Gemma's): each query sees its last `window`
// positions only, in both routines, across block boundaries. CPU only.
TEST_P(PagedAttentionTest, SlidingWindowMasksOlderPositions) {
  if (stream().kind() != DeviceKind::kCpu) GTEST_SKIP() << "CPU only";
  for (const TestBatch& batch : {kMixed, kDecodeK3}) {
    for (const int window : {1, 5, 9}) {
      SCOPED_TRACE(window);
      const HostStep s = WriteStep(batch, 400 + window);
      PagedAttentionParams p = ParamsFor(batch);
      p.sliding_window = window;
      ASSERT_TRUE((batch.uniform_query_len > 0
                       ? LaunchPagedAttentionUniformDecode(stream(), p)
                       : LaunchPagedAttention(stream(), p))
                      .ok());
      const std::vector<float> out = Output(batch.num_tokens);
      EXPECT_LE(MaxAbsDiff(out, ReferenceAttention(s, heads_, kv_heads_,
                                                   head_dim_, 0, 0, window)),
                kTolerance);
      EXPECT_GT(
          MaxAbsDiff(out, ReferenceAttention(s, heads_, kv_heads_, head_dim_)),
          10 * kTolerance);
    }
  }
  PagedAttentionParams bad = ParamsFor(kMixed);
  bad.sliding_window = -1;
  EXPECT_THAT(LaunchPagedAttention(stream(), bad),
              IsInvalidArgumentMentioning("sliding_window"));
}

TEST_P(PagedAttentionTest, MixedDecodesAndAChunkStartingMidSequence) {
  const HostStep s = WriteStep(kMixed, 200);
  ASSERT_TRUE(LaunchPagedAttention(stream(), ParamsFor(kMixed)).ok());
  ExpectMatchesReference(s);
}

TEST_P(PagedAttentionTest, UniformDecodeSingleToken) {
  const HostStep s = WriteStep(kDecodeK1, 300);
  ASSERT_TRUE(
      LaunchPagedAttentionUniformDecode(stream(), ParamsFor(kDecodeK1)).ok());
  ExpectMatchesReference(s);  // padding requests: zeros, no NaN
  const std::vector<float> decode = Output(kDecodeK1.num_tokens);
  // The varlen routine computes the same thing for a uniform batch.
  ASSERT_TRUE(LaunchPagedAttention(stream(), ParamsFor(kDecodeK1)).ok());
  EXPECT_TRUE(BitIdentical(Output(kDecodeK1.num_tokens), decode));
}

TEST_P(PagedAttentionTest, UniformDecodeThreeTokens) {
  const HostStep s = WriteStep(kDecodeK3, 400);
  ASSERT_TRUE(
      LaunchPagedAttentionUniformDecode(stream(), ParamsFor(kDecodeK3)).ok());
  ExpectMatchesReference(s);
  const std::vector<float> out = Output(kDecodeK3.num_tokens);
  for (size_t i = 9 * heads_ * head_dim_; i < out.size(); ++i) {
    ASSERT_EQ(out[i], 0.0f) << i;
  }
}

TEST_P(PagedAttentionTest, AllPaddingDecodeBatchIsZeros) {
  const TestBatch empty = {{}, 4, 1};
  WriteStep(empty, 500);
  ASSERT_TRUE(
      LaunchPagedAttentionUniformDecode(stream(), ParamsFor(empty)).ok());
  for (float v : Output(4)) ASSERT_EQ(v, 0.0f);
}

// A graph captured for one batch, replayed after another batch's metadata
// (num_reqs, query_start_loc, seq_lens, block tables) and data were written
// into the same buffers, equals an eager run on the new batch.
TEST_P(PagedAttentionTest, VarlenGraphReplayReadsMetadataAtRunTime) {
  TestBatch mixed = kMixed;
  mixed.num_tokens = kPrefill.num_tokens;  // same padded key
  WriteStep(kPrefill, 600);
  ASSERT_TRUE(stream().BeginCapture().ok());
  ASSERT_TRUE(LaunchPagedAttention(stream(), ParamsFor(kPrefill)).ok());
  absl::StatusOr<std::unique_ptr<CapturedGraph>> graph = stream().EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();

  const HostStep s = WriteStep(mixed, 601);
  ASSERT_TRUE((*graph)->Replay().ok());
  ExpectMatchesReference(s);
  const std::vector<float> replayed = Output(mixed.num_tokens);

  WriteStep(mixed, 601);
  ASSERT_TRUE(LaunchPagedAttention(stream(), ParamsFor(mixed)).ok());
  EXPECT_TRUE(BitIdentical(Output(mixed.num_tokens), replayed));
}

TEST_P(PagedAttentionTest, DecodeGraphReplayReadsMetadataAtRunTime) {
  WriteStep(kDecodeK1, 700);
  ASSERT_TRUE(stream().BeginCapture().ok());
  ASSERT_TRUE(
      LaunchPagedAttentionUniformDecode(stream(), ParamsFor(kDecodeK1)).ok());
  absl::StatusOr<std::unique_ptr<CapturedGraph>> graph = stream().EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();

  // Fewer real requests, other lengths, other blocks.
  const TestBatch next = {{{1, 30}, {1, 2}, {1, 16}}, 8, 1};
  const HostStep s = WriteStep(next, 701);
  ASSERT_TRUE((*graph)->Replay().ok());
  ExpectMatchesReference(s);
  const std::vector<float> replayed = Output(next.num_tokens);

  WriteStep(next, 701);
  ASSERT_TRUE(
      LaunchPagedAttentionUniformDecode(stream(), ParamsFor(next)).ok());
  EXPECT_TRUE(BitIdentical(Output(next.num_tokens), replayed));
}

// MHA; GQA with 4 heads per kv head; MQA; GQA with 12 heads per kv head
// (more than one pass of the kernel's 8-head scratch, over two kv heads).
// head_dim 12 is not a multiple of the dot product's 8 lanes.
INSTANTIATE_TEST_SUITE_P(
    Heads, PagedAttentionTest,
    ::testing::Values(std::make_tuple(4, 4, 16), std::make_tuple(8, 2, 16),
                      std::make_tuple(6, 1, 12), std::make_tuple(24, 2, 12)),
    [](const ::testing::TestParamInfo<std::tuple<int, int, int>>& info) {
      return "H" + std::to_string(std::get<0>(info.param)) + "KV" +
             std::to_string(std::get<1>(info.param)) + "D" +
             std::to_string(std::get<2>(info.param));
    });

class PagedAttentionErrorsTest : public KernelTest {
 protected:
  PagedAttentionParams Valid() {
    PagedAttentionParams p;
    p.num_tokens = 4;
    p.max_num_seqs = 4;
    p.num_heads = 4;
    p.num_kv_heads = 2;
    p.head_dim = 8;
    p.block_size = 4;
    p.num_blocks = 6;
    p.max_blocks_per_seq = 3;
    p.uniform_query_len = 1;
    p.num_reqs = AllocElements<int32_t>(1);
    p.query_start_loc = AllocElements<int32_t>(5);
    p.seq_lens = AllocElements<int32_t>(4);
    p.block_tables = AllocElements<int32_t>(4 * 3);
    p.query = AllocElements<float>(4 * 4 * 8);
    p.key_cache = AllocElements<float>(6 * 4 * 2 * 8);
    p.value_cache = AllocElements<float>(6 * 4 * 2 * 8);
    p.output = AllocElements<float>(4 * 4 * 8);
    Write(p.num_reqs, std::vector<int32_t>{0});
    Write(p.seq_lens, std::vector<int32_t>(4, 0));
    return p;
  }
};

TEST_F(PagedAttentionErrorsTest, RejectsBadBuffersAndShapes) {
  const PagedAttentionParams p = Valid();
  ASSERT_TRUE(LaunchPagedAttention(stream(), p).ok());
  ASSERT_TRUE(LaunchPagedAttentionUniformDecode(stream(), p).ok());
  auto expect_rejected = [&](const PagedAttentionParams& bad,
                             const char* text) {
    EXPECT_THAT(LaunchPagedAttention(stream(), bad),
                IsInvalidArgumentMentioning(text));
  };
  PagedAttentionParams bad = p;
  bad.num_reqs = DeviceBuffer();
  expect_rejected(bad, "'num_reqs'");
  // Uniform decode does not read num_reqs / query_start_loc.
  bad.query_start_loc = DeviceBuffer();
  EXPECT_TRUE(LaunchPagedAttentionUniformDecode(stream(), bad).ok());
  bad = p;
  bad.query_start_loc = AllocElements<int32_t>(4);
  expect_rejected(bad, "'query_start_loc'");
  bad = p;
  bad.seq_lens = AllocElements<int32_t>(3);
  expect_rejected(bad, "'seq_lens'");
  bad = p;
  bad.block_tables = AllocElements<int32_t>(4 * 3 - 1);
  expect_rejected(bad, "'block_tables'");
  bad = p;
  bad.query = AllocElements<float>(4 * 4 * 8 - 1);
  expect_rejected(bad, "'query'");
  bad = p;
  bad.key_cache = AllocElements<float>(6 * 4 * 2 * 8 - 1);
  expect_rejected(bad, "'key_cache'");
  bad = p;
  bad.value_cache = AllocElements<float>(5 * 4 * 2 * 8);
  expect_rejected(bad, "'value_cache'");
  bad = p;
  bad.output = AllocElements<float>(3 * 4 * 8);
  expect_rejected(bad, "'output'");
  bad = p;
  bad.output = p.query;
  expect_rejected(bad, "overlap");
  bad = p;
  bad.num_kv_heads = 3;
  expect_rejected(bad, "multiple of num_kv_heads");
  bad = p;
  bad.head_dim = 1024;
  expect_rejected(bad, "head_dim");

  bad = p;
  bad.uniform_query_len = 3;  // 4 tokens are not whole 3-token requests
  EXPECT_THAT(LaunchPagedAttentionUniformDecode(stream(), bad),
              IsInvalidArgumentMentioning("uniform_query_len"));
  bad.uniform_query_len = 0;
  EXPECT_THAT(LaunchPagedAttentionUniformDecode(stream(), bad),
              IsInvalidArgumentMentioning("uniform_query_len"));
  bad = p;
  bad.max_num_seqs = 2;  // 4 one-token requests do not fit
  bad.num_tokens = 4;
  EXPECT_THAT(LaunchPagedAttentionUniformDecode(stream(), bad),
              IsInvalidArgumentMentioning("max_num_seqs"));
}

// Which varlen kernels a model may force, on which backend: the reason a
// refusal gives names what is missing.
TEST(CheckVarlenAttentionKernelTest, RefusesWhatTheDeviceOrModelLacks) {
  using K = VarlenAttentionKernel;
  // The Llama-3.2-1B layout: head_dim 64, 32 heads over 8 kv heads.
  EXPECT_TRUE(
      CheckVarlenAttentionKernel(DeviceKind::kCpu, K::kAuto, 64, 32, 8).ok());
  for (const K kernel : {K::kTensorCores, K::kWarpgroupMma, K::kCudaCores}) {
    const absl::Status cpu =
        CheckVarlenAttentionKernel(DeviceKind::kCpu, kernel, 64, 32, 8);
    EXPECT_EQ(cpu.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(cpu.message(), ::testing::HasSubstr("must be auto on the cpu"));
  }
  EXPECT_TRUE(
      CheckVarlenAttentionKernel(DeviceKind::kCuda, K::kTensorCores, 64, 32, 8)
          .ok());
  EXPECT_TRUE(
      CheckVarlenAttentionKernel(DeviceKind::kCuda, K::kCudaCores, 96, 32, 2)
          .ok());
  // head_dim 96, and a GQA group of 16: no tensor-core kernel covers them.
  for (const auto& [head_dim, kv_heads] :
       {std::pair<int, int>{96, 8}, std::pair<int, int>{64, 2}}) {
    for (const K kernel : {K::kTensorCores, K::kWarpgroupMma}) {
      const absl::Status status = CheckVarlenAttentionKernel(
          DeviceKind::kCuda, kernel, head_dim, 32, kv_heads);
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(status.message(),
                  ::testing::HasSubstr(absl::StrCat(
                      "head_dim ", head_dim, " and 32 heads over ", kv_heads)));
    }
  }
  // The warpgroup-MMA kernel needs compute capability 9.0.
  const absl::Status wgmma = CheckVarlenAttentionKernel(
      DeviceKind::kCuda, K::kWarpgroupMma, 64, 32, 8);
  if (PagedAttentionHasWarpgroupMma(DeviceKind::kCuda)) {
    EXPECT_TRUE(wgmma.ok()) << wgmma;
  } else {
    EXPECT_EQ(wgmma.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(wgmma.message(),
                ::testing::HasSubstr("compute capability 9.0"));
  }
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker

namespace pdworker {
namespace kernels {
namespace {

// The CUDA decode routine's split count and workspace are host arithmetic,
// checked here on every machine: the workspace a worker allocates at startup
// (PagedAttentionWorkspaceBytes for its largest decode batch) must hold what
// any smaller launch of the same model uses, since the launch check refuses
// a short workspace and a captured graph bakes the split count in.
TEST(CudaDecodeSplitTest, StartupWorkspaceHoldsEverySmallerLaunch) {
  struct Model {
    int heads, kv_heads, head_dim;
  };
  for (const Model m : {Model{32, 8, 64}, Model{14, 2, 64}, Model{32, 32, 128},
                        Model{8, 1, 256}, Model{4, 4, 16}}) {
    for (const int max_blocks : {4, 64, 2048}) {
      const int64_t max_context = int64_t{max_blocks} * 16;
      for (const int k : {1, 2, 3, 8}) {
        for (const int max_tokens : {8, 64, 1024}) {
          const size_t allocated = PagedAttentionWorkspaceBytes(
              max_tokens, m.heads, m.head_dim, max_blocks, 16);
          for (int tokens = k; tokens <= max_tokens; tokens += k) {
            const int splits = CudaDecodeNumSplits(tokens, k, m.heads,
                                                   m.kv_heads, max_context);
            ASSERT_GE(splits, 1);
            ASSERT_LE(splits, kCudaDecodeMaxSplits);
            // Never more splits than the longest context can give keys.
            ASSERT_LE(splits, (max_context + kCudaDecodeMinSplitKeys - 1) /
                                  kCudaDecodeMinSplitKeys);
            const size_t used =
                sizeof(float) * tokens * m.heads * splits * (m.head_dim + 2);
            ASSERT_LE(used, allocated)
                << "heads " << m.heads << " kv " << m.kv_heads << " k " << k
                << " tokens " << tokens << " of " << max_tokens;
          }
        }
      }
    }
  }
}

// Small batches are spread over many CTAs and large ones are not split
// (paged_attention.h's example for Llama-3.2-1B: 32 heads, 8 kv heads).
TEST(CudaDecodeSplitTest, SplitsShrinkAsTheBatchFillsTheGpu) {
  const int64_t context = 131072;
  int previous = kCudaDecodeMaxSplits + 1;
  for (const int batch : {1, 2, 4, 8, 16, 32, 64, 128, 256}) {
    const int splits = CudaDecodeNumSplits(batch, 1, 32, 8, context);
    EXPECT_LE(splits, previous) << "batch " << batch;
    EXPECT_GE(int64_t{splits} * batch * 8, kCudaDecodeTargetCtas)
        << "batch " << batch << ": too few CTAs";
    previous = splits;
  }
  EXPECT_EQ(CudaDecodeNumSplits(1, 1, 32, 8, context), kCudaDecodeMaxSplits);
  EXPECT_EQ(CudaDecodeNumSplits(64, 1, 32, 8, context), 1);
  // A short maximum context caps the split: 100 tokens give 4 splits of >=
  // 32 keys at most.
  EXPECT_EQ(CudaDecodeNumSplits(1, 1, 32, 8, 100), 4);
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
