// Sampling on CUDA vs the CPU kernel with identical fp32 logits and
// parameters: the same counter-based RNG and the same decisions, so the
// tokens must be equal. (They could differ only when u·total falls within
// ~1e-15 relative of a CDF boundary, where the different summation order of
// the double sums can tip it; with these seeds that does not happen.)
// Logprobs are float roundings of double values computed in another order:
// within 1e-6 relative + 1e-6 absolute.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tests/kernels/cuda_kernel_test_util.h"
#include "worker/kernels/sampling.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::Backend;
using testing::CudaKernelTest;
using testing::SameBits;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

struct Row {
  std::vector<float> logits;
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  uint64_t seed = 0;
  int32_t position = 0;
};

struct Sampled {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
};

class SamplingCudaTest : public CudaKernelTest {
 protected:
  // num_truncated_rows: -1 (read back on the device) or the host's count.
  Sampled Run(Backend& b, const std::vector<Row>& rows, LogprobMode mode,
              SamplingPath path = SamplingPath::kGeneral,
              int num_truncated_rows = -1) {
    const int n = static_cast<int>(rows.size());
    const int vocab = static_cast<int>(rows[0].logits.size());
    std::vector<float> flat, temperature, top_p;
    std::vector<int32_t> top_k, positions;
    std::vector<uint64_t> seeds;
    for (const Row& r : rows) {
      flat.insert(flat.end(), r.logits.begin(), r.logits.end());
      temperature.push_back(r.temperature);
      top_k.push_back(r.top_k);
      top_p.push_back(r.top_p);
      seeds.push_back(r.seed);
      positions.push_back(r.position);
    }
    absl::StatusOr<size_t> workspace =
        SamplingWorkspaceBytesFor(b.device->kind(), vocab, n);
    EXPECT_TRUE(workspace.ok()) << workspace.status();
    SamplingParams p;
    p.logits = b.Upload(flat);
    p.temperature = b.Upload(temperature);
    p.top_k = b.Upload(top_k);
    p.top_p = b.Upload(top_p);
    p.seeds = b.Upload(seeds);
    p.positions = b.Upload(positions);
    p.workspace = b.Alloc(workspace.ok() ? *workspace : 0);
    p.sampled_token_ids = b.Alloc(sizeof(int32_t) * n);
    p.sampled_logprobs = b.Alloc(sizeof(float) * n);
    p.num_reqs = n;
    p.vocab_size = vocab;
    p.logprob_mode = mode;
    p.path = path;
    p.num_truncated_rows = num_truncated_rows;
    if (path == SamplingPath::kGreedy) {  // logits, and scratch on CUDA
      p.temperature = p.top_k = p.top_p = p.seeds = p.positions =
          DeviceBuffer();
    }
    const absl::Status status = LaunchSampling(*b.stream, p);
    EXPECT_TRUE(status.ok()) << status;
    return {b.Read<int32_t>(p.sampled_token_ids, n),
            b.Read<float>(p.sampled_logprobs, n)};
  }

  void ExpectSameSamples(const std::vector<Row>& rows,
                         const std::string& what) {
    for (const LogprobMode mode :
         {LogprobMode::kProcessed, LogprobMode::kRaw}) {
      const Sampled want = Run(cpu(), rows, mode);
      const Sampled got = Run(gpu(), rows, mode);
      ASSERT_EQ(got.tokens.size(), rows.size());
      for (size_t r = 0; r < rows.size(); ++r) {
        EXPECT_EQ(got.tokens[r], want.tokens[r]) << what << " row " << r;
        if (std::isnan(want.logprobs[r])) {
          // A +inf logit makes both kernels' weights exp(inf - inf) = NaN
          // (same token, NaN logprob); EXPECT_NEAR never accepts NaN.
          EXPECT_TRUE(std::isnan(got.logprobs[r])) << what << " row " << r;
        } else if (std::isinf(want.logprobs[r])) {
          EXPECT_EQ(got.logprobs[r], want.logprobs[r]) << what << " row " << r;
        } else {
          EXPECT_NEAR(got.logprobs[r], want.logprobs[r],
                      1e-6 * std::fabs(want.logprobs[r]) + 1e-6)
              << what << " row " << r;
        }
      }
    }
  }
};

std::vector<float> RandomLogits(int vocab, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> logits(vocab);
  for (float& l : logits) l = dist(rng);
  return logits;
}

// Every combination of greedy / temperatures, top-k and top-p, with
// different seeds and positions; 48 rows, so six groups of sorted rows.
TEST_F(SamplingCudaTest, EveryParameterCombinationSamplesLikeTheCpu) {
  const int vocab = 1000;
  std::vector<Row> rows;
  uint32_t seed = 1;
  for (const float temperature : {0.0f, 0.5f, 1.0f, 2.0f}) {
    for (const int32_t top_k : {0, 1, 50}) {
      for (const float top_p : {1.0f, 0.9f, 0.3f, 0.001f}) {
        Row r;
        r.logits = RandomLogits(vocab, seed, 2.0f);
        r.temperature = temperature;
        r.top_k = top_k;
        r.top_p = top_p;
        r.seed = 1000 + seed;
        r.position = static_cast<int32_t>(seed * 37);
        rows.push_back(r);
        ++seed;
      }
    }
  }
  ExpectSameSamples(rows, "combinations");
}

