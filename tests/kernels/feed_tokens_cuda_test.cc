// Sampled-token feed on CUDA vs the CPU kernel: both copy the same in-range
// feeds to distinct destinations (two feeds to one index are undefined, so
// the cases never list a destination twice), so the whole token_ids buffer,
// sentinels around the view included, must be identical.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "tests/kernels/cuda_kernel_test_util.h"
#include "worker/kernels/feed_tokens.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::Backend;
using testing::CudaKernelTest;

constexpr int32_t kIntMin = std::numeric_limits<int32_t>::min();
constexpr int32_t kIntMax = std::numeric_limits<int32_t>::max();
constexpr int32_t kTokenPad = -7;   // around token_ids: must stay
constexpr int32_t kSamplePad = -5;  // around the samples: must never be read
constexpr int kPad = 256;

struct FeedCase {
  int num_feeds = 0;
  int num_sampled = 0;
  int num_tokens = 0;
  std::vector<int32_t> sampled;      // [num_sampled]
  std::vector<int32_t> token_ids;    // [num_tokens]
  std::vector<int32_t> src_rows;     // [num_feeds]
  std::vector<int32_t> dst_indices;  // [num_feeds], distinct when in range
};

std::vector<int32_t> Padded(const std::vector<int32_t>& values, int32_t pad) {
  std::vector<int32_t> padded(kPad, pad);
  padded.insert(padded.end(), values.begin(), values.end());
  padded.insert(padded.end(), kPad, pad);
  return padded;
}

// Distinct destinations, sources with repetition, ~20% out of range.
FeedCase RandomCase(uint32_t seed, int num_sampled, int num_tokens,
                    int num_feeds) {
  std::mt19937 rng(seed);
  auto uniform = [&rng](int lo, int hi) {  // [lo, hi]
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  FeedCase c;
  c.num_sampled = num_sampled;
  c.num_tokens = num_tokens;
  c.num_feeds = num_feeds;
  for (int s = 0; s < num_sampled; ++s) c.sampled.push_back(uniform(0, 151935));
  for (int t = 0; t < num_tokens; ++t) {
    c.token_ids.push_back(uniform(0, 151935));
  }
  std::vector<int32_t> order(num_tokens);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const int32_t bad_src[] = {-1, num_sampled, kIntMin, kIntMax};
  const int32_t bad_dst[] = {-1, num_tokens, kIntMin, kIntMax};
  for (int i = 0; i < num_feeds; ++i) {
    int32_t src = uniform(0, num_sampled - 1);
    int32_t dst = order[i];
    if (uniform(0, 9) < 2) {
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

class FeedTokensCudaTest : public CudaKernelTest {
 protected:
  // The whole padded token_ids buffer after the feed on backend `b`.
  std::vector<int32_t> Run(Backend& b, const FeedCase& c) {
    const DeviceBuffer samples = b.Upload(Padded(c.sampled, kSamplePad));
    const DeviceBuffer tokens = b.Upload(Padded(c.token_ids, kTokenPad));
    FeedSampledTokensParams p;
    p.sampled_token_ids =
        samples.Slice(sizeof(int32_t) * kPad, sizeof(int32_t) * c.num_sampled);
    p.src_rows = b.Upload(c.src_rows);
    p.token_ids =
        tokens.Slice(sizeof(int32_t) * kPad, sizeof(int32_t) * c.num_tokens);
    p.dst_indices = b.Upload(c.dst_indices);
    p.num_feeds = c.num_feeds;
    p.num_sampled = c.num_sampled;
    p.num_tokens = c.num_tokens;
    const absl::Status status = LaunchFeedSampledTokens(*b.stream, p);
    EXPECT_TRUE(status.ok()) << status;
    return b.Read<int32_t>(tokens, c.token_ids.size() + 2 * kPad);
  }

  void ExpectSameAsCpu(const FeedCase& c) {
    const std::vector<int32_t> want = Run(cpu(), c);
    const std::vector<int32_t> got = Run(gpu(), c);
    EXPECT_EQ(got, want) << "feeds " << c.num_feeds << " sampled "
                         << c.num_sampled << " tokens " << c.num_tokens;
  }
};

TEST_F(FeedTokensCudaTest, RandomShapesFeedLikeTheCpu) {
  std::mt19937 rng(2);
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    const int sampled = std::uniform_int_distribution<int>(1, 512)(rng);
    const int tokens = std::uniform_int_distribution<int>(1, 4096)(rng);
    const int feeds = std::uniform_int_distribution<int>(1, tokens)(rng);
    ExpectSameAsCpu(RandomCase(seed, sampled, tokens, feeds));
  }
}

// More feeds than the capped grid has threads (1024 blocks of 256): the
// grid-stride loop must cover the rest.
TEST_F(FeedTokensCudaTest, MoreFeedsThanThreadsFeedLikeTheCpu) {
  ExpectSameAsCpu(RandomCase(99, 1024, 400000, 300000));
}

TEST_F(FeedTokensCudaTest, ZeroFeedsChangeNothing) {
  FeedCase c = RandomCase(5, 8, 32, 8);
  c.num_feeds = 0;
  EXPECT_EQ(Run(gpu(), c), Padded(c.token_ids, kTokenPad));
}

TEST_F(FeedTokensCudaTest, RefusedWhileCapturing) {
  Stream& stream = *gpu().stream;
  FeedSampledTokensParams p;
  p.sampled_token_ids = gpu().Upload(std::vector<int32_t>{42});
  p.src_rows = gpu().Upload(std::vector<int32_t>{0});
  p.token_ids = gpu().Upload(std::vector<int32_t>{1, 2});
  p.dst_indices = gpu().Upload(std::vector<int32_t>{1});
  p.num_feeds = 1;
  p.num_sampled = 1;
  p.num_tokens = 2;
  ASSERT_TRUE(stream.BeginCapture().ok());
  const absl::Status status = LaunchFeedSampledTokens(stream, p);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_FALSE(stream.EndCapture().ok());
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
