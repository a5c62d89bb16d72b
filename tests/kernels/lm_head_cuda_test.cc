// gather_rows and the LM head on CUDA vs the CPU kernels. The gather is a
// copy (exact); the logits are an fp32-output GEMM of bf16 operands, so they
// differ from the CPU's fp32 GEMM only by summation order: within
// 1e-5 · max Σ|h|·|w| + 1e-6 · |cpu| (see linear_cuda_test).
// The one-row head that folds its logits for the greedy sampler
// (lm_head_greedy.cu) against the CUDA-core skinny GEMM and the greedy
// sampler's own pass, bit for bit, and the CPU sampler.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/kernels/cuda_kernel_test_util.h"
#include "worker/kernels/lm_head.h"
#include "worker/kernels/rms_norm.h"
#include "worker/kernels/sampling.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::Backend;
using testing::CudaKernelTest;
using testing::ExpectClose;
using testing::RandomBf16Floats;
using testing::SameBits;

constexpr int kTokens = 12;
constexpr int kHidden = 64;
constexpr int kVocab = 1000;

class LmHeadCudaTest : public CudaKernelTest {};

TEST_F(LmHeadCudaTest, GatherRowsCopiesExactly) {
  const std::vector<float> in = RandomBf16Floats(kTokens * kHidden, 31);
  const std::vector<int32_t> indices = {11, 0, -1, kTokens, 5};
  const int n = static_cast<int>(indices.size());
  GatherRowsParams cpu_p{CpuFloats(in),
                         cpu().Upload(indices),
                         cpu().Alloc(4 * n * kHidden),
                         kTokens,
                         n,
                         kHidden};
  ASSERT_TRUE(LaunchGatherRows(*cpu().stream, cpu_p).ok());
  GatherRowsParams gpu_p{GpuBf16(in),
                         gpu().Upload(indices),
                         gpu().Alloc(2 * n * kHidden),
                         kTokens,
                         n,
                         kHidden,
                         DType::kBFloat16};
  ASSERT_TRUE(LaunchGatherRows(*gpu().stream, gpu_p).ok());
  EXPECT_TRUE(SameBits(ReadGpuBf16(gpu_p.output, n * kHidden),
                       cpu().Read<float>(cpu_p.output, n * kHidden)));
}

// Without a cap, and with Gemma 2's final logit soft-cap (a kernel after
// the head's GEMM, written without a GPU): the logits against the CPU
// kernel's, padding rows zero; the greedy head (which folds uncapped
// logits) is not offered under a cap.
TEST_F(LmHeadCudaTest, LogitsMatchTheCpuKernelAndPaddingRowsAreZero) {
  const std::vector<float> hidden = RandomBf16Floats(kTokens * kHidden, 32);
  const std::vector<float> weight = RandomBf16Floats(kVocab * kHidden, 33);
  const std::vector<int32_t> indices = {3, 11, 7, -1};  // last: padding
  const int rows = static_cast<int>(indices.size());
  // 2: the logits reach a few units, so tanh bends them.
  for (const float cap : {0.0f, 2.0f}) {
    SCOPED_TRACE(::testing::Message() << "softcap " << cap);
    LmHeadParams cpu_p;
    cpu_p.hidden = CpuFloats(hidden);
    cpu_p.logits_indices = cpu().Upload(indices);
    cpu_p.gathered = cpu().Alloc(4 * rows * kHidden);
    cpu_p.weight = CpuFloats(weight);
    cpu_p.logits = cpu().Alloc(4 * rows * kVocab);
    cpu_p.num_tokens = kTokens;
    cpu_p.num_rows = rows;
    cpu_p.hidden_size = kHidden;
    cpu_p.vocab_size = kVocab;
    cpu_p.softcap = cap;
    ASSERT_TRUE(LaunchLmHead(*cpu().stream, cpu_p).ok());
    const std::vector<float> want =
        cpu().Read<float>(cpu_p.logits, rows * kVocab);

    LmHeadParams gpu_p = cpu_p;
    gpu_p.hidden = GpuBf16(hidden);
    gpu_p.logits_indices = gpu().Upload(indices);
    gpu_p.gathered = gpu().Alloc(2 * rows * kHidden);
    gpu_p.weight = GpuBf16(weight);
    gpu_p.logits = gpu().Alloc(4 * rows * kVocab);
    gpu_p.dtype = DType::kBFloat16;
    ASSERT_TRUE(LaunchLmHead(*gpu().stream, gpu_p).ok());
    const std::vector<float> got =
        gpu().Read<float>(gpu_p.logits, rows * kVocab);
    // |h|, |w| <= 1 and 64 terms: Σ|h||w| <= 64; tanh only shrinks errors.
    ExpectClose(got, want, cap == 0.0f ? 1e-6 : 1e-5, 1e-5 * kHidden, "logits");
    for (int v = 0; v < kVocab; ++v) {
      ASSERT_EQ(got[3 * kVocab + v], 0.0f) << "padding row, token " << v;
    }
    if (cap == 0.0f) continue;
    float largest = 0;
    for (const float v : got) largest = std::max(largest, std::abs(v));
    EXPECT_LE(largest, cap);
    LmHeadParams one_row = gpu_p;
    one_row.logits_indices = DeviceBuffer();
    one_row.num_rows = 1;
    one_row.num_tokens = 1;
    one_row.greedy_tiles = gpu().Alloc(GreedyTilesBytes(1));
    EXPECT_FALSE(LmHeadWritesGreedyTiles(*gpu().stream, one_row));
  }
}

