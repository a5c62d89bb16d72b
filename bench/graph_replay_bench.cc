// Eager launches vs one graph replay for chains of small ops, per backend.
//
// Each iteration runs a chain of N axpy ops (y = a * x + y) and waits for it:
// eager launches them one by one through Stream::Launch; replay launches the
// chain captured once. CPU: 16 floats per op (pure launch overhead). CUDA:
// tiny kernels of 256 floats; skipped without a GPU. At the end the binary
// prints eager/replay ratios from the same run.
//
//   bazel run -c opt //bench:graph_replay_bench
#include <unistd.h>

#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "benchmark/benchmark.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/device_factory.h"
#include "worker/runtime/stream.h"
#include "worker/runtime/testing/test_ops.h"

namespace pdworker {
namespace {

enum class Execution { kEager, kReplay };

// Device, stream and two static buffers; `error` is set when unavailable.
struct BenchEnv {
  std::unique_ptr<Device> device;
  std::unique_ptr<Arena> arena;
  std::unique_ptr<Stream> stream;
  DeviceBuffer x, y;
  std::string error;
};

BenchEnv MakeEnv(DeviceKind kind) {
  BenchEnv env;
  absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice(kind);
  if (!device.ok()) {
    env.error = absl::StrCat("no ", DeviceKindName(kind),
                             " device: ", device.status().message());
    return env;
  }
  env.device = *std::move(device);
  absl::StatusOr<std::unique_ptr<Stream>> stream = env.device->CreateStream();
  ArenaOptions options;
  options.capacity_bytes = size_t{1} << 20;
  absl::StatusOr<std::unique_ptr<Arena>> arena =
      Arena::Create(*env.device, options);
  if (!stream.ok() || !arena.ok()) {
    env.error = "stream or arena creation failed";
    return env;
  }
  env.stream = *std::move(stream);
  env.arena = *std::move(arena);
  const size_t floats = kind == DeviceKind::kCpu ? 16 : 256;
  absl::StatusOr<DeviceBuffer> x = env.arena->Allocate(floats * sizeof(float));
  absl::StatusOr<DeviceBuffer> y = env.arena->Allocate(floats * sizeof(float));
  if (!x.ok() || !y.ok()) {
    env.error = "arena allocation failed";
    return env;
  }
  env.x = *x;
  env.y = *y;
  std::vector<float> zeros(floats, 0.0f);
  if (!env.stream->CopyToDevice(env.x, zeros.data(), x->size_bytes()).ok() ||
      !env.stream->CopyToDevice(env.y, zeros.data(), y->size_bytes()).ok()) {
    env.error = "input upload failed";
  }
  return env;
}

absl::Status LaunchChain(BenchEnv& env, int num_ops) {
  for (int i = 0; i < num_ops; ++i) {
    absl::Status status = test_ops::Axpy(*env.stream, 1.0001f, env.x, env.y);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

void BM_Chain(benchmark::State& state, DeviceKind kind, Execution execution,
              int num_ops) {
  BenchEnv env = MakeEnv(kind);
  if (!env.error.empty()) {
    state.SkipWithError(env.error.c_str());
    return;
  }
  std::unique_ptr<CapturedGraph> graph;
  if (execution == Execution::kReplay) {
    absl::Status status = env.stream->BeginCapture();
    if (status.ok()) status = LaunchChain(env, num_ops);
    absl::StatusOr<std::unique_ptr<CapturedGraph>> captured =
        env.stream->EndCapture();
    if (status.ok()) status = captured.status();
    if (!status.ok()) {
      state.SkipWithError(std::string(status.message()).c_str());
      return;
    }
    graph = *std::move(captured);
  }
  for (auto _ : state) {
    absl::Status status = execution == Execution::kEager
                              ? LaunchChain(env, num_ops)
                              : graph->Replay();
    if (status.ok()) status = env.stream->Synchronize();
    if (!status.ok()) {
      state.SkipWithError(std::string(status.message()).c_str());
      break;
    }
  }
  state.SetItemsProcessed(state.iterations() * num_ops);
}

// Console output plus, at the end, eager/replay per (backend, chain length).
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  RatioReporter()
      : ConsoleReporter(isatty(fileno(stdout)) ? OO_Defaults : OO_Tabular) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      // One figure per repetition set: the run itself, or with
      // --benchmark_repetitions the "mean" aggregate.
      const bool single =
          run.run_type == Run::RT_Iteration && run.repetitions <= 1;
      const bool mean =
          run.run_type == Run::RT_Aggregate && run.aggregate_name == "mean";
      if (run.error_occurred || !(single || mean)) continue;
      // Names are "<backend>/<eager|replay>/<num_ops>".
      std::vector<std::string> parts =
          absl::StrSplit(run.benchmark_name(), '/');
      if (parts.size() < 3) continue;
      Times& times = times_[{parts[0], std::stoi(parts[2])}];
      if (parts[1] == "eager") {
        times.eager_sum += run.GetAdjustedRealTime();
        ++times.eager_runs;
      } else {
        times.replay_sum += run.GetAdjustedRealTime();
        ++times.replay_runs;
      }
    }
  }

  void PrintRatios() const {
    std::printf("\n%-8s %8s %14s %14s %14s\n", "backend", "ops", "eager (ns)",
                "replay (ns)", "eager/replay");
    for (const auto& [key, times] : times_) {
      if (times.eager_runs == 0 || times.replay_runs == 0) continue;
      const double eager = times.eager_sum / times.eager_runs;
      const double replay = times.replay_sum / times.replay_runs;
      std::printf("%-8s %8d %14.0f %14.0f %14.2f\n", key.first.c_str(),
                  key.second, eager, replay, eager / replay);
    }
  }

 private:
  struct Times {
    double eager_sum = 0;
    double replay_sum = 0;
    int eager_runs = 0;
    int replay_runs = 0;
  };
  std::map<std::pair<std::string, int>, Times> times_;
};

void RegisterAll() {
  const std::vector<std::pair<DeviceKind, std::vector<int>>> plans = {
      {DeviceKind::kCpu, {10, 100, 1000}},
      {DeviceKind::kCuda, {100, 1000}},
  };
  for (const auto& [kind, lengths] : plans) {
    for (int num_ops : lengths) {
      for (Execution execution : {Execution::kEager, Execution::kReplay}) {
        const std::string name = absl::StrCat(
            DeviceKindName(kind), "/",
            execution == Execution::kEager ? "eager" : "replay", "/", num_ops);
        benchmark::RegisterBenchmark(name.c_str(), BM_Chain, kind, execution,
                                     num_ops)
            ->UseRealTime()
            ->Unit(benchmark::kNanosecond);
      }
    }
  }
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  pdworker::RegisterAll();
  pdworker::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintRatios();
  benchmark::Shutdown();
  return 0;
}
