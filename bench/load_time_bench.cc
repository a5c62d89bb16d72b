// What loading a checkpoint costs next to reading its files: in one run,
// `cat <files> > /dev/null` (the real cat, page cache warm) against the
// worker's load as ModelRunner::Create does it (Checkpoint::Open's fresh
// mapping, LoadLlamaWeights into the device's weights arena, WeightsDigest
// and ModelFingerprint), plus the digest alone on 1 thread and on all of
// them. Writes the llama_1b shape with random weights first (float32 by
// default: 4.95 GB, which fits this machine's page cache beside the loaded
// copy).
//
//   bazel build --config=opt //bench:load_time_bench
//   bazel-bin/bench/load_time_bench [--model_dir=DIR] [--dtype=F32|BF16]
//       [--reps=N] [--device=cpu|cuda]
//
// Prints one Markdown table (median and best of the reps, in seconds, and
// each figure over cat's median).
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "glog/logging.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/kernels/kernel_checks.h"
#include "worker/model/checkpoint.h"
#include "worker/model/llama_weights.h"
#include "worker/model/model_config.h"
#include "worker/model/model_fingerprint.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/device_factory.h"

ABSL_FLAG(std::string, model_dir, "",
          "Checkpoint to load; empty: /tmp/pdworker_bench_load_llama_1b_<dtype>"
          ", written first when it holds no config.json.");
ABSL_FLAG(std::string, dtype, "F32",
          "Storage dtype of the checkpoint written (F32 or BF16).");
ABSL_FLAG(int, reps, 3, "Timed repetitions of each measurement.");
ABSL_FLAG(std::string, device, "cpu",
          "Backend the weights load into (cpu or cuda), as --device.");

namespace pdworker {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct Timing {
  std::string what;
  std::vector<double> seconds;
  double Median() const {
    std::vector<double> s = seconds;
    std::sort(s.begin(), s.end());
    return s[s.size() / 2];
  }
  double Best() const {
    return *std::min_element(seconds.begin(), seconds.end());
  }
};

// The checkpoint's .safetensors files, sorted, as shell-quoted paths.
std::vector<std::string> SafetensorsFiles(const std::string& dir,
                                          size_t* total_bytes) {
  std::vector<std::string> files;
  *total_bytes = 0;
  DIR* d = opendir(dir.c_str());
  CHECK(d != nullptr) << dir;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() > 12 &&
        name.compare(name.size() - 12, 12, ".safetensors") == 0) {
      files.push_back(absl::StrCat(dir, "/", name));
    }
  }
  closedir(d);
  std::sort(files.begin(), files.end());
  for (const std::string& f : files) {
    struct stat st {};
    CHECK_EQ(::stat(f.c_str(), &st), 0) << f;
    *total_bytes += static_cast<size_t>(st.st_size);
  }
  return files;
}

