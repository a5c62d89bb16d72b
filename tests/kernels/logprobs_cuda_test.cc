// Raw logprobs on CUDA vs the CPU kernels, with identical fp32 logits.
//
// Tolerances, in fp32 rounding terms:
//  - top_token_ids: exact (max and comparisons are exact on both backends).
//  - logsumexp: both sum exp(logit - max) in double, in different orders
//    (and CUDA's double exp vs glibc's, both within 1 ulp), so the doubles
//    agree to ~1e-16 relative and the fp32 results differ by at most one
//    rounding step: |gpu - cpu| <= 2^-23 · |cpu| (one fp32 ulp); infinities
//    must be equal.
//  - logprobs (top and gathered): logit - logsumexp in fp32 on both, so a
//    one-ulp logsumexp difference passes through in absolute terms, plus the
//    subtraction's rounding: |gpu - cpu| <= 2^-23 · (|cpu logsumexp| +
//    |cpu|). Non-finite values must match (-inf exactly; NaN, from a +inf
//    logit, as NaN: the NaN's bits differ between x86 and CUDA).
//  Each GPU logprob must also be exactly logit - (GPU logsumexp) in fp32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tests/kernels/cuda_kernel_test_util.h"
#include "worker/kernels/logprobs.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::Backend;
using testing::CudaKernelTest;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int32_t kIntMin = std::numeric_limits<int32_t>::min();
constexpr int32_t kIntMax = std::numeric_limits<int32_t>::max();
constexpr int32_t kIdPoison = 0x5eadbeef;
constexpr uint32_t kFloatPoisonBits = 0x7fc0dead;
constexpr int kPad = 64;  // poisoned elements on each side of every output
constexpr double kUlp = 1.0 / (1 << 23);

uint32_t Bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

struct LogprobsCase {
  int num_logit_rows = 0;
  int vocab_size = 0;
  int k = 0;
  std::vector<float> logits;       // [num_logit_rows * vocab_size]
  std::vector<int32_t> rows;       // [num_rows], ~10% out of range
  std::vector<int32_t> token_ids;  // [num_logit_rows], ~10% out of range
};

struct Outputs {
  std::vector<float> logsumexp;  // [num_rows]
  std::vector<int32_t> ids;      // [num_rows * k]
  std::vector<float> logprobs;   // [num_rows * k]
  std::vector<float> gathered;   // [num_rows]
};

