// --gpu_memory_utilization: the KV cache gets what the fraction leaves once
// the weights, step buffers, activations and (on CUDA) the graph reserve
// are counted; a budget that leaves nothing, or too little for one
// max_model_len sequence, is refused naming the figures and the flags.
#include "worker/runner/kv_cache_budget.h"

#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/runner/model_runner_test_util.h"
#include "worker/runtime/cpu_device.h"

namespace pdworker {
namespace {

using runner_testing::SmallOptions;
using runner_testing::TinyModelDir;
using ::testing::HasSubstr;

constexpr int64_t kGiB = int64_t{1} << 30;

MemoryStats Memory(int64_t total, int64_t used) {
  MemoryStats m;
  m.total_bytes = static_cast<size_t>(total);
  m.used_bytes = static_cast<size_t>(used);
  m.free_bytes = static_cast<size_t>(total - used);
  return m;
}

TEST(KvCacheBudgetTest, CudaCountsEverythingUsedAndKeepsAGraphReserve) {
  // 80 GiB device, 17 GiB used (weights, context, another process).
  auto b = ComputeKvCacheBudget(
      {DeviceKind::kCuda, 0.9, Memory(80 * kGiB, 17 * kGiB), -1, kGiB});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->total_bytes, 80 * kGiB);
  EXPECT_EQ(b->limit_bytes, static_cast<int64_t>(0.9 * 80 * kGiB));
  EXPECT_EQ(b->graph_reserve_bytes, kCudaGraphReserveBytes);
  EXPECT_EQ(b->kv_cache_bytes,
            b->limit_bytes - 17 * kGiB - kGiB - kCudaGraphReserveBytes);
}

TEST(KvCacheBudgetTest, CpuAppliesToTheMemoryAvailableAtStartup) {
  // A 64 GiB capacity, but only 10 GiB available besides the 2 GiB the
  // worker holds: the fraction applies to 12 GiB; no graph reserve.
  auto b = ComputeKvCacheBudget(
      {DeviceKind::kCpu, 0.5, Memory(64 * kGiB, 2 * kGiB), 10 * kGiB, 0});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->total_bytes, 12 * kGiB);
  EXPECT_EQ(b->graph_reserve_bytes, 0);
  EXPECT_EQ(b->kv_cache_bytes, 6 * kGiB - 2 * kGiB);
  // Plenty available: the device's capacity bounds it.
  auto capped = ComputeKvCacheBudget(
      {DeviceKind::kCpu, 0.5, Memory(8 * kGiB, 2 * kGiB), 100 * kGiB, 0});
  ASSERT_TRUE(capped.ok());
  EXPECT_EQ(capped->total_bytes, 8 * kGiB);
  EXPECT_EQ(capped->kv_cache_bytes, 2 * kGiB);
}

