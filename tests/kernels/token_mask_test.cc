#include "worker/kernels/token_mask.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
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
constexpr float kFloatMax = std::numeric_limits<float>::max();
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

struct MaskCase {
  int num_logit_rows = 0;
  int vocab_size = 0;
  int num_rows = 0;
  std::vector<float> logits;  // [num_logit_rows * vocab_size]
  // [num_rows + kPad]: the entries past num_rows are valid rows with offset 0
  // (they would mask almost everything) that must not be applied.
  std::vector<int32_t> rows;
  std::vector<float> offsets;
};

// Independent reference, element by element: (r, v) becomes -inf when it is
// NaN and some entry i < num_rows names row r, or when such an entry has an
// offset in (-inf, 0] and the logit is below max(row r) + offset (the fp32
// sum; the max of the input row, NaN ignored). Every other element keeps its
// bits.
std::vector<float> MaskReference(const MaskCase& c) {
  std::vector<float> want = c.logits;
  for (int r = 0; r < c.num_logit_rows; ++r) {
    const size_t begin = static_cast<size_t>(r) * c.vocab_size;
    float max = -kInf;
    for (int v = 0; v < c.vocab_size; ++v) {
      if (!std::isnan(c.logits[begin + v])) {
        max = std::max(max, c.logits[begin + v]);
      }
    }
    for (int i = 0; i < c.num_rows; ++i) {
      if (c.rows[i] != r) continue;
      const float offset = c.offsets[i];
      const bool masks =
          !std::isnan(offset) && offset <= 0.0f && offset != -kInf;
      for (int v = 0; v < c.vocab_size; ++v) {
        const float x = c.logits[begin + v];
        if (std::isnan(x) || (masks && x < max + offset)) {
          want[begin + v] = -kInf;
        }
      }
    }
  }
  return want;
}