// Row kinds: smooth logits, integer-valued (exact ties), large magnitude,
// all -inf, all NaN, a +inf logit; NaN and -inf sprinkled in.
LogprobsCase RandomCase(uint32_t seed, int num_logit_rows, int vocab_size,
                        int k, int num_rows) {
  std::mt19937 rng(seed);
  auto uniform = [&rng](int lo, int hi) {  // [lo, hi]
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  std::uniform_real_distribution<float> logit(-12.0f, 12.0f);
  LogprobsCase c;
  c.num_logit_rows = num_logit_rows;
  c.vocab_size = vocab_size;
  c.k = k;
  c.logits.resize(static_cast<size_t>(num_logit_rows) * vocab_size);
  for (int r = 0; r < num_logit_rows; ++r) {
    float* row = c.logits.data() + static_cast<size_t>(r) * vocab_size;
    const int kind = uniform(0, 11);
    for (int v = 0; v < vocab_size; ++v) {
      row[v] = logit(rng);
      if (kind <= 2) row[v] = std::round(row[v] / 4.0f);  // ties
      if (kind == 3) row[v] *= 1000.0f;
      if (kind == 4) row[v] = -kInf;
      if (kind == 5) row[v] = kNaN;
      if (kind >= 7 && uniform(0, 49) == 0)
        row[v] = uniform(0, 1) ? kNaN : -kInf;
    }
    if (kind == 6) row[uniform(0, vocab_size - 1)] = kInf;
  }
  const int32_t bad_rows[] = {-1, num_logit_rows, kIntMin, kIntMax};
  for (int i = 0; i < num_rows; ++i) {
    c.rows.push_back(uniform(0, 9) == 0 ? bad_rows[uniform(0, 3)]
                                        : uniform(0, num_logit_rows - 1));
  }
  const int32_t bad_ids[] = {-1, vocab_size, kIntMin, kIntMax};
  for (int r = 0; r < num_logit_rows; ++r) {
    c.token_ids.push_back(uniform(0, 9) == 0 ? bad_ids[uniform(0, 3)]
                                             : uniform(0, vocab_size - 1));
  }
  return c;
}

bool SameValue(float got, float want) {
  return std::isnan(want) ? std::isnan(got) : Bits(got) == Bits(want);
}

// |got - want| <= kUlp · (scale + |want|); non-finite values must match.
bool Close(float got, float want, double scale) {
  if (!std::isfinite(want) || !std::isfinite(got)) {
    return SameValue(got, want);
  }
  return std::fabs(static_cast<double>(got) - want) <=
         kUlp * (scale + std::fabs(static_cast<double>(want)));
}

class LogprobsCudaTest : public CudaKernelTest {
 protected:
  template <typename T>
  DeviceBuffer PoisonedView(Backend& b, size_t n, T poison,
                            DeviceBuffer* whole) {
    *whole = b.Upload(std::vector<T>(n + 2 * kPad, poison));
    return whole->Slice(sizeof(T) * kPad, sizeof(T) * n);
  }

  template <typename T>
  std::vector<T> ReadView(Backend& b, DeviceBuffer whole, size_t n, T poison,
                          const std::string& what) {
    const std::vector<T> all = b.Read<T>(whole, n + 2 * kPad);
    for (int j = 0; j < kPad; ++j) {
      EXPECT_EQ(std::memcmp(&all[j], &poison, sizeof(T)), 0)
          << what << ": written before the view";
      EXPECT_EQ(std::memcmp(&all[kPad + n + j], &poison, sizeof(T)), 0)
          << what << ": written after the view";
    }
    return std::vector<T>(all.begin() + kPad, all.begin() + kPad + n);
  }

  // Top-k and logsumexp, then the gather with that logsumexp, on `b`.
  Outputs Run(Backend& b, const LogprobsCase& c) {
    const size_t n = c.rows.size();
    const size_t nk = n * c.k;
    const float poison = FromBits(kFloatPoisonBits);
    TopLogprobsParams top;
    top.logits = b.Upload(c.logits);
    top.rows = b.Upload(c.rows);
    DeviceBuffer lse_whole, ids_whole, lp_whole, gathered_whole;
    top.logsumexp = PoisonedView(b, n, poison, &lse_whole);
    top.top_token_ids = PoisonedView(b, nk, kIdPoison, &ids_whole);
    top.top_logprobs = PoisonedView(b, nk, poison, &lp_whole);
    top.num_rows = static_cast<int>(n);
    top.num_logit_rows = c.num_logit_rows;
    top.vocab_size = c.vocab_size;
    top.k = c.k;
    absl::Status status = LaunchTopLogprobs(*b.stream, top);
    EXPECT_TRUE(status.ok()) << status;

    GatherLogprobsParams gather;
    gather.logits = top.logits;
    gather.rows = top.rows;
    gather.token_ids = b.Upload(c.token_ids);
    gather.logsumexp = top.logsumexp;
    gather.logprobs = PoisonedView(b, n, poison, &gathered_whole);
    gather.num_rows = static_cast<int>(n);
    gather.num_logit_rows = c.num_logit_rows;
    gather.vocab_size = c.vocab_size;
    status = LaunchGatherLogprobs(*b.stream, gather);
    EXPECT_TRUE(status.ok()) << status;

    Outputs out;
    out.logsumexp = ReadView(b, lse_whole, n, poison, "logsumexp");
    out.ids = ReadView(b, ids_whole, nk, kIdPoison, "top_token_ids");
    out.logprobs = ReadView(b, lp_whole, nk, poison, "top_logprobs");
    out.gathered = ReadView(b, gathered_whole, n, poison, "logprobs");
    return out;
  }

  // The (NaN as -inf) logit of entry i's row at `token`.
  static float LogitAt(const LogprobsCase& c, int32_t row, int32_t token) {
    const float l = c.logits[static_cast<size_t>(row) * c.vocab_size + token];
    return std::isnan(l) ? -kInf : l;
  }

  static float ContractLogprob(float logit, float logsumexp) {
    return logsumexp == -kInf ? -kInf : logit - logsumexp;
  }

  void ExpectSameAsCpu(const LogprobsCase& c, const std::string& what) {
    const Outputs want = Run(cpu(), c);
    const Outputs got = Run(gpu(), c);
    ASSERT_EQ(got.ids, want.ids) << what;
    int lse_bad = 0, top_bad = 0, gathered_bad = 0, contract_bad = 0;
    for (size_t i = 0; i < c.rows.size(); ++i) {
      const double lse_scale =
          std::isfinite(want.logsumexp[i]) ? std::fabs(want.logsumexp[i]) : 0.0;
      if (!Close(got.logsumexp[i], want.logsumexp[i], 0.0)) {
        if (lse_bad++ == 0) {
          ADD_FAILURE() << what << " entry " << i << ": logsumexp "
                        << got.logsumexp[i] << " vs cpu " << want.logsumexp[i];
        }
      }
      for (int j = 0; j < c.k; ++j) {
        const size_t at = i * c.k + j;
        if (!Close(got.logprobs[at], want.logprobs[at], lse_scale)) {
          if (top_bad++ == 0) {
            ADD_FAILURE() << what << " entry " << i << " rank " << j << ": "
                          << got.logprobs[at] << " vs cpu "
                          << want.logprobs[at];
          }
        }
        const int32_t r = c.rows[i];
        if (r >= 0 && r < c.num_logit_rows &&
            !SameValue(got.logprobs[at],
                       ContractLogprob(LogitAt(c, r, got.ids[at]),
                                       got.logsumexp[i]))) {
          ++contract_bad;
        }
      }
      if (!Close(got.gathered[i], want.gathered[i], lse_scale)) {
        if (gathered_bad++ == 0) {
          ADD_FAILURE() << what << " entry " << i << ": gathered "
                        << got.gathered[i] << " vs cpu " << want.gathered[i];
        }
      }
    }
    EXPECT_EQ(lse_bad, 0) << what;
    EXPECT_EQ(top_bad, 0) << what;
    EXPECT_EQ(gathered_bad, 0) << what;
    EXPECT_EQ(contract_bad, 0) << what << ": logit - logsumexp in fp32";
  }
};

TEST_F(LogprobsCudaTest, RandomShapesMatchTheCpu) {
  std::mt19937 rng(1);
  auto uniform = [&rng](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  for (uint32_t seed = 1; seed <= 24; ++seed) {
    const int logit_rows = uniform(1, 12);
    const int vocab = uniform(0, 2) == 0 ? uniform(1, 40) : uniform(1, 5000);
    const int k = uniform(0, std::min(kMaxTopLogprobs, vocab));
    const int rows = uniform(1, 24);
    ExpectSameAsCpu(RandomCase(seed, logit_rows, vocab, k, rows),
                    "seed " + std::to_string(seed) + " vocab " +
                        std::to_string(vocab) + " k " + std::to_string(k));
  }
}

// Llama-3's vocabulary: 125 logits per thread, k = kMaxTopLogprobs passes.
TEST_F(LogprobsCudaTest, Llama3VocabularyMatchesTheCpu) {
  ExpectSameAsCpu(RandomCase(77, 6, 128256, kMaxTopLogprobs, 10),
                  "vocab 128256 k 20");
  ExpectSameAsCpu(RandomCase(78, 3, 128256, 1, 5), "vocab 128256 k 1");
  ExpectSameAsCpu(RandomCase(79, 2, 128256, 0, 4), "vocab 128256 k 0");
}

// More entries than the gather's capped grid has threads (1024 blocks of
// 256): its grid-stride loop must cover the rest.
TEST_F(LogprobsCudaTest, ManyEntriesMatchTheCpu) {
  ExpectSameAsCpu(RandomCase(5, 7, 33, 3, 300000), "300000 entries");
}

TEST_F(LogprobsCudaTest, ZeroRowsLaunchNothing) {
  Backend& b = gpu();
  TopLogprobsParams top;
  top.logits = b.Alloc(sizeof(float) * 2 * 10);
  top.rows = b.Upload(std::vector<int32_t>{1});
  top.logsumexp = b.Alloc(sizeof(float));
  top.top_token_ids = b.Alloc(sizeof(int32_t) * 3);
  top.top_logprobs = b.Alloc(sizeof(float) * 3);
  top.num_rows = 0;
  top.num_logit_rows = 2;
  top.vocab_size = 10;
  top.k = 3;
  ASSERT_TRUE(LaunchTopLogprobs(*b.stream, top).ok());
  EXPECT_EQ(b.Read<int32_t>(top.logsumexp, 1), std::vector<int32_t>(1, -1));
  EXPECT_EQ(b.Read<int32_t>(top.top_token_ids, 3), std::vector<int32_t>(3, -1));
  EXPECT_EQ(b.Read<int32_t>(top.top_logprobs, 3), std::vector<int32_t>(3, -1));

  GatherLogprobsParams gather;
  gather.logits = top.logits;
  gather.rows = top.rows;
  gather.token_ids = b.Upload(std::vector<int32_t>{0, 1});
  gather.logsumexp = b.Upload(std::vector<float>{1.0f});
  gather.logprobs = b.Alloc(sizeof(float));
  gather.num_rows = 0;
  gather.num_logit_rows = 2;
  gather.vocab_size = 10;
  ASSERT_TRUE(LaunchGatherLogprobs(*b.stream, gather).ok());
  EXPECT_EQ(b.Read<int32_t>(gather.logprobs, 1), std::vector<int32_t>(1, -1));
}

TEST_F(LogprobsCudaTest, RefusedWhileCapturing) {
  Stream& stream = *gpu().stream;
  TopLogprobsParams top;
  top.logits = gpu().Alloc(sizeof(float) * 2 * 10);
  top.rows = gpu().Upload(std::vector<int32_t>{1});
  top.logsumexp = gpu().Alloc(sizeof(float));
  top.num_rows = 1;
  top.num_logit_rows = 2;
  top.vocab_size = 10;
  ASSERT_TRUE(stream.BeginCapture().ok());
  const absl::Status status = LaunchTopLogprobs(stream, top);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_FALSE(stream.EndCapture().ok());

  GatherLogprobsParams gather;
  gather.logits = top.logits;
  gather.rows = top.rows;
  gather.token_ids = gpu().Upload(std::vector<int32_t>{0, 1});
  gather.logsumexp = top.logsumexp;
  gather.logprobs = gpu().Alloc(sizeof(float));
  gather.num_rows = 1;
  gather.num_logit_rows = 2;
  gather.vocab_size = 10;
  ASSERT_TRUE(stream.BeginCapture().ok());
  EXPECT_EQ(LaunchGatherLogprobs(stream, gather).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(stream.EndCapture().ok());
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
