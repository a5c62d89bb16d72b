// What the GPU benchmarks share: timing a kernel from a replayed graph of
// back-to-back launches, and appending records to bench/results/gpu.jsonl
// (DESIGN.md, "GPU results").
#ifndef PDWORKER_BENCH_GPU_BENCH_UTIL_H_
#define PDWORKER_BENCH_GPU_BENCH_UTIL_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "nlohmann/json.hpp"
#include "worker/runtime/device.h"
#include "worker/runtime/stream.h"

namespace pdworker {

// A benchmark's GPU and its stream (the stream is destroyed first).
struct BenchGpu {
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
};

// The CUDA device and a stream on it, or nullopt after printing
// "<bench>: skipped (why the CUDA device is unusable)": the GPU benchmarks exit
// 0 without a GPU, so CI can build and run them anywhere.
std::optional<BenchGpu> OpenBenchGpu(const std::string& bench);

// Microseconds per launch of `launch` (which enqueues one op on `stream`):
// one warm-up launch, a graph of `launches` launches captured and replayed
// once untimed, then the median of 5 event-timed replays / launches. No
// launch overhead is in the figure. CHECK-fails on any error.
double GraphReplayMicros(Device& device, Stream& stream,
                         const std::function<absl::Status()>& launch,
                         int launches);

// Appends each record to `path` as one JSON line, adding today's UTC date,
// `gpu` and `commit` (the fields a run's records share).
void AppendGpuRecords(const std::string& path, const std::string& gpu,
                      const std::string& commit,
                      std::vector<nlohmann::json> records);

}  // namespace pdworker

#endif  // PDWORKER_BENCH_GPU_BENCH_UTIL_H_
