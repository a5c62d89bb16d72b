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

// The test shapes the CUDA backend runs: all but Gemma 2 and 3 (sandwich
// norms, GeGLU, soft-capping, the embedding multiplier), which have no CUDA
// kernels yet (LlamaForward::Create refuses them by name;
// model_runner_gpu_test checks the refusal), and the 8-token window of
// mistral_window (no windowed CUDA attention: the runner caps max_model_len
// to the window there, below these tests' lengths). Qwen3's q/k norm and
// phi4_mini's partial rotary run with SmallOptions' unverified CUDA
// kernels allowed: these tests are those kernels' first GPU run.
inline std::vector<TinyShape> CudaTinyShapes() {
  std::vector<TinyShape> shapes;
  for (const TinyShape shape : AllTinyShapes()) {
    if (shape != TinyShape::kGemma2 && shape != TinyShape::kGemma3 &&
        shape != TinyShape::kGemma3Multimodal &&
        shape != TinyShape::kMistralWindow) {
      shapes.push_back(shape);
    }
  }
  return shapes;
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
