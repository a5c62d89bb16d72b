// The logit masks on CUDA vs the CPU kernels. Token bans store -inf at the
// same in-range (row, token) pairs and nothing else; the mask below the max
// compares the same fp32 logits with the same fp32 threshold (max + offset,
// the max being exact in any order). So the whole logits buffer, NaN padding
// around the view included, must be bit-identical.
#include <algorithm>
#include <cmath>
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
constexpr float kInf = std::numeric_limits<float>::infinity();
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

struct MaskCase {
  int num_logit_rows = 0;
  int vocab_size = 0;
  int num_rows = 0;
  std::vector<float> logits;   // [num_logit_rows * vocab_size]
  std::vector<int32_t> rows;   // [num_rows]
  std::vector<float> offsets;  // [num_rows]
};

// Rows with ties at the max, NaN / -inf / +inf logits or nothing finite;
// entries with every kind of offset (0, typical T * ln(min_p), very
// negative, -inf, NaN, positive), ~15% out of range, and rows listed several
// times (masked by several blocks at once).
MaskCase RandomMaskCase(uint32_t seed, int num_logit_rows, int vocab_size,
                        int num_rows) {
  std::mt19937 rng(seed);
  auto uniform = [&rng](int lo, int hi) {  // [lo, hi]
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  auto real = [&rng](float lo, float hi) {
    return std::uniform_real_distribution<float>(lo, hi)(rng);
  };
  MaskCase c;
  c.num_logit_rows = num_logit_rows;
  c.vocab_size = vocab_size;
  c.num_rows = num_rows;
  c.logits.resize(static_cast<size_t>(num_logit_rows) * vocab_size);
  for (float& l : c.logits) l = real(-8.0f, 8.0f);
  for (int r = 0; r < num_logit_rows; ++r) {
    float* row = &c.logits[static_cast<size_t>(r) * vocab_size];
    switch (uniform(0, 9)) {
      case 0:  // nothing finite
        for (int v = 0; v < vocab_size; ++v) {
          row[v] = uniform(0, 1) ? kNaN : -kInf;
        }
        break;
      case 1:
        row[uniform(0, vocab_size - 1)] = kInf;
        break;
      case 2:
      case 3:
      case 4: {  // ties at the max
        const float top = real(8.0f, 9.0f);
        for (int k = uniform(1, 4); k > 0; --k) {
          row[uniform(0, vocab_size - 1)] = top;
        }
        break;
      }
      default:
        break;
    }
    for (int k = uniform(0, 6); k > 0; --k) {
      row[uniform(0, vocab_size - 1)] = uniform(0, 1) ? kNaN : -kInf;
    }
  }
  const int32_t bad_rows[] = {-1, num_logit_rows, kIntMin, kIntMax};
  for (int i = 0; i < num_rows; ++i) {
    int32_t row = uniform(0, num_logit_rows - 1);
    if (uniform(0, 99) < 15) row = bad_rows[uniform(0, 3)];
    float offset;
    switch (uniform(0, 15)) {
      case 0:
        offset = 0.0f;
        break;
      case 1:
        offset = -kInf;
        break;
      case 2:
        offset = uniform(0, 1) ? -1e30f : -std::numeric_limits<float>::max();
        break;
      case 3:
        offset = uniform(0, 2) == 0 ? kNaN : (uniform(0, 1) ? 0.5f : kInf);
        break;
      default:  // T * ln(min_p)
        offset = real(0.05f, 2.0f) * std::log(real(0.01f, 1.0f));
        break;
    }
    c.rows.push_back(row);
    c.offsets.push_back(offset);
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
  // The whole padded logits buffer after the mask on backend `b`; the view
  // starts `front_pad` floats into the buffer (kPad keeps it 16-byte
  // aligned, kPad + 1 does not).
  std::vector<float> Run(Backend& b, const MaskCase& c, int front_pad = kPad) {
    std::vector<float> padded(front_pad, kNaN);
    padded.insert(padded.end(), c.logits.begin(), c.logits.end());
    padded.insert(padded.end(), kPad, kNaN);
    const DeviceBuffer whole = b.Upload(padded);
    MaskBelowMaxParams p;
    p.logits =
        whole.Slice(sizeof(float) * front_pad, sizeof(float) * c.logits.size());
    p.rows = b.Upload(c.rows);
    p.offsets = b.Upload(c.offsets);
    p.num_rows = c.num_rows;
    p.num_logit_rows = c.num_logit_rows;
    p.vocab_size = c.vocab_size;
    const absl::Status status = LaunchMaskBelowMax(*b.stream, p);
    EXPECT_TRUE(status.ok()) << status;
    return b.Read<float>(whole, padded.size());
  }

  void ExpectSameAsCpu(const MaskCase& c, int front_pad = kPad) {
    const std::vector<float> want = Run(cpu(), c, front_pad);
    const std::vector<float> got = Run(gpu(), c, front_pad);
    EXPECT_TRUE(SameBits(got, want))
        << "logit rows " << c.num_logit_rows << " vocab " << c.vocab_size
        << " entries " << c.num_rows << " front pad " << front_pad;
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

// ---- LaunchMaskBelowMax (min_p) ----

TEST_F(TokenMaskCudaTest, RandomShapesMaskBelowMaxLikeTheCpu) {
  std::mt19937 rng(2);
  for (uint32_t seed = 1; seed <= 30; ++seed) {
    const int logit_rows = std::uniform_int_distribution<int>(1, 32)(rng);
    const int vocab = std::uniform_int_distribution<int>(1, 5000)(rng);
    const int entries = std::uniform_int_distribution<int>(1, 64)(rng);
    const MaskCase c = RandomMaskCase(seed, logit_rows, vocab, entries);
    ExpectSameAsCpu(c);
    ExpectSameAsCpu(c, kPad + 1);
  }
}

// Llama-3's vocabulary: the float4 path (aligned rows) and the scalar path
// (the same rows one float off alignment); 48 entries on 8 rows, so every
// row is masked by several blocks at once.
TEST_F(TokenMaskCudaTest, Llama3VocabMasksBelowMaxLikeTheCpu) {
  const MaskCase c = RandomMaskCase(77, 8, 128256, 48);
  ExpectSameAsCpu(c);
  ExpectSameAsCpu(c, kPad + 1);
}

TEST_F(TokenMaskCudaTest, ZeroMaskRowsChangeNothing) {
  MaskCase c = RandomMaskCase(6, 4, 100, 10);
  c.num_rows = 0;
  std::vector<float> padded(kPad, kNaN);
  padded.insert(padded.end(), c.logits.begin(), c.logits.end());
  padded.insert(padded.end(), kPad, kNaN);
  EXPECT_TRUE(SameBits(Run(gpu(), c), padded));
}

TEST_F(TokenMaskCudaTest, MaskBelowMaxRefusedWhileCapturing) {
  Stream& stream = *gpu().stream;
  MaskBelowMaxParams p;
  p.logits = gpu().Alloc(sizeof(float) * 2 * 10);
  p.rows = gpu().Upload(std::vector<int32_t>{1});
  p.offsets = gpu().Upload(std::vector<float>{-1.0f});
  p.num_rows = 1;
  p.num_logit_rows = 2;
  p.vocab_size = 10;
  ASSERT_TRUE(stream.BeginCapture().ok());
  const absl::Status status = LaunchMaskBelowMax(stream, p);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_FALSE(stream.EndCapture().ok());
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
