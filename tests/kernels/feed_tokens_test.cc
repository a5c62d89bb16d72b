#include "worker/kernels/feed_tokens.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "tests/kernels/kernel_test_util.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::IsInvalidArgumentMentioning;
using testing::KernelTest;

constexpr int32_t kIntMin = std::numeric_limits<int32_t>::min();
constexpr int32_t kIntMax = std::numeric_limits<int32_t>::max();
// Sentinels around the views: a write before/after token_ids leaves
// kTokenPad changed; a read before/after sampled_token_ids carries kSamplePad
// into token_ids. Real token ids are never negative.
constexpr int32_t kTokenPad = -7;
constexpr int32_t kSamplePad = -5;
constexpr int kPad = 32;

struct FeedCase {
  int num_feeds = 0;
  int num_sampled = 0;
  int num_tokens = 0;
  std::vector<int32_t> sampled;    // [num_sampled]
  std::vector<int32_t> token_ids;  // [num_tokens]
  // [num_feeds + kPad]: the entries past num_feeds are valid feeds that must
  // not be applied (the kernel reads only num_feeds).
  std::vector<int32_t> src_rows;
  std::vector<int32_t> dst_indices;
};

// Independent reference: entry j takes the sample of the feed i < num_feeds
// that names it with an in-range source (at most one does, except in the
// duplicate test); every other entry keeps its value.
std::vector<int32_t> Reference(const FeedCase& c) {
  std::vector<int32_t> want = c.token_ids;
  for (int j = 0; j < c.num_tokens; ++j) {
    for (int i = 0; i < c.num_feeds; ++i) {
      const int32_t src = c.src_rows[i];
      if (c.dst_indices[i] == j && src >= 0 && src < c.num_sampled) {
        want[j] = c.sampled[src];
      }
    }
  }
  return want;
}

std::vector<int32_t> Padded(const std::vector<int32_t>& values, int32_t pad) {
  std::vector<int32_t> padded(kPad, pad);
  padded.insert(padded.end(), values.begin(), values.end());
  padded.insert(padded.end(), kPad, pad);
  return padded;
}

