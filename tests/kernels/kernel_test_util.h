// Shared fixture and helpers for the kernel tests: a CPU device, its stream
// and an arena of static buffers, plus host<->device helpers and seeded
// random data. The naive references live in each test file, written
// independently of the kernels.
#ifndef PDWORKER_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
#define PDWORKER_TESTS_KERNELS_KERNEL_TEST_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/device.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace kernels {
namespace testing {

class KernelTest : public ::testing::Test {
 protected:
  static constexpr size_t kArenaBytes = size_t{8} << 20;

  void SetUp() override;

  Device& device() { return *device_; }
  Stream& stream() { return *stream_; }

  // A fresh static buffer of `bytes` bytes (poisoned: 0xFF bytes).
  DeviceBuffer Alloc(size_t bytes, const std::string& label = "buffer");
  template <typename T>
  DeviceBuffer AllocElements(size_t n, const std::string& label = "buffer") {
    return Alloc(n * sizeof(T), label);
  }
  // A fresh buffer holding `values`.
  template <typename T>
  DeviceBuffer Upload(const std::vector<T>& values,
                      const std::string& label = "buffer") {
    DeviceBuffer buffer = Alloc(values.size() * sizeof(T), label);
    Write(buffer, values);
    return buffer;
  }
  // Overwrites the start of `buffer` with `values`.
  template <typename T>
  void Write(DeviceBuffer buffer, const std::vector<T>& values) {
    const absl::Status status =
        stream_->CopyToDevice(buffer, values.data(), values.size() * sizeof(T));
    ASSERT_TRUE(status.ok()) << status;
  }
  // The first `n` elements of `buffer` (all of it when n is omitted).
  template <typename T>
  std::vector<T> Read(DeviceBuffer buffer, size_t n = SIZE_MAX) {
    if (n == SIZE_MAX) n = buffer.num_elements<T>();
    std::vector<T> values(n);
    const absl::Status status =
        stream_->CopyToHost(values.data(), buffer, n * sizeof(T));
    EXPECT_TRUE(status.ok()) << status;
    return values;
  }

 private:
  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Arena> arena_;
};

// `n` floats uniform in [lo, hi) from a fixed-seed generator.
std::vector<float> RandomFloats(size_t n, uint32_t seed, float lo = -1.0f,
                                float hi = 1.0f);

// max_i |a[i] − b[i]|; +inf when sizes differ or a value is NaN.
double MaxAbsDiff(const std::vector<float>& a, const std::vector<double>& b);
double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b);

// True when both hold the same bits.
bool BitIdentical(const std::vector<float>& a, const std::vector<float>& b);

// Matches an INVALID_ARGUMENT status whose message mentions `text`.
MATCHER_P(IsInvalidArgumentMentioning, text, "") {
  const absl::Status& status = arg;
  *result_listener << "status: " << status;
  return status.code() == absl::StatusCode::kInvalidArgument &&
         status.message().find(text) != absl::string_view::npos;
}

}  // namespace testing
}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
