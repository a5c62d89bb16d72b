#include "worker/kernels/logprobs.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tests/kernels/kernel_test_util.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::IsInvalidArgumentMentioning;
using testing::KernelTest;
using testing::RandomFloats;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int32_t kIntMin = std::numeric_limits<int32_t>::min();
constexpr int32_t kIntMax = std::numeric_limits<int32_t>::max();
// Poison around (and, before the launch, inside) every output view: a NaN
// payload and an id no kernel computes, so an entry left unwritten or a
// write outside the view shows up.
constexpr uint32_t kFloatPoisonBits = 0x7fc0dead;
constexpr int32_t kIdPoison = 0x5eadbeef;
constexpr int kPad = 32;

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint32_t Bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

const float kFloatPoison = FromBits(kFloatPoisonBits);

// Independent reference for one logits row: log_softmax in long double (a
// direct max-subtracted sum) and the candidate order by a full sort.
struct RefRow {
  long double logsumexp = 0;
  std::vector<int32_t> order;  // every id, best first
  std::vector<float> value;    // [vocab]: the logit, NaN as -inf
};

RefRow Reference(const float* row, int vocab) {
  RefRow ref;
  ref.value.assign(row, row + vocab);
  for (float& v : ref.value) {
    if (std::isnan(v)) v = -kInf;
  }
  const long double max = *std::max_element(ref.value.begin(), ref.value.end());
  if (std::isinf(max)) {
    ref.logsumexp = max;
  } else {
    long double sum = 0;
    for (float v : ref.value)
      sum += std::exp(static_cast<long double>(v) - max);
    ref.logsumexp = max + std::log(sum);
  }
  ref.order.resize(vocab);
  std::iota(ref.order.begin(), ref.order.end(), 0);
  std::sort(ref.order.begin(), ref.order.end(), [&ref](int32_t a, int32_t b) {
    const float va = ref.value[a];
    const float vb = ref.value[b];
    if (va != vb) return va > vb;
    return a < b;
  });
  return ref;
}

// |got - want| within one fp32 ulp of want (plus 1e-15 for the double sum);
// non-finite values must match exactly.
bool WithinOneUlp(float got, long double want) {
  if (!std::isfinite(want) || !std::isfinite(got)) {
    return static_cast<long double>(got) == want;
  }
  const long double ulp =
      want == 0 ? 0
                : std::ldexp(1.0L, std::ilogb(static_cast<float>(want)) - 23);
  return std::fabs(static_cast<long double>(got) - want) <= ulp + 1e-15L;
}

// The contract: logprob = logit - logsumexp in fp32 (-inf when logsumexp is
// -inf). NaN (a +inf logit minus a +inf logsumexp) compares as NaN.
bool IsContractLogprob(float got, float logit, float logsumexp) {
  const float want = logsumexp == -kInf ? -kInf : logit - logsumexp;
  if (std::isnan(want)) return std::isnan(got);
  return Bits(got) == Bits(want);
}

struct LogprobsCase {
  int num_logit_rows = 0;
  int vocab_size = 0;
  int k = 0;
  std::vector<float> logits;  // [num_logit_rows * vocab_size]
  std::vector<int32_t> rows;  // [num_rows]
  int num_rows() const { return static_cast<int>(rows.size()); }
  const float* row(int r) const {
    return logits.data() + static_cast<size_t>(r) * vocab_size;
  }
  bool valid_row(int32_t r) const { return r >= 0 && r < num_logit_rows; }
};

struct TopResult {
  std::vector<float> logsumexp;  // [num_rows]
  std::vector<int32_t> ids;      // [num_rows * k]
  std::vector<float> logprobs;   // [num_rows * k]
};

