// Prefix caching on the CPU backend, side by side in one run (issue 20):
//  1. time to first token of a 2,048-token prompt whose first 1,536 tokens
//     are cached vs the same prompt length uncached (one prefill step alone
//     on an idle runner: its step time is the TTFT);
//  2. prefill throughput with a realistic mix: 80% of the requests share a
//     1,024-token system prompt, each with its own 256-token question,
//     caching on vs off.
// Model: on the CPU the `small` tiny config (hidden 256, 4 layers) with
// 4,096 positions in fp32; on a GPU (--device=cuda) the Llama-3.2-1B shape
// in bf16 with random weights. Block size 16, eager (prefill steps of this
// size run eagerly in the PIECEWISE-for-prefill modes too). Prints Markdown
// for RESULTS.md.
//
//   bazel build --config=opt //bench:prefix_cache_bench
//   bazel-bin/bench/prefix_cache_bench [--reps=N] [--device=cuda]
//
// CPU times are this machine's, not GPU figures; the ratios are what the
// issue's goals are about (cached TTFT <= 0.35x uncached on CPU, <= 0.45x on
// a GPU with today's prefill attention).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/model/model_config.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/device_factory.h"

ABSL_FLAG(int, reps, 5, "Timed repetitions per TTFT measurement (median).");
ABSL_FLAG(int, mix_requests, 20, "Requests in the mixed-traffic run.");
ABSL_FLAG(std::string, device, "cpu",
          "cpu, or cuda (skips, exit 0, without a usable GPU).");
ABSL_FLAG(std::string, model_dir, "",
          "Where the model is written (default: /tmp/pdworker_bench_small_4k "
          "on the CPU, /tmp/pdworker_bench_llama_1b on a GPU).");

