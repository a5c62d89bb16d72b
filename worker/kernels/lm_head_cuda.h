// CUDA launcher of gather_rows (worker/kernels/lm_head.h), bf16 rows. The LM
// head's GEMM is the linear op's cuBLAS path with fp32 output.
// Plain C++ with CUDA runtime types; included only where PDW_HAVE_CUDA.
#ifndef PDWORKER_WORKER_KERNELS_LM_HEAD_CUDA_H_
#define PDWORKER_WORKER_KERNELS_LM_HEAD_CUDA_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace pdworker {
namespace kernels {

struct GatherRowsCudaParams {
  const __nv_bfloat16* input = nullptr;  // [num_input_rows, row_size]
  const int32_t* indices = nullptr;      // [num_indices], read on device
  __nv_bfloat16* output = nullptr;       // [num_indices, row_size]
  int num_input_rows = 0;
  int num_indices = 0;
  int row_size = 0;
};

// One block per output row. Returns the launch error.
cudaError_t LaunchGatherRowsCuda(const GatherRowsCudaParams& p,
                                 cudaStream_t stream);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_LM_HEAD_CUDA_H_
