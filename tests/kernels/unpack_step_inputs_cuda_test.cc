// Step-input unpack on CUDA vs the CPU kernel: every output buffer, sentinel
// slack included, must be identical (it is integer data movement).
#include <cstdint>
#include <random>
#include <vector>

#include "tests/kernels/cuda_kernel_test_util.h"
#include "worker/kernels/unpack_step_inputs.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::Backend;
using testing::CudaKernelTest;

constexpr int32_t kSentinel = 0x5A5A5A5A;
constexpr int kSlack = 5;

struct Shape {
  int num_tokens, num_reqs, num_real_reqs, max_blocks_per_seq, num_logits,
      num_logits_rows;
};

// Packed words for `s`: random metadata, random per-row block counts, and
// about one corrupt start in six.
std::vector<int32_t> RandomPacked(uint32_t seed, const Shape& s,
                                  int* num_block_ids) {
  std::mt19937 rng(seed);
  auto uniform = [&rng](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  std::vector<int32_t> packed;
  for (int i = 0; i < 3 * s.num_tokens + 2 * s.num_reqs + 1 + s.num_logits;
       ++i) {
    packed.push_back(uniform(-1, 150000));
  }
  std::vector<int32_t> starts = {0};
  for (int r = 0; r < s.num_reqs; ++r) {
    starts.push_back(starts.back() + uniform(0, s.max_blocks_per_seq));
  }
  *num_block_ids = starts.back();
  for (int r = 1; r <= s.num_reqs; ++r) {
    if (uniform(0, 5) == 0) starts[r] = uniform(0, 1) ? -2 : 1 << 30;
  }
  packed.insert(packed.end(), starts.begin(), starts.end());
  for (int i = 0; i < *num_block_ids; ++i) packed.push_back(uniform(0, 9999));
  return packed;
}

class UnpackStepInputsCudaTest : public CudaKernelTest {
 protected:
  // Every output buffer after the unpack on `b`, concatenated.
  std::vector<int32_t> Run(Backend& b, const Shape& s,
                           const std::vector<int32_t>& packed,
                           int num_block_ids) {
    auto sentinels = [&b](int64_t n) {
      return b.Upload(std::vector<int32_t>(n + kSlack, kSentinel));
    };
    UnpackStepInputsParams p;
    p.packed = b.Upload(packed);
    StepBuffers& o = p.outputs;
    o.token_ids = sentinels(s.num_tokens);
    o.positions = sentinels(s.num_tokens);
    o.slot_mapping = sentinels(s.num_tokens);
    o.seq_lens = sentinels(s.num_reqs);
    o.query_start_loc = sentinels(s.num_reqs + 1);
    o.num_reqs = sentinels(1);
    o.block_tables =
        sentinels(static_cast<int64_t>(s.num_reqs) * s.max_blocks_per_seq);
    o.logits_indices = sentinels(s.num_logits_rows);
    p.num_tokens = s.num_tokens;
    p.num_reqs = s.num_reqs;
    p.num_real_reqs = s.num_real_reqs;
    p.num_block_ids = num_block_ids;
    p.max_blocks_per_seq = s.max_blocks_per_seq;
    p.num_logits = s.num_logits;
    p.num_logits_rows = s.num_logits_rows;
    const absl::Status status = LaunchUnpackStepInputs(*b.stream, p);
    EXPECT_TRUE(status.ok()) << status;
    std::vector<int32_t> all;
    for (const DeviceBuffer& d :
         {o.token_ids, o.positions, o.slot_mapping, o.seq_lens,
          o.query_start_loc, o.num_reqs, o.block_tables, o.logits_indices}) {
      const std::vector<int32_t> v =
          b.Read<int32_t>(d, d.num_elements<int32_t>());
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  }

  void ExpectSameAsCpu(uint32_t seed, const Shape& s) {
    int num_block_ids = 0;
    const std::vector<int32_t> packed = RandomPacked(seed, s, &num_block_ids);
    EXPECT_EQ(Run(gpu(), s, packed, num_block_ids),
              Run(cpu(), s, packed, num_block_ids))
        << "seed " << seed << ": tokens " << s.num_tokens << " reqs "
        << s.num_reqs << " max blocks " << s.max_blocks_per_seq;
  }
};

TEST_F(UnpackStepInputsCudaTest, RandomShapesUnpackLikeTheCpu) {
  std::mt19937 rng(7);
  auto uniform = [&rng](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  for (uint32_t seed = 1; seed <= 30; ++seed) {
    Shape s;
    s.num_tokens = uniform(1, 8192);
    s.num_reqs = uniform(0, 256);
    s.num_real_reqs = uniform(0, s.num_reqs);
    s.max_blocks_per_seq = uniform(1, 64);
    s.num_logits = uniform(0, 4 * s.num_reqs);
    s.num_logits_rows = s.num_logits + uniform(0, 8);
    ExpectSameAsCpu(seed, s);
  }
}

// More output words than the capped grid has threads (1024 blocks of 256):
// 256 rows of 2,048-entry block tables, a 32k context of 16-token blocks.
TEST_F(UnpackStepInputsCudaTest, MoreWordsThanThreadsUnpackLikeTheCpu) {
  ExpectSameAsCpu(99, Shape{8192, 256, 200, 2048, 1024, 1024});
}

TEST_F(UnpackStepInputsCudaTest, RefusedWhileCapturing) {
  Stream& stream = *gpu().stream;
  UnpackStepInputsParams p;
  p.packed = gpu().Upload(std::vector<int32_t>{5, 0, -1, 0, 0});
  StepBuffers& o = p.outputs;
  o.token_ids = gpu().Alloc(4);
  o.positions = gpu().Alloc(4);
  o.slot_mapping = gpu().Alloc(4);
  o.query_start_loc = gpu().Alloc(4);
  o.num_reqs = gpu().Alloc(4);
  p.num_tokens = 1;
  p.max_blocks_per_seq = 1;
  ASSERT_TRUE(stream.BeginCapture().ok());
  const absl::Status status = LaunchUnpackStepInputs(stream, p);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_FALSE(stream.EndCapture().ok());
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
