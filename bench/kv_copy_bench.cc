// The device-to-device KV copy of a CUDA IPC import (issue 24 item 1): one
// prompt's K and V of every layer copied between two paged caches on one
// GPU (what ImportKv does once the source's cache is mapped), the per-block
// copies (one cudaMemcpyAsync per block, layer and part) against the batched
// kernel (one launch). Llama-3.2-1B's KV: 16 layers × 8 kv heads × 64 dims
// bf16 = 1 KiB per token, layer and part; blocks of 16 in random order.
// Time: wall clock of CopyKvTokens + Synchronize, median of --reps; GB/s
// counts the bytes moved once (BytesFor).
//
//   bazel build --config=opt //bench:kv_copy_bench
//   bazel-bin/bench/kv_copy_bench [--tokens=16,...] [--jsonl=FILE
//       --commit=SHA]
// Without a usable GPU it prints why and exits 0.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "bench/gpu_bench_util.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"
#include "worker/runner/kv_cache_view.h"
#include "worker/runtime/device_factory.h"
#include "worker/runtime/stream.h"

ABSL_FLAG(std::vector<std::string>, tokens,
          (std::vector<std::string>{"16", "256", "1024", "2048", "8192"}),
          "Prompt lengths (tokens).");
ABSL_FLAG(int, reps, 20, "Timed copies per measurement (median).");
ABSL_FLAG(std::string, jsonl, "", "Append gpu.jsonl records to this file.");
ABSL_FLAG(std::string, commit, "", "Commit the binary was built from.");

namespace pdworker {
namespace {

constexpr int kLayers = 16, kBlockSize = 16, kMaxTokens = 8192;
constexpr size_t kTokenBytes = 8 * 64 * 2;

struct Cache {
  DeviceMemory memory;
  KvCacheView view;
};

Cache MakeCache(Device& device, int num_blocks) {
  Cache c;
  const size_t part =
      static_cast<size_t>(num_blocks) * kBlockSize * kTokenBytes;
  auto memory = device.Allocate(part * 2 * kLayers);
  CHECK(memory.ok()) << memory.status();
  c.memory = *std::move(memory);
  c.view.layout = {kLayers, 8, 64, "bfloat16"};
  c.view.block_size = kBlockSize;
  c.view.token_bytes = kTokenBytes;
  c.view.allocation = c.memory.buffer();
  for (int l = 0; l < kLayers; ++l) {
    c.view.keys.push_back(c.memory.buffer().Slice(2 * l * part, part));
    c.view.values.push_back(c.memory.buffer().Slice((2 * l + 1) * part, part));
  }
  return c;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  std::optional<BenchGpu> bench_gpu = OpenBenchGpu("kv_copy_bench");
  if (!bench_gpu) return 0;
  Device& device = *bench_gpu->device;
  Stream& stream = *bench_gpu->stream;
  const int blocks = 2 * kMaxTokens / kBlockSize;
  Cache src = MakeCache(device, blocks);
  Cache dst = MakeCache(device, blocks);
  std::mt19937 rng(5);
  std::vector<int32_t> ids(blocks);
  std::iota(ids.begin(), ids.end(), 0);
  const int reps = absl::GetFlag(FLAGS_reps);
  const std::string gpu = device.name();
  std::printf(
      "device: %s; 16 layers x 1 KiB per token and part, blocks of 16 in "
      "random order, median of %d\n\n| tokens | MiB | per-block copies ms | "
      "GB/s | batched kernel ms | GB/s | speed-up |\n| ---: | ---: | ---: | "
      "---: | ---: | ---: | ---: |\n",
      gpu.c_str(), reps);
  std::vector<nlohmann::json> records;
  for (const std::string& text : absl::GetFlag(FLAGS_tokens)) {
    int n = 0;
    CHECK(absl::SimpleAtoi(text, &n) && n > 0 && n <= kMaxTokens) << text;
    const int seq_blocks = (n + kBlockSize - 1) / kBlockSize;
    SequenceKv from, to;
    from.num_tokens = to.num_tokens = n;
    std::shuffle(ids.begin(), ids.end(), rng);
    from.blocks.assign(ids.begin(), ids.begin() + seq_blocks);
    std::shuffle(ids.begin(), ids.end(), rng);
    to.blocks.assign(ids.begin(), ids.begin() + seq_blocks);
    auto time_ms = [&](KvCopyMethod method) {
      std::vector<double> times;
      for (int rep = 0; rep < reps + 2; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        CHECK(
            CopyKvTokens(stream, src.view, from, dst.view, to, n, method).ok());
        CHECK(stream.Synchronize().ok());
        const auto t1 = std::chrono::steady_clock::now();
        if (rep >= 2) {
          times.push_back(
              std::chrono::duration<double, std::milli>(t1 - t0).count());
        }
      }
      return Median(times);
    };
    const double per_block = time_ms(KvCopyMethod::kPerBlock);
    const double batched = time_ms(KvCopyMethod::kAuto);
    const double bytes = static_cast<double>(src.view.BytesFor(n));
    std::printf("| %d | %.1f | %.3f | %.1f | %.3f | %.1f | %.1fx |\n", n,
                bytes / (1 << 20), per_block, bytes / per_block / 1e6, batched,
                bytes / batched / 1e6, per_block / batched);
    for (const auto& [system, ms] :
         {std::pair<const char*, double>{"pdworker_per_block", per_block},
          {"pdworker_batched", batched}}) {
      records.push_back({{"metric", "kv_copy_ms"},
                         {"shape", "llama_1b"},
                         {"system", system},
                         {"batch", 1},
                         {"tokens", n},
                         {"context", n},
                         {"value", ms}});
    }
  }
  const std::string path = absl::GetFlag(FLAGS_jsonl);
  if (!path.empty()) {
    AppendGpuRecords(path, gpu, absl::GetFlag(FLAGS_commit),
                     std::move(records));
  }
  return 0;
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) { return pdworker::Main(argc, argv); }