// Random shapes (vocab 1..3000, small vocabularies often); rows with ties at
// the max, NaN and -inf logits, a +inf, all NaN/-inf; offsets 0, -0, typical
// T * ln(min_p), very negative, -inf, and (rarely) NaN or positive; rows
// listed twice and ~15% out of range; logits planted exactly at and just
// below an entry's threshold.
MaskCase RandomMaskCase(uint32_t seed) {
  std::mt19937 rng(seed);
  auto uniform = [&rng](int lo, int hi) {  // [lo, hi]
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  auto real = [&rng](float lo, float hi) {
    return std::uniform_real_distribution<float>(lo, hi)(rng);
  };
  MaskCase c;
  c.num_logit_rows = uniform(1, 5);
  c.vocab_size = uniform(0, 2) == 0 ? uniform(1, 8) : uniform(1, 3000);
  c.num_rows = uniform(0, 10);
  const int vocab = c.vocab_size;
  c.logits = RandomFloats(static_cast<size_t>(c.num_logit_rows) * vocab, seed,
                          -8.0f, 8.0f);
  for (int r = 0; r < c.num_logit_rows; ++r) {
    float* row = &c.logits[static_cast<size_t>(r) * vocab];
    switch (uniform(0, 9)) {
      case 0:  // nothing finite
        for (int v = 0; v < vocab; ++v) row[v] = uniform(0, 1) ? kNaN : -kInf;
        break;
      case 1:  // a +inf max
        row[uniform(0, vocab - 1)] = kInf;
        break;
      case 2:
      case 3:
      case 4: {  // ties at the max (above every other logit)
        const float top = real(8.0f, 9.0f);
        for (int k = uniform(1, 4); k > 0; --k)
          row[uniform(0, vocab - 1)] = top;
        break;
      }
      default:
        break;
    }
    if (uniform(0, 1) == 0) {  // scattered NaN and -inf
      for (int k = uniform(1, 5); k > 0; --k) {
        row[uniform(0, vocab - 1)] = uniform(0, 1) ? kNaN : -kInf;
      }
    }
  }
  const int32_t bad_rows[] = {-1, c.num_logit_rows, kIntMin, kIntMax};
  for (int i = 0; i < c.num_rows + kPad; ++i) {
    int32_t row = uniform(0, c.num_logit_rows - 1);
    float offset = 0.0f;
    if (i < c.num_rows) {
      if (uniform(0, 99) < 15) row = bad_rows[uniform(0, 3)];
      switch (uniform(0, 19)) {
        case 0:
        case 1:
          offset = 0.0f;
          break;
        case 2:
          offset = -0.0f;
          break;
        case 3:
        case 4:
          offset = -kInf;
          break;
        case 5:
          offset = uniform(0, 1) ? -1e30f : -kFloatMax;
          break;
        case 6:
          offset = uniform(0, 1) ? -1e-30f : -real(20.0f, 100.0f);
          break;
        case 7:  // only a bug produces these: they mask nothing
          offset = uniform(0, 2) == 0 ? kNaN : (uniform(0, 1) ? 0.5f : kInf);
          break;
        default:  // T * ln(min_p): T in (0, 2], min_p in [0.01, 1)
          offset = real(0.05f, 2.0f) * std::log(real(0.01f, 1.0f));
          break;
      }
      // Plant logits exactly at the threshold (kept) and one float below it
      // (masked), away from the max.
      if (row >= 0 && row < c.num_logit_rows && offset < 0.0f &&
          offset > -kInf && vocab >= 4 && uniform(0, 1) == 0) {
        float* logits = &c.logits[static_cast<size_t>(row) * vocab];
        float max = -kInf;
        for (int v = 0; v < vocab; ++v) {
          if (logits[v] > max) max = logits[v];
        }
        const float threshold = max + offset;
        if (std::isfinite(threshold) && threshold < max) {
          for (int k = 0; k < 2; ++k) {
            const int v = uniform(0, vocab - 1);
            if (logits[v] == max) continue;
            logits[v] = k == 0 ? threshold : std::nextafter(threshold, -kInf);
          }
        }
      }
    }
    c.rows.push_back(row);
    c.offsets.push_back(offset);
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

  // Runs the mask on `c` with the logits view surrounded by kPad NaNs on
  // each side; returns the whole padded buffer.
  std::vector<float> Run(const MaskCase& c) {
    const DeviceBuffer whole = Upload(Padded(c.logits));
    MaskBelowMaxParams p;
    p.logits =
        whole.Slice(sizeof(float) * kPad, sizeof(float) * c.logits.size());
    p.rows = Upload(c.rows);
    p.offsets = Upload(c.offsets);
    p.num_rows = c.num_rows;
    p.num_logit_rows = c.num_logit_rows;
    p.vocab_size = c.vocab_size;
    const absl::Status status = LaunchMaskBelowMax(stream(), p);
    EXPECT_TRUE(status.ok()) << status;
    // The entries are only read.
    EXPECT_EQ(Read<int32_t>(p.rows), c.rows);
    EXPECT_TRUE(BitIdentical(Read<float>(p.offsets), c.offsets));
    return Read<float>(whole);
  }

  // Valid params for 2 entries on [3, 5] logits.
  MaskBelowMaxParams ValidMaskParams() {
    MaskBelowMaxParams p;
    p.logits = AllocElements<float>(3 * 5);
    p.rows = Upload(std::vector<int32_t>{2, 0});
    p.offsets = Upload(std::vector<float>{-1.0f, 0.0f});
    p.num_rows = 2;
    p.num_logit_rows = 3;
    p.vocab_size = 5;
    return p;
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

// ---- LaunchMaskBelowMax (min_p) ----

TEST_F(TokenMaskTest, MaskBelowMaxMatchesTheReferenceOnRandomShapes) {
  for (uint32_t seed = 1; seed <= 80; ++seed) {
    const MaskCase c = RandomMaskCase(seed);
    const std::vector<float> got = Run(c);
    EXPECT_TRUE(BitIdentical(got, Padded(MaskReference(c))))
        << "seed " << seed << ": logit rows " << c.num_logit_rows << " vocab "
        << c.vocab_size << " entries " << c.num_rows;
  }
}

MaskCase OneRowCase(std::vector<float> logits, float offset) {
  MaskCase c;
  c.num_logit_rows = 1;
  c.vocab_size = static_cast<int>(logits.size());
  c.num_rows = 1;
  c.logits = std::move(logits);
  c.rows = {0};
  c.offsets = {offset};
  return c;
}

TEST_F(TokenMaskTest, ZeroOffsetKeepsOnlyTheMaxAndItsTies) {
  const float below = std::nextafter(3.0f, 0.0f);
  const std::vector<float> logits = {1.0f, 3.0f, 3.0f,  -2.0f,
                                     3.0f, kNaN, below, -kInf};
  const std::vector<float> want = {-kInf, 3.0f,  3.0f,  -kInf,
                                   3.0f,  -kInf, -kInf, -kInf};
  for (float offset : {0.0f, -0.0f}) {
    EXPECT_TRUE(BitIdentical(Run(OneRowCase(logits, offset)), Padded(want)))
        << "offset " << offset;
  }
}

TEST_F(TokenMaskTest, MasksBelowTheMaxPlusTheOffset) {
  // max 2, offset -1.5: the threshold is 0.5, which itself stays.
  const std::vector<float> logits = {0.5f,  2.0f, std::nextafter(0.5f, 0.0f),
                                     -3.0f, 1.0f, 2.0f};
  const std::vector<float> want = {0.5f, 2.0f, -kInf, -kInf, 1.0f, 2.0f};
  EXPECT_TRUE(BitIdentical(Run(OneRowCase(logits, -1.5f)), Padded(want)));
}

TEST_F(TokenMaskTest, NonFiniteLogitsCountAsTheyDoInTheSampler) {
  // A +inf max keeps only the +inf logits (and NaN counts as -inf).
  EXPECT_TRUE(BitIdentical(
      Run(OneRowCase({kInf, 5.0f, -kInf, kNaN, kInf, kFloatMax}, -1.0f)),
      Padded({kInf, -kInf, -kInf, -kInf, kInf, -kInf})));
  // NaN is never the max: the max here is 1.
  EXPECT_TRUE(
      BitIdentical(Run(OneRowCase({kNaN, 1.0f, 0.25f, kNaN, 0.75f}, -0.5f)),
                   Padded({-kInf, 1.0f, -kInf, -kInf, 0.75f})));
  // Nothing finite: every NaN becomes -inf, nothing else changes.
  EXPECT_TRUE(BitIdentical(Run(OneRowCase({kNaN, -kInf, kNaN}, -1.0f)),
                           Padded({-kInf, -kInf, -kInf})));
  // A one-token vocabulary keeps its token.
  EXPECT_TRUE(BitIdentical(Run(OneRowCase({-7.0f}, 0.0f)), Padded({-7.0f})));
}

// -inf (min_p = 0) masks nothing; so do offsets only a bug produces (NaN,
// positive). NaN logits still become -inf: they already count as -inf.
TEST_F(TokenMaskTest, OffsetsThatMaskNothing) {
  const std::vector<float> logits = {-8.0f,      8.0f, kNaN,
                                     -kFloatMax, 0.0f, -kInf};
  const std::vector<float> want = {-8.0f, 8.0f, -kInf, -kFloatMax, 0.0f, -kInf};
  for (float offset : {-kInf, kNaN, -kNaN, 0.5f, kInf, kFloatMax}) {
    EXPECT_TRUE(BitIdentical(Run(OneRowCase(logits, offset)), Padded(want)))
        << "offset " << offset;
  }
  // Very negative offsets mask only what lies that far below the max:
  // 8 - kFloatMax rounds to -kFloatMax, which is not below itself.
  EXPECT_TRUE(BitIdentical(Run(OneRowCase(logits, -kFloatMax)), Padded(want)));
  std::vector<float> want_1e30 = want;
  want_1e30[3] = -kInf;
  EXPECT_TRUE(BitIdentical(Run(OneRowCase(logits, -1e30f)), Padded(want_1e30)));
}

TEST_F(TokenMaskTest, RowsListedTwiceTakeTheStricterOffset) {
  MaskCase c;
  c.num_logit_rows = 2;
  c.vocab_size = 4;
  c.logits = {4.0f, 3.5f,  1.0f,  2.5f,  //
              0.0f, -1.0f, -2.0f, -3.0f};
  c.rows = {0, 1, 0, 1};
  c.offsets = {-3.5f, -kInf, -1.0f, -2.5f};
  c.num_rows = 4;
  EXPECT_TRUE(BitIdentical(Run(c), Padded({4.0f, 3.5f, -kInf, -kInf,  //
                                           0.0f, -1.0f, -2.0f, -kInf})));
}

TEST_F(TokenMaskTest, MaskBelowMaxSkipsOutOfRangeRows) {
  MaskCase c;
  c.num_logit_rows = 2;
  c.vocab_size = 3;
  c.logits = {1.0f, 2.0f, 3.0f, kNaN, 5.0f, 4.0f};
  c.rows = {-1, 2, kIntMin, kIntMax, 1};
  c.offsets = {0.0f, 0.0f, 0.0f, 0.0f, -0.5f};
  c.num_rows = 5;  // only the last one is in range
  EXPECT_TRUE(
      BitIdentical(Run(c), Padded({1.0f, 2.0f, 3.0f, -kInf, 5.0f, -kInf})));
}

// num_rows = 0 returns before launching: the listed (valid) entries are
// never read, and no entry list is needed at all.
TEST_F(TokenMaskTest, ZeroMaskRowsChangeNothingAndNeedNoLists) {
  std::vector<float> logits = RandomFloats(15, 10);
  logits[3] = kNaN;  // a launch would turn it into -inf
  MaskBelowMaxParams p = ValidMaskParams();
  Write(p.logits, logits);
  p.num_rows = 0;
  ASSERT_TRUE(LaunchMaskBelowMax(stream(), p).ok());
  EXPECT_TRUE(BitIdentical(Read<float>(p.logits), logits));
  p.rows = DeviceBuffer();
  p.offsets = DeviceBuffer();
  ASSERT_TRUE(LaunchMaskBelowMax(stream(), p).ok());
  EXPECT_TRUE(BitIdentical(Read<float>(p.logits), logits));
}

TEST_F(TokenMaskTest, MaskBelowMaxRefusedWhileCapturing) {
  // Buffers first: allocation and uploads are refused during capture too.
  const MaskBelowMaxParams p = ValidMaskParams();
  MaskBelowMaxParams none = p;
  none.num_rows = 0;
  ASSERT_TRUE(stream().BeginCapture().ok());
  const absl::Status status = LaunchMaskBelowMax(stream(), p);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_FALSE(stream().EndCapture().ok());

  // Even with nothing to mask: the launcher has no place in a graph.
  ASSERT_TRUE(stream().BeginCapture().ok());
  EXPECT_EQ(LaunchMaskBelowMax(stream(), none).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(stream().EndCapture().ok());
}

TEST_F(TokenMaskTest, MaskBelowMaxRejectsBadShapes) {
  const MaskBelowMaxParams p = ValidMaskParams();
  ASSERT_TRUE(LaunchMaskBelowMax(stream(), p).ok());

  MaskBelowMaxParams bad = p;
  bad.num_rows = -1;
  EXPECT_THAT(LaunchMaskBelowMax(stream(), bad),
              IsInvalidArgumentMentioning("num_rows"));
  bad = p;
  bad.num_logit_rows = -1;
  EXPECT_THAT(LaunchMaskBelowMax(stream(), bad),
              IsInvalidArgumentMentioning("num_logit_rows"));
  bad = p;
  bad.vocab_size = 0;
  EXPECT_THAT(LaunchMaskBelowMax(stream(), bad),
              IsInvalidArgumentMentioning("vocab_size"));
  bad = p;
  bad.logits = AllocElements<float>(3 * 5 - 1);
  EXPECT_THAT(LaunchMaskBelowMax(stream(), bad),
              IsInvalidArgumentMentioning("'logits'"));
  bad = p;
  bad.num_logit_rows = 4;  // the logits buffer holds 3 rows
  EXPECT_THAT(LaunchMaskBelowMax(stream(), bad),
              IsInvalidArgumentMentioning("'logits'"));
  bad = p;
  bad.logits = DeviceBuffer();
  EXPECT_THAT(LaunchMaskBelowMax(stream(), bad),
              IsInvalidArgumentMentioning("'logits'"));
  bad = p;
  bad.rows = AllocElements<int32_t>(1);
  EXPECT_THAT(LaunchMaskBelowMax(stream(), bad),
              IsInvalidArgumentMentioning("'rows'"));
  bad = p;
  bad.offsets = AllocElements<float>(1);
  EXPECT_THAT(LaunchMaskBelowMax(stream(), bad),
              IsInvalidArgumentMentioning("'offsets'"));
  bad = p;
  bad.offsets = DeviceBuffer();
  EXPECT_THAT(LaunchMaskBelowMax(stream(), bad),
              IsInvalidArgumentMentioning("'offsets'"));
  bad = p;
  bad.rows = p.logits.Slice(sizeof(float) * 4, sizeof(int32_t) * 2);
  EXPECT_THAT(LaunchMaskBelowMax(stream(), bad),
              IsInvalidArgumentMentioning("overlap"));
  bad = p;
  bad.offsets = p.logits.Slice(sizeof(float) * 13, sizeof(float) * 2);
  EXPECT_THAT(LaunchMaskBelowMax(stream(), bad),
              IsInvalidArgumentMentioning("overlap"));
}

// What the op is for: with offset T * ln(min_p) (fp32, as the host computes
// it), the kept set is vLLM's min_p set {i : softmax(l / T)_i >= min_p *
// max_j softmax(l / T)_j}, computed here in double. The fp32 threshold may
// round either way, so a token may land on the other side only when its
// probability is within 1e-6 (relative) of min_p * p_max.
TEST_F(TokenMaskTest, KeepsExactlyTheMinPSet) {
  const float temperatures[] = {0.5f, 1.0f, 1.7f};
  const float min_ps[] = {0.05f, 0.3f};
  int kept_total = 0;
  int masked_total = 0;
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    std::mt19937 rng(seed);
    MaskCase c;
    c.num_logit_rows = 6;  // one row per (T, min_p)
    c.vocab_size = std::uniform_int_distribution<int>(1, 3000)(rng);
    c.logits = RandomFloats(static_cast<size_t>(6) * c.vocab_size, seed + 100,
                            -8.0f, 8.0f);
    for (float t : temperatures) {
      for (float min_p : min_ps) {
        c.rows.push_back(static_cast<int32_t>(c.offsets.size()));
        c.offsets.push_back(t * std::log(min_p));
      }
    }
    c.num_rows = 6;
    c.rows.resize(6 + kPad, 0);
    c.offsets.resize(6 + kPad, 0.0f);
    const std::vector<float> got = Run(c);
    int row = 0;
    for (float t : temperatures) {
      for (float min_p : min_ps) {
        const size_t begin = static_cast<size_t>(row) * c.vocab_size;
        double max_logit = -std::numeric_limits<double>::infinity();
        for (int v = 0; v < c.vocab_size; ++v) {
          max_logit = std::max<double>(max_logit, c.logits[begin + v]);
        }
        std::vector<double> p(c.vocab_size);
        double sum = 0.0;
        for (int v = 0; v < c.vocab_size; ++v) {
          p[v] = std::exp((c.logits[begin + v] - max_logit) / t);
          sum += p[v];
        }
        double p_max = 0.0;
        for (double& x : p) {
          x /= sum;
          p_max = std::max(p_max, x);
        }
        const double bound = static_cast<double>(min_p) * p_max;
        for (int v = 0; v < c.vocab_size; ++v) {
          const float out = got[kPad + begin + v];
          const bool kept = out != -kInf;
          if (kept) {
            EXPECT_TRUE(BitIdentical({out}, {c.logits[begin + v]}));
          }
          const bool want = p[v] >= bound;
          kept_total += kept;
          masked_total += !kept;
          if (kept != want) {
            EXPECT_LE(std::fabs(p[v] - bound), 1e-6 * bound)
                << "seed " << seed << " T " << t << " min_p " << min_p
                << " token " << v << " p " << p[v] << " bound " << bound
                << (kept ? " kept" : " masked");
          }
        }
        ++row;
      }
    }
  }
  // Both sides are well populated.
  EXPECT_GT(kept_total, 1000);
  EXPECT_GT(masked_total, 1000);
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
