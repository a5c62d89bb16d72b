// What the KV cache gets when --kv_cache_bytes is not set: vLLM's
// --gpu_memory_utilization. The worker may use that fraction of the
// device's memory for everything it holds (weights, step buffers,
// activations, graphs and the KV cache); the KV cache gets what the rest
// leaves, measured once the weights and step buffers are allocated.
//
// CUDA: "used" is the whole device's (cudaMemGetInfo: this process's CUDA
// context, libraries and anything other processes hold), as vLLM counts
// memory it does not own against the budget. Graphs are captured after the
// KV cache exists, so they get a fixed reserve (kCudaGraphReserveBytes);
// CaptureGraphs logs what they really took.
// CPU: the budget applies to the host memory available to the worker at
// startup (MemAvailable plus what the worker already holds, at most the
// CPU device's capacity), so a default worker never asks for memory the
// host does not have; graphs there are host structures (no reserve).
#ifndef PDWORKER_WORKER_RUNNER_KV_CACHE_BUDGET_H_
#define PDWORKER_WORKER_RUNNER_KV_CACHE_BUDGET_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "worker/runtime/device.h"

namespace pdworker {

inline constexpr double kDefaultGpuMemoryUtilization = 0.9;
// Device memory kept for the CUDA graphs captured after the KV cache is
// allocated: every buffer a graph touches is a static arena of ours, so a
// graph holds only its nodes (tens of KiB each; a few hundred graphs).
inline constexpr int64_t kCudaGraphReserveBytes = int64_t{256} << 20;

struct KvCacheBudgetParams {
  DeviceKind device_kind = DeviceKind::kCpu;
  double memory_utilization = kDefaultGpuMemoryUtilization;  // (0, 1]
  // The device's memory once weights and step buffers are allocated.
  MemoryStats memory;
  // CPU only: the host's MemAvailable (bytes) at that point; < 0: unknown
  // (the device's capacity is the total then).
  int64_t host_available_bytes = -1;
  int64_t activation_bytes = 0;  // allocated with the KV cache, next
};

struct KvCacheBudget {
  int64_t total_bytes = 0;  // the memory the utilization applies to
  int64_t limit_bytes = 0;  // utilization x total
  int64_t used_bytes = 0;   // held before the KV cache and activations
  int64_t activation_bytes = 0;
  int64_t graph_reserve_bytes = 0;
  int64_t kv_cache_bytes = 0;  // what is left: > 0

  // "limit 21.6 GiB (0.90 of 24.0 GiB): weights and buffers 4.6 GiB,
  // activations 0.1 GiB, graphs 0.0 GiB, KV cache 16.9 GiB"
  std::string ToString(double memory_utilization) const;
};

// INVALID_ARGUMENT for a utilization outside (0, 1]; RESOURCE_EXHAUSTED
// naming the figures and the flags to change when nothing is left for the
// KV cache.
absl::StatusOr<KvCacheBudget> ComputeKvCacheBudget(
    const KvCacheBudgetParams& params);

// Host memory the worker may still take, in bytes: /proc/meminfo's
// MemAvailable, and in a container with a memory limit (cgroup v2
// memory.max, as Kubernetes sets from resources.limits.memory) at most
// the limit less memory.current: MemAvailable is the node's. -1 when
// neither is readable.
int64_t HostMemAvailableBytes();
// The same from the three files' contents ("" for a missing file).
int64_t HostMemAvailableBytes(const std::string& meminfo,
                              const std::string& cgroup_max,
                              const std::string& cgroup_current);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNNER_KV_CACHE_BUDGET_H_
