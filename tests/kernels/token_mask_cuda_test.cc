// Token bans on CUDA vs the CPU kernel: both store -inf at the same
// in-range (row, token) pairs and nothing else, so the whole logits buffer,
// NaN padding around the view included, must be bit-identical.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "tests/kernels/cuda_kernel_test_util.h"
#include "worker/kernels/token_mask.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::Backend;
using testing::CudaKernelTest;
using testing::SameBits;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int32_t kIntMin = std::numeric_limits<int32_t>::min();
constexpr int32_t kIntMax = std::numeric_limits<int32_t>::max();
constexpr int kPad = 256;  // NaN floats on each side of the logits view

struct BanCase {
  int num_rows = 0;
  int vocab_size = 0;
  int num_bans = 0;
  std::vector<float> logits;       // [num_rows * vocab_size]
  std::vector<int32_t> rows;       // [num_bans]
  std::vector<int32_t> token_ids;  // [num_bans]
};

// ~20% of the bans out of range; tokens often from a few hot ids, so the
// same (row, token) is banned by several threads at once.
BanCase RandomCase(uint32_t seed, int num_rows, int vocab_size, int num_bans) {
  std::mt19937 rng(seed);
  auto uniform = [&rng](int lo, int hi) {  // [lo, hi]
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  BanCase c;
  c.num_rows = num_rows;
  c.vocab_size = vocab_size;
  c.num_bans = num_bans;
  std::uniform_real_distribution<float> logit(-8.0f, 8.0f);
  c.logits.resize(static_cast<size_t>(num_rows) * vocab_size);
  for (float& l : c.logits) l = logit(rng);
  const int32_t bad_rows[] = {-1, num_rows, kIntMin, kIntMax};
  const int32_t bad_ids[] = {-1, vocab_size, kIntMin, kIntMax};
  for (int i = 0; i < num_bans; ++i) {
    int32_t row = uniform(0, num_rows - 1);
    int32_t token = uniform(0, 1) == 0 ? uniform(0, std::min(vocab_size, 4) - 1)
                                       : uniform(0, vocab_size - 1);
    if (uniform(0, 9) < 2) {
      if (uniform(0, 1) == 0) {
        row = bad_rows[uniform(0, 3)];
      } else {
        token = bad_ids[uniform(0, 3)];
      }
    }
    c.rows.push_back(row);
    c.token_ids.push_back(token);
  }
  return c;
}

class TokenMaskCudaTest : public CudaKernelTest {
 protected:
  // The whole padded logits buffer after the bans on backend `b`.
  std::vector<float> Run(Backend& b, const BanCase& c) {
    std::vector<float> padded(kPad, kNaN);
    padded.insert(padded.end(), c.logits.begin(), c.logits.end());
    padded.insert(padded.end(), kPad, kNaN);
    const DeviceBuffer whole = b.Upload(padded);
    BanTokensParams p;
    p.logits =
        whole.Slice(sizeof(float) * kPad, sizeof(float) * c.logits.size());
    p.rows = b.Upload(c.rows);
    p.token_ids = b.Upload(c.token_ids);
    p.num_bans = c.num_bans;
    p.num_rows = c.num_rows;
    p.vocab_size = c.vocab_size;
    const absl::Status status = LaunchBanTokens(*b.stream, p);
    EXPECT_TRUE(status.ok()) << status;
    return b.Read<float>(whole, padded.size());
  }

  void ExpectSameAsCpu(const BanCase& c) {
    const std::vector<float> want = Run(cpu(), c);
    const std::vector<float> got = Run(gpu(), c);
    EXPECT_TRUE(SameBits(got, want)) << "rows " << c.num_rows << " vocab "
                                     << c.vocab_size << " bans " << c.num_bans;
  }
};

TEST_F(TokenMaskCudaTest, RandomShapesBanLikeTheCpu) {
  std::mt19937 rng(1);
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    const int rows = std::uniform_int_distribution<int>(1, 64)(rng);
    const int vocab = std::uniform_int_distribution<int>(1, 5000)(rng);
    const int bans = std::uniform_int_distribution<int>(1, 2000)(rng);
    ExpectSameAsCpu(RandomCase(seed, rows, vocab, bans));
  }
}

// More bans than the capped grid has threads (1024 blocks of 256): the
// grid-stride loop must cover the rest. Llama-3's vocabulary.
TEST_F(TokenMaskCudaTest, MoreBansThanThreadsBanLikeTheCpu) {
  ExpectSameAsCpu(RandomCase(99, 8, 128256, 300000));
}

TEST_F(TokenMaskCudaTest, ZeroBansChangeNothing) {
  BanCase c = RandomCase(5, 4, 100, 10);
  c.num_bans = 0;
  std::vector<float> padded(kPad, kNaN);
  padded.insert(padded.end(), c.logits.begin(), c.logits.end());
  padded.insert(padded.end(), kPad, kNaN);
  EXPECT_TRUE(SameBits(Run(gpu(), c), padded));
}

TEST_F(TokenMaskCudaTest, RefusedWhileCapturing) {
  Stream& stream = *gpu().stream;
  BanTokensParams p;
  p.logits = gpu().Alloc(sizeof(float) * 2 * 10);
  p.rows = gpu().Upload(std::vector<int32_t>{1});
  p.token_ids = gpu().Upload(std::vector<int32_t>{3});
  p.num_bans = 1;
  p.num_rows = 2;
  p.vocab_size = 10;
  ASSERT_TRUE(stream.BeginCapture().ok());
  const absl::Status status = LaunchBanTokens(stream, p);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_FALSE(stream.EndCapture().ok());
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
