// The n-gram prompt lookup against vLLM's documented example and an
// independent brute force of its rule (the longest n-gram in [min, max]
// whose last occurrence-before-the-end is earliest, then up to k tokens
// after it, capped by the sequence's end and max_model_len).
#include "worker/engine/ngram_proposer.h"

#include <cstdint>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

NgramParams Params(int min_n, int max_n, int k, int max_model_len = 1 << 20) {
  return {min_n, max_n, k, max_model_len};
}

// The rule written out position by position: for each n from the longest,
// the first start j whose n tokens equal the last n and end before the last
// token.
std::vector<int32_t> BruteForce(const std::vector<int32_t>& t,
                                const NgramParams& p) {
  const int total = static_cast<int>(t.size());
  const int k = std::min(p.num_speculative_tokens, p.max_model_len - total);
  if (k <= 0) return {};
  for (int n = p.prompt_lookup_max; n >= p.prompt_lookup_min; --n) {
    if (n > total - 1) continue;
    for (int j = 0; j + n <= total - 1; ++j) {
      bool same = true;
      for (int i = 0; i < n && same; ++i) same = t[j + i] == t[total - n + i];
      if (!same) continue;
      std::vector<int32_t> draft;
      for (int i = j + n; i < total && static_cast<int>(draft.size()) < k;
           ++i) {
        draft.push_back(t[i]);
      }
      return draft;
    }
  }
  return {};
}

// vLLM's docstring: [1,2,3,4,2,3], min 2, max 3, k 4: [4,2,3] has no
// earlier occurrence, [2,3] has, and only three tokens follow it.
TEST(NgramProposerTest, VllmsExample) {
  EXPECT_THAT(ProposeNgramDraft({1, 2, 3, 4, 2, 3}, Params(2, 3, 4)),
              ElementsAre(4, 2, 3));
}

TEST(NgramProposerTest, LongestNgramThenEarliestOccurrence) {
  // [7, 1, 2] occurs once before (after a 7); [1, 2] twice: the longer wins.
  EXPECT_THAT(
      ProposeNgramDraft({1, 2, 9, 7, 1, 2, 8, 5, 7, 1, 2}, Params(2, 3, 2)),
      ElementsAre(8, 5));
  // Two occurrences of [1, 2]: the earliest one's continuation.
  EXPECT_THAT(ProposeNgramDraft({1, 2, 9, 1, 2, 8, 1, 2}, Params(2, 2, 3)),
              ElementsAre(9, 1, 2));
}

TEST(NgramProposerTest, NothingToProposeIsEmpty) {
  EXPECT_THAT(ProposeNgramDraft({1, 2, 3, 4}, Params(1, 3, 4)), IsEmpty());
  EXPECT_THAT(ProposeNgramDraft({5}, Params(1, 3, 4)), IsEmpty());
  EXPECT_THAT(ProposeNgramDraft({}, Params(1, 3, 4)), IsEmpty());
  // Shorter than the shortest n-gram plus one token.
  EXPECT_THAT(ProposeNgramDraft({5, 5}, Params(2, 3, 4)), IsEmpty());
}

TEST(NgramProposerTest, OverlappingRepeatsAndTheLengthCap) {
  // [5,5,5] occurs at 0 (overlapping the suffix): one token follows it.
  EXPECT_THAT(ProposeNgramDraft({5, 5, 5, 5}, Params(1, 3, 4)), ElementsAre(5));
  // Never past max_model_len: 6 tokens of 8 leave room for 2.
  EXPECT_THAT(ProposeNgramDraft({1, 2, 3, 4, 1, 2}, Params(2, 2, 4, 8)),
              ElementsAre(3, 4));
  EXPECT_THAT(ProposeNgramDraft({1, 2, 3, 4, 1, 2}, Params(2, 2, 4, 6)),
              IsEmpty());
}

TEST(NgramProposerTest, AgreesWithTheRuleOnRandomSequences) {
  std::mt19937 rng(7);
  int nonempty = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::uniform_int_distribution<int> len(0, 40), vocab(0, 3 + trial % 5),
        lo(1, 3), extra(0, 3), kk(1, 6), room(0, 50);
    std::vector<int32_t> t(len(rng));
    for (int32_t& v : t) v = vocab(rng);
    const int min_n = lo(rng);
    const NgramParams p = Params(min_n, min_n + extra(rng), kk(rng),
                                 static_cast<int>(t.size()) + room(rng));
    const std::vector<int32_t> want = BruteForce(t, p);
    ASSERT_EQ(ProposeNgramDraft(t, p), want) << "trial " << trial;
    nonempty += !want.empty();
  }
  EXPECT_GT(nonempty, 1000);  // the sequences do repeat
}

TEST(NgramProposerTest, ParamsAreCheckedByName) {
  EXPECT_TRUE(ValidateNgramParams(Params(1, 4, 3, 128)).ok());
  EXPECT_THAT(ValidateNgramParams(Params(0, 4, 3, 128)).message(),
              ::testing::HasSubstr("prompt_lookup_min"));
  EXPECT_THAT(ValidateNgramParams(Params(3, 2, 3, 128)).message(),
              ::testing::HasSubstr("prompt_lookup_max"));
  EXPECT_THAT(ValidateNgramParams(Params(1, 2, 0, 128)).message(),
              ::testing::HasSubstr("num_speculative_tokens"));
  EXPECT_THAT(ValidateNgramParams(Params(1, 2, 3, 0)).message(),
              ::testing::HasSubstr("max_model_len"));
}

}  // namespace
}  // namespace pdworker
