#include "tests/kernels/kernel_test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "worker/runtime/device_factory.h"

namespace pdworker {
namespace kernels {
namespace testing {

void KernelTest::SetUp() {
  absl::StatusOr<std::unique_ptr<Device>> device =
      CreateDevice(DeviceKind::kCpu);
  ASSERT_TRUE(device.ok()) << device.status();
  device_ = *std::move(device);
  absl::StatusOr<std::unique_ptr<Stream>> stream = device_->CreateStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  stream_ = *std::move(stream);
  ArenaOptions options;
  options.capacity_bytes = kArenaBytes;
  options.name = "kernel_test_arena";
  absl::StatusOr<std::unique_ptr<Arena>> arena =
      Arena::Create(*device_, options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  arena_ = *std::move(arena);
}

DeviceBuffer KernelTest::Alloc(size_t bytes, const std::string& label) {
  absl::StatusOr<DeviceBuffer> buffer = arena_->Allocate(bytes, label);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  return buffer.ok() ? *buffer : DeviceBuffer();
}

std::vector<float> RandomFloats(size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> values(n);
  for (float& v : values) v = dist(rng);
  return values;
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double max = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    if (std::isnan(d)) return std::numeric_limits<double>::infinity();
    max = std::max(max, d);
  }
  return max;
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  return MaxAbsDiff(a, std::vector<double>(b.begin(), b.end()));
}

bool BitIdentical(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace testing
}  // namespace kernels
}  // namespace pdworker