TEST(KvCacheBudgetTest, NothingLeftIsRefusedNamingTheFlags) {
  auto b = ComputeKvCacheBudget(
      {DeviceKind::kCuda, 0.25, Memory(80 * kGiB, 20 * kGiB), -1, kGiB});
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(b.status().message(), HasSubstr("--gpu_memory_utilization"));
  EXPECT_THAT(b.status().message(), HasSubstr("--kv_cache_bytes"));
  EXPECT_THAT(b.status().message(), HasSubstr("weights and buffers 20.00 GiB"));
  for (const double bad : {0.0, -0.5, 1.01}) {
    auto refused = ComputeKvCacheBudget(
        {DeviceKind::kCuda, bad, Memory(80 * kGiB, 0), -1, 0});
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(KvCacheBudgetTest, HostMemoryIsBoundByTheContainersLimit) {
  const std::string meminfo =
      "MemTotal:       24683520 kB\n"
      "MemFree:         8000000 kB\n"
      "MemAvailable:   20000000 kB\n";
  // No cgroup limit ("max", or no file): the node's MemAvailable.
  EXPECT_EQ(HostMemAvailableBytes(meminfo, "max\n", "123\n"),
            int64_t{20000000} * 1024);
  EXPECT_EQ(HostMemAvailableBytes(meminfo, "", ""), int64_t{20000000} * 1024);
  // A pod limited to 8 GiB that holds 1 GiB may take 7 GiB more.
  EXPECT_EQ(HostMemAvailableBytes(meminfo, "8589934592\n", "1073741824\n"),
            7 * kGiB);
  // Over its limit already: nothing.
  EXPECT_EQ(HostMemAvailableBytes(meminfo, "1073741824\n", "2147483648\n"), 0);
  EXPECT_EQ(HostMemAvailableBytes("", "max", ""), -1);
  EXPECT_EQ(HostMemAvailableBytes("", "4096", "1024"), 3072);
}

// Through ModelRunner::Create on a CPU device whose capacity is the bound:
// the KV cache is what the fraction leaves after what Create allocated.
TEST(KvCacheBudgetTest, RunnerSizesTheKvCacheFromTheFraction) {
  auto dir = TinyModelDir(TinyShape::kGqa);
  ASSERT_TRUE(dir.ok()) << dir.status();
  CpuDeviceOptions device_options;
  device_options.capacity_bytes = size_t{256} << 20;
  CpuDevice device(device_options);
  ModelRunnerOptions o = SmallOptions(R"({"cudagraph_mode":"NONE"})");
  o.kv_cache_bytes = 0;
  o.gpu_memory_utilization = 0.25;
  auto runner = ModelRunner::Create(device, *dir, o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  const int64_t limit = int64_t{64} << 20;  // 0.25 x 256 MiB
  const int64_t used =
      static_cast<int64_t>(device.GetMemoryStats()->used_bytes);
  const int64_t per_block =
      (*runner)->kv_cache_bytes() / (*runner)->kv_cache().Stats().total_blocks;
  // Everything allocated fits the limit (up to the KV arena's per-layer
  // alignment), and the KV cache took the rest up to less than one block.
  EXPECT_LE(used, limit + 4096);
  EXPECT_GT(used, limit - per_block - 4096);
  EXPECT_GT((*runner)->kv_cache_bytes(), int64_t{32} << 20);
}

// A budget that leaves less than one sequence of max_model_len is refused
// naming both and the flags, and frees everything Create allocated.
TEST(KvCacheBudgetTest, RunnerRefusesABudgetShortOfOneSequence) {
  auto dir = TinyModelDir(TinyShape::kGqa);
  ASSERT_TRUE(dir.ok()) << dir.status();
  // What the runner holds besides its KV cache, and one sequence's KV.
  int64_t non_kv = 0, sequence = 0;
  {
    CpuDevice device{CpuDeviceOptions{}};
    auto probe = ModelRunner::Create(
        device, *dir, SmallOptions(R"({"cudagraph_mode":"NONE"})"));
    ASSERT_TRUE(probe.ok()) << probe.status();
    non_kv = static_cast<int64_t>(device.GetMemoryStats()->used_bytes) -
             (*probe)->kv_cache_bytes();
    sequence = (*probe)->kv_cache_bytes() /
               (*probe)->kv_cache().Stats().total_blocks *
               (*probe)->kv_cache().max_blocks_per_seq();
  }
  ASSERT_GT(non_kv, 0);
  ASSERT_GT(sequence, 0);
  // The whole device (fraction 1) leaves half a sequence.
  CpuDeviceOptions device_options;
  device_options.capacity_bytes = static_cast<size_t>(non_kv + sequence / 2);
  CpuDevice device(device_options);
  ModelRunnerOptions o = SmallOptions(R"({"cudagraph_mode":"NONE"})");
  o.kv_cache_bytes = 0;
  o.gpu_memory_utilization = 1.0;
  auto refused = ModelRunner::Create(device, *dir, o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(),
              HasSubstr(absl::StrCat("max_model_len=", o.max_model_len)));
  EXPECT_THAT(refused.status().message(), HasSubstr("--max_model_len"));
  EXPECT_THAT(refused.status().message(),
              HasSubstr("--gpu_memory_utilization"));
  EXPECT_EQ(device.GetMemoryStats()->used_bytes, 0u);

  // One and a half sequences' worth: the KV cache takes it all (less the
  // arena's alignment).
  device_options.capacity_bytes =
      static_cast<size_t>(non_kv + sequence * 3 / 2);
  CpuDevice roomier(device_options);
  auto fits = ModelRunner::Create(roomier, *dir, o);
  ASSERT_TRUE(fits.ok()) << fits.status();
  const int32_t per_sequence = (*fits)->kv_cache().max_blocks_per_seq();
  EXPECT_GT((*fits)->kv_cache().Stats().total_blocks, per_sequence);
  EXPECT_LE((*fits)->kv_cache().Stats().total_blocks, per_sequence * 3 / 2);
}

}  // namespace
}  // namespace pdworker
