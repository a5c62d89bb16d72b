// StepInputs: the per-step metadata a forward reads, in static device buffers.
//
// Captured graphs bake buffer addresses in, so every step writes its inputs
// into the same buffers: host staging arrays are filled here, then copied in
// one CopyToDevice per buffer. Kernels read lengths, positions, slots and
// block tables from these buffers at run time, which is what lets one graph
// serve every batch that pads to its key.
#ifndef PDWORKER_WORKER_RUNNER_STEP_INPUTS_H_
#define PDWORKER_WORKER_RUNNER_STEP_INPUTS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/kv_cache/kv_cache_manager.h"
#include "worker/model/step_buffers.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {

struct StepLimits {
  int max_num_seqs = 0;            // requests per step
  int max_num_batched_tokens = 0;  // query tokens per step (padded)
  int max_blocks_per_seq = 0;      // block-table width
};

// One request of the step, after the KV cache reserved its tokens:
// kv->num_tokens already counts `new_tokens`.
struct StepSequence {
  const SequenceKv* kv = nullptr;
  absl::Span<const int32_t> new_tokens;
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
  // Carves the buffers from `arena` (at startup).
  static absl::StatusOr<std::unique_ptr<StepInputs>> Create(
      Arena& arena, const StepLimits& limits, int32_t block_size);

  // Fills the host staging arrays for `seqs` padded to `shape`. Validates
  // sizes against the limits (INVALID_ARGUMENT); allocates nothing.
  absl::Status Build(absl::Span<const StepSequence> seqs,
                     const PaddedShape& shape);
  // Capture-time inputs for `shape`: every token is padding (id 0, slot -1),
  // every padding request has an empty context and num_reqs is 0, so warm-up
  // and capture runs compute finite garbage and never touch the KV cache.
  absl::Status BuildDummy(const PaddedShape& shape);
  // Copies what Build filled into the device buffers (not during capture).
  absl::Status Upload(Stream& stream) const;

  const StepBuffers& buffers() const { return buffers_; }
  const StepLimits& limits() const { return limits_; }
  int num_tokens() const { return num_tokens_; }
  int num_reqs() const { return num_reqs_; }
  const PaddedShape& shape() const { return shape_; }

  // Host copies, for tests and the sampler.
  absl::Span<const int32_t> host_token_ids() const {
    return absl::MakeConstSpan(token_ids_).first(shape_.num_tokens);
  }
  absl::Span<const int32_t> host_positions() const {
    return absl::MakeConstSpan(positions_).first(shape_.num_tokens);
  }
  absl::Span<const int32_t> host_slot_mapping() const {
    return absl::MakeConstSpan(slot_mapping_).first(shape_.num_tokens);
  }
  absl::Span<const int32_t> host_seq_lens() const {
    return absl::MakeConstSpan(seq_lens_).first(shape_.num_reqs);
  }
  absl::Span<const int32_t> host_query_start_loc() const {
    return absl::MakeConstSpan(query_start_loc_).first(shape_.num_reqs + 1);
  }
  absl::Span<const int32_t> host_logits_indices() const {
    return absl::MakeConstSpan(logits_indices_).first(shape_.num_reqs);
  }
  absl::Span<const int32_t> host_block_table_row(int r) const {
    return absl::MakeConstSpan(block_tables_)
        .subspan(static_cast<size_t>(r) * limits_.max_blocks_per_seq,
                 limits_.max_blocks_per_seq);
  }

 private:
  StepInputs(const StepLimits& limits, int32_t block_size, StepBuffers buffers);

  StepLimits limits_;
  int32_t block_size_;
  StepBuffers buffers_;
  int num_tokens_ = 0;
  int num_reqs_ = 0;
  PaddedShape shape_;
  // Host staging, sized at startup (the step path allocates nothing).
  std::vector<int32_t> token_ids_, positions_, slot_mapping_, seq_lens_,
      query_start_loc_, block_tables_, logits_indices_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNNER_STEP_INPUTS_H_
