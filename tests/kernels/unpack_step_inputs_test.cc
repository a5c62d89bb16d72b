#include "worker/kernels/unpack_step_inputs.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/kernels/kernel_test_util.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::IsInvalidArgumentMentioning;
using testing::KernelTest;

// Every output buffer starts as this and is kSlack words longer than the
// op may write: a word written out of place, or not written, shows.
constexpr int32_t kSentinel = 0x5A5A5A5A;
constexpr int kSlack = 5;

struct UnpackCase {
  int num_tokens = 0;
  int num_reqs = 0;
  int num_real_reqs = 0;
  int max_blocks_per_seq = 0;
  int num_logits = 0;  // packed entries (1 + k per verifying request)
  int num_logits_rows = 0;
  int num_block_ids = 0;
  std::vector<int32_t> packed;
};

// Random shapes and contents; about one row in six gets a corrupt start
// (negative, past the ids, or spanning more than a row holds).
UnpackCase RandomCase(uint32_t seed) {
  std::mt19937 rng(seed);
  auto uniform = [&rng](int lo, int hi) {  // [lo, hi]
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  UnpackCase c;
  c.num_tokens = uniform(1, 40);
  c.num_reqs = uniform(0, 6);
  c.num_real_reqs = uniform(0, c.num_reqs);
  c.max_blocks_per_seq = uniform(1, 9);
  c.num_logits = uniform(0, 2 * c.num_reqs + 2);
  c.num_logits_rows = c.num_logits + uniform(0, 3);
  const int t = c.num_tokens, r = c.num_reqs;
  for (int i = 0; i < 3 * t + 2 * r + 1 + c.num_logits; ++i) {
    c.packed.push_back(uniform(-1, 100000));
  }
  std::vector<int32_t> starts = {0};
  for (int i = 0; i < r; ++i) {
    starts.push_back(starts.back() + uniform(0, c.max_blocks_per_seq));
  }
  c.num_block_ids = starts.back();
  for (int i = 1; i <= r; ++i) {
    if (uniform(0, 5) != 0) continue;
    const int kind = uniform(0, 2);
    starts[i] = kind == 0   ? -3
                : kind == 1 ? c.num_block_ids + 7
                            : starts[i - 1] + c.max_blocks_per_seq + 1;
  }
  c.packed.insert(c.packed.end(), starts.begin(), starts.end());
  for (int i = 0; i < c.num_block_ids; ++i) {
    c.packed.push_back(uniform(1, 500));
  }
  return c;
}

// The unpacked buffers, each with its kSlack sentinels.
struct Unpacked {
  std::vector<int32_t> token_ids, positions, slot_mapping, seq_lens,
      query_start_loc, num_reqs, block_tables, logits_indices;
};

void ExpectSame(const Unpacked& got, const Unpacked& want,
                const std::string& what) {
  EXPECT_EQ(got.token_ids, want.token_ids) << what;
  EXPECT_EQ(got.positions, want.positions) << what;
  EXPECT_EQ(got.slot_mapping, want.slot_mapping) << what;
  EXPECT_EQ(got.seq_lens, want.seq_lens) << what;
  EXPECT_EQ(got.query_start_loc, want.query_start_loc) << what;
  EXPECT_EQ(got.num_reqs, want.num_reqs) << what;
  EXPECT_EQ(got.block_tables, want.block_tables) << what;
  EXPECT_EQ(got.logits_indices, want.logits_indices) << what;
}

// What the header says the op writes, from the packed words directly.
Unpacked Reference(const UnpackCase& c) {
  const int t = c.num_tokens, r = c.num_reqs, mb = c.max_blocks_per_seq;
  const int n = c.num_logits;
  auto segment = [&c](int offset, int n) {
    std::vector<int32_t> v(c.packed.begin() + offset,
                           c.packed.begin() + offset + n);
    v.insert(v.end(), kSlack, kSentinel);
    return v;
  };
  Unpacked u;
  u.token_ids = segment(0, t);
  u.positions = segment(t, t);
  u.slot_mapping = segment(2 * t, t);
  u.seq_lens = segment(3 * t, r);
  u.query_start_loc = segment(3 * t + r, r + 1);
  u.num_reqs = {c.num_real_reqs};
  u.num_reqs.insert(u.num_reqs.end(), kSlack, kSentinel);
  for (int i = 0; i < c.num_logits_rows; ++i) {
    u.logits_indices.push_back(i < n ? c.packed[3 * t + 2 * r + 1 + i] : -1);
  }
  u.logits_indices.insert(u.logits_indices.end(), kSlack, kSentinel);
  const int starts = 3 * t + 2 * r + 1 + n, ids = 3 * t + 3 * r + 2 + n;
  for (int i = 0; i < r; ++i) {
    const int s = c.packed[starts + i], e = c.packed[starts + i + 1];
    const bool ok = s >= 0 && e >= s && e <= c.num_block_ids && e - s <= mb;
    for (int j = 0; j < mb; ++j) {
      u.block_tables.push_back(ok && j < e - s ? c.packed[ids + s + j] : 0);
    }
  }
  u.block_tables.insert(u.block_tables.end(), kSlack, kSentinel);
  return u;
}

// A random case with at least two requests.
UnpackCase CaseWithRequests(uint32_t seed) {
  UnpackCase c = RandomCase(seed);
  while (c.num_reqs < 2) c = RandomCase(++seed);
  return c;
}

class UnpackStepInputsTest : public KernelTest {
 protected:
  DeviceBuffer Sentinels(int64_t n) {
    return Upload(std::vector<int32_t>(n + kSlack, kSentinel));
  }

  UnpackStepInputsParams Params(const UnpackCase& c) {
    UnpackStepInputsParams p;
    p.packed = Upload(c.packed);
    p.outputs.token_ids = Sentinels(c.num_tokens);
    p.outputs.positions = Sentinels(c.num_tokens);
    p.outputs.slot_mapping = Sentinels(c.num_tokens);
    p.outputs.seq_lens = Sentinels(c.num_reqs);
    p.outputs.query_start_loc = Sentinels(c.num_reqs + 1);
    p.outputs.num_reqs = Sentinels(1);
    p.outputs.block_tables =
        Sentinels(static_cast<int64_t>(c.num_reqs) * c.max_blocks_per_seq);
    p.outputs.logits_indices = Sentinels(c.num_logits_rows);
    p.num_tokens = c.num_tokens;
    p.num_reqs = c.num_reqs;
    p.num_real_reqs = c.num_real_reqs;
    p.num_block_ids = c.num_block_ids;
    p.max_blocks_per_seq = c.max_blocks_per_seq;
    p.num_logits = c.num_logits;
    p.num_logits_rows = c.num_logits_rows;
    return p;
  }

  Unpacked Run(const UnpackCase& c) {
    const UnpackStepInputsParams p = Params(c);
    const absl::Status status = LaunchUnpackStepInputs(stream(), p);
    EXPECT_TRUE(status.ok()) << status;
    const StepBuffers& o = p.outputs;
    Unpacked u;
    u.token_ids = Read<int32_t>(o.token_ids);
    u.positions = Read<int32_t>(o.positions);
    u.slot_mapping = Read<int32_t>(o.slot_mapping);
    u.seq_lens = Read<int32_t>(o.seq_lens);
    u.query_start_loc = Read<int32_t>(o.query_start_loc);
    u.num_reqs = Read<int32_t>(o.num_reqs);
    u.block_tables = Read<int32_t>(o.block_tables);
    u.logits_indices = Read<int32_t>(o.logits_indices);
    EXPECT_EQ(Read<int32_t>(p.packed), c.packed) << "packed is only read";
    return u;
  }
};

TEST_F(UnpackStepInputsTest, MatchesTheReferenceOnRandomShapes) {
  for (uint32_t seed = 1; seed <= 80; ++seed) {
    const UnpackCase c = RandomCase(seed);
    ExpectSame(Run(c), Reference(c),
               absl::StrCat("seed ", seed, ": tokens ", c.num_tokens, " reqs ",
                            c.num_reqs, " max blocks ", c.max_blocks_per_seq));
  }
}

// The layout the runner and the op share: offsets in the header's order.
TEST_F(UnpackStepInputsTest, LayoutSegmentsFollowEachOther) {
  const PackedStepLayout l = PackedStepLayout::For(7, 3, 5);
  EXPECT_EQ(l.token_ids, 0);
  EXPECT_EQ(l.positions, 7);
  EXPECT_EQ(l.slot_mapping, 14);
  EXPECT_EQ(l.seq_lens, 21);
  EXPECT_EQ(l.query_start_loc, 24);
  EXPECT_EQ(l.logits_indices, 28);
  EXPECT_EQ(l.block_starts, 33);
  EXPECT_EQ(l.block_ids, 37);
}

TEST_F(UnpackStepInputsTest, BadCountsAndSmallBuffersAreRefusedByName) {
  const UnpackCase c = CaseWithRequests(3);
  UnpackStepInputsParams p = Params(c);
  p.num_real_reqs = p.num_reqs + 1;
  EXPECT_THAT(LaunchUnpackStepInputs(stream(), p),
              IsInvalidArgumentMentioning("num_real_reqs"));
  p = Params(c);
  p.num_logits_rows = p.num_logits - 1;
  EXPECT_THAT(LaunchUnpackStepInputs(stream(), p),
              IsInvalidArgumentMentioning("num_logits_rows"));
  p = Params(c);
  p.num_block_ids += 1;
  EXPECT_THAT(LaunchUnpackStepInputs(stream(), p),
              IsInvalidArgumentMentioning("packed"));
  p = Params(c);
  p.max_blocks_per_seq += 1;
  EXPECT_THAT(LaunchUnpackStepInputs(stream(), p),
              IsInvalidArgumentMentioning("block_tables"));
  p = Params(c);
  p.num_tokens = 0;
  EXPECT_THAT(LaunchUnpackStepInputs(stream(), p),
              IsInvalidArgumentMentioning("num_tokens"));
}

TEST_F(UnpackStepInputsTest, RefusedWhileCapturing) {
  const UnpackStepInputsParams p = Params(RandomCase(4));
  ASSERT_TRUE(stream().BeginCapture().ok());
  const absl::Status status = LaunchUnpackStepInputs(stream(), p);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_FALSE(stream().EndCapture().ok());
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
