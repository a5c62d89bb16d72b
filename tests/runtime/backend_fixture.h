// A GoogleTest fixture parameterized over the runtime backend, so behavioural
// tests are written once and run on the CPU backend everywhere and on CUDA
// where a GPU is present.
#ifndef PDWORKER_TESTS_RUNTIME_BACKEND_FIXTURE_H_
#define PDWORKER_TESTS_RUNTIME_BACKEND_FIXTURE_H_

#include <cstddef>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/cpu_work_queue.h"
#include "worker/runtime/device.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {

// The backend a BackendTest runs on; for the CPU backend also how its streams
// run their work (CUDA ignores it).
struct BackendParam {
  DeviceKind kind = DeviceKind::kCpu;
  CpuStreamExecution cpu_stream_execution = CpuStreamExecution::kInline;
};

// "cpu", "cpu_threaded" or "cuda"; BackendParamName is the test-name suffix.
std::string BackendName(const BackendParam& param);
std::string BackendParamName(
    const ::testing::TestParamInfo<BackendParam>& info);
void PrintTo(const BackendParam& param, std::ostream* os);

// Creates a device, its stream and a 1 MiB arena. For kCuda without a GPU
// (or in a binary built without CUDA) every test is skipped with the reason.
class BackendTest : public ::testing::TestWithParam<BackendParam> {
 protected:
  static constexpr size_t kArenaBytes = size_t{1} << 20;

  void SetUp() override;

  DeviceKind kind() const { return GetParam().kind; }
  CpuStreamExecution cpu_stream_execution() const {
    return GetParam().cpu_stream_execution;
  }
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

// Distinct values: element i of a vector of size n is seed + i * 0.37.
std::vector<float> Ramp(size_t n, float seed);

// True when the two float vectors have identical bits.
bool BitIdentical(const std::vector<float>& a, const std::vector<float>& b);

}  // namespace pdworker

// Instantiates a BackendTest-derived suite for the CPU backend (inline
// streams), or, in the `gpu`-tagged targets built with -DPDW_TEST_ON_CUDA=1,
// for CUDA. The _WITH_THREADED_CPU variant also runs the CPU suite on
// threaded streams (CpuStreamExecution::kThreaded), where work runs
// asynchronously as on a GPU.
#if defined(PDW_TEST_ON_CUDA) && PDW_TEST_ON_CUDA
#define PDW_INSTANTIATE_BACKEND_TESTS(suite)                              \
  INSTANTIATE_TEST_SUITE_P(Cuda, suite,                                   \
                           ::testing::Values(::pdworker::BackendParam{    \
                               ::pdworker::DeviceKind::kCuda,             \
                               ::pdworker::CpuStreamExecution::kInline}), \
                           ::pdworker::BackendParamName)
#define PDW_INSTANTIATE_BACKEND_TESTS_WITH_THREADED_CPU(suite) \
  PDW_INSTANTIATE_BACKEND_TESTS(suite)
#else
#define PDW_INSTANTIATE_BACKEND_TESTS(suite)                              \
  INSTANTIATE_TEST_SUITE_P(Cpu, suite,                                    \
                           ::testing::Values(::pdworker::BackendParam{    \
                               ::pdworker::DeviceKind::kCpu,              \
                               ::pdworker::CpuStreamExecution::kInline}), \
                           ::pdworker::BackendParamName)
#define PDW_INSTANTIATE_BACKEND_TESTS_WITH_THREADED_CPU(suite)               \
  INSTANTIATE_TEST_SUITE_P(                                                  \
      Cpu, suite,                                                            \
      ::testing::Values(                                                     \
          ::pdworker::BackendParam{::pdworker::DeviceKind::kCpu,             \
                                   ::pdworker::CpuStreamExecution::kInline}, \
          ::pdworker::BackendParam{                                          \
              ::pdworker::DeviceKind::kCpu,                                  \
              ::pdworker::CpuStreamExecution::kThreaded}),                   \
      ::pdworker::BackendParamName)
#endif

#endif  // PDWORKER_TESTS_RUNTIME_BACKEND_FIXTURE_H_
