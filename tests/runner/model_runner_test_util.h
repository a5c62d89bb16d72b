// Shared helpers for the model runner tests: tiny checkpoints and runners.
#ifndef PDWORKER_TESTS_RUNNER_MODEL_RUNNER_TEST_UTIL_H_
#define PDWORKER_TESTS_RUNNER_MODEL_RUNNER_TEST_UTIL_H_

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/cpu_device.h"

namespace pdworker::runner_testing {

// Writes the tiny checkpoint `shape` under $TEST_TMPDIR (once per process).
inline absl::StatusOr<std::string> TinyModelDir(TinyShape shape) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp ? tmp : "/tmp") + "/tiny_" +
                          std::string(TinyShapeName(shape));
  TinyModelOptions options;
  options.shape = shape;
  options.seed = 7;
  absl::Status s = WriteTinyModel(options, dir);
  if (!s.ok()) return s;
  return dir;
}

// The CUDA backend runs every test shape. Qwen3's q/k norm, phi4_mini's
// partial rotary, Gemma 2/3's layer (sandwich norms, GeGLU, soft-capping,
// the embedding multiplier) and windowed attention (mistral_window's 8
// tokens, Gemma's local layers) have CUDA kernels written without a GPU:
// they run with SmallOptions' unverified CUDA kernels allowed, so the GPU
// tests are their first GPU run (model_runner_gpu_test's
// CudaRefusalGpuTest checks that they are refused by default).
//
// Whether the CUDA forward fuses a decode step's layers (the skinny GEMM's
// epilogues, the megakernel) for `config`: not where the layer needs
// kernels those paths do not implement (UnverifiedCudaFeatures) nor a
// window run on CUDA (SmallOptions allows the window kernels).
inline bool CudaFusesDecode(const ModelConfig& config) {
  return UnverifiedCudaFeatures(config).empty() &&
         !config.sliding_window.has_value();
}

// Whether a one-row CUDA step's LM head folds its logits for the greedy
// sampler: not under a final logit soft-cap (Gemma 2).
inline bool CudaGreedyHead(const ModelConfig& config) {
  return config.final_logit_softcapping == 0;
}

// Step options small enough for fast CPU tests; capture sizes 1..16.
inline ModelRunnerOptions SmallOptions(const std::string& mode_json) {
  ModelRunnerOptions o;
  o.role = Role::kBoth;
  o.max_num_seqs = 8;
  o.max_num_batched_tokens = 64;
  o.kv_cache_bytes = int64_t{4} << 20;
  o.block_size = 4;
  o.max_model_len = 128;
  o.input_address_check = InputAddressCheck::kOn;
  // The GPU tests run the CUDA kernels written without a GPU (q/k norm,
  // partial rotary); the CPU backend ignores this.
  o.kernel_options.unverified_cuda_kernels = UnverifiedCudaKernels::kAllow;
  auto config = ParseCompilationConfig(mode_json);
  if (config.ok()) o.compilation = *config;
  return o;
}

inline SequenceStep Seq(const std::string& id, std::vector<int32_t> tokens) {
  SequenceStep s;
  s.sequence_id = id;
  s.token_ids = std::move(tokens);
  return s;
}

}  // namespace pdworker::runner_testing

#endif  // PDWORKER_TESTS_RUNNER_MODEL_RUNNER_TEST_UTIL_H_
