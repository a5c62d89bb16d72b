#include "worker/kernels/embedding.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "tests/kernels/kernel_test_util.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::IsInvalidArgumentMentioning;
using testing::KernelTest;
using testing::RandomFloats;

class EmbeddingTest : public KernelTest {};

TEST_F(EmbeddingTest, CopiesTableRowsAndZeroesOutOfRangeIds) {
  constexpr int kVocab = 50, kHidden = 24;
  const std::vector<float> table = RandomFloats(kVocab * kHidden, 1);
  // 0 is what padding tokens carry; -1 and kVocab are corrupt ids.
  const std::vector<int32_t> ids = {7, 0, 49, 7, -1, kVocab, 13};
  const int num_tokens = static_cast<int>(ids.size());
  EmbeddingParams p;
  p.token_ids = Upload(ids);
  p.table = Upload(table);
  p.output = AllocElements<float>(num_tokens * kHidden);
  p.num_tokens = num_tokens;
  p.vocab_size = kVocab;
  p.hidden_size = kHidden;
  ASSERT_TRUE(LaunchEmbedding(stream(), p).ok());

  const std::vector<float> out = Read<float>(p.output);
  for (int t = 0; t < num_tokens; ++t) {
    for (int i = 0; i < kHidden; ++i) {
      const bool valid = ids[t] >= 0 && ids[t] < kVocab;
      const float expected = valid ? table[ids[t] * kHidden + i] : 0.0f;
      ASSERT_EQ(out[t * kHidden + i], expected) << "token " << t << " i " << i;
    }
  }
}

// Gemma's sqrt(hidden_size) multiplier: every row times the scale.
TEST_F(EmbeddingTest, ScaleMultipliesEveryRow) {
  constexpr int kVocab = 30, kHidden = 16;
  const std::vector<float> table = RandomFloats(kVocab * kHidden, 2);
  const std::vector<int32_t> ids = {3, 29, 0};
  EmbeddingParams p;
  p.token_ids = Upload(ids);
  p.table = Upload(table);
  p.output = AllocElements<float>(3 * kHidden);
  p.num_tokens = 3;
  p.vocab_size = kVocab;
  p.hidden_size = kHidden;
  p.scale = 4.0f;
  ASSERT_TRUE(LaunchEmbedding(stream(), p).ok());
  const std::vector<float> out = Read<float>(p.output);
  for (int t = 0; t < 3; ++t) {
    for (int i = 0; i < kHidden; ++i) {
      ASSERT_EQ(out[t * kHidden + i], 4.0f * table[ids[t] * kHidden + i]);
    }
  }
  p.scale = std::nanf("");
  EXPECT_THAT(LaunchEmbedding(stream(), p),
              IsInvalidArgumentMentioning("scale"));
}

TEST_F(EmbeddingTest, ReadsTokenIdsWhenAGraphReplays) {
  constexpr int kVocab = 10, kHidden = 8, kTokens = 3;
  const std::vector<float> table = RandomFloats(kVocab * kHidden, 2);
  EmbeddingParams p;
  p.token_ids = Upload(std::vector<int32_t>{1, 2, 3});
  p.table = Upload(table);
  p.output = AllocElements<float>(kTokens * kHidden);
  p.num_tokens = kTokens;
  p.vocab_size = kVocab;
  p.hidden_size = kHidden;
  ASSERT_TRUE(stream().BeginCapture().ok());
  ASSERT_TRUE(LaunchEmbedding(stream(), p).ok());
  auto graph = stream().EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();

  Write(p.token_ids, std::vector<int32_t>{9, 0, 4});
  ASSERT_TRUE((*graph)->Replay().ok());
  const std::vector<float> out = Read<float>(p.output);
  EXPECT_EQ(out[0], table[9 * kHidden]);
  EXPECT_EQ(out[kHidden], table[0]);
  EXPECT_EQ(out[2 * kHidden + 5], table[4 * kHidden + 5]);
}

TEST_F(EmbeddingTest, RejectsTooSmallBuffers) {
  EmbeddingParams p;
  p.num_tokens = 4;
  p.vocab_size = 10;
  p.hidden_size = 8;
  p.token_ids = AllocElements<int32_t>(4);
  p.table = AllocElements<float>(10 * 8);
  p.output = AllocElements<float>(4 * 8);
  ASSERT_TRUE(LaunchEmbedding(stream(), p).ok());

  EmbeddingParams bad = p;
  bad.token_ids = AllocElements<int32_t>(3);
  EXPECT_THAT(LaunchEmbedding(stream(), bad),
              IsInvalidArgumentMentioning("'token_ids'"));
  bad = p;
  bad.table = AllocElements<float>(10 * 8 - 1);
  EXPECT_THAT(LaunchEmbedding(stream(), bad),
              IsInvalidArgumentMentioning("'table'"));
  bad = p;
  bad.output = AllocElements<float>(3 * 8);
  EXPECT_THAT(LaunchEmbedding(stream(), bad),
              IsInvalidArgumentMentioning("'output'"));
  bad = p;
  bad.hidden_size = 0;
  EXPECT_THAT(LaunchEmbedding(stream(), bad),
              IsInvalidArgumentMentioning("hidden_size"));
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
