// Speculation keeps the target distribution (issue 42): thousands of verify
// steps of one sequence on the CPU backend, each with its own seed,
// temperature 1 and top-p 0.9, verifying two fixed draft tokens (a
// deterministic proposer's situation: q is one token with probability 1).
// The request emits rows 0..AcceptedDrafts. The first emitted token must
// follow p1, the target's distribution after the context (softmax of logits
// row 0 over its top-p set), and the second, among the steps that accepted
// draft 1, p2, the target's after the context and draft 1 (logits row 1):
// Pearson's chi-square at significance 0.001 for each. Draft 1's acceptance
// rate must be p1(draft 1) within 4 standard errors.
#include "worker/engine/draft_acceptance.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/cpu_device.h"

namespace pdworker {
namespace {

TEST(AcceptedDraftsTest, TheLongestAgreeingPrefix) {
  const std::vector<int32_t> drafts = {5, 6, 7};
  EXPECT_EQ(AcceptedDrafts(drafts, std::vector<int32_t>{5, 6, 7, 8}), 3);
  EXPECT_EQ(AcceptedDrafts(drafts, std::vector<int32_t>{5, 9, 7, 8}), 1);
  EXPECT_EQ(AcceptedDrafts(drafts, std::vector<int32_t>{1, 6, 7, 8}), 0);
  EXPECT_EQ(AcceptedDrafts({}, std::vector<int32_t>{4}), 0);
}

// softmax(logits / temperature) restricted to the shortest most-likely-first
// prefix (ties to lower ids) whose probability reaches top_p, renormalized:
// the sampler's documented top-p (worker/kernels/sampling.h), in double.
std::vector<double> TopP(const std::vector<float>& logits, double temperature,
                         double top_p) {
  const int vocab = static_cast<int>(logits.size());
  const double max = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(vocab);
  double sum = 0.0;
  for (int v = 0; v < vocab; ++v) {
    p[v] = std::exp((logits[v] - max) / temperature);
    sum += p[v];
  }
  for (double& x : p) x /= sum;
  std::vector<int> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&p](int a, int b) { return p[a] > p[b]; });
  std::vector<double> kept(vocab, 0.0);
  double mass = 0.0;
  for (const int v : order) {
    kept[v] = p[v];
    mass += p[v];
    if (mass >= top_p) break;
  }
  for (double& x : kept) x /= mass;
  return kept;
}

// Pearson's statistic and its degrees of freedom; +inf when a token outside
// the support was drawn.
struct ChiSquare {
  double statistic = 0.0;
  int degrees = 0;
};
ChiSquare Pearson(const std::vector<int>& counts,
                  const std::vector<double>& expected, int n) {
  ChiSquare c;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (expected[i] == 0.0) {
      if (counts[i] != 0) c.statistic = INFINITY;
      continue;
    }
    const double e = expected[i] * n;
    c.statistic += (counts[i] - e) * (counts[i] - e) / e;
    ++c.degrees;
  }
  --c.degrees;
  return c;
}

// The chi-square quantile at 1 - 0.001 (Wilson-Hilferty; z = 3.0902).
double Critical(int degrees) {
  const double k = degrees, z = 3.0902;
  const double t = 1.0 - 2.0 / (9.0 * k) + z * std::sqrt(2.0 / (9.0 * k));
  return k * t * t * t;
}

