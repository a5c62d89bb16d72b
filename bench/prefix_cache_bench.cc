// Prefix caching on the CPU backend, side by side in one run (issue 20):
//  1. time to first token of a 2,048-token prompt whose first 1,536 tokens
//     are cached vs the same prompt length uncached (one prefill step alone
//     on an idle runner: its step time is the TTFT);
//  2. prefill throughput with a realistic mix: 80% of the requests share a
//     1,024-token system prompt, each with its own 256-token question,
//     caching on vs off.
// Model: the `small` tiny config (hidden 256, 4 layers) with 4,096
// positions, block size 16, eager (prefill steps run eagerly in the
// PIECEWISE-for-prefill modes too). Prints Markdown for RESULTS.md.
//
//   bazel build --config=opt //bench:prefix_cache_bench
//   bazel-bin/bench/prefix_cache_bench [--reps=N]
//
// Absolute times are this machine's CPU, not GPU figures; the ratios are
// what the issue's goals are about (cached TTFT <= 0.35x uncached on CPU).
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
#include "worker/runner/model_runner.h"
#include "worker/runtime/cpu_device.h"

ABSL_FLAG(int, reps, 5, "Timed repetitions per TTFT measurement (median).");
ABSL_FLAG(int, mix_requests, 20, "Requests in the mixed-traffic run.");
ABSL_FLAG(std::string, model_dir, "/tmp/pdworker_bench_small_4k",
          "Where the small model (4,096 positions) is written.");

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
  ModelRunnerOptions o;
  o.role = Role::kPrefill;
  o.max_num_seqs = 8;
  o.max_num_batched_tokens = kPrompt;
  o.max_model_len = kPrompt;
  o.kv_cache_bytes = int64_t{256} << 20;
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
  TinyModelOptions model;
  model.shape = TinyShape::kSmall;
  model.max_position_embeddings = 4096;
  const std::string dir = absl::GetFlag(FLAGS_model_dir);
  CHECK(WriteTinyModel(model, dir).ok());
  CpuDevice device;
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
      "### TTFT of a %d-token prompt, %d tokens cached (CPU, small model, "
      "median of %d)\n\n",
      kPrompt, kCachedPrefix, reps);
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
      "%d-token system prompt (CPU, small model)\n\n",
      n, kSystemPrompt + kQuestion, kSystemPrompt);
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
