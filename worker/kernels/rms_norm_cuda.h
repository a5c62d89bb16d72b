// CUDA launchers of RMSNorm and fused residual-add + RMSNorm
// (worker/kernels/rms_norm.h), bf16 in and out, fp32 statistics.
// Plain C++ with CUDA runtime types; included only where PDW_HAVE_CUDA.
#ifndef PDWORKER_WORKER_KERNELS_RMS_NORM_CUDA_H_
#define PDWORKER_WORKER_KERNELS_RMS_NORM_CUDA_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace pdworker {
namespace kernels {

struct RmsNormCudaParams {
  const __nv_bfloat16* input = nullptr;  // [num_tokens, hidden_size]
  // Fused variant only: [num_tokens, hidden_size], read-write; nullptr for
  // the plain norm.
  __nv_bfloat16* residual = nullptr;
  const __nv_bfloat16* weight = nullptr;  // [hidden_size]
  __nv_bfloat16* output = nullptr;        // may be `input`
  int num_tokens = 0;                     // output rows
  int hidden_size = 0;
  float epsilon = 1e-6f;
  // Gather: output row t from input (and residual) row row_indices[t]; an
  // index outside [0, num_input_rows) gives a zero row; the residual is not
  // written. nullptr: row t from row t.
  const int32_t* row_indices = nullptr;
  int num_input_rows = 0;
};

// One block per row. With `residual` set: residual = bf16(residual + input),
// output = rmsnorm(residual) * weight (the norm sees the rounded residual,
// as vLLM's fused_add_rms_norm). Returns the launch error.
cudaError_t LaunchRmsNormCuda(const RmsNormCudaParams& p, cudaStream_t stream);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_RMS_NORM_CUDA_H_