namespace pdworker {
namespace {

constexpr int kPrompt = 2048;
constexpr int kCachedPrefix = 1536;
constexpr int kSystemPrompt = 1024;
constexpr int kQuestion = 256;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Distinct token streams per seed (vocab of the small shape: 2,048).
std::vector<int32_t> Tokens(int seed, int n) {
  std::vector<int32_t> t(n);
  uint32_t x = 2654435761u * static_cast<uint32_t>(seed + 1);
  for (int i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    t[i] = static_cast<int32_t>((x >> 8) % 2048);
  }
  return t;
}

std::unique_ptr<ModelRunner> MakeRunner(Device& device, const std::string& dir,
                                        PrefixCaching caching) {
  const bool gpu = device.kind() == DeviceKind::kCuda;
  ModelRunnerOptions o;
  o.role = Role::kPrefill;
  o.max_num_seqs = 8;
  o.max_num_batched_tokens = kPrompt;
  o.max_model_len = kPrompt;
  // A 2,048-token sequence: 2 MiB (small, fp32) or 64 MiB (1B, bf16).
  o.kv_cache_bytes = gpu ? int64_t{2} << 30 : int64_t{256} << 20;
  o.block_size = 16;
  o.prefix_caching = caching;
  auto config = ParseCompilationConfig(R"({"cudagraph_mode":"NONE"})");
  CHECK(config.ok()) << config.status();
  o.compilation = *config;
  auto runner = ModelRunner::Create(device, dir, o);
  CHECK(runner.ok()) << runner.status();
  return std::move(*runner);
}

// One prefill step of `tokens` as a new sequence, released after; returns
// its wall time (ms) and the cached tokens it reported.
double Prefill(ModelRunner& r, const std::string& id,
               const std::vector<int32_t>& tokens, int* cached) {
  SequenceStep s = MakeSequenceStep(id, tokens, SequenceCreation::kMustBeNew);
  const auto t0 = std::chrono::steady_clock::now();
  auto result = r.Execute({s});
  const auto t1 = std::chrono::steady_clock::now();
  CHECK(result.ok()) << result.status();
  if (cached != nullptr) *cached = result->sequences[0].cached_tokens;
  CHECK(r.Release(id).ok());
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}

int Main() {
  const std::string kind = absl::GetFlag(FLAGS_device);
  CHECK(kind == "cpu" || kind == "cuda") << "--device must be cpu or cuda";
  const bool gpu = kind == "cuda";
  auto created = CreateDevice(gpu ? DeviceKind::kCuda : DeviceKind::kCpu);
  if (!created.ok()) {
    std::printf("prefix_cache_bench: skipped, no usable CUDA device (%s)\n",
                std::string(created.status().message()).c_str());
    return 0;
  }
  Device& device = **created;
  TinyModelOptions model;
  model.shape = gpu ? TinyShape::kLlama1B : TinyShape::kSmall;
  model.dtype = gpu ? DType::kBFloat16 : DType::kFloat32;
  if (!gpu) model.max_position_embeddings = 4096;
  std::string dir = absl::GetFlag(FLAGS_model_dir);
  if (dir.empty()) {
    dir = gpu ? "/tmp/pdworker_bench_llama_1b" : "/tmp/pdworker_bench_small_4k";
  }
  if (!LoadModelConfig(dir).ok()) CHECK(WriteTinyModel(model, dir).ok());
  std::printf("device: %s, model %s\n\n", device.name().c_str(),
              std::string(TinyShapeName(model.shape)).c_str());
  std::unique_ptr<ModelRunner> on = MakeRunner(device, dir, PrefixCaching::kOn);
  const int reps = absl::GetFlag(FLAGS_reps);

  // 1. TTFT. Uncached: a fresh 2,048-token prompt each time. Cached: a
  // shared 1,536-token prefix (run once first) plus a fresh 512-token tail.
  const std::vector<int32_t> prefix = Tokens(1, kCachedPrefix);
  Prefill(*on, "warm", prefix, nullptr);  // caches the prefix
  std::vector<double> uncached_ms, cached_ms;
  int cached_tokens = 0;
  for (int i = 0; i < reps; ++i) {
    uncached_ms.push_back(Prefill(*on, "u", Tokens(100 + i, kPrompt), nullptr));
    std::vector<int32_t> p = prefix;
    const std::vector<int32_t> tail = Tokens(200 + i, kPrompt - kCachedPrefix);
    p.insert(p.end(), tail.begin(), tail.end());
    cached_ms.push_back(Prefill(*on, "c", p, &cached_tokens));
  }
  CHECK_EQ(cached_tokens, kCachedPrefix);
  const double u = Median(uncached_ms), c = Median(cached_ms);
  std::printf(
      "### TTFT of a %d-token prompt, %d tokens cached (%s, median of "
      "%d)\n\n",
      kPrompt, kCachedPrefix, device.name().c_str(), reps);
  std::printf("| prompt | cached tokens | TTFT ms | vs uncached |\n");
  std::printf("| --- | --- | --- | --- |\n");
  std::printf("| uncached | 0 | %.1f | 1.00x |\n", u);
  std::printf("| 1,536 of 2,048 cached | %d | %.1f | %.2fx |\n\n",
              cached_tokens, c, c / u);

  // 2. The mix: 80% share the system prompt. Same request list, caching on
  // and off, alternating runners so both see the same machine state.
  std::unique_ptr<ModelRunner> off =
      MakeRunner(device, dir, PrefixCaching::kOff);
  std::unique_ptr<ModelRunner> mix_on =
      MakeRunner(device, dir, PrefixCaching::kOn);
  const std::vector<int32_t> system = Tokens(7, kSystemPrompt);
  const int n = absl::GetFlag(FLAGS_mix_requests);
  double on_ms = 0, off_ms = 0;
  int64_t tokens = 0, hits = 0;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> p;
    if (i % 5 != 4) {
      p = system;
    } else {
      p = Tokens(300 + i, kSystemPrompt);
    }
    const std::vector<int32_t> q = Tokens(400 + i, kQuestion);
    p.insert(p.end(), q.begin(), q.end());
    int cached = 0;
    on_ms += Prefill(*mix_on, "m", p, &cached);
    off_ms += Prefill(*off, "m", p, nullptr);
    tokens += static_cast<int64_t>(p.size());
    hits += cached;
  }
  std::printf(
      "### Prefill throughput, %d requests of %d tokens, 80%% sharing a "
      "%d-token system prompt (%s)\n\n",
      n, kSystemPrompt + kQuestion, kSystemPrompt, device.name().c_str());
  std::printf(
      "| prefix caching | prompt tokens/s | total ms | cached tokens |\n");
  std::printf("| --- | --- | --- | --- |\n");
  std::printf("| off | %.0f | %.0f | 0 |\n", tokens / (off_ms * 1e-3), off_ms);
  std::printf("| on | %.0f | %.0f | %lld (%.0f%%) |\n\n",
              tokens / (on_ms * 1e-3), on_ms, static_cast<long long>(hits),
              100.0 * hits / tokens);
  std::printf("on/off throughput: %.2fx\n", off_ms / on_ms);
  return 0;
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pdworker::Main();
}
