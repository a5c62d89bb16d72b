// The longest sequence a runner serves (max_model_len), and what depends on
// it in the model: ModelRunner::Create's first decision after the config.
#ifndef PDWORKER_WORKER_RUNNER_CONTEXT_LENGTH_H_
#define PDWORKER_WORKER_RUNNER_CONTEXT_LENGTH_H_

#include "absl/status/statusor.h"
#include "worker/model/llama_forward.h"
#include "worker/model/model_config.h"
#include "worker/runtime/device.h"

namespace pdworker {

struct ContextLengthParams {
  int requested = 0;  // --max_model_len; <= 0: the config's
  DeviceKind device = DeviceKind::kCpu;
  UnverifiedCudaKernels unverified_cuda_kernels =
      UnverifiedCudaKernels::kRefuse;
};

// max_model_len: the requested one, else the config's
// max_position_embeddings (never more: INVALID_ARGUMENT naming both). A
// windowed model on a device whose window kernels may not run (CUDA
// without UnverifiedCudaKernels::kAllow; the CPU attention masks to the
// window) attends to the whole context, which is only exact within the
// window: the default is capped to the window (vLLM did the same before it
// ran windows), a longer explicit length refused naming the window.
// Then LongRoPE's factor list is fixed by it (RopeScaling says why):
// `config->rope_scaling.long_factor_active` is set, and with it the
// fingerprint.
absl::StatusOr<int> ResolveContextLength(const ContextLengthParams& params,
                                         ModelConfig* config);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNNER_CONTEXT_LENGTH_H_
