// CUDA launcher of the gated MLP activations: SiLU (worker/kernels/
// silu_and_mul.h) and GeGLU's tanh GELU (gelu_tanh_and_mul.h), bf16 in and
// out, fp32 math.
// Plain C++ with CUDA runtime types; included only where PDW_HAVE_CUDA.
#ifndef PDWORKER_WORKER_KERNELS_SILU_AND_MUL_CUDA_H_
#define PDWORKER_WORKER_KERNELS_SILU_AND_MUL_CUDA_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace pdworker {
namespace kernels {

enum class GatedActivation { kSilu, kGeluTanh };

struct SiluAndMulCudaParams {
  const __nv_bfloat16* input = nullptr;  // [num_tokens, 2 * intermediate]
  __nv_bfloat16* output = nullptr;       // [num_tokens, intermediate]
  int num_tokens = 0;
  int intermediate_size = 0;
  // kGeluTanh was written without a GPU (LlamaForward's
  // UnverifiedCudaKernels).
  GatedActivation activation = GatedActivation::kSilu;
};

// Returns the launch error.
cudaError_t LaunchSiluAndMulCuda(const SiluAndMulCudaParams& p,
                                 cudaStream_t stream);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_SILU_AND_MUL_CUDA_H_
