#include "worker/runner/kv_cache_budget.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace pdworker {
namespace {

std::string GiB(int64_t bytes) {
  return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / (1 << 30));
}

}  // namespace

std::string KvCacheBudget::ToString(double memory_utilization) const {
  return absl::StrCat("limit ", GiB(limit_bytes), " (",
                      absl::StrFormat("%.2f", memory_utilization), " of ",
                      GiB(total_bytes), "): weights and buffers ",
                      GiB(used_bytes), ", activations ", GiB(activation_bytes),
                      ", graphs ", GiB(graph_reserve_bytes), ", KV cache ",
                      GiB(kv_cache_bytes));
}

absl::StatusOr<KvCacheBudget> ComputeKvCacheBudget(
    const KvCacheBudgetParams& p) {
  if (!(p.memory_utilization > 0.0 && p.memory_utilization <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu_memory_utilization must be in (0, 1], got ",
                     p.memory_utilization));
  }
  KvCacheBudget b;
  b.used_bytes = static_cast<int64_t>(p.memory.used_bytes);
  b.total_bytes = static_cast<int64_t>(p.memory.total_bytes);
  if (p.device_kind == DeviceKind::kCpu && p.host_available_bytes >= 0) {
    b.total_bytes =
        std::min(b.total_bytes, p.host_available_bytes + b.used_bytes);
  }
  b.limit_bytes = static_cast<int64_t>(p.memory_utilization *
                                       static_cast<double>(b.total_bytes));
  b.activation_bytes = p.activation_bytes;
  b.graph_reserve_bytes =
      p.device_kind == DeviceKind::kCuda ? kCudaGraphReserveBytes : 0;
  b.kv_cache_bytes =
      b.limit_bytes - b.used_bytes - b.activation_bytes - b.graph_reserve_bytes;
  if (b.kv_cache_bytes <= 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no memory is left for the KV cache: ",
        b.ToString(p.memory_utilization),
        "; raise --gpu_memory_utilization, lower --max_num_batched_tokens or "
        "--max_num_seqs (activations), or set --kv_cache_bytes"));
  }
  return b;
}

int64_t HostMemAvailableBytes(const std::string& meminfo,
                              const std::string& cgroup_max,
                              const std::string& cgroup_current) {
  int64_t available = -1;
  std::istringstream lines(meminfo);
  std::string key, unit;
  int64_t kib = 0;
  while (lines >> key >> kib >> unit) {
    if (key == "MemAvailable:") {
      available = kib * 1024;
      break;
    }
  }
  int64_t limit = 0, current = 0;
  // memory.max is "max" without a limit.
  if (absl::SimpleAtoi(absl::StripAsciiWhitespace(cgroup_max), &limit) &&
      absl::SimpleAtoi(absl::StripAsciiWhitespace(cgroup_current), &current)) {
    const int64_t left = std::max<int64_t>(0, limit - current);
    available = available < 0 ? left : std::min(available, left);
  }
  return available;
}

int64_t HostMemAvailableBytes() {
  const auto read = [](const char* path) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  return HostMemAvailableBytes(read("/proc/meminfo"),
                               read("/sys/fs/cgroup/memory.max"),
                               read("/sys/fs/cgroup/memory.current"));
}

}  // namespace pdworker