struct GreedyHeadCase {
  int hidden;
  int vocab;
  // A planted argmax: row vocab / 3 is the hidden row itself (logit |h|²,
  // far above the random rows'), row vocab - 1 a copy of it (a tie across
  // slices: the lower id wins), and one weight of row vocab / 2 is NaN (a
  // NaN logit, which never wins and has no mass). Otherwise random rows,
  // where the log-sum-exp matters.
  bool planted;
};

struct Sample {
  int32_t token;
  float logprob;
};

// kGreedy sampling of one row of `logits` on `b`, from the logits or, when
// `tiles` is set, from the head's tile folds.
Sample SampleGreedy(Backend& b, DeviceBuffer logits, int vocab,
                    DeviceBuffer tiles = {}) {
  absl::StatusOr<size_t> workspace =
      SamplingWorkspaceBytesFor(b.device->kind(), vocab, 1);
  EXPECT_TRUE(workspace.ok()) << workspace.status();
  SamplingParams p;
  p.logits = logits;
  p.workspace = b.Alloc(workspace.ok() ? *workspace : 0);
  p.sampled_token_ids = b.Alloc(sizeof(int32_t));
  p.sampled_logprobs = b.Alloc(sizeof(float));
  p.num_reqs = 1;
  p.vocab_size = vocab;
  p.path = SamplingPath::kGreedy;
  p.greedy_tiles = tiles;
  const absl::Status status = LaunchSampling(*b.stream, p);
  EXPECT_TRUE(status.ok()) << status;
  return {b.Read<int32_t>(p.sampled_token_ids, 1)[0],
          b.Read<float>(p.sampled_logprobs, 1)[0]};
}

