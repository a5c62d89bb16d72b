#include "worker/kernels/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <utility>
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

struct RowParams {
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

// Independent helpers: softmax of logits / temperature in double.
std::vector<double> Softmax(const std::vector<float>& logits,
                            double temperature = 1.0) {
  double max = -kInf;
  for (float l : logits) max = std::max(max, double{l});
  std::vector<double> p(logits.size());
  double sum = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    sum += p[i] = std::exp((logits[i] - max) / temperature);
  }
  for (double& x : p) x /= sum;
  return p;
}

int32_t Argmax(const std::vector<float>& logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) -
                              logits.begin());
}

// Pearson's chi-square statistic of `counts` against probabilities
// `expected` (zero-probability cells must have zero counts).
double ChiSquare(const std::vector<int>& counts,
                 const std::vector<double>& expected, int n) {
  double chi2 = 0.0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (expected[i] == 0.0) {
      if (counts[i] != 0) return kInf;
      continue;
    }
    const double e = expected[i] * n;
    chi2 += (counts[i] - e) * (counts[i] - e) / e;
  }
  return chi2;
}

class SamplingTest : public KernelTest {
 protected:
  Sampled Run(const std::vector<std::vector<float>>& logits,
              const std::vector<RowParams>& params,
              LogprobMode mode = LogprobMode::kProcessed) {
    const int n = static_cast<int>(logits.size());
    const int vocab = static_cast<int>(logits[0].size());
    std::vector<float> flat;
    std::vector<float> temperature, top_p;
    std::vector<int32_t> top_k, positions;
    std::vector<uint64_t> seeds;
    for (int r = 0; r < n; ++r) {
      flat.insert(flat.end(), logits[r].begin(), logits[r].end());
      temperature.push_back(params[r].temperature);
      top_k.push_back(params[r].top_k);
      top_p.push_back(params[r].top_p);
      seeds.push_back(params[r].seed);
      positions.push_back(params[r].position);
    }
    SamplingParams p;
    p.logits = Upload(flat);
    p.temperature = Upload(temperature);
    p.top_k = Upload(top_k);
    p.top_p = Upload(top_p);
    p.seeds = Upload(seeds);
    p.positions = Upload(positions);
    p.workspace = Alloc(SamplingWorkspaceBytes(vocab));
    p.sampled_token_ids = AllocElements<int32_t>(n);
    p.sampled_logprobs = AllocElements<float>(n);
    p.num_reqs = n;
    p.vocab_size = vocab;
    p.logprob_mode = mode;
    const absl::Status status = LaunchSampling(stream(), p);
    EXPECT_TRUE(status.ok()) << status;
    return {Read<int32_t>(p.sampled_token_ids),
            Read<float>(p.sampled_logprobs)};
  }

  // n requests with the same logits row, seeds 0..n-1 (or one seed and
  // positions 0..n-1 when `vary_position`), sampled in one batch; returns
  // the token histogram.
  std::vector<int> Histogram(const std::vector<float>& logits, RowParams base,
                             int n, bool vary_position) {
    std::vector<std::vector<float>> rows(n, logits);
    std::vector<RowParams> params(n, base);
    for (int i = 0; i < n; ++i) {
      if (vary_position) {
        params[i].position = i;
      } else {
        params[i].seed = static_cast<uint64_t>(i);
      }
    }
    const Sampled sampled = Run(rows, params);
    std::vector<int> counts(logits.size(), 0);
    for (int32_t t : sampled.tokens) ++counts.at(t);
    return counts;
  }
};

const std::vector<float> kSmallLogits = {1.0f, 0.5f, 0.0f, -0.5f, 2.0f, -1.0f};
constexpr int kDraws = 20000;

TEST_F(SamplingTest, GreedyIsArgmaxWithTiesToTheLowestId) {
  const std::vector<std::vector<float>> logits = {
      {0.1f, 3.0f, -2.0f, 3.0f},   // tie between 1 and 3
      {5.0f, 5.0f, 5.0f, 5.0f},    // all equal
      {-1.0f, kNaN, -0.5f, -3.0f}  // NaN never wins
  };
  for (float temperature : {0.0f, 1e-7f, kNaN}) {
    for (int32_t top_k : {0, 2}) {
      std::vector<RowParams> params(3);
      for (RowParams& rp : params) {
        rp.temperature = temperature;
        rp.top_k = top_k;
        rp.seed = 99;
      }
      const Sampled sampled = Run(logits, params);
      EXPECT_EQ(sampled.tokens, (std::vector<int32_t>{1, 0, 2}))
          << "temperature " << temperature << " top_k " << top_k;
      // Greedy, no truncation: log_softmax of the raw logits.
      if (top_k == 0) {
        EXPECT_NEAR(sampled.logprobs[0], std::log(Softmax(logits[0])[1]), 1e-6);
        EXPECT_NEAR(sampled.logprobs[1], std::log(0.25), 1e-6);
      }
    }
  }
}

