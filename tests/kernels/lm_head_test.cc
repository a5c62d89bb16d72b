#include "worker/kernels/lm_head.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "tests/kernels/kernel_test_util.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::IsInvalidArgumentMentioning;
using testing::KernelTest;
using testing::MaxAbsDiff;
using testing::RandomFloats;

class LmHeadTest : public KernelTest {};

TEST_F(LmHeadTest, GatherRowsCopiesIndexedRowsAndZeroesInvalidOnes) {
  const std::vector<float> input = RandomFloats(5 * 3, 51);
  GatherRowsParams p;
  p.input = Upload(input);
  p.indices = Upload(std::vector<int32_t>{4, 0, -1, 4, 5});
  p.output = AllocElements<float>(5 * 3);
  p.num_input_rows = 5;
  p.num_indices = 5;
  p.row_size = 3;
  ASSERT_TRUE(LaunchGatherRows(stream(), p).ok());
  const std::vector<float> out = Read<float>(p.output);
  const std::vector<int> expected_rows = {4, 0, -1, 4, -1};
  for (int i = 0; i < 5; ++i) {
    for (int c = 0; c < 3; ++c) {
      const float expected =
          expected_rows[i] < 0 ? 0.0f : input[expected_rows[i] * 3 + c];
      EXPECT_EQ(out[i * 3 + c], expected) << i << "," << c;
    }
  }
}

// Logits for each request's last token only, for padding requests (index
// -1) zero; indices read when a captured graph replays.
TEST_F(LmHeadTest, LogitsOfSelectedRowsMatchReferenceAcrossReplays) {
  constexpr int kTokens = 10, kRows = 4, kHidden = 32, kVocab = 50;
  const std::vector<float> hidden = RandomFloats(kTokens * kHidden, 52);
  const std::vector<float> weight = RandomFloats(kVocab * kHidden, 53);
  LmHeadParams p;
  p.hidden = Upload(hidden);
  p.logits_indices = Upload(std::vector<int32_t>{2, 5, 9, -1});
  p.gathered = AllocElements<float>(kRows * kHidden);
  p.weight = Upload(weight);
  p.logits = AllocElements<float>(kRows * kVocab);
  p.num_tokens = kTokens;
  p.num_rows = kRows;
  p.hidden_size = kHidden;
  p.vocab_size = kVocab;

  auto reference = [&](const std::vector<int32_t>& indices) {
    std::vector<double> logits(kRows * kVocab, 0.0);
    for (int r = 0; r < kRows; ++r) {
      if (indices[r] < 0) continue;
      for (int v = 0; v < kVocab; ++v) {
        double acc = 0.0;
        for (int i = 0; i < kHidden; ++i) {
          acc += double{hidden[indices[r] * kHidden + i]} *
                 weight[v * kHidden + i];
        }
        logits[r * kVocab + v] = acc;
      }
    }
    return logits;
  };

  ASSERT_TRUE(stream().BeginCapture().ok());
  ASSERT_TRUE(LaunchLmHead(stream(), p).ok());
  absl::StatusOr<std::unique_ptr<CapturedGraph>> graph = stream().EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();

  ASSERT_TRUE((*graph)->Replay().ok());
  EXPECT_LE(MaxAbsDiff(Read<float>(p.logits), reference({2, 5, 9, -1})), 1e-5);
  const std::vector<int32_t> next = {0, 0, 7, 3};
  Write(p.logits_indices, next);
  ASSERT_TRUE((*graph)->Replay().ok());
  EXPECT_LE(MaxAbsDiff(Read<float>(p.logits), reference(next)), 1e-5);
}

// Without logits_indices the LM head takes `hidden` as its rows (the final
// norm gathered them): the logits of the gathered rows, bit for bit.
TEST_F(LmHeadTest, WithoutIndicesTheRowsAreTheHiddenRows) {
  constexpr int kTokens = 6, kRows = 3, kHidden = 16, kVocab = 20;
  const std::vector<float> hidden = RandomFloats(kTokens * kHidden, 61);
  const std::vector<int32_t> indices = {5, -1, 1};
  LmHeadParams gathering;
  gathering.hidden = Upload(hidden);
  gathering.logits_indices = Upload(indices);
  gathering.gathered = AllocElements<float>(kRows * kHidden);
  gathering.weight = Upload(RandomFloats(kVocab * kHidden, 62));
  gathering.logits = AllocElements<float>(kRows * kVocab);
  gathering.num_tokens = kTokens;
  gathering.num_rows = kRows;
  gathering.hidden_size = kHidden;
  gathering.vocab_size = kVocab;
  ASSERT_TRUE(LaunchLmHead(stream(), gathering).ok());

  std::vector<float> rows(kRows * kHidden, 0.0f);
  for (int r = 0; r < kRows; ++r) {
    if (indices[r] < 0) continue;
    std::copy_n(hidden.begin() + indices[r] * kHidden, kHidden,
                rows.begin() + r * kHidden);
  }
  LmHeadParams direct = gathering;
  direct.hidden = Upload(rows);
  direct.logits_indices = DeviceBuffer();
  direct.gathered = DeviceBuffer();
  direct.logits = AllocElements<float>(kRows * kVocab);
  ASSERT_TRUE(LaunchLmHead(stream(), direct).ok());
  EXPECT_EQ(Read<float>(direct.logits), Read<float>(gathering.logits));

  direct.hidden = AllocElements<float>(kRows * kHidden - 1);
  EXPECT_THAT(LaunchLmHead(stream(), direct),
              IsInvalidArgumentMentioning("'hidden'"));
}

