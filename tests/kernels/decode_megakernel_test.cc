// The decode megakernel's host side on the CPU: its L2 prefetch schedule
// (plain arithmetic on the weights' sizes) and its refusal off CUDA. The
// kernel itself runs in tests/runner/model_runner_gpu_test.cc.
#include "worker/kernels/decode_megakernel.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "tests/kernels/kernel_test_util.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::KernelTest;

constexpr int kPhases = 6;

// Where each phase's own weights end in the stream (qkv, o_proj, gate_up,
// down per layer; the attention phases read none: o_proj's start).
std::vector<int64_t> OwnEnds(const std::vector<int64_t>& segments,
                             int num_layers) {
  std::vector<int64_t> start(segments.size() + 1, 0);
  for (size_t s = 0; s < segments.size(); ++s) {
    start[s + 1] = start[s] + segments[s];
  }
  std::vector<int64_t> ends;
  for (int l = 0; l < num_layers; ++l) {
    ends.push_back(start[4 * l + 1]);  // qkv
    ends.push_back(start[4 * l + 1]);  // split: o_proj's start
    ends.push_back(start[4 * l + 1]);  // reduce
    ends.push_back(start[4 * l + 2]);  // o_proj
    ends.push_back(start[4 * l + 3]);  // gate_up
    ends.push_back(start[4 * l + 4]);  // down
  }
  return ends;
}

// Walks the schedule in launch order and checks the invariants every
// schedule keeps: ranges inside their segment, 16-byte multiples, at most 4
// a phase, contiguous in stream order from byte 0 (nothing asked twice,
// nothing skipped); returns the stream bytes asked for by the end of each
// phase.
std::vector<int64_t> CheckAndAccumulate(
    const std::vector<std::vector<PrefetchRange>>& schedule,
    const std::vector<int64_t>& segments) {
  std::vector<int64_t> start(segments.size() + 1, 0);
  for (size_t s = 0; s < segments.size(); ++s) {
    start[s + 1] = start[s] + segments[s];
  }
  std::vector<int64_t> asked;
  int64_t cursor = 0;
  for (size_t phase = 0; phase < schedule.size(); ++phase) {
    EXPECT_LE(schedule[phase].size(), 4u) << "phase " << phase;
    for (const PrefetchRange& r : schedule[phase]) {
      EXPECT_GE(r.segment, 0);
      EXPECT_LT(r.segment, static_cast<int>(segments.size()));
      EXPECT_GT(r.bytes, 0);
      EXPECT_EQ(r.bytes % 16, 0);
      EXPECT_EQ(r.offset % 16, 0);
      EXPECT_LE(r.offset + r.bytes, segments[r.segment]);
      EXPECT_EQ(start[r.segment] + r.offset, cursor)
          << "phase " << phase << " skips or repeats bytes";
      cursor = start[r.segment] + r.offset + r.bytes;
    }
    asked.push_back(cursor);
  }
  return asked;
}

TEST(DecodeMegakernelScheduleTest, KeepsTheWindowAheadOfEveryPhase) {
  // Two layers of the 0.5B shape's byte counts (qkv, o_proj, gate_up,
  // down), and a window of 8 MB: smaller than one layer, larger than most
  // phases.
  const std::vector<int64_t> layer = {896 * 1152 * 2, 896 * 896 * 2,
                                      9728 * 896 * 2, 896 * 4864 * 2};
  std::vector<int64_t> segments;
  for (int l = 0; l < 2; ++l) {
    segments.insert(segments.end(), layer.begin(), layer.end());
  }
  int64_t total = 0;
  for (int64_t s : segments) total += s;
  const int64_t window = int64_t{8} << 20;
  const auto schedule = MegakernelPrefetchSchedule(segments, 2, window);
  ASSERT_EQ(schedule.size(), 2u * kPhases);
  const std::vector<int64_t> asked = CheckAndAccumulate(schedule, segments);
  const std::vector<int64_t> own_end = OwnEnds(segments, 2);
  for (int p = 0; p < 2 * kPhases; ++p) {
    const int64_t target = std::min(total, own_end[p] + window);
    // Four ranges always reach the target here: the bytes between two
    // targets span at most four matrices of this shape (down's tail, the
    // next qkv and o_proj, the start of its gate_up).
    EXPECT_EQ(asked[p], target) << "phase " << p;
  }
  EXPECT_EQ(asked.back(), total);
}