// Shapes: the tiny models' (every tile one id or empty), rows of 37 and 112
// 8-element groups (a partial last chunk; the 0.5B's 896), the 1B's 2,048
// with a vocabulary in the tens of thousands; prime vocabularies leave the
// last slices and tiles short or empty.
TEST_F(LmHeadCudaTest,
       GreedyHeadWritesTheSkinnyGemmsLogitsAndTheSamplersFolds) {
  const std::vector<GreedyHeadCase> cases = {
      {64, 256, true},    {64, 256, false},    {296, 5003, true},
      {896, 9973, false}, {2048, 32771, true}, {2048, 32771, false}};
  uint32_t seed = 100;
  for (const GreedyHeadCase& c : cases) {
    SCOPED_TRACE(absl::StrCat("hidden ", c.hidden, " vocab ", c.vocab,
                              c.planted ? " planted" : " random"));
    const std::vector<float> hidden = RandomBf16Floats(c.hidden, ++seed);
    std::vector<float> weight =
        RandomBf16Floats(static_cast<size_t>(c.vocab) * c.hidden, ++seed);
    const int winner = c.vocab / 3;
    if (c.planted) {
      for (const int row : {winner, c.vocab - 1}) {
        std::memcpy(&weight[static_cast<size_t>(row) * c.hidden], hidden.data(),
                    sizeof(float) * c.hidden);
      }
      weight[static_cast<size_t>(c.vocab / 2) * c.hidden + 5] =
          std::numeric_limits<float>::quiet_NaN();
    }
    LmHeadParams head;
    head.hidden = GpuBf16(hidden);
    head.weight = GpuBf16(weight);
    head.num_tokens = 1;
    head.num_rows = 1;
    head.hidden_size = c.hidden;
    head.vocab_size = c.vocab;
    head.dtype = DType::kBFloat16;

    LmHeadParams fused = head;
    fused.logits = gpu().Alloc(sizeof(float) * c.vocab);  // poisoned
    fused.greedy_tiles = gpu().Alloc(GreedyTilesBytes(1));
    ASSERT_TRUE(LmHeadWritesGreedyTiles(*gpu().stream, fused));
    ASSERT_TRUE(LaunchLmHead(*gpu().stream, fused).ok());

    LmHeadParams skinny = head;
    skinny.logits = gpu().Alloc(sizeof(float) * c.vocab);
    skinny.linear_kernel = LinearKernel::kSkinnyGemm;
    ASSERT_FALSE(LmHeadWritesGreedyTiles(*gpu().stream, skinny));
    ASSERT_TRUE(LaunchLmHead(*gpu().stream, skinny).ok());

    const std::vector<float> got = gpu().Read<float>(fused.logits, c.vocab);
    const std::vector<float> want = gpu().Read<float>(skinny.logits, c.vocab);
    EXPECT_TRUE(SameBits(got, want)) << "fused head vs the skinny GEMM";
    if (c.planted) {
      EXPECT_TRUE(std::isnan(got[c.vocab / 2]));
      EXPECT_EQ(got[winner], got[c.vocab - 1]);
    }

    const Sample from_logits = SampleGreedy(gpu(), skinny.logits, c.vocab);
    const Sample from_tiles =
        SampleGreedy(gpu(), fused.logits, c.vocab, fused.greedy_tiles);
    EXPECT_EQ(from_tiles.token, from_logits.token);
    EXPECT_EQ(
        std::memcmp(&from_tiles.logprob, &from_logits.logprob, sizeof(float)),
        0)
        << from_tiles.logprob << " vs " << from_logits.logprob;
    // The CPU sampler on the same logits: the same argmax, the logprob
    // within fp32 rounding of a log-sum-exp over the vocabulary.
    const Sample cpu_sample = SampleGreedy(cpu(), cpu().Upload(want), c.vocab);
    EXPECT_EQ(from_tiles.token, cpu_sample.token);
    EXPECT_NEAR(from_tiles.logprob, cpu_sample.logprob,
                1e-5 * std::fabs(cpu_sample.logprob) + 1e-6);
    if (c.planted) {
      EXPECT_EQ(from_tiles.token, winner);
    }
  }
}

