// CPU-backend specifics: exact memory accounting, poisoned allocations, the
// recorded op list of a CpuGraph, and the device factory.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/cpu_device.h"
#include "worker/runtime/cpu_graph.h"
#include "worker/runtime/device_factory.h"
#include "worker/runtime/stream.h"
#include "worker/runtime/testing/test_ops.h"

namespace pdworker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(CpuDeviceTest, AccountsExactlyAndFreesThroughRaii) {
  CpuDeviceOptions options;
  options.capacity_bytes = 10000;
  CpuDevice device(options);
  {
    absl::StatusOr<DeviceMemory> a = device.Allocate(6000);
    ASSERT_TRUE(a.ok()) << a.status();
    absl::StatusOr<MemoryStats> stats = device.GetMemoryStats();
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->used_bytes, 6000u);
    EXPECT_EQ(stats->free_bytes, 4000u);
    EXPECT_EQ(stats->total_bytes, 10000u);

    absl::StatusOr<DeviceMemory> b = device.Allocate(5000);
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(std::string(b.status().message()), HasSubstr("out of memory"));

    DeviceMemory moved = *std::move(a);  // Ownership moves, no double free.
    EXPECT_EQ(device.GetMemoryStats()->used_bytes, 6000u);
  }
  EXPECT_EQ(device.GetMemoryStats()->used_bytes, 0u);
}

TEST(CpuDeviceTest, HostMemoryIsPoisonedAndNotDeviceMemory) {
  CpuDeviceOptions options;
  options.capacity_bytes = 256;
  CpuDevice device(options);
  absl::StatusOr<HostMemory> host = device.AllocateHost(4096);
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_TRUE(std::isnan(host->as<float>()[0]));
  EXPECT_EQ(host->as<int32_t>()[1023], -1);
  EXPECT_EQ(device.GetMemoryStats()->used_bytes, 0u)
      << "pinned host memory does not use the device's capacity";
}

TEST(CpuDeviceTest, ZeroByteAllocationIsInvalid) {
  CpuDevice device;
  EXPECT_EQ(device.Allocate(0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CpuDeviceTest, NewMemoryIsPoisonedSoUnwrittenReadsShow) {
  CpuDevice device;
  absl::StatusOr<DeviceMemory> memory = device.Allocate(64);
  ASSERT_TRUE(memory.ok());
  EXPECT_TRUE(std::isnan(memory->buffer().as<float>()[0]));
  EXPECT_EQ(memory->buffer().as<int32_t>()[3], -1);
}

// Allocations past 64 MiB per hardware thread are poisoned by several
// threads at once (the first touch of their pages is most of a weights
// load): every byte still reads 0xFF, including the last piece's end, and
// an odd size's tail.
TEST(CpuDeviceTest, LargeAllocationsArePoisonedToTheLastByte) {
  CpuDevice device;
  const size_t size = (size_t{200} << 20) + 12345;
  absl::StatusOr<DeviceMemory> memory = device.Allocate(size);
  ASSERT_TRUE(memory.ok()) << memory.status();
  const auto* bytes = memory->buffer().as<const unsigned char>();
  for (size_t i = 0; i < size; i += 4093) {
    ASSERT_EQ(bytes[i], 0xFF) << "byte " << i;
  }
  for (size_t i = size - 4096; i < size; ++i) {
    ASSERT_EQ(bytes[i], 0xFF) << "byte " << i;
  }
}

TEST(CpuDeviceTest, ArenaLargerThanDeviceFails) {
  CpuDeviceOptions options;
  options.capacity_bytes = 1000;
  CpuDevice device(options);
  ArenaOptions arena_options;
  arena_options.capacity_bytes = 2000;
  arena_options.name = "activations";
  absl::StatusOr<std::unique_ptr<Arena>> arena =
      Arena::Create(device, arena_options);
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(arena.status().message()),
              HasSubstr("arena 'activations'"));
}

TEST(CpuDeviceTest, ArenaRejectsBadOptions) {
  CpuDevice device;
  ArenaOptions options;
  options.capacity_bytes = 0;
  EXPECT_EQ(Arena::Create(device, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.capacity_bytes = 1024;
  options.alignment_bytes = 48;
  EXPECT_EQ(Arena::Create(device, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CpuGraphTest, RecordsEachLaunchInOrderWithItsName) {
  CpuDevice device;
  absl::StatusOr<std::unique_ptr<Stream>> stream = device.CreateStream();
  ASSERT_TRUE(stream.ok());
  absl::StatusOr<DeviceMemory> memory = device.Allocate(4 * sizeof(float));
  ASSERT_TRUE(memory.ok());
  DeviceBuffer x = memory->buffer();

  ASSERT_TRUE((*stream)->BeginCapture().ok());
  ASSERT_TRUE(test_ops::Fill(**stream, x, 1.0f).ok());
  ASSERT_TRUE(test_ops::Axpy(**stream, 2.0f, x, x).ok());
  ASSERT_TRUE((*stream)
                  ->Launch("custom",
                           [](const OpContext& context) {
                             // CPU ops get no native handles.
                             EXPECT_EQ(context.cuda_stream, nullptr);
                           })
                  .ok());
  absl::StatusOr<std::unique_ptr<CapturedGraph>> graph =
      (*stream)->EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();
  auto* cpu_graph = dynamic_cast<CpuGraph*>(graph->get());
  ASSERT_NE(cpu_graph, nullptr);
  std::vector<std::string> names;
  for (const RecordedOp& op : cpu_graph->ops()) names.push_back(op.name);
  EXPECT_THAT(names, ElementsAre("fill", "axpy", "custom"));
  ASSERT_TRUE(cpu_graph->Replay().ok());
  EXPECT_EQ(x.as<float>()[0], 3.0f);  // 2 * 1 + 1
}

TEST(CpuGraphTest, EmptyOpIsRejected) {
  CpuDevice device;
  absl::StatusOr<std::unique_ptr<Stream>> stream = device.CreateStream();
  ASSERT_TRUE(stream.ok());
  EXPECT_EQ((*stream)->Launch("nothing", nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(DeviceFactoryTest, CpuAlwaysWorksAndCudaExplainsItself) {
  absl::StatusOr<std::unique_ptr<Device>> cpu = CreateDevice(DeviceKind::kCpu);
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ((*cpu)->kind(), DeviceKind::kCpu);
  absl::StatusOr<std::unique_ptr<Device>> cuda =
      CreateDevice(DeviceKind::kCuda);
  if (!CudaBackendCompiledIn()) {
    EXPECT_EQ(cuda.status().code(), absl::StatusCode::kUnimplemented);
  } else if (!cuda.ok()) {
    EXPECT_EQ(cuda.status().code(), absl::StatusCode::kUnavailable)
        << cuda.status();
  } else {
    EXPECT_EQ((*cuda)->kind(), DeviceKind::kCuda);
  }
}

TEST(DeviceBufferTest, SliceStaysInBounds) {
  float storage[8] = {};
  DeviceBuffer buffer(storage, sizeof(storage));
  DeviceBuffer tail = buffer.Slice(4 * sizeof(float), 4 * sizeof(float));
  EXPECT_EQ(tail.as<float>(), storage + 4);
  EXPECT_EQ(tail.num_elements<float>(), 4u);
  EXPECT_DEATH(buffer.Slice(4 * sizeof(float), 5 * sizeof(float)), "");
}

}  // namespace
}  // namespace pdworker
