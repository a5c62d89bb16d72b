// CUDA launchers of the raw logprobs (worker/kernels/logprobs.h): the CPU
// kernels' results, the logsumexp summed in double in another order.
// Plain C++ with CUDA runtime types; included only where PDW_HAVE_CUDA.
#ifndef PDWORKER_WORKER_KERNELS_LOGPROBS_CUDA_H_
#define PDWORKER_WORKER_KERNELS_LOGPROBS_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace pdworker {
namespace kernels {

struct TopLogprobsCudaParams {
  const float* logits = nullptr;     // [num_logit_rows, vocab_size]
  const int32_t* rows = nullptr;     // [num_rows], read on device
  float* logsumexp = nullptr;        // [num_rows]
  int32_t* top_token_ids = nullptr;  // [num_rows, k]
  float* top_logprobs = nullptr;     // [num_rows, k]
  int num_rows = 0;                  // a host value: never captured
  int num_logit_rows = 0;
  int vocab_size = 0;
  int k = 0;  // a host value; any k in [0, vocab_size]
};

// One block per entry: a block-wide argmax (the max, and the top-1), a
// block-wide double sum of exp(logit - max), then k - 1 more block-wide
// argmax passes, each over the ids after the previous pick in the (logit
// descending, id ascending) order. Returns the launch error
// (cudaGetLastError); nothing for num_rows <= 0.
cudaError_t LaunchTopLogprobsCuda(const TopLogprobsCudaParams& p,
                                  cudaStream_t stream);

struct GatherLogprobsCudaParams {
  const float* logits = nullptr;       // [num_logit_rows, vocab_size]
  const int32_t* rows = nullptr;       // [num_rows], read on device
  const int32_t* token_ids = nullptr;  // [num_logit_rows], read on device
  const float* logsumexp = nullptr;    // [num_rows]
  float* logprobs = nullptr;           // [num_rows]
  int num_rows = 0;                    // a host value: never captured
  int num_logit_rows = 0;
  int vocab_size = 0;
};

// One thread per entry (grid-stride). Returns the launch error
// (cudaGetLastError); nothing for num_rows <= 0.
cudaError_t LaunchGatherLogprobsCuda(const GatherLogprobsCudaParams& p,
                                     cudaStream_t stream);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_LOGPROBS_CUDA_H_
