// CUDA launchers of the logit masks (worker/kernels/token_mask.h).
// Plain C++ with CUDA runtime types; included only where PDW_HAVE_CUDA.
#ifndef PDWORKER_WORKER_KERNELS_TOKEN_MASK_CUDA_H_
#define PDWORKER_WORKER_KERNELS_TOKEN_MASK_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace pdworker {
namespace kernels {

struct BanTokensCudaParams {
  float* logits = nullptr;             // [num_rows, vocab_size]
  const int32_t* rows = nullptr;       // [num_bans], read on device
  const int32_t* token_ids = nullptr;  // [num_bans], read on device
  int num_bans = 0;                    // a host value: never captured
  int num_rows = 0;
  int vocab_size = 0;
};

// One thread per ban (grid-stride); out-of-range entries are skipped.
// Returns the launch error (cudaGetLastError); nothing for num_bans <= 0.
cudaError_t LaunchBanTokensCuda(const BanTokensCudaParams& p,
                                cudaStream_t stream);

struct MaskBelowMaxCudaParams {
  float* logits = nullptr;         // [num_logit_rows, vocab_size]
  const int32_t* rows = nullptr;   // [num_rows], read on device
  const float* offsets = nullptr;  // [num_rows], read on device
  int num_rows = 0;                // a host value: never captured
  int num_logit_rows = 0;
  int vocab_size = 0;
};

// One block per entry: the row's max, then the masking pass (16-byte loads
// when the rows are 16-byte aligned). Out-of-range rows are skipped. Returns
// the launch error (cudaGetLastError); nothing for num_rows <= 0.
cudaError_t LaunchMaskBelowMaxCuda(const MaskBelowMaxCudaParams& p,
                                   cudaStream_t stream);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_TOKEN_MASK_CUDA_H_
