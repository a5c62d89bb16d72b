#include "worker/kernels/token_mask.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tests/kernels/kernel_test_util.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::BitIdentical;
using testing::IsInvalidArgumentMentioning;
using testing::KernelTest;
using testing::RandomFloats;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int32_t kIntMin = std::numeric_limits<int32_t>::min();
constexpr int32_t kIntMax = std::numeric_limits<int32_t>::max();
// NaN logits around the [num_rows, vocab_size] view: a write before or after
// it (a negative row, a row past num_rows) changes a NaN into -inf.
constexpr int kPad = 64;

struct BanCase {
  int num_rows = 0;
  int vocab_size = 0;
  int num_bans = 0;
  std::vector<float> logits;  // [num_rows * vocab_size]
  // [num_bans + kPad]: the entries past num_bans are valid bans that must
  // not be applied (the kernel reads only num_bans).
  std::vector<int32_t> rows;
  std::vector<int32_t> token_ids;
};

// Independent reference: element (r, v) is -inf when any ban i < num_bans
// names exactly (r, v); every other element keeps its bits.
std::vector<float> Reference(const BanCase& c) {
  std::vector<float> want = c.logits;
  for (int r = 0; r < c.num_rows; ++r) {
    for (int v = 0; v < c.vocab_size; ++v) {
      for (int i = 0; i < c.num_bans; ++i) {
        if (c.rows[i] == r && c.token_ids[i] == v) {
          want[static_cast<size_t>(r) * c.vocab_size + v] = -kInf;
        }
      }
    }
  }
  return want;
}