// The head that normalizes its own row (the final norm in its prologue)
// against the gathering RMSNorm kernel followed by the head: the same logits
// and tile folds, bit for bit, for a row inside the residual stream and
// for a padding index (a zero row). Widths cover the RMSNorm kernel's
// vectorized variants (1, 2 and 4 vectors per thread) and a partial last
// chunk (296).
TEST_F(LmHeadCudaTest, GreedyHeadWithItsOwnFinalNormKeepsEveryBit) {
  constexpr int kInputRows = 3;
  constexpr int kVocabSize = 4099;
  constexpr float kEpsilon = 1e-5f;
  uint32_t seed = 200;
  for (const int hidden : {296, 2048, 4096, 8192}) {
    for (const int32_t index : {2, -1}) {
      SCOPED_TRACE(absl::StrCat("hidden ", hidden, " row ", index));
      // A residual stream of O(10) values, as after a few layers.
      const std::vector<float> residual =
          RandomBf16Floats(kInputRows * hidden, ++seed, -10.0f, 10.0f);
      const std::vector<float> norm_weight =
          RandomBf16Floats(hidden, ++seed, 0.5f, 1.5f);
      const DeviceBuffer residual_d = GpuBf16(residual);
      const DeviceBuffer norm_weight_d = GpuBf16(norm_weight);
      const DeviceBuffer index_d = gpu().Upload(std::vector<int32_t>{index});
      const DeviceBuffer weight_d = GpuBf16(
          RandomBf16Floats(static_cast<size_t>(kVocabSize) * hidden, ++seed));

      RmsNormParams norm;
      norm.input = residual_d;
      norm.weight = norm_weight_d;
      norm.output = gpu().Alloc(2 * hidden);
      norm.num_tokens = 1;
      norm.hidden_size = hidden;
      norm.epsilon = kEpsilon;
      norm.dtype = DType::kBFloat16;
      norm.row_indices = index_d;
      norm.num_input_rows = kInputRows;
      ASSERT_TRUE(LaunchRmsNorm(*gpu().stream, norm).ok());
      LmHeadParams separate;
      separate.hidden = norm.output;
      separate.weight = weight_d;
      separate.logits = gpu().Alloc(sizeof(float) * kVocabSize);
      separate.greedy_tiles = gpu().Alloc(GreedyTilesBytes(1));
      separate.num_tokens = 1;
      separate.num_rows = 1;
      separate.hidden_size = hidden;
      separate.vocab_size = kVocabSize;
      separate.dtype = DType::kBFloat16;
      ASSERT_TRUE(LaunchLmHead(*gpu().stream, separate).ok());

      LmHeadParams own = separate;
      own.hidden = residual_d;
      own.num_tokens = kInputRows;
      own.norm_weight = norm_weight_d;
      own.norm_epsilon = kEpsilon;
      own.norm_row_index = index_d;
      own.logits = gpu().Alloc(sizeof(float) * kVocabSize);
      own.greedy_tiles = gpu().Alloc(GreedyTilesBytes(1));
      ASSERT_TRUE(LmHeadWritesGreedyTiles(*gpu().stream, own));
      ASSERT_TRUE(LaunchLmHead(*gpu().stream, own).ok());

      const std::vector<float> want =
          gpu().Read<float>(separate.logits, kVocabSize);
      EXPECT_TRUE(SameBits(gpu().Read<float>(own.logits, kVocabSize), want));
      const size_t tile_floats = GreedyTilesBytes(1) / sizeof(float);
      EXPECT_TRUE(
          SameBits(gpu().Read<float>(own.greedy_tiles, tile_floats),
                   gpu().Read<float>(separate.greedy_tiles, tile_floats)));
      if (index < 0) {
        for (int v = 0; v < kVocabSize; ++v) ASSERT_EQ(want[v], 0.0f) << v;
      }
    }
  }
}