// Rows without top-k / top-p take the sliced kernels (64 blocks a row, the
// inverse CDF inside the crossing slice): a Qwen-sized vocabulary, flat and
// peaked rows, greedy and sampled, next to one sorted row, like the CPU.
TEST_F(SamplingCudaTest, UntruncatedRowsOfALargeVocabularySampleLikeTheCpu) {
  const int vocab = 151936;
  std::vector<Row> rows;
  for (int i = 0; i < 12; ++i) {
    Row r;
    r.logits = RandomLogits(vocab, 900 + i, i % 3 == 0 ? 0.2f : 5.0f);
    r.temperature = i == 4 ? 0.0f : 0.3f + 0.25f * i;
    r.seed = 4000 + i;
    r.position = 17 * i;
    rows.push_back(r);
  }
  rows[7].top_k = 20;  // one row on the sort path beside them
  rows[9].logits.assign(vocab, -kInf);
  rows[9].logits[vocab - 1] = 1.0f;  // all mass on the last id
  ExpectSameSamples(rows, "untruncated, vocab 151936");
}

// The runner passes the count of top-k / top-p rows from the options it
// holds, so sampling does not synchronize the stream: the same samples, bit
// for bit, as when the kernel reads the count back.
TEST_F(SamplingCudaTest, TheHostsTruncatedCountSamplesLikeTheReadBack) {
  const int vocab = 1000;
  std::vector<Row> rows;
  uint32_t seed = 300;
  for (const int32_t top_k : {0, 7, vocab, -1}) {
    for (const float top_p : {1.0f, 0.8f, kNaN}) {
      Row r;
      r.logits = RandomLogits(vocab, seed, 2.0f);
      r.temperature = 0.9f;
      r.top_k = top_k;
      r.top_p = top_p;
      r.seed = seed;
      r.position = static_cast<int32_t>(seed);
      rows.push_back(r);
      ++seed;
    }
  }
  int truncated = 0;
  for (const Row& r : rows) {
    truncated += SamplingRowTruncates(r.top_k, r.top_p, vocab);
  }
  // top_k 7 with each top_p, and top_p 0.8 with each top_k that is off.
  ASSERT_EQ(truncated, 6);
  for (const LogprobMode mode : {LogprobMode::kProcessed, LogprobMode::kRaw}) {
    const Sampled read_back = Run(gpu(), rows, mode);
    const Sampled counted =
        Run(gpu(), rows, mode, SamplingPath::kGeneral, truncated);
    EXPECT_EQ(counted.tokens, read_back.tokens);
    EXPECT_TRUE(SameBits(counted.logprobs, read_back.logprobs));
  }
}

TEST_F(SamplingCudaTest, SpecialLogitsSampleLikeTheCpu) {
  const int vocab = 300;
  std::vector<Row> rows;
  Row nan = {RandomLogits(vocab, 50, 1.0f), 1.0f, 0, 1.0f, 7, 3};
  nan.logits[0] = kNaN;
  nan.logits[17] = kNaN;
  rows.push_back(nan);
  Row dead = {std::vector<float>(vocab, -kInf), 1.0f, 0, 1.0f, 8, 4};
  rows.push_back(dead);  // nothing has mass
  Row ties = {std::vector<float>(vocab, 0.5f), 0.0f, 0, 1.0f, 9, 5};
  rows.push_back(ties);  // greedy: id 0
  Row ties_k = ties;
  ties_k.temperature = 1.0f;
  ties_k.top_k = 10;  // ids 0..9 kept
  rows.push_back(ties_k);
  Row zeros = {std::vector<float>(vocab, 0.0f), 1.0f, 3, 0.5f, 10, 6};
  for (int v = 0; v < vocab; v += 2) zeros.logits[v] = -0.0f;  // -0 == +0
  rows.push_back(zeros);
  Row inf = {RandomLogits(vocab, 51, 1.0f), 1.0f, 5, 1.0f, 11, 7};
  inf.logits[123] = kInf;  // a certain token (NaN logprob on both)
  rows.push_back(inf);
  Row tiny_t = {RandomLogits(vocab, 52, 1.0f), 1e-6f, 0, 1.0f, 12, 8};
  rows.push_back(tiny_t);  // below eps: greedy
  Row nan_t = {RandomLogits(vocab, 53, 1.0f), kNaN, 0, 0.5f, 13, 9};
  rows.push_back(nan_t);  // NaN temp: greedy
  Row big_k = {RandomLogits(vocab, 54, 1.0f), 1.0f, vocab + 5, kNaN, 14, 10};
  rows.push_back(big_k);  // both filters off
  ExpectSameSamples(rows, "special logits");
}

