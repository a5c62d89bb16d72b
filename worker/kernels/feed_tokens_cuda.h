// CUDA launcher of the sampled-token feed (worker/kernels/feed_tokens.h).
// Plain C++ with CUDA runtime types; included only where PDW_HAVE_CUDA.
#ifndef PDWORKER_WORKER_KERNELS_FEED_TOKENS_CUDA_H_
#define PDWORKER_WORKER_KERNELS_FEED_TOKENS_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace pdworker {
namespace kernels {

struct FeedSampledTokensCudaParams {
  const int32_t* sampled_token_ids = nullptr;  // [num_sampled]
  const int32_t* src_rows = nullptr;           // [num_feeds], read on device
  int32_t* token_ids = nullptr;                // [num_tokens]
  const int32_t* dst_indices = nullptr;        // [num_feeds], read on device
  int num_feeds = 0;                           // a host value: never captured
  int num_sampled = 0;
  int num_tokens = 0;
};

// One thread per feed (grid-stride); out-of-range entries are skipped.
// Returns the launch error (cudaGetLastError); nothing for num_feeds <= 0.
cudaError_t LaunchFeedSampledTokensCuda(const FeedSampledTokensCudaParams& p,
                                        cudaStream_t stream);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_FEED_TOKENS_CUDA_H_
