// CUDA launcher of token sampling (worker/kernels/sampling.h): the same
// decisions as the CPU kernel, the same counter-based RNG.
// Plain C++ with CUDA runtime types; included only where PDW_HAVE_CUDA.
#ifndef PDWORKER_WORKER_KERNELS_SAMPLING_CUDA_H_
#define PDWORKER_WORKER_KERNELS_SAMPLING_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace pdworker {
namespace kernels {

// Rows sorted per pass by the top-k / top-p path: the workspace holds the
// sort buffers of this many rows, whatever max_num_seqs is.
inline constexpr int kCudaSamplingSortRows = 8;

struct SamplingCudaParams {
  const float* logits = nullptr;  // [num_reqs, vocab_size]
  const float* temperature = nullptr;
  const int32_t* top_k = nullptr;
  const float* top_p = nullptr;
  const uint64_t* seeds = nullptr;
  const int32_t* positions = nullptr;
  // SamplingCudaWorkspaceBytes(vocab_size) bytes, 256-byte aligned.
  void* workspace = nullptr;
  int32_t* sampled_token_ids = nullptr;
  float* sampled_logprobs = nullptr;
  int num_reqs = 0;  // a host value: sampling is never captured
  int vocab_size = 0;
  bool raw_logprobs = false;        // LogprobMode::kRaw
  float greedy_temperature = 0.0f;  // kGreedyTemperature
  // SamplingParams::num_truncated_rows: >= 0 skips the read-back.
  int num_truncated_rows = -1;
  // Greedy path only: GreedyTilesCudaBytes(num_reqs) bytes of tile folds
  // the LM head wrote with the logits (lm_head_cuda.h), or null.
  const void* greedy_tiles = nullptr;
};

// SamplingPath::kGreedy: the argmax and an fp32 log-sum-exp per row, each
// row reduced in 64 slices by 64 blocks (one pass over the logits, one warp
// per tile of the row: greedy_fold.cuh), then the slices combined by a
// second kernel. Reads the logits and writes the slices' partial results to
// `workspace` (>= GreedySamplingCudaWorkspaceBytes(num_reqs) bytes, 4-byte
// aligned); the other inputs may be null. With `greedy_tiles` set only the
// second kernel runs, on the tiles' folds: the same bits, the logits
// unread.
cudaError_t LaunchGreedySamplingCuda(const SamplingCudaParams& p,
                                     cudaStream_t stream);
size_t GreedySamplingCudaWorkspaceBytes(int num_reqs);
// The tile folds of `num_reqs` rows (512 per row, 12 bytes each).
size_t GreedyTilesCudaBytes(int num_reqs);

// Workspace bytes for `vocab_size` and up to `max_num_reqs` rows per
// launch: kCudaSamplingSortRows rows of sort keys and ids (twice: in and
// out), segment offsets, the list of rows that truncate, cub's radix-sort
// scratch (queried from cub, which needs a current CUDA device) and the
// sliced rows' partial results; or the greedy path's, if larger.
cudaError_t SamplingCudaWorkspaceBytes(int vocab_size, int max_num_reqs,
                                       size_t* bytes);

// A small kernel lists the rows that use top-k / top-p and, unless the
// caller gave their count (num_truncated_rows), the host reads it back (a
// stream synchronization: sampling runs eagerly, never in a graph); then
// every other row is sampled from the logits over 64 blocks (three kernels:
// slice maxima, slice sums, the inverse CDF in the crossing slice), and
// the listed rows go through groups of kCudaSamplingSortRows: a prepare
// kernel (sort keys), one cub segmented radix sort (descending, stable: ties
// keep the lower id first) and the sampling kernel. Returns the first error.
cudaError_t LaunchSamplingCuda(const SamplingCudaParams& p,
                               cudaStream_t stream);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_SAMPLING_CUDA_H_
