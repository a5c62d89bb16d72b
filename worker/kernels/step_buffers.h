// StepBuffers: the per-step metadata the forward reads, in static device
// buffers (the model's input contract; worker/runner/step_inputs fills them).
#ifndef PDWORKER_WORKER_KERNELS_STEP_BUFFERS_H_
#define PDWORKER_WORKER_KERNELS_STEP_BUFFERS_H_

#include "worker/runtime/device_buffer.h"

namespace pdworker {

// All int32. Shapes in elements. Kernels read them when they run, so one
// captured graph serves every batch that pads to its key.
struct StepBuffers {
  DeviceBuffer token_ids;        // [max_tokens]; padding tokens: 0
  DeviceBuffer positions;        // [max_tokens]; padding tokens: 0
  DeviceBuffer slot_mapping;     // [max_tokens]; padding tokens: -1
  DeviceBuffer seq_lens;         // [max_seqs]; context incl. this step; pad: 0
  DeviceBuffer query_start_loc;  // [max_seqs + 1]; cumulative query lengths
  DeviceBuffer num_reqs;         // [1]; real requests this step
  DeviceBuffer block_tables;     // [max_seqs, max_blocks_per_seq]
  // [max_seqs]; last query token of request r; -1 beyond the real requests
  // (the LM head writes zero logits for those rows).
  DeviceBuffer logits_indices;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_STEP_BUFFERS_H_
