#include "tests/runtime/backend_fixture.h"

#include <cstring>

#include "worker/runtime/device_factory.h"
#include "worker/runtime/testing/test_ops.h"

namespace pdworker {

void BackendTest::SetUp() {
  DeviceOptions options;
  options.cpu.stream_execution = cpu_stream_execution();
  absl::StatusOr<std::unique_ptr<Device>> device =
      CreateDevice(kind(), options);
  if (!device.ok()) {
    if (kind() == DeviceKind::kCuda) {
      GTEST_SKIP() << "CUDA backend not available here ("
                   << device.status().message()
                   << "); run the gpu-tagged targets on a GPU machine";
    }
    FAIL() << device.status();
  }
  device_ = *std::move(device);
  absl::StatusOr<std::unique_ptr<Stream>> stream = device_->CreateStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  stream_ = *std::move(stream);
  ArenaOptions arena_options;
  arena_options.capacity_bytes = kArenaBytes;
  arena_options.name = "test_arena";
  absl::StatusOr<std::unique_ptr<Arena>> arena =
      Arena::Create(*device_, arena_options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  arena_ = *std::move(arena);

  // First launches may load kernel modules lazily (CUDA); do that outside
  // any capture, as the capture session's warm-up runs do.
  DeviceBuffer scratch = NewFloats(16, "warmup");
  ASSERT_TRUE(test_ops::Fill(*stream_, scratch, 0.0f).ok());
  ASSERT_TRUE(test_ops::Axpy(*stream_, 1.0f, scratch, scratch).ok());
  ASSERT_TRUE(test_ops::MulAdd(*stream_, scratch, scratch, 0.0f, scratch).ok());
  ASSERT_TRUE(stream_->Synchronize().ok());
}

DeviceBuffer BackendTest::NewFloats(size_t n, const std::string& label) {
  absl::StatusOr<DeviceBuffer> buffer =
      arena_->Allocate(n * sizeof(float), label);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  return buffer.ok() ? *buffer : DeviceBuffer();
}

void BackendTest::Upload(DeviceBuffer dst, const std::vector<float>& values) {
  absl::Status status =
      stream_->CopyToDevice(dst, values.data(), values.size() * sizeof(float));
  EXPECT_TRUE(status.ok()) << status;
}

std::vector<float> BackendTest::Download(DeviceBuffer src) {
  std::vector<float> values(src.num_elements<float>());
  absl::Status status =
      stream_->CopyToHost(values.data(), src, values.size() * sizeof(float));
  EXPECT_TRUE(status.ok()) << status;
  return values;
}

std::string BackendName(const BackendParam& param) {
  std::string name(DeviceKindName(param.kind));
  if (param.kind == DeviceKind::kCpu &&
      param.cpu_stream_execution != CpuStreamExecution::kInline) {
    name += "_";
    name += std::string(CpuStreamExecutionName(param.cpu_stream_execution));
  }
  return name;
}

std::string BackendParamName(
    const ::testing::TestParamInfo<BackendParam>& info) {
  return BackendName(info.param);
}

void PrintTo(const BackendParam& param, std::ostream* os) {
  *os << BackendName(param);
}

std::vector<float> Ramp(size_t n, float seed) {
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i)
    values[i] = seed + 0.37f * static_cast<float>(i);
  return values;
}

bool BitIdentical(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace pdworker