// Random shapes: vocab 1..3000 (often tiny), k 0..min(20, vocab), rows
// repeated and in any order with ~10% out of range. Row kinds: smooth,
// integer-valued (many exact ties), large magnitude, all -inf, all NaN;
// NaN and -inf sprinkled in.
LogprobsCase RandomCase(uint32_t seed) {
  std::mt19937 rng(seed);
  auto uniform = [&rng](int lo, int hi) {  // [lo, hi]
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  LogprobsCase c;
  c.num_logit_rows = uniform(1, 6);
  c.vocab_size = uniform(0, 2) == 0 ? uniform(1, 30) : uniform(1, 3000);
  c.k = uniform(0, std::min(kMaxTopLogprobs, c.vocab_size));
  c.logits = RandomFloats(static_cast<size_t>(c.num_logit_rows) * c.vocab_size,
                          seed, -10.0f, 10.0f);
  for (int r = 0; r < c.num_logit_rows; ++r) {
    float* row = c.logits.data() + static_cast<size_t>(r) * c.vocab_size;
    const int kind = uniform(0, 9);
    for (int v = 0; v < c.vocab_size; ++v) {
      if (kind <= 2) row[v] = std::round(row[v] / 3.0f);  // ties
      if (kind == 3) row[v] *= 1000.0f;                   // large
      if (kind == 4) row[v] = -kInf;
      if (kind == 5) row[v] = kNaN;
      if (kind >= 6) {
        const int special = uniform(0, 39);
        if (special == 0) row[v] = kNaN;
        if (special == 1) row[v] = -kInf;
      }
    }
  }
  const int32_t bad_rows[] = {-1, c.num_logit_rows, kIntMin, kIntMax};
  const int num_rows = uniform(1, 12);
  for (int i = 0; i < num_rows; ++i) {
    c.rows.push_back(uniform(0, 9) == 0 ? bad_rows[uniform(0, 3)]
                                        : uniform(0, c.num_logit_rows - 1));
  }
  return c;
}

class LogprobsTest : public KernelTest {
 protected:
  // A view of n elements in a buffer of kPad + n + kPad, all `poison`.
  template <typename T>
  DeviceBuffer PoisonedView(size_t n, T poison, DeviceBuffer* whole) {
    *whole = Upload(std::vector<T>(n + 2 * kPad, poison));
    return whole->Slice(sizeof(T) * kPad, sizeof(T) * n);
  }

  // The view of a PoisonedView buffer, after checking that the padding on
  // both sides still holds the poison bits.
  template <typename T>
  std::vector<T> ReadView(DeviceBuffer whole, size_t n, T poison) {
    const std::vector<T> all = Read<T>(whole);
    EXPECT_EQ(all.size(), n + 2 * kPad);
    for (int j = 0; j < kPad; ++j) {
      EXPECT_EQ(std::memcmp(&all[j], &poison, sizeof(T)), 0)
          << "written before the view at " << j - kPad;
      EXPECT_EQ(std::memcmp(&all[kPad + n + j], &poison, sizeof(T)), 0)
          << "written after the view at +" << j;
    }
    return std::vector<T>(all.begin() + kPad, all.begin() + kPad + n);
  }

  TopResult RunTop(const LogprobsCase& c) {
    const size_t n = c.rows.size();
    const size_t nk = n * c.k;
    TopLogprobsParams p;
    p.logits = Upload(c.logits);
    p.rows = Upload(c.rows);
    DeviceBuffer lse_whole, ids_whole, lp_whole;
    p.logsumexp = PoisonedView(n, kFloatPoison, &lse_whole);
    p.top_token_ids = PoisonedView(nk, kIdPoison, &ids_whole);
    p.top_logprobs = PoisonedView(nk, kFloatPoison, &lp_whole);
    p.num_rows = c.num_rows();
    p.num_logit_rows = c.num_logit_rows;
    p.vocab_size = c.vocab_size;
    p.k = c.k;
    const absl::Status status = LaunchTopLogprobs(stream(), p);
    EXPECT_TRUE(status.ok()) << status;
    // The inputs are only read.
    EXPECT_TRUE(testing::BitIdentical(Read<float>(p.logits), c.logits));
    EXPECT_EQ(Read<int32_t>(p.rows), c.rows);
    TopResult result;
    result.logsumexp = ReadView(lse_whole, n, kFloatPoison);
    result.ids = ReadView(ids_whole, nk, kIdPoison);
    result.logprobs = ReadView(lp_whole, nk, kFloatPoison);
    return result;
  }

  // Checks `got` entry by entry against the reference.
  void ExpectMatchesReference(const LogprobsCase& c, const TopResult& got,
                              const std::string& what) {
    for (int i = 0; i < c.num_rows(); ++i) {
      const int32_t r = c.rows[i];
      const float lse = got.logsumexp[i];
      if (!c.valid_row(r)) {
        EXPECT_EQ(lse, -kInf) << what << " entry " << i << " row " << r;
        for (int j = 0; j < c.k; ++j) {
          EXPECT_EQ(got.ids[i * c.k + j], -1) << what << " entry " << i;
          EXPECT_EQ(got.logprobs[i * c.k + j], -kInf) << what << " entry " << i;
        }
        continue;
      }
      const RefRow ref = Reference(c.row(r), c.vocab_size);
      EXPECT_TRUE(WithinOneUlp(lse, ref.logsumexp))
          << what << " entry " << i << ": logsumexp " << lse << " want "
          << static_cast<double>(ref.logsumexp);
      for (int j = 0; j < c.k; ++j) {
        const int32_t id = got.ids[i * c.k + j];
        const float lp = got.logprobs[i * c.k + j];
        ASSERT_EQ(id, ref.order[j]) << what << " entry " << i << " rank " << j;
        EXPECT_TRUE(IsContractLogprob(lp, ref.value[id], lse))
            << what << " entry " << i << " rank " << j << ": " << lp;
        const long double want = ref.value[id] - ref.logsumexp;
        if (std::isfinite(want)) {
          const long double tol =
              std::ldexp(1.0L, -23) *
                  (std::fabs(ref.logsumexp) + std::fabs(want)) +
              1e-15L;
          EXPECT_LE(std::fabs(lp - want), tol)
              << what << " entry " << i << " rank " << j << ": " << lp
              << " want " << static_cast<double>(want);
        }
      }
    }
  }

  // Logsumexp from LaunchTopLogprobs (k = 0), then the gather; returns
  // the gathered logprobs (poison around them checked).
  std::vector<float> RunGather(const LogprobsCase& c,
                               const std::vector<int32_t>& token_ids,
                               const std::vector<float>& logsumexp) {
    const size_t n = c.rows.size();
    GatherLogprobsParams p;
    p.logits = Upload(c.logits);
    p.rows = Upload(c.rows);
    p.token_ids = Upload(token_ids);
    p.logsumexp = Upload(logsumexp);
    DeviceBuffer whole;
    p.logprobs = PoisonedView(n, kFloatPoison, &whole);
    p.num_rows = c.num_rows();
    p.num_logit_rows = c.num_logit_rows;
    p.vocab_size = c.vocab_size;
    const absl::Status status = LaunchGatherLogprobs(stream(), p);
    EXPECT_TRUE(status.ok()) << status;
    EXPECT_TRUE(testing::BitIdentical(Read<float>(p.logits), c.logits));
    EXPECT_EQ(Read<int32_t>(p.token_ids), token_ids);
    EXPECT_TRUE(testing::BitIdentical(Read<float>(p.logsumexp), logsumexp));
    return ReadView(whole, n, kFloatPoison);
  }

  // Valid params: 3 entries over [2, 5] logits, k = 2.
  TopLogprobsParams ValidTopParams() {
    TopLogprobsParams p;
    p.logits = Upload(RandomFloats(2 * 5, 3));
    p.rows = Upload(std::vector<int32_t>{1, 0, 1});
    p.logsumexp = AllocElements<float>(3);
    p.top_token_ids = AllocElements<int32_t>(3 * 2);
    p.top_logprobs = AllocElements<float>(3 * 2);
    p.num_rows = 3;
    p.num_logit_rows = 2;
    p.vocab_size = 5;
    p.k = 2;
    return p;
  }

  GatherLogprobsParams ValidGatherParams() {
    GatherLogprobsParams p;
    p.logits = Upload(RandomFloats(2 * 5, 4));
    p.rows = Upload(std::vector<int32_t>{1, 0, 1});
    p.token_ids = Upload(std::vector<int32_t>{4, 2});
    p.logsumexp = Upload(std::vector<float>{3.0f, 2.0f, 3.0f});
    p.logprobs = AllocElements<float>(3);
    p.num_rows = 3;
    p.num_logit_rows = 2;
    p.vocab_size = 5;
    return p;
  }
};

TEST_F(LogprobsTest, MatchesTheReferenceOnRandomShapes) {
  for (uint32_t seed = 1; seed <= 50; ++seed) {
    const LogprobsCase c = RandomCase(seed);
    ExpectMatchesReference(c, RunTop(c),
                           "seed " + std::to_string(seed) + " (logit rows " +
                               std::to_string(c.num_logit_rows) + ", vocab " +
                               std::to_string(c.vocab_size) + ", k " +
                               std::to_string(c.k) + ")");
  }
}

TEST_F(LogprobsTest, TiesGoToTheLowerIdAndMinusInfComesLast) {
  LogprobsCase c;
  c.num_logit_rows = 2;
  c.vocab_size = 9;
  c.k = 9;
  c.logits = {1.0f, 3.0f, 3.0f, -kInf, 3.0f, kNaN, -kInf, 2.0f, 3.0f,
              // -0 == +0: a tie, the lower id first.
              -kInf, 0.0f, -0.0f, kNaN, -1.0f, -0.0f, 0.0f, -kInf, kNaN};
  c.rows = {0, 1};
  const TopResult got = RunTop(c);
  EXPECT_EQ(std::vector<int32_t>(got.ids.begin(), got.ids.begin() + 9),
            (std::vector<int32_t>{1, 2, 4, 8, 7, 0, 3, 5, 6}));
  EXPECT_EQ(std::vector<int32_t>(got.ids.begin() + 9, got.ids.end()),
            (std::vector<int32_t>{1, 2, 5, 6, 4, 0, 3, 7, 8}));
  ExpectMatchesReference(c, got, "ties");
  // The four 3.0 logits share one logprob; -inf logits get -inf.
  EXPECT_EQ(got.logprobs[0], got.logprobs[3]);
  EXPECT_EQ(got.logprobs[8], -kInf);
}

TEST_F(LogprobsTest, RowsWithoutMassAndInfiniteLogits) {
  LogprobsCase c;
  c.num_logit_rows = 3;
  c.vocab_size = 4;
  c.k = 4;
  c.logits = {-kInf, -kInf, -kInf, -kInf,  // no mass
              kNaN,  kNaN,  kNaN,  kNaN,   // NaN counts as -inf
              1.0f,  kInf,  2.0f,  kInf};  // +inf: logsumexp +inf
  c.rows = {0, 1, 2};
  const TopResult got = RunTop(c);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(got.logsumexp[i], -kInf);
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(got.ids[i * 4 + j], j);  // lowest ids first
      EXPECT_EQ(got.logprobs[i * 4 + j], -kInf);
    }
  }
  EXPECT_EQ(got.logsumexp[2], kInf);
  EXPECT_EQ(std::vector<int32_t>(got.ids.begin() + 8, got.ids.end()),
            (std::vector<int32_t>{1, 3, 2, 0}));
  EXPECT_TRUE(std::isnan(got.logprobs[8]));  // inf - inf
  EXPECT_TRUE(std::isnan(got.logprobs[9]));
  EXPECT_EQ(got.logprobs[10], -kInf);
  EXPECT_EQ(got.logprobs[11], -kInf);
}