// SamplingPath::kGreedy reads the logits alone (every option buffer left
// empty) and gives what kGeneral gives greedy untruncated rows, in both
// logprob modes: ties to the lowest id, NaN never wins, an all -inf row is
// token 0 with logprob -inf.
TEST_F(SamplingTest, GreedyPathMatchesTheGeneralPathOnGreedyRows) {
  std::vector<std::vector<float>> logits = {{0.1f, 3.0f, -2.0f, 3.0f},
                                            {5.0f, 5.0f, 5.0f, 5.0f},
                                            {-1.0f, kNaN, -0.5f, -3.0f},
                                            {-kInf, -kInf, -kInf, -kInf},
                                            {2.0f, -7.5f, 0.25f, 1.0f}};
  const int n = static_cast<int>(logits.size());
  std::vector<float> flat;
  for (const auto& row : logits)
    flat.insert(flat.end(), row.begin(), row.end());
  SamplingParams p;
  p.logits = Upload(flat);
  p.sampled_token_ids = AllocElements<int32_t>(n);
  p.sampled_logprobs = AllocElements<float>(n);
  p.num_reqs = n;
  p.vocab_size = 4;
  p.path = SamplingPath::kGreedy;
  ASSERT_TRUE(LaunchSampling(stream(), p).ok());
  const std::vector<int32_t> tokens = Read<int32_t>(p.sampled_token_ids);
  const std::vector<float> logprobs = Read<float>(p.sampled_logprobs);
  for (const LogprobMode mode : {LogprobMode::kProcessed, LogprobMode::kRaw}) {
    RowParams greedy;
    greedy.temperature = 0.0f;
    const Sampled want = Run(logits, std::vector<RowParams>(n, greedy), mode);
    EXPECT_EQ(tokens, want.tokens);
    for (int r = 0; r < n; ++r) {
      if (std::isinf(want.logprobs[r])) {
        EXPECT_EQ(logprobs[r], want.logprobs[r]) << "row " << r;
      } else {
        EXPECT_NEAR(logprobs[r], want.logprobs[r], 1e-6) << "row " << r;
      }
    }
  }
  EXPECT_EQ(tokens, (std::vector<int32_t>{1, 0, 2, 0, 0}));
  EXPECT_EQ(logprobs[3], -kInf);
  // The general path still needs its options.
  p.path = SamplingPath::kGeneral;
  EXPECT_EQ(LaunchSampling(stream(), p).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(SamplingTest, SameSeedAndPositionGiveTheSameDrawAnywhereInTheBatch) {
  const std::vector<float> logits = RandomFloats(100, 61, -2.0f, 2.0f);
  RowParams mine;
  mine.temperature = 0.8f;
  mine.top_p = 0.95f;
  mine.seed = 0xDEADBEEFCAFEull;
  mine.position = 41;
  const Sampled alone = Run({logits}, {mine});

  std::vector<std::vector<float>> rows;
  std::vector<RowParams> params;
  for (int r = 0; r < 7; ++r) {
    rows.push_back(RandomFloats(100, 70 + r, -2.0f, 2.0f));
    RowParams other;
    other.seed = 1000 + r;
    other.position = r;
    other.top_k = r;
    params.push_back(other);
  }
  for (int slot : {0, 3, 7}) {
    std::vector<std::vector<float>> batch_rows = rows;
    std::vector<RowParams> batch_params = params;
    batch_rows.insert(batch_rows.begin() + slot, logits);
    batch_params.insert(batch_params.begin() + slot, mine);
    const Sampled batch = Run(batch_rows, batch_params);
    EXPECT_EQ(batch.tokens[slot], alone.tokens[0]) << "slot " << slot;
    EXPECT_EQ(batch.logprobs[slot], alone.logprobs[0]) << "slot " << slot;
  }

  // The position advances the stream: successive positions do not repeat
  // one token (100 tokens, a flat-ish distribution).
  std::vector<std::vector<float>> same(50, logits);
  std::vector<RowParams> positions(50, mine);
  for (int i = 0; i < 50; ++i) positions[i].position = i;
  const Sampled walk = Run(same, positions);
  EXPECT_GT(std::set<int32_t>(walk.tokens.begin(), walk.tokens.end()).size(),
            10u);
}

TEST_F(SamplingTest, TopK1AndTinyTopPAreGreedy) {
  std::vector<std::vector<float>> rows;
  for (int r = 0; r < 200; ++r) rows.push_back(RandomFloats(64, 200 + r));
  std::vector<RowParams> top_k1(200), top_p_tiny(200);
  for (int r = 0; r < 200; ++r) {
    top_k1[r].top_k = 1;
    top_k1[r].seed = top_p_tiny[r].seed = r;
    top_k1[r].temperature = top_p_tiny[r].temperature = 1.5f;
    top_p_tiny[r].top_p = 1e-6f;
  }
  const Sampled k1 = Run(rows, top_k1);
  const Sampled p_tiny = Run(rows, top_p_tiny);
  for (int r = 0; r < 200; ++r) {
    EXPECT_EQ(k1.tokens[r], Argmax(rows[r])) << r;
    EXPECT_EQ(p_tiny.tokens[r], Argmax(rows[r])) << r;
    // A one-token kept set: the draw had probability 1.
    EXPECT_EQ(k1.logprobs[r], 0.0f);
    EXPECT_EQ(p_tiny.logprobs[r], 0.0f);
  }
}

// Frequencies over many seeds follow softmax(logits / T). Chi-square with 5
// degrees of freedom: the 0.1% critical value is 20.5; the draws are
// deterministic (fixed seeds), so this is a regression check with margin.
TEST_F(SamplingTest, FrequenciesFollowTheTemperatureSoftmax) {
  for (float temperature : {1.0f, 0.5f, 2.0f}) {
    RowParams base;
    base.temperature = temperature;
    base.position = 3;
    const std::vector<double> expected = Softmax(kSmallLogits, temperature);
    const double over_seeds = ChiSquare(
        Histogram(kSmallLogits, base, kDraws, false), expected, kDraws);
    EXPECT_LT(over_seeds, 20.5) << "temperature " << temperature;
    base.seed = 7;
    const double over_positions = ChiSquare(
        Histogram(kSmallLogits, base, kDraws, true), expected, kDraws);
    EXPECT_LT(over_positions, 20.5) << "temperature " << temperature;
  }
}

TEST_F(SamplingTest, TopKKeepsTheKMostLikelyRenormalized) {
  RowParams base;
  base.top_k = 3;  // ids 4, 0, 1
  const std::vector<double> p = Softmax(kSmallLogits);
  const double kept = p[4] + p[0] + p[1];
  const std::vector<double> expected = {p[0] / kept, p[1] / kept, 0,
                                        0,           p[4] / kept, 0};
  // 2 degrees of freedom: 0.1% critical value 13.8.
  EXPECT_LT(
      ChiSquare(Histogram(kSmallLogits, base, kDraws, false), expected, kDraws),
      13.8);
}

TEST_F(SamplingTest, TopPKeepsTheShortestPrefixReachingP) {
  // Probabilities 0.5, 0.3, 0.15, 0.05 (ids 2, 0, 3, 1).
  const std::vector<float> logits = {std::log(0.3f), std::log(0.05f),
                                     std::log(0.5f), std::log(0.15f)};
  RowParams base;
  base.top_p = 0.7f;  // 0.5 < 0.7 <= 0.8: keeps ids 2 and 0
  EXPECT_LT(ChiSquare(Histogram(logits, base, kDraws, false),
                      {0.3 / 0.8, 0, 0.5 / 0.8, 0}, kDraws),
            10.8);     // 1 degree of freedom
  base.top_p = 0.85f;  // keeps ids 2, 0, 3
  EXPECT_LT(ChiSquare(Histogram(logits, base, kDraws, false),
                      {0.3 / 0.95, 0, 0.5 / 0.95, 0.15 / 0.95}, kDraws),
            13.8);
}

// A flat distribution over a large vocabulary needs a kept set longer than
// the kernel's first sorted prefix (256): the prefix must grow.
TEST_F(SamplingTest, TopPOverAFlatLargeVocabularyKeepsTheExactPrefix) {
  constexpr int kVocab = 3000;
  RowParams base;
  base.top_p = 0.5f;  // equal logits, ties by id: keeps ids [0, 1500)
  const std::vector<int> counts =
      Histogram(std::vector<float>(kVocab, 0.0f), base, 400, false);
  int largest = -1;
  for (int id = 0; id < kVocab; ++id) {
    if (counts[id] > 0) largest = id;
  }
  EXPECT_LT(largest, 1500);
  EXPECT_GT(largest, 1450);  // 400 uniform draws reach the top of the range

  std::vector<RowParams> params(1, base);
  const Sampled one = Run({std::vector<float>(kVocab, 0.0f)}, params);
  EXPECT_NEAR(one.logprobs[0], std::log(1.0 / 1500), 1e-5);
}

TEST_F(SamplingTest, LogprobsFollowTheChosenMode) {
  const std::vector<float> logits = RandomFloats(32, 81, -3.0f, 3.0f);
  std::vector<std::vector<float>> rows(50, logits);
  std::vector<RowParams> params(50);
  for (int i = 0; i < 50; ++i) {
    params[i].temperature = 0.7f;
    params[i].top_k = 10;
    params[i].top_p = 0.9f;
    params[i].seed = i;
  }
  // Reference for kProcessed: softmax(l / T), keep top 10, renormalize,
  // keep the shortest prefix reaching 0.9 of that, renormalize.
  const std::vector<double> p = Softmax(logits, 0.7);
  std::vector<int> order(32);
  for (int i = 0; i < 32; ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return p[a] > p[b]; });
  double top_k_mass = 0.0;
  for (int m = 0; m < 10; ++m) top_k_mass += p[order[m]];
  double kept_mass = 0.0;
  std::set<int> kept;
  for (int m = 0; m < 10 && kept_mass < 0.9 * top_k_mass; ++m) {
    kept_mass += p[order[m]];
    kept.insert(order[m]);
  }
  const Sampled processed = Run(rows, params, LogprobMode::kProcessed);
  const Sampled raw = Run(rows, params, LogprobMode::kRaw);
  const std::vector<double> raw_p = Softmax(logits);
  for (int i = 0; i < 50; ++i) {
    const int32_t token = processed.tokens[i];
    ASSERT_EQ(kept.count(token), 1u) << token;
    EXPECT_NEAR(processed.logprobs[i], std::log(p[token] / kept_mass), 1e-5);
    EXPECT_EQ(raw.tokens[i], token);  // the mode changes only the logprob
    EXPECT_NEAR(raw.logprobs[i], std::log(raw_p[token]), 1e-5);
  }
}

TEST_F(SamplingTest, NonFiniteLogitsAreHandled) {
  const std::vector<std::vector<float>> logits = {
      {kNaN, 0.0f, kNaN, -kInf},  // only id 1 has mass
      {-kInf, -kInf, -kInf, -kInf},
      {kNaN, kNaN, kNaN, kNaN}};
  std::vector<RowParams> params(3);
  const Sampled sampled = Run(logits, params);
  EXPECT_EQ(sampled.tokens[0], 1);
  EXPECT_EQ(sampled.logprobs[0], 0.0f);
  EXPECT_EQ(sampled.tokens[1], 0);
  EXPECT_EQ(sampled.logprobs[1], -kInf);
  EXPECT_EQ(sampled.tokens[2], 0);
  EXPECT_EQ(sampled.logprobs[2], -kInf);
}

TEST(SamplingUniformTest, IsInUnitIntervalAndUniformEnough) {
  double sum = 0.0;
  std::vector<int> deciles(10, 0);
  for (int i = 0; i < 100000; ++i) {
    const double u = SamplingUniform(12345, i);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    ++deciles[static_cast<int>(u * 10)];
  }
  EXPECT_NEAR(sum / 100000, 0.5, 0.005);
  EXPECT_LT(ChiSquare(deciles, std::vector<double>(10, 0.1), 100000), 27.9);
  EXPECT_NE(SamplingUniform(1, 0), SamplingUniform(2, 0));
  EXPECT_NE(SamplingUniform(1, 0), SamplingUniform(1, 1));
}

// Tile folds come from a CUDA LM head; the CPU sampler refuses them rather
// than ignore them, on either path, and writes nothing.
TEST_F(SamplingTest, GreedyTilesAreRefusedOnTheCpuBackend) {
  for (const SamplingPath path :
       {SamplingPath::kGreedy, SamplingPath::kGeneral}) {
    SamplingParams p;
    p.logits = Upload(std::vector<float>{0.1f, 3.0f, -2.0f});
    p.temperature = Upload(std::vector<float>{0.0f});
    p.top_k = Upload(std::vector<int32_t>{0});
    p.top_p = Upload(std::vector<float>{1.0f});
    p.seeds = Upload(std::vector<uint64_t>{1});
    p.positions = Upload(std::vector<int32_t>{0});
    p.workspace = Alloc(SamplingWorkspaceBytes(3));
    p.sampled_token_ids = Upload(std::vector<int32_t>{-7});
    p.sampled_logprobs = Upload(std::vector<float>{0.0f});
    p.num_reqs = 1;
    p.vocab_size = 3;
    p.path = path;
    p.greedy_tiles = Alloc(8192);
    EXPECT_THAT(LaunchSampling(stream(), p),
                IsInvalidArgumentMentioning("'greedy_tiles'"));
    ASSERT_TRUE(stream().Synchronize().ok());
    EXPECT_EQ(Read<int32_t>(p.sampled_token_ids), std::vector<int32_t>{-7});
  }
}

TEST_F(SamplingTest, RefusedWhileCapturing) {
  SamplingParams p;
  ASSERT_TRUE(stream().BeginCapture().ok());
  EXPECT_EQ(LaunchSampling(stream(), p).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(stream().EndCapture().ok());
}

TEST_F(SamplingTest, RejectsBadBuffers) {
  constexpr int kReqs = 3, kVocab = 10;
  SamplingParams p;
  p.logits = AllocElements<float>(kReqs * kVocab);
  p.temperature = Upload(std::vector<float>(kReqs, 1.0f));
  p.top_k = Upload(std::vector<int32_t>(kReqs, 0));
  p.top_p = Upload(std::vector<float>(kReqs, 1.0f));
  p.seeds = AllocElements<uint64_t>(kReqs);
  p.positions = AllocElements<int32_t>(kReqs);
  p.workspace = Alloc(SamplingWorkspaceBytes(kVocab));
  p.sampled_token_ids = AllocElements<int32_t>(kReqs);
  p.sampled_logprobs = AllocElements<float>(kReqs);
  p.num_reqs = kReqs;
  p.vocab_size = kVocab;
  Write(p.logits, std::vector<float>(kReqs * kVocab, 0.0f));
  ASSERT_TRUE(LaunchSampling(stream(), p).ok());

  const std::pair<DeviceBuffer SamplingParams::*, const char*> fields[] = {
      {&SamplingParams::logits, "'logits'"},
      {&SamplingParams::temperature, "'temperature'"},
      {&SamplingParams::top_k, "'top_k'"},
      {&SamplingParams::top_p, "'top_p'"},
      {&SamplingParams::seeds, "'seeds'"},
      {&SamplingParams::positions, "'positions'"},
      {&SamplingParams::workspace, "'workspace'"},
      {&SamplingParams::sampled_token_ids, "'sampled_token_ids'"},
      {&SamplingParams::sampled_logprobs, "'sampled_logprobs'"},
  };
  for (const auto& [field, name] : fields) {
    SamplingParams bad = p;
    bad.*field = (p.*field).Slice(0, (p.*field).size_bytes() - 1);
    EXPECT_THAT(LaunchSampling(stream(), bad),
                IsInvalidArgumentMentioning(name));
  }
  SamplingParams bad = p;
  bad.num_reqs = 0;
  EXPECT_THAT(LaunchSampling(stream(), bad),
              IsInvalidArgumentMentioning("num_reqs"));
  for (const int count : {-2, kReqs + 1}) {
    bad = p;
    bad.num_truncated_rows = count;
    EXPECT_THAT(LaunchSampling(stream(), bad),
                IsInvalidArgumentMentioning("num_truncated_rows"));
  }
}

// The host's test of which rows take the top-k / top-p path, as the device
// applies it: top_k in (0, vocab), top_p below 1, NaN top_p off.
TEST_F(SamplingTest, RowTruncatesOnTopKInsideTheVocabularyOrTopPBelowOne) {
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(SamplingRowTruncates(0, 1.0f, 100));
  EXPECT_TRUE(SamplingRowTruncates(1, 1.0f, 100));
  EXPECT_TRUE(SamplingRowTruncates(99, 1.0f, 100));
  EXPECT_FALSE(SamplingRowTruncates(100, 1.0f, 100));
  EXPECT_FALSE(SamplingRowTruncates(-3, 1.0f, 100));
  EXPECT_TRUE(SamplingRowTruncates(0, 0.999f, 100));
  EXPECT_FALSE(SamplingRowTruncates(0, kNaN, 100));
  EXPECT_FALSE(SamplingRowTruncates(0, 1.5f, 100));
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
