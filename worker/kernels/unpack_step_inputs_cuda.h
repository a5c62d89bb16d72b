// CUDA launcher of the step-input unpack (worker/kernels/unpack_step_inputs.h).
// Plain C++ with CUDA runtime types; included only where PDW_HAVE_CUDA.
#ifndef PDWORKER_WORKER_KERNELS_UNPACK_STEP_INPUTS_CUDA_H_
#define PDWORKER_WORKER_KERNELS_UNPACK_STEP_INPUTS_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace pdworker {
namespace kernels {

struct UnpackStepInputsCudaParams {
  const int32_t* packed = nullptr;
  // Word offsets into `packed` (PackedStepLayout).
  int64_t positions = 0, slot_mapping = 0, seq_lens = 0, query_start_loc = 0,
          logits_indices = 0, block_starts = 0, block_ids = 0;
  int32_t* token_ids_out = nullptr;
  int32_t* positions_out = nullptr;
  int32_t* slot_mapping_out = nullptr;
  int32_t* seq_lens_out = nullptr;
  int32_t* query_start_loc_out = nullptr;
  int32_t* num_reqs_out = nullptr;
  int32_t* block_tables_out = nullptr;
  int32_t* logits_indices_out = nullptr;
  int num_tokens = 0;
  int num_reqs = 0;
  int num_real_reqs = 0;
  int num_block_ids = 0;
  int max_blocks_per_seq = 0;
  int num_logits = 0;  // packed logits_indices entries
  int num_logits_rows = 0;
};

// One thread per output word (grid-stride). Returns the launch error.
cudaError_t LaunchUnpackStepInputsCuda(const UnpackStepInputsCudaParams& p,
                                       cudaStream_t stream);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_UNPACK_STEP_INPUTS_CUDA_H_