// Random shapes: distinct destinations (the defined case), sources drawn
// with repetition (one sample may feed several entries), ~20% of the feeds
// out of range in source or destination.
FeedCase RandomCase(uint32_t seed) {
  std::mt19937 rng(seed);
  auto uniform = [&rng](int lo, int hi) {  // [lo, hi]
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  FeedCase c;
  c.num_sampled = uniform(0, 24);
  c.num_tokens = uniform(1, 80);
  c.num_feeds = uniform(0, c.num_tokens);
  for (int s = 0; s < c.num_sampled; ++s) {
    c.sampled.push_back(uniform(0, 151935));
  }
  for (int t = 0; t < c.num_tokens; ++t) {
    c.token_ids.push_back(uniform(0, 151935));
  }
  std::vector<int32_t> order(c.num_tokens);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const int32_t bad_src[] = {-1, c.num_sampled, kIntMin, kIntMax};
  const int32_t bad_dst[] = {-1, c.num_tokens, kIntMin, kIntMax};
  for (int i = 0; i < c.num_feeds + kPad; ++i) {
    int32_t src = c.num_sampled > 0 ? uniform(0, c.num_sampled - 1) : -1;
    int32_t dst = i < c.num_feeds ? order[i] : uniform(0, c.num_tokens - 1);
    if (i < c.num_feeds && uniform(0, 9) < 2) {
      if (uniform(0, 1) == 0) {
        src = bad_src[uniform(0, 3)];
      } else {
        dst = bad_dst[uniform(0, 3)];
      }
    }
    c.src_rows.push_back(src);
    c.dst_indices.push_back(dst);
  }
  return c;
}

class FeedTokensTest : public KernelTest {
 protected:
  // Runs the kernel on `c` with both id views between sentinels; returns
  // the whole padded token_ids buffer.
  std::vector<int32_t> Run(const FeedCase& c) {
    const DeviceBuffer samples = Upload(Padded(c.sampled, kSamplePad));
    const DeviceBuffer tokens = Upload(Padded(c.token_ids, kTokenPad));
    FeedSampledTokensParams p;
    p.sampled_token_ids =
        samples.Slice(sizeof(int32_t) * kPad, sizeof(int32_t) * c.num_sampled);
    p.src_rows = Upload(c.src_rows);
    p.token_ids =
        tokens.Slice(sizeof(int32_t) * kPad, sizeof(int32_t) * c.num_tokens);
    p.dst_indices = Upload(c.dst_indices);
    p.num_feeds = c.num_feeds;
    p.num_sampled = c.num_sampled;
    p.num_tokens = c.num_tokens;
    const absl::Status status = LaunchFeedSampledTokens(stream(), p);
    EXPECT_TRUE(status.ok()) << status;
    // Everything but token_ids is only read.
    EXPECT_EQ(Read<int32_t>(samples), Padded(c.sampled, kSamplePad));
    EXPECT_EQ(Read<int32_t>(p.src_rows), c.src_rows);
    EXPECT_EQ(Read<int32_t>(p.dst_indices), c.dst_indices);
    return Read<int32_t>(tokens);
  }

  // Valid params: 2 feeds from 3 samples into 4 tokens.
  FeedSampledTokensParams ValidParams() {
    FeedSampledTokensParams p;
    p.sampled_token_ids = Upload(std::vector<int32_t>{11, 12, 13});
    p.src_rows = Upload(std::vector<int32_t>{2, 0});
    p.token_ids = Upload(std::vector<int32_t>{1, 2, 3, 4});
    p.dst_indices = Upload(std::vector<int32_t>{1, 3});
    p.num_feeds = 2;
    p.num_sampled = 3;
    p.num_tokens = 4;
    return p;
  }
};

TEST_F(FeedTokensTest, MatchesTheReferenceOnRandomShapes) {
  for (uint32_t seed = 1; seed <= 60; ++seed) {
    const FeedCase c = RandomCase(seed);
    EXPECT_EQ(Run(c), Padded(Reference(c), kTokenPad))
        << "seed " << seed << ": feeds " << c.num_feeds << " sampled "
        << c.num_sampled << " tokens " << c.num_tokens;
  }
}

TEST_F(FeedTokensTest, OneSampleMayFeedSeveralEntries) {
  FeedCase c;
  c.sampled = {100, 200};
  c.token_ids = {1, 2, 3, 4, 5};
  c.src_rows = {1, 1, 0};
  c.dst_indices = {0, 4, 2};
  c.num_feeds = 3;
  c.num_sampled = 2;
  c.num_tokens = 5;
  EXPECT_EQ(Run(c), Padded({200, 2, 100, 4, 200}, kTokenPad));
}

// Two feeds to one index are undefined by contract (CUDA threads race); the
// entry must still end up with one of the two samples, and nothing else may
// change.
TEST_F(FeedTokensTest, TwoFeedsToOneIndexWriteOneOfThem) {
  FeedCase c;
  c.sampled = {100, 200, 300};
  c.token_ids = {1, 2, 3};
  c.src_rows = {0, 2, 1};
  c.dst_indices = {1, 1, 0};
  c.num_feeds = 3;
  c.num_sampled = 3;
  c.num_tokens = 3;
  const std::vector<int32_t> got = Run(c);
  EXPECT_EQ(got[kPad + 0], 200);
  EXPECT_TRUE(got[kPad + 1] == 100 || got[kPad + 1] == 300) << got[kPad + 1];
  EXPECT_EQ(got[kPad + 2], 3);
}

TEST_F(FeedTokensTest, OutOfRangeEntriesAreSkipped) {
  FeedCase c;
  c.sampled = {100, 200};
  c.token_ids = {1, 2, 3};
  c.src_rows = {-1, 2, kIntMin, kIntMax, 0, 0, 0, 0, 1};
  c.dst_indices = {0, 0, 1, 2, -1, 3, kIntMin, kIntMax, 2};
  c.num_feeds = 9;  // only the last one is in range
  c.num_sampled = 2;
  c.num_tokens = 3;
  EXPECT_EQ(Run(c), Padded({1, 2, 200}, kTokenPad));

  // No samples at all: every feed is out of range.
  FeedCase none = c;
  none.sampled.clear();
  none.num_sampled = 0;
  EXPECT_EQ(Run(none), Padded(c.token_ids, kTokenPad));
}

// num_feeds = 0 returns before launching: the listed (valid) feeds past it
// are never read, and no feed list is needed at all.
TEST_F(FeedTokensTest, ZeroFeedsChangeNothingAndNeedNoFeedList) {
  FeedSampledTokensParams p = ValidParams();
  p.num_feeds = 0;
  ASSERT_TRUE(LaunchFeedSampledTokens(stream(), p).ok());
  EXPECT_EQ(Read<int32_t>(p.token_ids), (std::vector<int32_t>{1, 2, 3, 4}));
  p.src_rows = DeviceBuffer();
  p.dst_indices = DeviceBuffer();
  ASSERT_TRUE(LaunchFeedSampledTokens(stream(), p).ok());
  EXPECT_EQ(Read<int32_t>(p.token_ids), (std::vector<int32_t>{1, 2, 3, 4}));
}

TEST_F(FeedTokensTest, RefusedWhileCapturing) {
  // Buffers first: allocation and uploads are refused during capture too.
  const FeedSampledTokensParams p = ValidParams();
  FeedSampledTokensParams none = p;
  none.num_feeds = 0;
  ASSERT_TRUE(stream().BeginCapture().ok());
  const absl::Status status = LaunchFeedSampledTokens(stream(), p);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_FALSE(stream().EndCapture().ok());

  // Even with nothing to feed: the launcher has no place in a graph.
  ASSERT_TRUE(stream().BeginCapture().ok());
  EXPECT_EQ(LaunchFeedSampledTokens(stream(), none).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(stream().EndCapture().ok());
}

TEST_F(FeedTokensTest, RejectsBadShapes) {
  const FeedSampledTokensParams p = ValidParams();
  ASSERT_TRUE(LaunchFeedSampledTokens(stream(), p).ok());

  FeedSampledTokensParams bad = p;
  bad.num_feeds = -1;
  EXPECT_THAT(LaunchFeedSampledTokens(stream(), bad),
              IsInvalidArgumentMentioning("num_feeds"));
  bad = p;
  bad.num_sampled = -2;
  EXPECT_THAT(LaunchFeedSampledTokens(stream(), bad),
              IsInvalidArgumentMentioning("num_sampled"));
  bad = p;
  bad.num_tokens = -3;
  EXPECT_THAT(LaunchFeedSampledTokens(stream(), bad),
              IsInvalidArgumentMentioning("num_tokens"));
  bad = p;
  bad.num_sampled = 4;
  EXPECT_THAT(LaunchFeedSampledTokens(stream(), bad),
              IsInvalidArgumentMentioning("'sampled_token_ids'"));
  bad = p;
  bad.src_rows = AllocElements<int32_t>(1);
  EXPECT_THAT(LaunchFeedSampledTokens(stream(), bad),
              IsInvalidArgumentMentioning("'src_rows'"));
  bad = p;
  bad.num_tokens = 5;
  EXPECT_THAT(LaunchFeedSampledTokens(stream(), bad),
              IsInvalidArgumentMentioning("'token_ids'"));
  bad = p;
  bad.dst_indices = DeviceBuffer();
  EXPECT_THAT(LaunchFeedSampledTokens(stream(), bad),
              IsInvalidArgumentMentioning("'dst_indices'"));
  bad = p;
  bad.sampled_token_ids = p.token_ids;  // the samples would be overwritten
  EXPECT_THAT(LaunchFeedSampledTokens(stream(), bad),
              IsInvalidArgumentMentioning("overlap"));
  bad = p;
  bad.dst_indices = p.token_ids.Slice(sizeof(int32_t) * 2, sizeof(int32_t) * 2);
  EXPECT_THAT(LaunchFeedSampledTokens(stream(), bad),
              IsInvalidArgumentMentioning("overlap"));
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
