// What the weights digest of the model fingerprint costs: the SHA-256 tree
// over every tensor byte (WeightsDigest, on every hardware thread) vs
// reading the same tensors to float32 (what the CPU backend's load does), in
// seconds per GB, on the llama_1b shape in bf16 (2.47 GB, written once) or
// any checkpoint given. bench/load_time_bench times the whole load.
//
//   bazel build --config=opt //bench:weights_digest_bench
//   bazel-bin/bench/weights_digest_bench [--model_dir=DIR] [--reps=N]
//
// Runs with the page cache warm (one untimed pass first) and the checkpoint
// mapped once.
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "glog/logging.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/model/checkpoint.h"
#include "worker/model/model_fingerprint.h"
#include "worker/model/safetensors.h"

ABSL_FLAG(std::string, model_dir, "/tmp/pdworker_bench_llama_1b_bf16",
          "Checkpoint to hash; the llama_1b shape in bf16 is written there "
          "first when it holds no config.json.");
ABSL_FLAG(int, reps, 3, "Timed repetitions (the fastest is reported).");

namespace pdworker {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since)
      .count();
}

int Main() {
  const std::string dir = absl::GetFlag(FLAGS_model_dir);
  struct stat info {};
  if (::stat((dir + "/config.json").c_str(), &info) != 0) {
    TinyModelOptions options;
    options.shape = TinyShape::kLlama1B;
    options.dtype = DType::kBFloat16;
    const absl::Status written = WriteTinyModel(options, dir);
    CHECK(written.ok()) << written;
  }
  const auto opened = Checkpoint::Open(dir);
  CHECK(opened.ok()) << opened.status();
  const Checkpoint& checkpoint = **opened;
  size_t bytes = 0;
  size_t largest = 0;
  for (const std::string& name : checkpoint.TensorNames()) {
    const TensorInfo& t = *checkpoint.Find(name);
    bytes += t.bytes.size();
    largest = std::max(largest, static_cast<size_t>(t.NumElements()));
  }
  const double gb = static_cast<double>(bytes) / 1e9;

  // Float32 conversion into one reused buffer: the load's read of every
  // tensor without its allocations.
  std::vector<float> scratch(largest);
  auto convert_all = [&] {
    for (const std::string& name : checkpoint.TensorNames()) {
      const TensorInfo& t = *checkpoint.Find(name);
      ConvertToFloat32(t.dtype, t.bytes.data(), t.NumElements(),
                       scratch.data());
    }
  };
  std::string digest;
  auto hash_all = [&] {
    const auto d = WeightsDigest(checkpoint);
    CHECK(d.ok()) << d.status();
    digest = *d;
  };

  convert_all();  // warms the page cache and the mapping
  double hash_s = 1e30, convert_s = 1e30;
  for (int i = 0; i < absl::GetFlag(FLAGS_reps); ++i) {
    auto start = std::chrono::steady_clock::now();
    hash_all();
    hash_s = std::min(hash_s, Seconds(start));
    start = std::chrono::steady_clock::now();
    convert_all();
    convert_s = std::min(convert_s, Seconds(start));
  }
  std::printf("checkpoint %s: %zu tensors, %.3f GB\n", dir.c_str(),
              checkpoint.TensorNames().size(), gb);
  std::printf("weights digest %s\n", digest.c_str());
  std::printf("| what | seconds | s/GB | GB/s |\n| --- | --- | --- | --- |\n");
  std::printf(
      "| SHA-256 tree of every tensor (WeightsDigest) | %.3f | %.3f | %.2f |\n",
      hash_s, hash_s / gb, gb / hash_s);
  std::printf("| every tensor to float32 (CPU load) | %.3f | %.3f | %.2f |\n",
              convert_s, convert_s / gb, gb / convert_s);
  return 0;
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pdworker::Main();
}