// Random shapes; bans drawn from a few hot tokens (duplicates are common, as
// with one EOS id banned in many rows) and the whole vocabulary, with ~20%
// out of range in row or token id.
BanCase RandomCase(uint32_t seed) {
  std::mt19937 rng(seed);
  auto uniform = [&rng](int lo, int hi) {  // [lo, hi]
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  BanCase c;
  c.num_rows = uniform(1, 9);
  c.vocab_size = uniform(1, 300);
  c.num_bans = uniform(0, 48);
  c.logits = RandomFloats(static_cast<size_t>(c.num_rows) * c.vocab_size, seed,
                          -8.0f, 8.0f);
  // Non-finite logits stay what they are unless banned.
  if (c.logits.size() > 2) {
    c.logits[0] = kNaN;
    c.logits[1] = kInf;
  }
  const int32_t bad_rows[] = {-1, c.num_rows, kIntMin, kIntMax};
  const int32_t bad_ids[] = {-1, c.vocab_size, kIntMin, kIntMax};
  for (int i = 0; i < c.num_bans + kPad; ++i) {
    int32_t row = uniform(0, c.num_rows - 1);
    int32_t token = uniform(0, 1) == 0
                        ? uniform(0, std::min(c.vocab_size, 3) - 1)
                        : uniform(0, c.vocab_size - 1);
    if (i < c.num_bans && uniform(0, 9) < 2) {
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

class TokenMaskTest : public KernelTest {
 protected:
  // Runs the kernel on `c` with the logits view surrounded by kPad NaNs on
  // each side; returns the whole padded buffer.
  std::vector<float> Run(const BanCase& c) {
    const DeviceBuffer whole = Upload(Padded(c.logits));
    BanTokensParams p;
    p.logits =
        whole.Slice(sizeof(float) * kPad, sizeof(float) * c.logits.size());
    p.rows = Upload(c.rows);
    p.token_ids = Upload(c.token_ids);
    p.num_bans = c.num_bans;
    p.num_rows = c.num_rows;
    p.vocab_size = c.vocab_size;
    const absl::Status status = LaunchBanTokens(stream(), p);
    EXPECT_TRUE(status.ok()) << status;
    // The ban lists are only read.
    EXPECT_EQ(Read<int32_t>(p.rows), c.rows);
    EXPECT_EQ(Read<int32_t>(p.token_ids), c.token_ids);
    return Read<float>(whole);
  }

  static std::vector<float> Padded(const std::vector<float>& logits) {
    std::vector<float> padded(kPad, kNaN);
    padded.insert(padded.end(), logits.begin(), logits.end());
    padded.insert(padded.end(), kPad, kNaN);
    return padded;
  }

  // Valid params for 3 bans in [2, 5] logits.
  BanTokensParams ValidParams() {
    BanTokensParams p;
    p.logits = AllocElements<float>(2 * 5);
    p.rows = Upload(std::vector<int32_t>{0, 1, 1});
    p.token_ids = Upload(std::vector<int32_t>{4, 0, 2});
    p.num_bans = 3;
    p.num_rows = 2;
    p.vocab_size = 5;
    return p;
  }
};

TEST_F(TokenMaskTest, MatchesTheReferenceOnRandomShapes) {
  for (uint32_t seed = 1; seed <= 60; ++seed) {
    const BanCase c = RandomCase(seed);
    const std::vector<float> got = Run(c);
    EXPECT_TRUE(BitIdentical(got, Padded(Reference(c))))
        << "seed " << seed << ": rows " << c.num_rows << " vocab "
        << c.vocab_size << " bans " << c.num_bans;
  }
}

TEST_F(TokenMaskTest, BansExactlyTheListedLogitsAndDuplicatesOnce) {
  BanCase c;
  c.num_rows = 3;
  c.vocab_size = 4;
  c.logits = RandomFloats(12, 7);
  // (1, 2) twice, (0, 3) and (2, 3): an EOS id 3 banned in two rows.
  c.rows = {1, 0, 1, 2};
  c.token_ids = {2, 3, 2, 3};
  c.num_bans = 4;
  const std::vector<float> got = Run(c);
  std::vector<float> want = c.logits;
  want[1 * 4 + 2] = -kInf;
  want[0 * 4 + 3] = -kInf;
  want[2 * 4 + 3] = -kInf;
  EXPECT_TRUE(BitIdentical(got, Padded(want)));
}

TEST_F(TokenMaskTest, OutOfRangeEntriesAreSkipped) {
  BanCase c;
  c.num_rows = 2;
  c.vocab_size = 3;
  c.logits = RandomFloats(6, 8);
  c.rows = {-1, 2, 0, kIntMax, 1, kIntMin, 0, 1};
  c.token_ids = {0, 0, -1, 0, 3, 1, kIntMax, 1};
  c.num_bans = 8;  // only the last one is in range
  const std::vector<float> got = Run(c);
  std::vector<float> want = c.logits;
  want[1 * 3 + 1] = -kInf;
  EXPECT_TRUE(BitIdentical(got, Padded(want)));
}

// num_bans = 0 returns before launching: the listed (valid) bans past it are
// never read, and no ban list is needed at all.
TEST_F(TokenMaskTest, ZeroBansChangeNothingAndNeedNoBanList) {
  const std::vector<float> logits = RandomFloats(10, 9);
  BanTokensParams p = ValidParams();
  Write(p.logits, logits);
  p.num_bans = 0;
  ASSERT_TRUE(LaunchBanTokens(stream(), p).ok());
  EXPECT_TRUE(BitIdentical(Read<float>(p.logits), logits));
  p.rows = DeviceBuffer();
  p.token_ids = DeviceBuffer();
  ASSERT_TRUE(LaunchBanTokens(stream(), p).ok());
  EXPECT_TRUE(BitIdentical(Read<float>(p.logits), logits));
}

TEST_F(TokenMaskTest, RefusedWhileCapturing) {
  // Buffers first: allocation and uploads are refused during capture too.
  const BanTokensParams p = ValidParams();
  BanTokensParams none = p;
  none.num_bans = 0;
  ASSERT_TRUE(stream().BeginCapture().ok());
  const absl::Status status = LaunchBanTokens(stream(), p);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_FALSE(stream().EndCapture().ok());

  // Even with nothing to ban: the launcher has no place in a graph.
  ASSERT_TRUE(stream().BeginCapture().ok());
  EXPECT_EQ(LaunchBanTokens(stream(), none).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(stream().EndCapture().ok());
}

TEST_F(TokenMaskTest, RejectsBadShapes) {
  const BanTokensParams p = ValidParams();
  ASSERT_TRUE(LaunchBanTokens(stream(), p).ok());

  BanTokensParams bad = p;
  bad.num_bans = -1;
  EXPECT_THAT(LaunchBanTokens(stream(), bad),
              IsInvalidArgumentMentioning("num_bans"));
  bad = p;
  bad.num_rows = -1;
  EXPECT_THAT(LaunchBanTokens(stream(), bad),
              IsInvalidArgumentMentioning("num_rows"));
  bad = p;
  bad.vocab_size = 0;
  EXPECT_THAT(LaunchBanTokens(stream(), bad),
              IsInvalidArgumentMentioning("vocab_size"));
  bad = p;
  bad.logits = AllocElements<float>(2 * 5 - 1);
  EXPECT_THAT(LaunchBanTokens(stream(), bad),
              IsInvalidArgumentMentioning("'logits'"));
  bad = p;
  bad.num_rows = 3;  // the logits buffer holds 2 rows
  EXPECT_THAT(LaunchBanTokens(stream(), bad),
              IsInvalidArgumentMentioning("'logits'"));
  bad = p;
  bad.rows = AllocElements<int32_t>(2);
  EXPECT_THAT(LaunchBanTokens(stream(), bad),
              IsInvalidArgumentMentioning("'rows'"));
  bad = p;
  bad.token_ids = DeviceBuffer();
  EXPECT_THAT(LaunchBanTokens(stream(), bad),
              IsInvalidArgumentMentioning("'token_ids'"));
  bad = p;
  bad.rows = p.logits.Slice(0, sizeof(int32_t) * 3);
  EXPECT_THAT(LaunchBanTokens(stream(), bad),
              IsInvalidArgumentMentioning("overlap"));
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
