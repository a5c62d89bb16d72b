// A GoogleTest fixture parameterized over the runtime backend, so behavioural
// tests are written once and run on the CPU backend everywhere and on CUDA
// where a GPU is present.
#ifndef PDWORKER_TESTS_RUNTIME_BACKEND_FIXTURE_H_
#define PDWORKER_TESTS_RUNTIME_BACKEND_FIXTURE_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/device.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {

// Creates a device, its stream and a 1 MiB arena. For kCuda without a GPU
// (or in a binary built without CUDA) every test is skipped with the reason.
class BackendTest : public ::testing::TestWithParam<DeviceKind> {
 protected:
  static constexpr size_t kArenaBytes = size_t{1} << 20;

  void SetUp() override;

  DeviceKind kind() const { return GetParam(); }
  Device& device() { return *device_; }
  Stream& stream() { return *stream_; }
  Arena& arena() { return *arena_; }

  // A static float buffer of `n` elements from the arena.
  DeviceBuffer NewFloats(size_t n, const std::string& label = "buffer");
  // Blocking host<->device helpers (fail the test on error).
  void Upload(DeviceBuffer dst, const std::vector<float>& values);
  std::vector<float> Download(DeviceBuffer src);

 private:
  std::unique_ptr<Device> device_;
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<Stream> stream_;
};

// "cpu" / "cuda" as test-name suffix.
std::string BackendParamName(const ::testing::TestParamInfo<DeviceKind>& info);

// Distinct values: element i of a vector of size n is seed + i * 0.37.
std::vector<float> Ramp(size_t n, float seed);

// True when the two float vectors have identical bits.
bool BitIdentical(const std::vector<float>& a, const std::vector<float>& b);

}  // namespace pdworker

// Instantiates a BackendTest-derived suite for the CPU backend, or, in the
// `gpu`-tagged targets built with -DPDW_TEST_ON_CUDA=1, for CUDA.
#if defined(PDW_TEST_ON_CUDA) && PDW_TEST_ON_CUDA
#define PDW_INSTANTIATE_BACKEND_TESTS(suite)                                 \
  INSTANTIATE_TEST_SUITE_P(Cuda, suite,                                      \
                           ::testing::Values(::pdworker::DeviceKind::kCuda), \
                           ::pdworker::BackendParamName)
#else
#define PDW_INSTANTIATE_BACKEND_TESTS(suite)                                \
  INSTANTIATE_TEST_SUITE_P(Cpu, suite,                                      \
                           ::testing::Values(::pdworker::DeviceKind::kCpu), \
                           ::pdworker::BackendParamName)
#endif

#endif  // PDWORKER_TESTS_RUNTIME_BACKEND_FIXTURE_H_