TEST(DecodeMegakernelScheduleTest, AHugeWindowAsksFourMatricesAPhase) {
  const std::vector<int64_t> segments(12, 4096);  // 3 layers
  const auto schedule =
      MegakernelPrefetchSchedule(segments, 3, int64_t{1} << 40);
  const std::vector<int64_t> asked = CheckAndAccumulate(schedule, segments);
  // Each phase can ask for at most 4 ranges, each inside one matrix.
  EXPECT_EQ(asked[0], 4 * 4096);
  EXPECT_EQ(asked[1], 8 * 4096);
  EXPECT_EQ(asked[2], 12 * 4096);
  EXPECT_EQ(asked.back(), 12 * 4096);
}

TEST(DecodeMegakernelScheduleTest, WindowZeroOrBadSegmentsAskNothing) {
  const std::vector<int64_t> segments(8, 4096);
  for (const auto& schedule :
       {MegakernelPrefetchSchedule(segments, 2, 0),
        MegakernelPrefetchSchedule(segments, 2, -5),
        // 8 segments are not 4 per layer of 3 layers.
        MegakernelPrefetchSchedule(segments, 3, 1 << 20)}) {
    for (const auto& phase : schedule) EXPECT_TRUE(phase.empty());
  }
}

// The LM head after the layers: the last layer's phases run the window into
// it, and no further (the head's own kernel streams the rest).
TEST(DecodeMegakernelScheduleTest, TheNextKernelsWeightsTrailTheLastLayer) {
  std::vector<int64_t> segments(8, int64_t{1} << 20);  // 2 layers of 1 MiB
  segments.push_back(int64_t{64} << 20);               // the head: 64 MiB
  const int64_t window = int64_t{4} << 20;
  const auto schedule = MegakernelPrefetchSchedule(segments, 2, window);
  ASSERT_EQ(schedule.size(), 2u * kPhases);
  const std::vector<int64_t> asked = CheckAndAccumulate(schedule, segments);
  // down of layer 1 ends at 8 MiB: the window reaches 4 MiB into the head.
  EXPECT_EQ(asked.back(), int64_t{12} << 20);
  EXPECT_EQ(schedule.back().back().segment, 8);
  EXPECT_EQ(schedule.back().back().offset + schedule.back().back().bytes,
            int64_t{4} << 20);
}

TEST(DecodeMegakernelScheduleTest, AWindowNotAMultipleOf16IsRoundedDown) {
  const std::vector<int64_t> segments(4, 1 << 20);
  const auto schedule = MegakernelPrefetchSchedule(segments, 1, 1000 + 7);
  const std::vector<int64_t> asked = CheckAndAccumulate(schedule, segments);
  // qkv's own megabyte plus 1000 bytes (1007 rounded down to 16s: 992).
  EXPECT_EQ(asked[0], (1 << 20) + 992);
}

class DecodeMegakernelCpuTest : public KernelTest {};

TEST_F(DecodeMegakernelCpuTest, PlanIsRefusedOffCudaAndNeedsNoMemory) {
  EXPECT_EQ(DecodeMegakernelBytes(DeviceKind::kCpu, 24), 0u);
  DecodeMegakernelParams params;
  params.layers = std::vector<DecodeMegakernelLayer>(2);
  absl::StatusOr<DecodeMegakernelPlan> plan =
      DecodeMegakernelPlan::Create(stream(), params);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(plan.status().message().find("CUDA"), absl::string_view::npos)
      << plan.status();
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
