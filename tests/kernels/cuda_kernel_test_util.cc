#include "tests/kernels/cuda_kernel_test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "worker/model/float16.h"
#include "worker/runtime/device_factory.h"

namespace pdworker {
namespace kernels {
namespace testing {
namespace {

absl::Status MakeBackend(DeviceKind kind, size_t arena_bytes, Backend* b) {
  absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice(kind);
  if (!device.ok()) return device.status();
  b->device = *std::move(device);
  absl::StatusOr<std::unique_ptr<Stream>> stream = b->device->CreateStream();
  if (!stream.ok()) return stream.status();
  b->stream = *std::move(stream);
  ArenaOptions options;
  options.capacity_bytes = arena_bytes;
  options.name = "cuda_kernel_test_arena";
  absl::StatusOr<std::unique_ptr<Arena>> arena =
      Arena::Create(*b->device, options);
  if (!arena.ok()) return arena.status();
  b->arena = *std::move(arena);
  return absl::OkStatus();
}

}  // namespace

DeviceBuffer Backend::Alloc(size_t bytes, uint8_t fill) {
  absl::StatusOr<DeviceBuffer> buffer = arena->Allocate(bytes, "test");
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  if (!buffer.ok()) return DeviceBuffer();
  const std::vector<uint8_t> pattern(bytes, fill);
  const absl::Status status =
      stream->CopyToDevice(*buffer, pattern.data(), bytes);
  EXPECT_TRUE(status.ok()) << status;
  return *buffer;
}

void CudaKernelTest::SetUp() {
  absl::Status gpu = MakeBackend(DeviceKind::kCuda, kGpuArenaBytes, &gpu_);
  if (!gpu.ok()) {
    GTEST_SKIP() << "CUDA backend not available here (" << gpu.message()
                 << "); these gpu-tagged tests run on a GPU machine";
  }
  const absl::Status cpu = MakeBackend(DeviceKind::kCpu, kCpuArenaBytes, &cpu_);
  ASSERT_TRUE(cpu.ok()) << cpu;
}

DeviceBuffer CudaKernelTest::GpuBf16(const std::vector<float>& values) {
  return gpu_.Upload(ToBf16Bits(values));
}

std::vector<float> CudaKernelTest::ReadGpuBf16(DeviceBuffer buffer, size_t n) {
  return FromBf16Bits(gpu_.Read<uint16_t>(buffer, n));
}

std::vector<uint16_t> ToBf16Bits(const std::vector<float>& values) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    bits[i] = FloatToBFloat16Bits(values[i]);
  }
  return bits;
}

std::vector<float> FromBf16Bits(const std::vector<uint16_t>& bits) {
  std::vector<float> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    values[i] = BFloat16BitsToFloat(bits[i]);
  }
  return values;
}

std::vector<float> RoundToBf16(const std::vector<float>& values) {
  return FromBf16Bits(ToBf16Bits(values));
}

std::vector<float> RandomBf16Floats(size_t n, uint32_t seed, float lo,
                                    float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> values(n);
  for (float& v : values) v = dist(rng);
  return RoundToBf16(values);
}

double WorstToleranceRatio(const std::vector<float>& got,
                           const std::vector<float>& want, double rel,
                           double abs) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double diff = std::fabs(double{got[i]} - double{want[i]});
    if (std::isnan(diff)) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, diff / (rel * std::fabs(double{want[i]}) + abs));
  }
  return worst;
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 double rel, double abs, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t worst_index = 0;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double diff = std::fabs(double{got[i]} - double{want[i]});
    const double ratio = std::isnan(diff)
                             ? std::numeric_limits<double>::infinity()
                             : diff / (rel * std::fabs(double{want[i]}) + abs);
    if (ratio > worst) {
      worst = ratio;
      worst_index = i;
    }
  }
  EXPECT_LE(worst, 1.0) << what << ": element " << worst_index << " is "
                        << got[worst_index] << ", expected "
                        << want[worst_index] << " (tolerance " << rel
                        << " relative + " << abs << " absolute)";
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace testing
}  // namespace kernels
}  // namespace pdworker
