// Fixture for the CUDA kernel tests (tag "gpu"): a CPU device and a CUDA
// device, each with a stream and an arena of static buffers, so every test
// runs an op on both backends with the same inputs and compares. Without a
// usable GPU (or in a binary built without CUDA) every test is skipped.
//
// Inputs are drawn in fp32 and rounded to bf16 once; the CPU backend gets
// the rounded values in fp32, the GPU the bf16 bits, so the only differences
// left are the GPU's bf16 rounding of outputs (and intermediate activations)
// and fp32 summation order. Each test documents its tolerance in those terms.
#ifndef PDWORKER_TESTS_KERNELS_CUDA_KERNEL_TEST_UTIL_H_
#define PDWORKER_TESTS_KERNELS_CUDA_KERNEL_TEST_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/device.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace kernels {
namespace testing {

// One backend's device, stream and arena.
struct Backend {
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<Arena> arena;

  // A fresh buffer of `bytes` bytes, every byte `fill` (a poison pattern:
  // reading uninitialized memory shows up in results).
  DeviceBuffer Alloc(size_t bytes, uint8_t fill = 0xFF);
  // A fresh buffer holding `values` (raw bytes of T).
  template <typename T>
  DeviceBuffer Upload(const std::vector<T>& values) {
    DeviceBuffer buffer = Alloc(values.size() * sizeof(T));
    Write(buffer, values);
    return buffer;
  }
  template <typename T>
  void Write(DeviceBuffer buffer, const std::vector<T>& values) {
    const absl::Status status =
        stream->CopyToDevice(buffer, values.data(), values.size() * sizeof(T));
    ASSERT_TRUE(status.ok()) << status;
  }
  template <typename T>
  std::vector<T> Read(DeviceBuffer buffer, size_t n) {
    std::vector<T> values(n);
    const absl::Status status =
        stream->CopyToHost(values.data(), buffer, n * sizeof(T));
    EXPECT_TRUE(status.ok()) << status;
    return values;
  }
};

class CudaKernelTest : public ::testing::Test {
 protected:
  static constexpr size_t kCpuArenaBytes = size_t{64} << 20;
  static constexpr size_t kGpuArenaBytes = size_t{4} << 30;

  void SetUp() override;

  Backend& cpu() { return cpu_; }
  Backend& gpu() { return gpu_; }

  // fp32 values on the CPU backend / their bf16 bits on the GPU.
  DeviceBuffer CpuFloats(const std::vector<float>& values) {
    return cpu_.Upload(values);
  }
  DeviceBuffer GpuBf16(const std::vector<float>& values);
  // The first n bf16 values of a GPU buffer, widened to fp32.
  std::vector<float> ReadGpuBf16(DeviceBuffer buffer, size_t n);

 private:
  Backend cpu_;
  Backend gpu_;
};

// `values` rounded to bf16 (round to nearest even) and back to fp32.
std::vector<float> RoundToBf16(const std::vector<float>& values);
std::vector<uint16_t> ToBf16Bits(const std::vector<float>& values);
std::vector<float> FromBf16Bits(const std::vector<uint16_t>& bits);

// `n` floats uniform in [lo, hi), fixed seed, already rounded to bf16.
std::vector<float> RandomBf16Floats(size_t n, uint32_t seed, float lo = -1.0f,
                                    float hi = 1.0f);

// The largest |got − want| / (rel · |want| + abs) over all elements (NaN
// counts as +inf): <= 1 means every element is within tolerance.
double WorstToleranceRatio(const std::vector<float>& got,
                           const std::vector<float>& want, double rel,
                           double abs);

// Expects got ≈ want elementwise within rel · |want| + abs, reporting the
// worst element.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 double rel, double abs, const std::string& what);

bool SameBits(const std::vector<float>& a, const std::vector<float>& b);

}  // namespace testing
}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_TESTS_KERNELS_CUDA_KERNEL_TEST_UTIL_H_
