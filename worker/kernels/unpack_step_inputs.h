// Unpacking a step's metadata on the device. StepInputs writes the used part
// of every per-step array into one pinned host block, which reaches the
// device in one DMA (instead of one pageable copy per array); this op
// scatters it into the static buffers the forward's graphs read. Runs before
// the step, outside graphs: the sizes are host values that change every step.
//
// Packed layout, int32 words, with T = num_tokens and R = num_reqs (the
// padded shape) and L = num_logits (the logits rows the step samples: one
// per request, or 1 + k for a request that verifies k draft tokens):
//   token_ids [T] | positions [T] | slot_mapping [T] | seq_lens [R] |
//   query_start_loc [R + 1] | logits_indices [L] | block_starts [R + 1] |
//   block ids [num_block_ids]
// Row r's block table is block ids [block_starts[r], block_starts[r + 1]):
// only the blocks a sequence holds cross the bus, where its static row is
// max_blocks_per_seq wide (2,048 entries at a 32k context of 16-token
// blocks).
#ifndef PDWORKER_WORKER_KERNELS_UNPACK_STEP_INPUTS_H_
#define PDWORKER_WORKER_KERNELS_UNPACK_STEP_INPUTS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "worker/kernels/step_buffers.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace kernels {

// Word offsets of the packed layout's segments for T tokens, R requests and
// L logits rows.
struct PackedStepLayout {
  int64_t token_ids = 0;
  int64_t positions = 0;
  int64_t slot_mapping = 0;
  int64_t seq_lens = 0;
  int64_t query_start_loc = 0;
  int64_t logits_indices = 0;
  int64_t block_starts = 0;
  int64_t block_ids = 0;  // the last segment: words = block_ids + num ids

  static PackedStepLayout For(int num_tokens, int num_reqs, int num_logits) {
    PackedStepLayout l;
    const int64_t t = num_tokens, r = num_reqs, n = num_logits;
    l.positions = t;
    l.slot_mapping = 2 * t;
    l.seq_lens = 3 * t;
    l.query_start_loc = 3 * t + r;
    l.logits_indices = 3 * t + 2 * r + 1;
    l.block_starts = 3 * t + 2 * r + 1 + n;
    l.block_ids = 3 * t + 3 * r + 2 + n;
    return l;
  }
};

// Writes, from `packed`:
//  - token_ids, positions, slot_mapping [0, num_tokens);
//  - seq_lens [0, num_reqs), query_start_loc [0, num_reqs];
//  - logits_indices [0, num_logits_rows): the packed entry for rows below
//    num_logits, -1 (a zero logits row) for the rest;
//  - num_reqs[0] = num_real_reqs;
//  - block_tables rows [0, num_reqs), each max_blocks_per_seq wide: the
//    row's packed block ids, then zeros. A row whose block_starts are not
//    ordered within [0, num_block_ids], or span more than
//    max_blocks_per_seq ids, gets an all-zero row: the starts are device
//    data, and a bad one must never become an out-of-bounds access.
// Nothing else of `outputs` is written.
struct UnpackStepInputsParams {
  DeviceBuffer packed;  // int32 [>= layout.block_ids + num_block_ids]
  StepBuffers outputs;
  int num_tokens = 0;
  int num_reqs = 0;       // padded requests (rows of the block tables)
  int num_real_reqs = 0;  // <= num_reqs
  int num_block_ids = 0;
  int max_blocks_per_seq = 0;
  int num_logits = 0;       // packed logits_indices entries
  int num_logits_rows = 0;  // >= num_logits: logits_indices entries written
};

// FAILED_PRECONDITION while the stream is capturing (the sizes would be
// frozen into the graph), and the capture is invalidated. INVALID_ARGUMENT
// naming the field for a negative or inconsistent count, or a buffer smaller
// than its shape.
absl::Status LaunchUnpackStepInputs(Stream& stream,
                                    const UnpackStepInputsParams& p);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_UNPACK_STEP_INPUTS_H_
