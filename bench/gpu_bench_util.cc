#include "bench/gpu_bench_util.h"

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <utility>

#include "glog/logging.h"
#include "worker/runtime/device_factory.h"
#include "worker/runtime/event.h"

namespace pdworker {

std::optional<BenchGpu> OpenBenchGpu(const std::string& bench) {
  auto device = CreateDevice(DeviceKind::kCuda);
  if (!device.ok()) {
    std::printf("%s: skipped (%s)\n", bench.c_str(),
                std::string(device.status().message()).c_str());
    return std::nullopt;
  }
  auto stream = (*device)->CreateStream();
  CHECK(stream.ok()) << stream.status();
  return BenchGpu{*std::move(device), *std::move(stream)};
}

double GraphReplayMicros(Device& device, Stream& stream,
                         const std::function<absl::Status()>& launch,
                         int launches) {
  CHECK(launch().ok());  // warm-up
  CHECK(stream.BeginCapture().ok());
  for (int i = 0; i < launches; ++i) CHECK(launch().ok());
  auto graph = stream.EndCapture();
  CHECK(graph.ok()) << graph.status();
  CHECK((*graph)->Replay().ok());  // warm-up
  auto start = device.CreateEvent();
  auto stop = device.CreateEvent();
  CHECK(start.ok() && stop.ok());
  std::vector<double> runs;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK(stream.RecordEvent(**start).ok());
    CHECK((*graph)->Replay().ok());
    CHECK(stream.RecordEvent(**stop).ok());
    auto ms = (*stop)->ElapsedMillisecondsSince(**start);
    CHECK(ms.ok()) << ms.status();
    runs.push_back(*ms * 1000.0 / launches);
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

void AppendGpuRecords(const std::string& path, const std::string& gpu,
                      const std::string& commit,
                      std::vector<nlohmann::json> records) {
  char date[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  std::ofstream out(path, std::ios::app);
  for (nlohmann::json& r : records) {
    r["date"] = date;
    r["gpu"] = gpu;
    r["commit"] = commit;
    out << r.dump() << "\n";
  }
  CHECK(out.good()) << "cannot write " << path;
}

}  // namespace pdworker