// Logits far from 0 (a row of 1e4 would overflow exp without the max
// subtracted) and a single-token vocabulary (logprob exactly 0).
TEST_F(LogprobsTest, LargeLogitsAndSingleTokenVocabulary) {
  LogprobsCase c;
  c.num_logit_rows = 1;
  c.vocab_size = 3;
  c.k = 3;
  c.logits = {10000.0f, 9999.0f, -30000.0f};
  c.rows = {0};
  const TopResult got = RunTop(c);
  ExpectMatchesReference(c, got, "large");
  EXPECT_TRUE(std::isfinite(got.logsumexp[0]));

  LogprobsCase one;
  one.num_logit_rows = 2;
  one.vocab_size = 1;
  one.k = 1;
  one.logits = {-7.5f, 88.0f};
  one.rows = {1, 0};
  const TopResult single = RunTop(one);
  EXPECT_EQ(single.logsumexp, (std::vector<float>{88.0f, -7.5f}));
  EXPECT_EQ(single.ids, (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(single.logprobs, (std::vector<float>{0.0f, 0.0f}));
}

TEST_F(LogprobsTest, OutOfRangeRowsGetMinusInfAndNoTokens) {
  LogprobsCase c;
  c.num_logit_rows = 2;
  c.vocab_size = 6;
  c.k = 3;
  c.logits = RandomFloats(12, 11);
  c.rows = {-1, 1, 2, kIntMin, 0, kIntMax};
  const TopResult got = RunTop(c);
  ExpectMatchesReference(c, got, "out of range");
  EXPECT_EQ(got.logsumexp[0], -kInf);
  EXPECT_EQ(got.ids[0], -1);
  EXPECT_NE(got.ids[3], -1);
}

TEST_F(LogprobsTest, ZeroKWritesOnlyTheLogsumexp) {
  LogprobsCase c = RandomCase(21);
  c.k = 0;
  const TopResult got = RunTop(c);  // empty top views: all pads intact
  EXPECT_TRUE(got.ids.empty());
  ExpectMatchesReference(c, got, "k = 0");
}

// num_rows = 0 returns before launching: outputs keep their poison (Alloc
// fills 0xFF bytes), and no row list or output buffer is needed at all.
TEST_F(LogprobsTest, ZeroRowsLaunchNothing) {
  TopLogprobsParams top = ValidTopParams();
  top.num_rows = 0;
  ASSERT_TRUE(LaunchTopLogprobs(stream(), top).ok());
  EXPECT_EQ(Read<int32_t>(top.logsumexp), std::vector<int32_t>(3, -1));
  EXPECT_EQ(Read<int32_t>(top.top_token_ids), std::vector<int32_t>(6, -1));
  EXPECT_EQ(Read<int32_t>(top.top_logprobs), std::vector<int32_t>(6, -1));
  top.rows = DeviceBuffer();
  top.logsumexp = DeviceBuffer();
  top.top_token_ids = DeviceBuffer();
  top.top_logprobs = DeviceBuffer();
  EXPECT_TRUE(LaunchTopLogprobs(stream(), top).ok());

  GatherLogprobsParams gather = ValidGatherParams();
  gather.num_rows = 0;
  ASSERT_TRUE(LaunchGatherLogprobs(stream(), gather).ok());
  EXPECT_EQ(Read<int32_t>(gather.logprobs), std::vector<int32_t>(3, -1));
  gather.rows = DeviceBuffer();
  gather.logsumexp = DeviceBuffer();
  gather.logprobs = DeviceBuffer();
  EXPECT_TRUE(LaunchGatherLogprobs(stream(), gather).ok());
}

// The API flow: logsumexp (and the top-k) from the raw logits, then the
// logits are masked away from the sampled tokens, then the gather. Random
// sampled ids (~10% out of range), random rows (~10% out of range).
TEST_F(LogprobsTest, GatherMatchesTheReferenceForRandomSampledIds) {
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    LogprobsCase c = RandomCase(1000 + seed);
    std::mt19937 rng(seed);
    auto uniform = [&rng](int lo, int hi) {
      return std::uniform_int_distribution<int>(lo, hi)(rng);
    };
    const TopResult top = RunTop(c);
    const int32_t bad_ids[] = {-1, c.vocab_size, kIntMin, kIntMax};
    std::vector<int32_t> token_ids;
    for (int r = 0; r < c.num_logit_rows; ++r) {
      token_ids.push_back(uniform(0, 9) == 0 ? bad_ids[uniform(0, 3)]
                                             : uniform(0, c.vocab_size - 1));
    }
    LogprobsCase masked = c;  // bans elsewhere than the sampled token
    for (int r = 0; r < c.num_logit_rows; ++r) {
      for (int v = 0; v < c.vocab_size; ++v) {
        if (v != token_ids[r] && uniform(0, 3) == 0) {
          masked.logits[static_cast<size_t>(r) * c.vocab_size + v] = -kInf;
        }
      }
    }
    const std::vector<float> got = RunGather(masked, token_ids, top.logsumexp);
    for (int i = 0; i < c.num_rows(); ++i) {
      const int32_t r = c.rows[i];
      const std::string what = "seed " + std::to_string(seed) + " entry " +
                               std::to_string(i) + " row " + std::to_string(r);
      if (!c.valid_row(r) || token_ids[r] < 0 || token_ids[r] >= c.vocab_size) {
        EXPECT_EQ(got[i], -kInf) << what;
        continue;
      }
      const int32_t token = token_ids[r];
      const RefRow ref = Reference(c.row(r), c.vocab_size);
      EXPECT_TRUE(IsContractLogprob(got[i], ref.value[token], top.logsumexp[i]))
          << what << ": " << got[i];
      const long double want = ref.value[token] - ref.logsumexp;
      if (std::isfinite(want)) {
        EXPECT_LE(std::fabs(got[i] - want),
                  std::ldexp(1.0L, -23) *
                          (std::fabs(ref.logsumexp) + std::fabs(want)) +
                      1e-15L)
            << what;
      } else {
        EXPECT_EQ(got[i], -kInf) << what;
      }
      // A sampled token listed in the top-k has the same bits there.
      for (int j = 0; j < c.k; ++j) {
        if (top.ids[i * c.k + j] == token) {
          EXPECT_EQ(Bits(top.logprobs[i * c.k + j]), Bits(got[i])) << what;
        }
      }
    }
  }
}

TEST_F(LogprobsTest, RefusedWhileCapturing) {
  // Buffers first: allocation and uploads are refused during capture too.
  const TopLogprobsParams top = ValidTopParams();
  const GatherLogprobsParams gather = ValidGatherParams();
  TopLogprobsParams no_rows = top;
  no_rows.num_rows = 0;

  ASSERT_TRUE(stream().BeginCapture().ok());
  const absl::Status status = LaunchTopLogprobs(stream(), top);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_FALSE(stream().EndCapture().ok());

  // Even with nothing to do: the launcher has no place in a graph.
  ASSERT_TRUE(stream().BeginCapture().ok());
  EXPECT_EQ(LaunchTopLogprobs(stream(), no_rows).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(stream().EndCapture().ok());

  ASSERT_TRUE(stream().BeginCapture().ok());
  EXPECT_EQ(LaunchGatherLogprobs(stream(), gather).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(stream().EndCapture().ok());
}

TEST_F(LogprobsTest, TopRejectsBadShapes) {
  const TopLogprobsParams p = ValidTopParams();
  ASSERT_TRUE(LaunchTopLogprobs(stream(), p).ok());

  TopLogprobsParams bad = p;
  bad.num_rows = -1;
  EXPECT_THAT(LaunchTopLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("num_rows"));
  bad = p;
  bad.num_logit_rows = -1;
  EXPECT_THAT(LaunchTopLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("num_logit_rows"));
  bad = p;
  bad.vocab_size = 0;
  EXPECT_THAT(LaunchTopLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("vocab_size"));
  bad = p;
  bad.k = -1;
  EXPECT_THAT(LaunchTopLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("k must be in"));
  bad = p;
  bad.k = 6;  // more than the vocabulary (5)
  EXPECT_THAT(LaunchTopLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("k must be in"));
  bad = p;
  bad.logits = Upload(RandomFloats(40 * 25, 1));
  bad.num_logit_rows = 40;
  bad.vocab_size = 25;
  bad.k = kMaxTopLogprobs + 1;  // more than kMaxTopLogprobs
  EXPECT_THAT(LaunchTopLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("k must be in"));
  bad = p;
  bad.logits = AllocElements<float>(2 * 5 - 1);
  EXPECT_THAT(LaunchTopLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("'logits'"));
  bad = p;
  bad.num_logit_rows = 3;  // the logits buffer holds 2 rows
  EXPECT_THAT(LaunchTopLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("'logits'"));
  bad = p;
  bad.rows = AllocElements<int32_t>(2);
  EXPECT_THAT(LaunchTopLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("'rows'"));
  bad = p;
  bad.logsumexp = DeviceBuffer();
  EXPECT_THAT(LaunchTopLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("'logsumexp'"));
  bad = p;
  bad.top_token_ids = AllocElements<int32_t>(5);
  EXPECT_THAT(LaunchTopLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("'top_token_ids'"));
  bad = p;
  bad.top_logprobs = DeviceBuffer();
  EXPECT_THAT(LaunchTopLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("'top_logprobs'"));
  // k = 0 needs no top buffers.
  bad = p;
  bad.k = 0;
  bad.top_token_ids = DeviceBuffer();
  bad.top_logprobs = DeviceBuffer();
  EXPECT_TRUE(LaunchTopLogprobs(stream(), bad).ok());

  // Outputs overlapping inputs or each other.
  bad = p;
  bad.logsumexp = p.logits.Slice(0, sizeof(float) * 3);
  EXPECT_THAT(LaunchTopLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("overlap"));
  bad = p;
  bad.top_token_ids = DeviceBuffer(p.rows.data(), sizeof(int32_t) * 6);
  EXPECT_THAT(LaunchTopLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("overlap"));
  bad = p;
  bad.top_logprobs = DeviceBuffer(p.top_token_ids.data(), sizeof(float) * 6);
  EXPECT_THAT(LaunchTopLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("overlap"));
  bad = p;
  bad.logsumexp = DeviceBuffer(p.top_logprobs.data(), sizeof(float) * 3);
  EXPECT_THAT(LaunchTopLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("overlap"));
}

TEST_F(LogprobsTest, GatherRejectsBadShapes) {
  const GatherLogprobsParams p = ValidGatherParams();
  ASSERT_TRUE(LaunchGatherLogprobs(stream(), p).ok());

  GatherLogprobsParams bad = p;
  bad.num_rows = -1;
  EXPECT_THAT(LaunchGatherLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("num_rows"));
  bad = p;
  bad.num_logit_rows = -1;
  EXPECT_THAT(LaunchGatherLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("num_logit_rows"));
  bad = p;
  bad.vocab_size = -3;
  EXPECT_THAT(LaunchGatherLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("vocab_size"));
  bad = p;
  bad.logits = AllocElements<float>(9);
  EXPECT_THAT(LaunchGatherLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("'logits'"));
  bad = p;
  bad.rows = DeviceBuffer();
  EXPECT_THAT(LaunchGatherLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("'rows'"));
  bad = p;
  bad.token_ids = AllocElements<int32_t>(1);  // one per logits row: 2
  EXPECT_THAT(LaunchGatherLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("'token_ids'"));
  bad = p;
  bad.logsumexp = AllocElements<float>(2);
  EXPECT_THAT(LaunchGatherLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("'logsumexp'"));
  bad = p;
  bad.logprobs = AllocElements<float>(2);
  EXPECT_THAT(LaunchGatherLogprobs(stream(), bad),
              IsInvalidArgumentMentioning("'logprobs'"));
  for (const DeviceBuffer& input :
       {p.logits, p.rows, p.token_ids, p.logsumexp}) {
    bad = p;
    bad.logprobs = DeviceBuffer(input.data(), sizeof(float) * 3);
    EXPECT_THAT(LaunchGatherLogprobs(stream(), bad),
                IsInvalidArgumentMentioning("overlap"));
  }
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
