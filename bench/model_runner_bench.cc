// CPU step time of the model runner per CUDA graph mode, side by side in one
// run: decode batches of 1/8/32 sequences and prefills of 16/128/512 tokens
// on the `small` tiny config (hidden 256, 4 layers, 3.8M parameters), plus
// what capture cost and the arenas' sizes. Prints Markdown for RESULTS.md.
//
//   bazel build --config=opt //bench:model_runner_bench
//   bazel-bin/bench/model_runner_bench [--reps=N]
//
// On the CPU backend a "graph" replays recorded op closures, so it saves only
// per-op launch overhead (~25 ns/op, bench/graph_replay_bench); for compute-
// bound steps graph and eager must come out nearly equal. The absolute step
// times are this machine's and are not GPU figures.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/cpu_device.h"

ABSL_FLAG(int, reps, 7, "Timed repetitions per measurement (median reported).");
ABSL_FLAG(std::string, model_dir, "/tmp/pdworker_bench_small",
          "Where the small model is written.");

namespace pdworker {
namespace {

constexpr const char* kModes[] = {"NONE", "PIECEWISE", "FULL",
                                  "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"};
constexpr int kDecodeBatches[] = {1, 8, 32};
constexpr int kPrefillLengths[] = {16, 128, 512};
constexpr int kDecodeContext = 16;  // prompt tokens before timed decodes

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct ModeResult {
  std::map<int, double> decode_ms;   // batch -> median step ms
  std::map<int, double> prefill_ms;  // length -> median step ms
  std::map<int, std::string> decode_mode, prefill_mode;  // what ran
  double capture_seconds = 0;
  int graphs = 0;
  size_t activation_bytes = 0, kv_bytes = 0;
};

std::unique_ptr<ModelRunner> MakeRunner(Device& device, const std::string& dir,
                                        const char* mode) {
  ModelRunnerOptions o;
  o.role = Role::kBoth;
  o.max_num_seqs = 32;
  o.max_num_batched_tokens = 512;
  o.max_model_len = 512;
  o.kv_cache_bytes = int64_t{64} << 20;
  o.block_size = 16;
  auto config = ParseCompilationConfig(absl::StrCat(
      R"({"cudagraph_mode":")", mode,
      R"(","cudagraph_capture_sizes":[1,2,4,8,16,24,32,48,64,96,128,192,256,384,512]})"));
  CHECK(config.ok()) << config.status();
  o.compilation = *config;
  auto runner = ModelRunner::Create(device, dir, o);
  CHECK(runner.ok()) << runner.status();
  return std::move(*runner);
}

double TimeStep(ModelRunner& r, const std::vector<SequenceStep>& batch,
                std::string* mode) {
  const auto t0 = std::chrono::steady_clock::now();
  auto result = r.Execute(batch);
  const auto t1 = std::chrono::steady_clock::now();
  CHECK(result.ok()) << result.status();
  *mode = std::string(RuntimeModeName(result->info.mode));
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}

ModeResult Measure(const std::string& dir, const char* mode, int reps) {
  CpuDevice device;
  std::unique_ptr<ModelRunner> r = MakeRunner(device, dir, mode);
  ModeResult out;
  auto capture = r->CaptureGraphs();
  CHECK(capture.ok()) << capture.status();
  out.capture_seconds = capture->total_seconds;
  out.graphs = r->NumCapturedGraphs();
  out.activation_bytes = r->forward().activation_bytes();
  out.kv_bytes = r->forward().kv_cache_bytes();

  int next_id = 0;
  for (int batch : kDecodeBatches) {
    // Prefill `batch` sequences (untimed), then time decode steps; the
    // context grows by one token per step, from kDecodeContext on.
    std::vector<std::string> ids;
    std::vector<SequenceStep> prefill;
    for (int s = 0; s < batch; ++s) {
      ids.push_back(absl::StrCat("d", next_id++));
      std::vector<int32_t> prompt(kDecodeContext);
      for (int i = 0; i < kDecodeContext; ++i) prompt[i] = (s * 31 + i) % 2000;
      prefill.push_back(MakeSequenceStep(ids.back(), std::move(prompt),
                                         SequenceCreation::kMustBeNew));
    }
    std::string ran;
    TimeStep(*r, prefill, &ran);
    std::vector<double> times;
    for (int rep = 0; rep < reps + 1; ++rep) {  // +1: first is warm-up
      std::vector<SequenceStep> step;
      for (const auto& id : ids) {
        step.push_back(
            MakeSequenceStep(id, {rep + 1}, SequenceCreation::kMustExist));
      }
      const double ms = TimeStep(*r, step, &ran);
      if (rep > 0) times.push_back(ms);
    }
    out.decode_ms[batch] = Median(times);
    out.decode_mode[batch] = ran;
    for (const auto& id : ids) CHECK(r->Release(id).ok());
  }
  for (int len : kPrefillLengths) {
    std::vector<double> times;
    std::string ran;
    for (int rep = 0; rep < reps + 1; ++rep) {
      const std::string id = absl::StrCat("p", next_id++);
      std::vector<int32_t> prompt(len);
      for (int i = 0; i < len; ++i) prompt[i] = (i * 7 + rep) % 2000;
      const double ms =
          TimeStep(*r,
                   {MakeSequenceStep(id, std::move(prompt),
                                     SequenceCreation::kMustBeNew)},
                   &ran);
      if (rep > 0) times.push_back(ms);
      CHECK(r->Release(id).ok());
    }
    out.prefill_ms[len] = Median(times);
    out.prefill_mode[len] = ran;
  }
  return out;
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  FLAGS_minloglevel = 1;
  const std::string dir = absl::GetFlag(FLAGS_model_dir);
  TinyModelOptions model;
  model.shape = TinyShape::kSmall;
  CHECK(WriteTinyModel(model, dir).ok());
  const int reps = absl::GetFlag(FLAGS_reps);

  std::map<std::string, ModeResult> results;
  for (const char* mode : kModes) results[mode] = Measure(dir, mode, reps);
  const ModeResult& eager = results["NONE"];

  std::printf(
      "| mode | step | ran as | median ms | eager ms | eager / mode |\n"
      "| --- | --- | --- | ---: | ---: | ---: |\n");
  for (const char* mode : kModes) {
    const ModeResult& m = results[mode];
    for (int b : kDecodeBatches) {
      std::printf("| %s | decode x%d | %s | %.3f | %.3f | %.2f |\n", mode, b,
                  m.decode_mode.at(b).c_str(), m.decode_ms.at(b),
                  eager.decode_ms.at(b),
                  eager.decode_ms.at(b) / m.decode_ms.at(b));
    }
    for (int l : kPrefillLengths) {
      std::printf("| %s | prefill %d | %s | %.3f | %.3f | %.2f |\n", mode, l,
                  m.prefill_mode.at(l).c_str(), m.prefill_ms.at(l),
                  eager.prefill_ms.at(l),
                  eager.prefill_ms.at(l) / m.prefill_ms.at(l));
    }
  }
  std::printf(
      "\n| mode | graphs | capture s | activation arena bytes | KV cache bytes "
      "|\n| --- | ---: | ---: | ---: | ---: |\n");
  for (const char* mode : kModes) {
    const ModeResult& m = results[mode];
    std::printf("| %s | %d | %.3f | %zu | %zu |\n", mode, m.graphs,
                m.capture_seconds, m.activation_bytes, m.kv_bytes);
  }
  return 0;
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) { return pdworker::Main(argc, argv); }
