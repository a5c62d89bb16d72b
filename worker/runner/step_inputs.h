// StepInputs: the per-step metadata a forward reads, in static device buffers.
//
// Captured graphs bake buffer addresses in, so every step writes its inputs
// into the same buffers. Build writes the used part of every array into one
// pinned host block (kernels::PackedStepLayout); Upload copies that block in
// one DMA and unpacks it on the device (kernels::LaunchUnpackStepInputs),
// where one pageable copy per array cost a host staging copy and a DMA each.
// Kernels read lengths, positions, slots and block tables from the static
// buffers at run time, which is what lets one graph serve every batch that
// pads to its key.
#ifndef PDWORKER_WORKER_RUNNER_STEP_INPUTS_H_
#define PDWORKER_WORKER_RUNNER_STEP_INPUTS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/kernels/step_buffers.h"
#include "worker/kernels/unpack_step_inputs.h"
#include "worker/kv_cache/kv_cache_manager.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/device.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"
#include "worker/runtime/upload_ring.h"

namespace pdworker {

struct StepLimits {
  int max_num_seqs = 0;            // requests per step
  int max_num_batched_tokens = 0;  // query tokens per step (padded)
  int max_blocks_per_seq = 0;      // block-table width
  // Steps whose inputs may be uploaded but not yet copied by the device
  // (the runner's steps in flight, plus the one being built): each has its
  // own block of the upload ring, and Build waits only when it must reuse
  // one whose copy has not run yet.
  int max_uploads_in_flight = 1;
  // Logits rows per step, >= max_num_seqs: max_num_seqs x (1 + speculative
  // tokens), where each verifying request samples after each of its 1 + k
  // tokens.
  int max_logits_rows = 0;
};

// One request of the step, after the KV cache reserved its tokens:
// kv->num_tokens already counts `new_tokens`.
struct StepSequence {
  const SequenceKv* kv = nullptr;
  absl::Span<const int32_t> new_tokens;
  // Logits rows: one after each of the last num_logits new tokens (1: the
  // next token's; 1 + k to verify k draft tokens). In [1, new_tokens.size()].
  int num_logits = 1;
};

// The shape the step runs at (from the dispatcher): padded token count, and
// the request count the graph was captured for. Real sizes are <= these.
struct PaddedShape {
  int num_tokens = 0;
  int num_reqs = 0;
  // Query length of each padding request (uniform decode keys), or 0 when
  // padding tokens belong to no request (mixed keys).
  int padding_query_len = 0;
};

class StepInputs {
 public:
  // Carves the device buffers from `arena` and allocates the pinned upload
  // ring from `device` (at startup).
  static absl::StatusOr<std::unique_ptr<StepInputs>> Create(
      Device& device, Arena& arena, const StepLimits& limits,
      int32_t block_size);

  // Device words of the static buffers plus the packed block, for sizing
  // the arena.
  static int64_t DeviceWords(const StepLimits& limits);

  // Fills the upload ring's next block for `seqs` padded to `shape`.
  // Validates sizes against the limits first (INVALID_ARGUMENT, and nothing
  // changes); allocates nothing. Waits for that block's previous copy when
  // it has not run yet (and returns the stream's error if it failed).
  absl::Status Build(absl::Span<const StepSequence> seqs,
                     const PaddedShape& shape);
  // Capture-time inputs for `shape`: every token is padding (id 0, slot -1),
  // every padding request has an empty context and num_reqs is 0, so warm-up
  // and capture runs compute finite garbage and never touch the KV cache.
  absl::Status BuildDummy(const PaddedShape& shape);
  // Copies what Build filled into the device buffers: one copy of the
  // packed block and one unpack op, in stream order (not during capture).
  // FAILED_PRECONDITION before the first Build.
  absl::Status Upload(Stream& stream);

  const StepBuffers& buffers() const { return buffers_; }
  const StepLimits& limits() const { return limits_; }
  int num_tokens() const { return num_tokens_; }
  int num_reqs() const { return num_reqs_; }
  // Logits rows of the real requests, in request order (rows past it read
  // index -1: zero logits).
  int num_logits() const { return num_logits_; }
  const PaddedShape& shape() const { return shape_; }

  // What Build wrote (valid until the next Build), for tests and the
  // runner's token feed.
  absl::Span<const int32_t> host_token_ids() const {
    return Segment(layout_.token_ids, shape_.num_tokens);
  }
  absl::Span<const int32_t> host_positions() const {
    return Segment(layout_.positions, shape_.num_tokens);
  }
  absl::Span<const int32_t> host_slot_mapping() const {
    return Segment(layout_.slot_mapping, shape_.num_tokens);
  }
  absl::Span<const int32_t> host_seq_lens() const {
    return Segment(layout_.seq_lens, shape_.num_reqs);
  }
  absl::Span<const int32_t> host_query_start_loc() const {
    return Segment(layout_.query_start_loc, shape_.num_reqs + 1);
  }
  absl::Span<const int32_t> host_logits_indices() const {
    return Segment(layout_.logits_indices, num_logits_);
  }
  // The blocks request r holds (its block-table row without the zeros).
  absl::Span<const int32_t> host_block_table_row(int r) const {
    const int32_t* starts = Staged() + layout_.block_starts;
    return Segment(layout_.block_ids + starts[r], starts[r + 1] - starts[r]);
  }

 private:
  StepInputs(const StepLimits& limits, int32_t block_size, StepBuffers buffers,
             DeviceBuffer packed, std::unique_ptr<UploadRing> ring);

  // Moves to the ring's next block for `shape` and `num_logits` rows.
  absl::Status NextBlock(const PaddedShape& shape, int num_logits);
  int32_t* Staged() const { return static_cast<int32_t*>(ring_->current()); }
  absl::Span<const int32_t> Segment(int64_t offset, int64_t size) const {
    return absl::MakeConstSpan(Staged() + offset, static_cast<size_t>(size));
  }

  StepLimits limits_;
  int32_t block_size_;
  StepBuffers buffers_;
  DeviceBuffer packed_;  // where the packed block lands before the unpack
  std::unique_ptr<UploadRing> ring_;  // blocks of the layout at its largest
  int num_tokens_ = 0;
  int num_reqs_ = 0;
  int num_logits_ = 0;
  int num_block_ids_ = 0;
  PaddedShape shape_;
  kernels::PackedStepLayout layout_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNNER_STEP_INPUTS_H_