TEST(DraftAcceptanceTest, EmittedTokensKeepTheTargetDistribution) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp ? tmp : "/tmp") + "/accept_gqa";
  TinyModelOptions tiny;
  tiny.shape = TinyShape::kGqa;
  tiny.seed = 7;
  ASSERT_TRUE(WriteTinyModel(tiny, dir).ok());
  CpuDeviceOptions device_options;
  device_options.stream_execution = CpuStreamExecution::kInline;
  CpuDevice device(device_options);
  ModelRunnerOptions o;
  o.max_num_seqs = 8;
  o.max_num_batched_tokens = 64;
  o.kv_cache_bytes = int64_t{1} << 20;
  o.block_size = 4;
  o.max_model_len = 128;
  o.uniform_decode_query_len = 3;
  auto runner = ModelRunner::Create(device, dir, o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  ModelRunner& r = **runner;
  const int vocab = static_cast<int>(r.model_config().vocab_size);

  const std::vector<int32_t> prompt = {5, 17, 42, 8, 99, 3, 61, 20};
  auto prefill =
      r.Execute({MakeSequenceStep("a", prompt, SequenceCreation::kMustBeNew)});
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  const int32_t last = prefill->sequences[0].token_id;
  const int32_t length = prefill->sequences[0].num_tokens;

  SamplingOptions sampling;
  sampling.temperature = 1.0f;
  sampling.top_p = 0.9f;
  // One verify step of `drafts` with `seed`; its rows and, with `logits`,
  // the step's two logits rows; the sequence is trimmed back after.
  auto verify = [&](const std::vector<int32_t>& drafts, uint64_t seed,
                    std::vector<float>* logits) {
    SequenceStep step = MakeSequenceStep("a", {last, drafts[0], drafts[1]},
                                         SequenceCreation::kMustExist);
    step.num_samples = 3;
    step.sampling = sampling;
    step.sampling.seed = seed;
    absl::StatusOr<StepResult> result = r.Execute({step});
    EXPECT_TRUE(result.ok()) << result.status();
    std::vector<int32_t> rows;
    if (!result.ok()) return rows;
    rows = result->sequences[0].prior_token_ids;
    rows.push_back(result->sequences[0].token_id);
    if (logits != nullptr) EXPECT_TRUE(r.ReadLogits(2, logits).ok());
    EXPECT_TRUE(r.Truncate("a", length).ok());
    return rows;
  };
  auto argmax = [vocab](const std::vector<float>& l, int row) {
    return static_cast<int32_t>(
        std::max_element(l.begin() + row * vocab,
                         l.begin() + (row + 1) * vocab) -
        (l.begin() + row * vocab));
  };
  // Drafts the target likes (so draft 1 is often accepted): its most
  // likely token after the context, then after that one.
  std::vector<float> logits;
  verify({0, 0}, 0, &logits);
  const int32_t d1 = argmax(logits, 0);
  verify({d1, 0}, 0, &logits);
  const int32_t d2 = argmax(logits, 1);
  const std::vector<double> p1 = TopP(
      std::vector<float>(logits.begin(), logits.begin() + vocab), 1.0, 0.9);
  const std::vector<double> p2 = TopP(
      std::vector<float>(logits.begin() + vocab, logits.begin() + 2 * vocab),
      1.0, 0.9);

  constexpr int kDraws = 4000;
  std::vector<int> first(vocab, 0), second(vocab, 0);
  int accepted_d1 = 0;
  for (int seed = 1; seed <= kDraws; ++seed) {
    const std::vector<int32_t> rows = verify({d1, d2}, seed, nullptr);
    ASSERT_EQ(rows.size(), 3u);
    const int32_t accepted = AcceptedDrafts({d1, d2}, rows);
    ++first[rows[0]];  // emitted first: row 0, whether d1 or not
    if (accepted >= 1) {
      ++accepted_d1;
      ++second[rows[1]];  // emitted second: row 1, given d1
    }
  }
  const ChiSquare c1 = Pearson(first, p1, kDraws);
  EXPECT_LT(c1.statistic, Critical(c1.degrees))
      << "first token, " << c1.degrees + 1 << " tokens in top-p";
  ASSERT_GT(accepted_d1, 200) << "draft 1 is too rarely accepted to test";
  const ChiSquare c2 = Pearson(second, p2, accepted_d1);
  EXPECT_LT(c2.statistic, Critical(c2.degrees))
      << "second token, " << c2.degrees + 1 << " tokens in top-p";
  const double rate = p1[d1];
  const double stderr_ = std::sqrt(rate * (1 - rate) / kDraws);
  EXPECT_NEAR(static_cast<double>(accepted_d1) / kDraws, rate, 4 * stderr_);
}

}  // namespace
}  // namespace pdworker
