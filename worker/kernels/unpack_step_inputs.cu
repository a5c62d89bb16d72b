// Step-input unpack on CUDA (see unpack_step_inputs.h): one thread per output
// word over the concatenation of
//   [0, 3T + 2R + 1)          token_ids | positions | slot_mapping |
//                             seq_lens | query_start_loc (contiguous in
//                             `packed` too: a straight copy)
//   [.., + num_logits_rows)   logits_indices
//   [.., + 1)                 num_reqs
//   [.., + R · max_blocks)    block_tables
#include <algorithm>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/unpack_step_inputs_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

constexpr int kThreads = 256;
// At most a few hundred thousand words (256 rows of 2,048-block tables):
// the cap bounds the grid, the loop strides over the rest.
constexpr unsigned int kMaxBlocks = 1024;

// Row r's block ids [start, end) in the block-id segment, or an empty range
// for a row whose starts are corrupt (never read out of bounds).
__device__ __forceinline__ void BlockRange(const UnpackStepInputsCudaParams& p,
                                           int r, int* start, int* count) {
  const int32_t* starts = p.packed + p.block_starts;
  const int32_t s = starts[r], e = starts[r + 1];
  const bool ok =
      s >= 0 && e >= s && e <= p.num_block_ids && e - s <= p.max_blocks_per_seq;
  *start = ok ? s : 0;
  *count = ok ? e - s : 0;
}

__global__ void UnpackStepInputsKernel(const UnpackStepInputsCudaParams p) {
  const int64_t t = p.num_tokens, r = p.num_reqs;
  const int64_t head = 3 * t + 2 * r + 1;
  const int64_t logits_end = head + p.num_logits_rows;
  const int64_t tables = r * p.max_blocks_per_seq;
  const int64_t total = logits_end + 1 + tables;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < total; i += stride) {
    if (i < head) {
      const int32_t v = p.packed[i];
      if (i < p.positions) {
        p.token_ids_out[i] = v;
      } else if (i < p.slot_mapping) {
        p.positions_out[i - p.positions] = v;
      } else if (i < p.seq_lens) {
        p.slot_mapping_out[i - p.slot_mapping] = v;
      } else if (i < p.query_start_loc) {
        p.seq_lens_out[i - p.seq_lens] = v;
      } else {
        p.query_start_loc_out[i - p.query_start_loc] = v;
      }
    } else if (i < logits_end) {
      const int64_t row = i - head;
      p.logits_indices_out[row] =
          row < p.num_logits ? p.packed[p.logits_indices + row] : -1;
    } else if (i == logits_end) {
      *p.num_reqs_out = p.num_real_reqs;
    } else {
      // 32-bit division (a 64-bit one is ~5x the instructions): the
      // tables are max_num_seqs x max_blocks_per_seq < 2^31 entries.
      const int e = static_cast<int>(i - logits_end - 1);
      const int row = e / p.max_blocks_per_seq;
      const int j = e - row * p.max_blocks_per_seq;
      int start, count;
      BlockRange(p, row, &start, &count);
      p.block_tables_out[e] = j < count ? p.packed[p.block_ids + start + j] : 0;
    }
  }
}

}  // namespace

cudaError_t LaunchUnpackStepInputsCuda(const UnpackStepInputsCudaParams& p,
                                       cudaStream_t stream) {
  const int64_t total = 3 * static_cast<int64_t>(p.num_tokens) +
                        2 * static_cast<int64_t>(p.num_reqs) + 1 +
                        p.num_logits_rows + 1 +
                        static_cast<int64_t>(p.num_reqs) * p.max_blocks_per_seq;
  const unsigned int grid = static_cast<unsigned int>(
      std::min<int64_t>((total + kThreads - 1) / kThreads, kMaxBlocks));
  UnpackStepInputsKernel<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace pdworker
