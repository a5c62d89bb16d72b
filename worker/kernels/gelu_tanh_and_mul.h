// GeGLU MLP activation (Gemma 2 and 3, hidden_activation
// "gelu_pytorch_tanh"): out = gelu_tanh(gate) * up, with
// gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
// fp32 on the CPU backend, bf16 on CUDA (silu_and_mul.cu's kernel with this
// activation, written without a GPU: UnverifiedCudaKernels).
#ifndef PDWORKER_WORKER_KERNELS_GELU_TANH_AND_MUL_H_
#define PDWORKER_WORKER_KERNELS_GELU_TANH_AND_MUL_H_

#include "absl/status/status.h"
#include "common/dtype.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace kernels {

struct GeluTanhAndMulParams {
  // [>= num_tokens, 2 * intermediate_size]: each row is [gate | up].
  DeviceBuffer input;
  DeviceBuffer output;  // [>= num_tokens, intermediate_size]; must not
                        // overlap input
  int num_tokens = 0;   // padded
  int intermediate_size = 0;
  DType dtype = DType::kFloat32;  // the model dtype of the backend
};

absl::Status LaunchGeluTanhAndMul(Stream& stream,
                                  const GeluTanhAndMulParams& p);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_GELU_TANH_AND_MUL_H_
