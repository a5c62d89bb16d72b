// SiLU-gated MLP activation (Llama): out = silu(gate) * up.
#ifndef PDWORKER_WORKER_KERNELS_SILU_AND_MUL_H_
#define PDWORKER_WORKER_KERNELS_SILU_AND_MUL_H_

#include "absl/status/status.h"
#include "common/dtype.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace kernels {

struct SiluAndMulParams {
  // [>= num_tokens, 2 * intermediate_size]: each row is [gate | up], the
  // output of one linear over gate_proj and up_proj concatenated along
  // out_features (gate rows first).
  DeviceBuffer input;
  DeviceBuffer output;  // [>= num_tokens, intermediate_size]; must not
                        // overlap input
  int num_tokens = 0;   // padded
  int intermediate_size = 0;
  // fp32 on the CPU backend, bf16 on CUDA (fp32 math, one output rounding).
  DType dtype = DType::kFloat32;
};

// output[t, i] = silu(gate[t, i]) * up[t, i], silu(x) = x / (1 + exp(-x)).
absl::Status LaunchSiluAndMul(Stream& stream, const SiluAndMulParams& p);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_SILU_AND_MUL_H_