// A Llama-3 sized vocabulary: the sort path over 128256 ids per row, with
// flat-ish (top-p keeps thousands of tokens) and peaked rows.
TEST_F(SamplingCudaTest, LargeVocabularyTopPAndTopKSampleLikeTheCpu) {
  const int vocab = 128256;
  std::vector<Row> rows;
  for (int i = 0; i < 10; ++i) {
    Row r;
    r.logits = RandomLogits(vocab, 60 + i, i % 2 == 0 ? 0.5f : 4.0f);
    r.temperature = 0.7f + 0.1f * i;
    r.top_p = i < 5 ? 0.95f : 1.0f;
    r.top_k = i % 3 == 0 ? 0 : 40 * i;
    r.seed = 77 + i;
    r.position = 1000 + i;
    rows.push_back(r);
  }
  ExpectSameSamples(rows, "vocab 128256");
}

// SamplingPath::kGreedy (fp32, one pass, nothing but the logits read)
// against the CPU's general path on greedy rows: the same tokens (ties to
// the lowest id, NaN never wins, all -inf -> token 0), and the logprob of
// an fp32 log-sum-exp over up to 128,256 logits within 1e-5 (relative and
// absolute) of the double one.
TEST_F(SamplingCudaTest, GreedyPathSamplesLikeTheCpu) {
  std::vector<Row> rows;
  for (const int vocab : {6, 1000, 128256}) {
    rows.clear();
    for (uint32_t seed = 0; seed < 5; ++seed) {
      Row row;
      row.logits = RandomLogits(vocab, 300 + seed, seed == 0 ? 0.1f : 4.0f);
      row.temperature = 0.0f;
      rows.push_back(row);
    }
    rows[1].logits[vocab / 2] = rows[1].logits[vocab - 1] = 100.0f;  // tie
    rows[2].logits.assign(vocab, -kInf);
    rows[3].logits[0] = kNaN;
    rows[3].logits[vocab - 1] = 50.0f;
    for (const LogprobMode mode :
         {LogprobMode::kProcessed, LogprobMode::kRaw}) {
      const Sampled want = Run(cpu(), rows, mode);
      const Sampled got = Run(gpu(), rows, mode, SamplingPath::kGreedy);
      ASSERT_EQ(got.tokens.size(), rows.size());
      for (size_t r = 0; r < rows.size(); ++r) {
        SCOPED_TRACE(::testing::Message() << "vocab " << vocab << " row " << r);
        EXPECT_EQ(got.tokens[r], want.tokens[r]);
        if (std::isinf(want.logprobs[r])) {
          EXPECT_EQ(got.logprobs[r], want.logprobs[r]);
        } else {
          EXPECT_NEAR(got.logprobs[r], want.logprobs[r],
                      1e-5 * std::fabs(want.logprobs[r]) + 1e-5);
        }
      }
      EXPECT_EQ(got.tokens[1], vocab / 2);
      EXPECT_EQ(got.tokens[2], 0);
      EXPECT_EQ(got.tokens[3], vocab - 1);
    }
  }
}

// The greedy path's slicing and reduction orders depend on the vocabulary
// alone: a row sampled alone and inside a batch of 9 (a padded graph's
// batch vs the real one) gives the same token and the same logprob bits.
TEST_F(SamplingCudaTest, GreedyRowsDoNotDependOnTheirBatch) {
  const int vocab = 128256;
  std::vector<Row> batch;
  for (uint32_t seed = 0; seed < 9; ++seed) {
    Row row;
    row.logits = RandomLogits(vocab, 700 + seed, 3.0f);
    row.temperature = 0.0f;
    batch.push_back(row);
  }
  const Sampled together =
      Run(gpu(), batch, LogprobMode::kRaw, SamplingPath::kGreedy);
  for (size_t r = 0; r < batch.size(); ++r) {
    const Sampled alone =
        Run(gpu(), {batch[r]}, LogprobMode::kRaw, SamplingPath::kGreedy);
    EXPECT_EQ(alone.tokens[0], together.tokens[r]) << "row " << r;
    EXPECT_EQ(alone.logprobs[0], together.logprobs[r]) << "row " << r;
  }
}

TEST_F(SamplingCudaTest, GreedyPathNeedsItsWorkspaceOnCuda) {
  SamplingParams p;
  p.logits = gpu().Upload(std::vector<float>(2 * 1000, 0.5f));
  p.sampled_token_ids = gpu().Alloc(2 * sizeof(int32_t));
  p.sampled_logprobs = gpu().Alloc(2 * sizeof(float));
  p.num_reqs = 2;
  p.vocab_size = 1000;
  p.path = SamplingPath::kGreedy;
  const absl::Status status = LaunchSampling(*gpu().stream, p);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("workspace"), absl::string_view::npos)
      << status;
}

TEST_F(SamplingCudaTest, RefusedWhileCapturing) {
  Stream& stream = *gpu().stream;
  ASSERT_TRUE(stream.BeginCapture().ok());
  SamplingParams p;
  p.num_reqs = 1;
  p.vocab_size = 10;
  const absl::Status status = LaunchSampling(stream, p);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_FALSE(stream.EndCapture().ok());
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