// Gemma 2's final_logit_softcapping: the logits of the same rows, each x
// as cap * tanh(x / cap).
TEST_F(LmHeadTest, SoftcapBendsEveryLogit) {
  constexpr int kRows = 2, kHidden = 16, kVocab = 24;
  LmHeadParams p;
  p.hidden = Upload(RandomFloats(kRows * kHidden, 63, -3, 3));
  p.weight = Upload(RandomFloats(kVocab * kHidden, 64, -1, 1));
  p.logits = AllocElements<float>(kRows * kVocab);
  p.num_tokens = kRows;
  p.num_rows = kRows;
  p.hidden_size = kHidden;
  p.vocab_size = kVocab;
  ASSERT_TRUE(LaunchLmHead(stream(), p).ok());
  const std::vector<float> plain = Read<float>(p.logits);
  p.softcap = 2.0f;
  p.logits = AllocElements<float>(kRows * kVocab);
  ASSERT_TRUE(LaunchLmHead(stream(), p).ok());
  const std::vector<float> capped = Read<float>(p.logits);
  float largest = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_NEAR(capped[i], 2.0 * std::tanh(plain[i] / 2.0), 1e-6) << i;
    EXPECT_LT(std::fabs(capped[i]), 2.0f);
    largest = std::max(largest, std::fabs(plain[i]));
  }
  EXPECT_GT(largest, 2.0f);  // some logits were bent, not passed through
  p.softcap = -1.0f;
  EXPECT_THAT(LaunchLmHead(stream(), p),
              IsInvalidArgumentMentioning("softcap"));
}

// The greedy tile folds are a CUDA head's (lm_head_greedy.cu): the CPU
// backend says it cannot write them and refuses a launch that asks, before
// anything runs.
TEST_F(LmHeadTest, GreedyTilesAreRefusedOnTheCpuBackend) {
  constexpr int kHidden = 8, kVocab = 12;
  LmHeadParams p;
  p.num_tokens = 1;
  p.num_rows = 1;
  p.hidden_size = kHidden;
  p.vocab_size = kVocab;
  p.hidden = Upload(RandomFloats(kHidden, 71));
  p.weight = Upload(RandomFloats(kVocab * kHidden, 72));
  p.logits = AllocElements<float>(kVocab);
  p.greedy_tiles = AllocElements<float>(4096);
  const std::vector<float> before = Read<float>(p.logits);
  EXPECT_FALSE(LmHeadWritesGreedyTiles(stream(), p));
  EXPECT_THAT(LaunchLmHead(stream(), p),
              IsInvalidArgumentMentioning("'greedy_tiles'"));
  ASSERT_TRUE(stream().Synchronize().ok());
  const std::vector<float> after = Read<float>(p.logits);
  EXPECT_EQ(
      std::memcmp(after.data(), before.data(), sizeof(float) * before.size()),
      0);
  p.greedy_tiles = DeviceBuffer();
  EXPECT_TRUE(LaunchLmHead(stream(), p).ok());
}

TEST_F(LmHeadTest, RejectsBadBuffers) {
  LmHeadParams p;
  p.num_tokens = 6;
  p.num_rows = 2;
  p.hidden_size = 8;
  p.vocab_size = 12;
  p.hidden = AllocElements<float>(6 * 8);
  p.logits_indices = AllocElements<int32_t>(2);
  p.gathered = AllocElements<float>(2 * 8);
  p.weight = AllocElements<float>(12 * 8);
  p.logits = AllocElements<float>(2 * 12);
  ASSERT_TRUE(LaunchLmHead(stream(), p).ok());
  LmHeadParams bad = p;
  bad.hidden = AllocElements<float>(6 * 8 - 1);
  EXPECT_THAT(LaunchLmHead(stream(), bad),
              IsInvalidArgumentMentioning("'hidden'"));
  bad = p;
  bad.logits_indices = AllocElements<int32_t>(1);
  EXPECT_THAT(LaunchLmHead(stream(), bad),
              IsInvalidArgumentMentioning("'logits_indices'"));
  bad = p;
  bad.gathered = AllocElements<float>(2 * 8 - 1);
  EXPECT_THAT(LaunchLmHead(stream(), bad),
              IsInvalidArgumentMentioning("'gathered'"));
  bad = p;
  bad.weight = AllocElements<float>(11 * 8);
  EXPECT_THAT(LaunchLmHead(stream(), bad),
              IsInvalidArgumentMentioning("'weight'"));
  bad = p;
  bad.logits = AllocElements<float>(2 * 12 - 1);
  EXPECT_THAT(LaunchLmHead(stream(), bad),
              IsInvalidArgumentMentioning("'logits'"));

  GatherRowsParams gather;
  gather.input = AllocElements<float>(4 * 3);
  gather.indices = AllocElements<int32_t>(2);
  gather.output = AllocElements<float>(2 * 3);
  gather.num_input_rows = 4;
  gather.num_indices = 2;
  gather.row_size = 3;
  ASSERT_TRUE(LaunchGatherRows(stream(), gather).ok());
  GatherRowsParams bad_gather = gather;
  bad_gather.indices = AllocElements<int32_t>(1);
  EXPECT_THAT(LaunchGatherRows(stream(), bad_gather),
              IsInvalidArgumentMentioning("'indices'"));
  bad_gather = gather;
  bad_gather.output = gather.input;
  EXPECT_THAT(LaunchGatherRows(stream(), bad_gather),
              IsInvalidArgumentMentioning("overlap"));
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