TEST_F(LmHeadCudaTest, GreedyTilesAreRefusedWhereTheHeadCannotWriteThem) {
  constexpr int kRows = 2;
  LmHeadParams p;
  p.hidden = GpuBf16(RandomBf16Floats(kRows * kHidden, 41));
  p.weight = GpuBf16(RandomBf16Floats(kVocab * kHidden, 42));
  p.logits = gpu().Alloc(sizeof(float) * kRows * kVocab);
  p.greedy_tiles = gpu().Alloc(GreedyTilesBytes(1));
  p.num_tokens = kRows;
  p.hidden_size = kHidden;
  p.vocab_size = kVocab;
  p.dtype = DType::kBFloat16;
  const std::vector<float> before = gpu().Read<float>(p.logits, kVocab);
  struct Refusal {
    std::string what;
    int num_rows;
    LinearKernel kernel;
  };
  for (const Refusal& r :
       {Refusal{"two rows", 2, LinearKernel::kAuto},
        Refusal{"cuBLAS forced", 1, LinearKernel::kCublas},
        Refusal{"tensor cores forced", 1, LinearKernel::kSkinnyMma}}) {
    SCOPED_TRACE(r.what);
    LmHeadParams q = p;
    q.num_rows = r.num_rows;
    q.linear_kernel = r.kernel;
    EXPECT_FALSE(LmHeadWritesGreedyTiles(*gpu().stream, q));
    const absl::Status status = LaunchLmHead(*gpu().stream, q);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(status.message().find("greedy_tiles"), absl::string_view::npos)
        << status;
  }
  // The head's own norm needs the tiles, and rows that are not gathered.
  LmHeadParams norm_without_tiles = p;
  norm_without_tiles.num_rows = 1;
  norm_without_tiles.greedy_tiles = DeviceBuffer();
  norm_without_tiles.norm_weight = GpuBf16(std::vector<float>(kHidden, 1.0f));
  norm_without_tiles.norm_row_index = gpu().Upload(std::vector<int32_t>{0});
  for (const bool gathering : {false, true}) {
    LmHeadParams q = norm_without_tiles;
    if (gathering) {
      q.greedy_tiles = p.greedy_tiles;
      q.logits_indices = gpu().Upload(std::vector<int32_t>{1});
      q.gathered = gpu().Alloc(2 * kHidden);
    }
    const absl::Status norm_status = LaunchLmHead(*gpu().stream, q);
    EXPECT_EQ(norm_status.code(), absl::StatusCode::kInvalidArgument)
        << norm_status;
    EXPECT_NE(norm_status.message().find("norm_weight"),
              absl::string_view::npos)
        << norm_status;
  }
  LmHeadParams short_tiles = p;
  short_tiles.num_rows = 1;
  short_tiles.greedy_tiles = gpu().Alloc(GreedyTilesBytes(1) - 4);
  const absl::Status status = LaunchLmHead(*gpu().stream, short_tiles);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("greedy_tiles"), absl::string_view::npos)
      << status;
  // Nothing ran.
  EXPECT_TRUE(SameBits(gpu().Read<float>(p.logits, kVocab), before));
}

TEST_F(LmHeadCudaTest, GreedyTilesAreReadByTheGreedyPathOnly) {
  SamplingParams p;
  p.logits = gpu().Upload(std::vector<float>(kVocab, 0.5f));
  p.temperature = gpu().Upload(std::vector<float>{1.0f});
  p.top_k = gpu().Upload(std::vector<int32_t>{0});
  p.top_p = gpu().Upload(std::vector<float>{1.0f});
  p.seeds = gpu().Upload(std::vector<uint64_t>{7});
  p.positions = gpu().Upload(std::vector<int32_t>{3});
  absl::StatusOr<size_t> workspace =
      SamplingWorkspaceBytesFor(DeviceKind::kCuda, kVocab, 1);
  ASSERT_TRUE(workspace.ok()) << workspace.status();
  p.workspace = gpu().Alloc(*workspace);
  p.sampled_token_ids = gpu().Alloc(sizeof(int32_t));
  p.sampled_logprobs = gpu().Alloc(sizeof(float));
  p.num_reqs = 1;
  p.vocab_size = kVocab;
  p.path = SamplingPath::kGeneral;
  p.greedy_tiles = gpu().Alloc(GreedyTilesBytes(1));
  absl::Status status = LaunchSampling(*gpu().stream, p);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("greedy_tiles"), absl::string_view::npos);
  p.path = SamplingPath::kGreedy;
  p.greedy_tiles = gpu().Alloc(GreedyTilesBytes(1) - 4);
  status = LaunchSampling(*gpu().stream, p);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("greedy_tiles"), absl::string_view::npos);
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
