// Shared helpers for the engine tests: a tiny model (optionally with a
// longer context or generation_config.json EOS ids), an Engine over a real
// ModelRunner on the CPU backend whose stream runs on its own thread (so the
// races host/device overlap brings can show), a reference that generates a
// prompt alone step by step through ModelRunner::Execute, and synchronous
// wrappers around the engine's asynchronous calls.
#ifndef PDWORKER_TESTS_ENGINE_ENGINE_TEST_UTIL_H_
#define PDWORKER_TESTS_ENGINE_ENGINE_TEST_UTIL_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "metrics/worker_metrics.h"
#include "worker/engine/engine.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/cpu_device.h"

namespace pdworker::engine_testing {

struct ModelDirOptions {
  int max_position_embeddings = 0;  // 0: the tiny model's 512
  // Written to generation_config.json when set.
  std::optional<std::vector<int32_t>> generation_eos_ids;
};
// The gqa tiny checkpoint (vocab 256), edited as asked, in a directory of
// its own under $TEST_TMPDIR.
std::string ModelDir(const ModelDirOptions& options = {});

// 8 sequences and 64 tokens per step, blocks of 4 tokens, max_model_len
// 128, 1 MiB of KV (256 blocks of fp32 K/V), capture sizes 1..16 in
// `mode_json`'s cudagraph_mode.
ModelRunnerOptions SmallOptions(const std::string& mode = "FULL_AND_PIECEWISE");

// The graph modes the engine tests run in.
std::vector<std::string> AllModes();

struct TestEngine {
  std::unique_ptr<CpuDevice> device;
  std::unique_ptr<ModelRunner> runner;
  std::unique_ptr<WorkerMetrics> metrics;  // what the engine exports
  std::unique_ptr<Engine> engine;

  // The Prometheus text of `metrics`.
  std::string MetricsText() const;
};
// A runner with its graphs captured and an engine around it, exporting to
// its own WorkerMetrics. The device's stream runs on its own thread unless
// `execution` says otherwise.
std::unique_ptr<TestEngine> StartEngine(
    const std::string& model_dir, const ModelRunnerOptions& options,
    const EngineOptions& engine_options,
    CpuStreamExecution execution = CpuStreamExecution::kThreaded);

// What a request produced, gathered from its updates.
struct Generation {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  // Per token, when the request asked for logprobs (RequestSpec::logprobs).
  std::vector<TokenLogprobs> token_logprobs;
  std::vector<int64_t> token_steps;  // the update's step, per token
  std::optional<FinishReason> finish_reason;
  std::optional<int32_t> matched_token_id;
  absl::Status status;
  int updates = 0;
  int32_t cached_tokens = 0;  // RequestUpdate::num_cached_tokens (last)
};

// A submitted request; Wait() blocks until its last update.
class PendingGeneration {
 public:
  // Submits `spec` to `engine` now.
  PendingGeneration(Engine& engine, RequestSpec spec,
                    std::shared_ptr<CallControl> control = nullptr);
  Generation Wait();
  // Tokens received so far (any thread).
  int TokensSoFar() const;

 private:
  // A condition variable, not std::promise: TSan models pthread condition
  // variables, but not libstdc++'s futex-based future wait, and would report
  // the engine's later frees as races with the waiter.
  mutable std::mutex mu_;
  std::condition_variable done_cv_;
  bool done_ = false;
  Generation result_;
};

// A greedy (or `sampling`) request for `prompt`, at most `max_tokens`
// outputs, EOS ignored.
RequestSpec Spec(const std::string& id, std::vector<int32_t> prompt,
                 int32_t max_tokens, SamplingOptions sampling = {});

// `prompt` alone through `runner.Execute`: prefill in chunks of the
// runner's token budget, then one decode per step, `num_tokens` samples.
// Sample i bans `banned` while i < `ban_until` (min_tokens). The sequence
// is released at the end.
struct Sampled {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
};
absl::StatusOr<Sampled> ReferenceGeneration(
    ModelRunner& runner, const std::string& id,
    const std::vector<int32_t>& prompt, int num_tokens,
    const SamplingOptions& sampling = {},
    const std::vector<int32_t>& banned = {}, int ban_until = 0);

// Deterministic pseudo-random prompt of `length` tokens in [3, 256).
std::vector<int32_t> Prompt(int length, uint64_t seed);

// Engine::Submit for an abort, waited for.
absl::StatusOr<AbortOutcome> Abort(Engine& engine,
                                   std::vector<std::string> ids);

// A Forward call of one sequence through Engine::Submit, waited for.
absl::StatusOr<ForwardOutcome> Forward(Engine& engine, const std::string& id,
                                       std::vector<int32_t> tokens,
                                       SequenceCreation creation,
                                       AfterStep after = AfterStep::kKeep);

}  // namespace pdworker::engine_testing

#endif  // PDWORKER_TESTS_ENGINE_ENGINE_TEST_UTIL_H_