int Main() {
  const absl::StatusOr<DType> dtype =
      ParseSafetensorsDType(absl::GetFlag(FLAGS_dtype));
  CHECK(dtype.ok()) << dtype.status();
  std::string dir = absl::GetFlag(FLAGS_model_dir);
  if (dir.empty()) {
    dir = absl::StrCat("/tmp/pdworker_bench_load_llama_1b_",
                       SafetensorsDTypeName(*dtype));
  }
  struct stat info {};
  if (::stat((dir + "/config.json").c_str(), &info) != 0) {
    TinyModelOptions options;
    options.shape = TinyShape::kLlama1B;
    options.dtype = *dtype;
    const auto start = Clock::now();
    const absl::Status written = WriteTinyModel(options, dir);
    CHECK(written.ok()) << written;
    std::printf("wrote %s in %.1f s\n", dir.c_str(), SecondsSince(start));
  }
  size_t file_bytes = 0;
  const std::vector<std::string> files = SafetensorsFiles(dir, &file_bytes);
  CHECK(!files.empty()) << "no .safetensors in " << dir;
  const std::string cat =
      absl::StrCat("cat '", absl::StrJoin(files, "' '"), "' > /dev/null");

  const absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  CHECK(config.ok()) << config.status();
  DeviceOptions device_options;
  // As the worker's default --cpu_stream=threaded.
  device_options.cpu.stream_execution = CpuStreamExecution::kThreaded;
  const std::string device_name = absl::GetFlag(FLAGS_device);
  CHECK(device_name == "cpu" || device_name == "cuda") << device_name;
  auto device =
      CreateDevice(device_name == "cpu" ? DeviceKind::kCpu : DeviceKind::kCuda,
                   device_options);
  CHECK(device.ok()) << device.status();
  auto stream = (*device)->CreateStream();
  CHECK(stream.ok()) << stream.status();

  const int hardware_threads =
      static_cast<int>(std::thread::hardware_concurrency());
  Timing cat_time{"`" + std::string("cat files > /dev/null") + "`", {}};
  Timing open_load{"Checkpoint::Open + LoadLlamaWeights", {}};
  Timing digest_in_load{absl::StrCat("WeightsDigest after the load (",
                                     hardware_threads, " threads)"),
                        {}};
  Timing load_total{"the load: open + weights + digest + fingerprint", {}};
  Timing overlapped{
      "the load with the digest on other threads at once (same result)", {}};
  Timing arena_alone{
      "the weights arena alone (Arena::Create: the device's first touch of "
      "fresh memory, the floor of any load into it)",
      {}};
  Timing digest_1{"WeightsDigest alone, 1 thread (fresh mapping)", {}};
  Timing digest_n{absl::StrCat("WeightsDigest alone, ", hardware_threads,
                               " threads (fresh mapping)"),
                  {}};
  std::string fingerprint;

  const auto run_cat = [&] {
    const auto start = Clock::now();
    CHECK_EQ(std::system(cat.c_str()), 0) << cat;
    return SecondsSince(start);
  };
  const auto digest_alone = [&](int threads) {
    const auto start = Clock::now();
    auto checkpoint = Checkpoint::Open(dir);
    CHECK(checkpoint.ok()) << checkpoint.status();
    const auto digest = WeightsDigest(**checkpoint, threads);
    CHECK(digest.ok()) << digest.status();
    return SecondsSince(start);
  };

  run_cat();  // the page cache holds every file from here on
  for (int rep = 0; rep < absl::GetFlag(FLAGS_reps); ++rep) {
    cat_time.seconds.push_back(run_cat());
    {
      // ModelRunner::Create's order: open, load, digest, fingerprint.
      const auto start = Clock::now();
      auto checkpoint = Checkpoint::Open(dir);
      CHECK(checkpoint.ok()) << checkpoint.status();
      auto weights =
          LoadLlamaWeights(*config, **checkpoint, **device, **stream);
      CHECK(weights.ok()) << weights.status();
      open_load.seconds.push_back(SecondsSince(start));
      const auto digest_start = Clock::now();
      const auto digest = WeightsDigest(**checkpoint);
      CHECK(digest.ok()) << digest.status();
      const auto model = ModelFingerprint(*config, *digest);
      CHECK(model.ok()) << model.status();
      digest_in_load.seconds.push_back(SecondsSince(digest_start));
      load_total.seconds.push_back(SecondsSince(start));
      fingerprint = *model;
    }  // the weights are freed before the next measurement
    {
      // The digest on its own threads while the weights load: both only
      // read the mapping.
      const auto start = Clock::now();
      auto checkpoint = Checkpoint::Open(dir);
      CHECK(checkpoint.ok()) << checkpoint.status();
      absl::StatusOr<std::string> digest;
      std::thread hasher([&] { digest = WeightsDigest(**checkpoint); });
      auto weights =
          LoadLlamaWeights(*config, **checkpoint, **device, **stream);
      hasher.join();
      CHECK(weights.ok()) << weights.status();
      CHECK(digest.ok()) << digest.status();
      const auto model = ModelFingerprint(*config, *digest);
      CHECK(model.ok()) << model.status();
      CHECK_EQ(*model, fingerprint);
      overlapped.seconds.push_back(SecondsSince(start));
    }
    {
      const auto start = Clock::now();
      auto arena = Arena::Create(
          **device,
          {LlamaWeightBytes(*config, kernels::ModelDTypeFor((*device)->kind())),
           256, "weights"});
      CHECK(arena.ok()) << arena.status();
      arena_alone.seconds.push_back(SecondsSince(start));
    }
    digest_1.seconds.push_back(digest_alone(1));
    digest_n.seconds.push_back(digest_alone(0));
  }

  std::printf("checkpoint %s: %zu file(s), %.3f GB (%s), device %s\n",
              dir.c_str(), files.size(), static_cast<double>(file_bytes) / 1e9,
              std::string(SafetensorsDTypeName(*dtype)).c_str(),
              (*device)->name().c_str());
  std::printf("model fingerprint %s\n", fingerprint.c_str());
  std::printf("%d reps\n\n", absl::GetFlag(FLAGS_reps));
  std::printf(
      "| what | median s | best s | median / cat's median |\n"
      "| --- | --- | --- | --- |\n");
  const double cat_median = cat_time.Median();
  for (const Timing* t : {&cat_time, &open_load, &digest_in_load, &load_total,
                          &overlapped, &arena_alone, &digest_1, &digest_n}) {
    std::printf("| %s | %.3f | %.3f | %.2fx |\n", t->what.c_str(), t->Median(),
                t->Best(), t->Median() / cat_median);
  }
  return 0;
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pdworker::Main();
}
