#include "worker/kernels/unpack_step_inputs.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL
#include "worker/kernels/kernel_checks.h"

#if PDW_HAVE_CUDA
#include "worker/kernels/unpack_step_inputs_cuda.h"
#include "worker/runtime/cuda_status.h"
#endif

namespace pdworker {
namespace kernels {
namespace {

constexpr char kOp[] = "unpack_step_inputs";

void UnpackStepInputsCpu(const UnpackStepInputsParams& p) {
  const PackedStepLayout l =
      PackedStepLayout::For(p.num_tokens, p.num_reqs, p.num_logits);
  const int32_t* packed = p.packed.as<const int32_t>();
  const StepBuffers& o = p.outputs;
  std::copy_n(packed + l.token_ids, p.num_tokens, o.token_ids.as<int32_t>());
  std::copy_n(packed + l.positions, p.num_tokens, o.positions.as<int32_t>());
  std::copy_n(packed + l.slot_mapping, p.num_tokens,
              o.slot_mapping.as<int32_t>());
  std::copy_n(packed + l.seq_lens, p.num_reqs, o.seq_lens.as<int32_t>());
  std::copy_n(packed + l.query_start_loc, p.num_reqs + 1,
              o.query_start_loc.as<int32_t>());
  int32_t* logits = o.logits_indices.as<int32_t>();
  for (int r = 0; r < p.num_logits_rows; ++r) {
    logits[r] = r < p.num_logits ? packed[l.logits_indices + r] : -1;
  }
  *o.num_reqs.as<int32_t>() = p.num_real_reqs;
  const int32_t* starts = packed + l.block_starts;
  for (int r = 0; r < p.num_reqs; ++r) {
    int32_t* row = o.block_tables.as<int32_t>() +
                   static_cast<int64_t>(r) * p.max_blocks_per_seq;
    const int32_t s = starts[r], e = starts[r + 1];
    const bool ok = s >= 0 && e >= s && e <= p.num_block_ids &&
                    e - s <= p.max_blocks_per_seq;
    const int count = ok ? e - s : 0;
    std::copy_n(packed + l.block_ids + (ok ? s : 0), count, row);
    std::fill(row + count, row + p.max_blocks_per_seq, 0);
  }
}

#if PDW_HAVE_CUDA
absl::Status UnpackStepInputsOnCuda(Stream& stream,
                                    const UnpackStepInputsParams& p) {
  const PackedStepLayout l =
      PackedStepLayout::For(p.num_tokens, p.num_reqs, p.num_logits);
  UnpackStepInputsCudaParams c;
  c.packed = p.packed.as<const int32_t>();
  c.positions = l.positions;
  c.slot_mapping = l.slot_mapping;
  c.seq_lens = l.seq_lens;
  c.query_start_loc = l.query_start_loc;
  c.logits_indices = l.logits_indices;
  c.block_starts = l.block_starts;
  c.block_ids = l.block_ids;
  const StepBuffers& o = p.outputs;
  c.token_ids_out = o.token_ids.as<int32_t>();
  c.positions_out = o.positions.as<int32_t>();
  c.slot_mapping_out = o.slot_mapping.as<int32_t>();
  c.seq_lens_out = o.seq_lens.as<int32_t>();
  c.query_start_loc_out = o.query_start_loc.as<int32_t>();
  c.num_reqs_out = o.num_reqs.as<int32_t>();
  c.block_tables_out = o.block_tables.as<int32_t>();
  c.logits_indices_out = o.logits_indices.as<int32_t>();
  c.num_tokens = p.num_tokens;
  c.num_reqs = p.num_reqs;
  c.num_real_reqs = p.num_real_reqs;
  c.num_block_ids = p.num_block_ids;
  c.max_blocks_per_seq = p.max_blocks_per_seq;
  c.num_logits = p.num_logits;
  c.num_logits_rows = p.num_logits_rows;
  return LaunchCudaOp(stream, kOp, [c](const OpContext& ctx) {
    return CudaStatus(LaunchUnpackStepInputsCuda(
                          c, static_cast<cudaStream_t>(ctx.cuda_stream)),
                      kOp);
  });
}
#endif

}  // namespace

absl::Status LaunchUnpackStepInputs(Stream& stream,
                                    const UnpackStepInputsParams& p) {
  PDW_RETURN_IF_ERROR(stream.RefuseDuringCapture(
      kOp,
      "the sizes are host values; unpack before the step's capture or "
      "replay"));
  absl::Status status = FirstError(
      {CheckPositive(kOp, "num_tokens", p.num_tokens),
       CheckNonNegative(kOp, "num_reqs", p.num_reqs),
       CheckNonNegative(kOp, "num_real_reqs", p.num_real_reqs),
       CheckNonNegative(kOp, "num_logits", p.num_logits),
       CheckNonNegative(kOp, "num_block_ids", p.num_block_ids),
       CheckPositive(kOp, "max_blocks_per_seq", p.max_blocks_per_seq)});
  if (!status.ok()) return status;
  if (p.num_real_reqs > p.num_reqs) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: num_real_reqs (%d) exceeds num_reqs (%d)", kOp,
                        p.num_real_reqs, p.num_reqs));
  }
  if (static_cast<int64_t>(p.num_reqs) * p.max_blocks_per_seq >
      std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: num_reqs (%d) x max_blocks_per_seq (%d) block-table entries "
        "exceed 2^31 - 1",
        kOp, p.num_reqs, p.max_blocks_per_seq));
  }
  if (p.num_logits_rows < p.num_logits) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: num_logits_rows (%d) is below num_logits (%d)",
                        kOp, p.num_logits_rows, p.num_logits));
  }
  const PackedStepLayout l =
      PackedStepLayout::For(p.num_tokens, p.num_reqs, p.num_logits);
  const StepBuffers& o = p.outputs;
  const int64_t t = p.num_tokens, r = p.num_reqs;
  const std::string tokens = absl::StrFormat("[num_tokens=%d] int32", t);
  const std::string reqs = absl::StrFormat("[num_reqs=%d] int32", r);
  status = FirstError(
      {CheckBuffer(kOp, "packed", p.packed, l.block_ids + p.num_block_ids,
                   sizeof(int32_t),
                   absl::StrFormat("[3 * num_tokens + 3 * num_reqs + "
                                   "num_logits + 2 + num_block_ids=%d] int32",
                                   l.block_ids + p.num_block_ids)),
       CheckBuffer(kOp, "token_ids", o.token_ids, t, sizeof(int32_t), tokens),
       CheckBuffer(kOp, "positions", o.positions, t, sizeof(int32_t), tokens),
       CheckBuffer(kOp, "slot_mapping", o.slot_mapping, t, sizeof(int32_t),
                   tokens),
       CheckBuffer(kOp, "seq_lens", o.seq_lens, r, sizeof(int32_t), reqs),
       CheckBuffer(kOp, "query_start_loc", o.query_start_loc, r + 1,
                   sizeof(int32_t), "[num_reqs + 1] int32"),
       CheckBuffer(kOp, "num_reqs", o.num_reqs, 1, sizeof(int32_t),
                   "[1] int32"),
       CheckBuffer(kOp, "block_tables", o.block_tables,
                   r * p.max_blocks_per_seq, sizeof(int32_t),
                   absl::StrFormat("[num_reqs=%d, max_blocks_per_seq=%d] int32",
                                   r, p.max_blocks_per_seq)),
       CheckBuffer(
           kOp, "logits_indices", o.logits_indices, p.num_logits_rows,
           sizeof(int32_t),
           absl::StrFormat("[num_logits_rows=%d] int32", p.num_logits_rows)),
       CheckBackendImplemented(stream, kOp)});
  if (!status.ok()) return status;
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) {
    return UnpackStepInputsOnCuda(stream, p);
  }
#endif
  return stream.Launch(kOp, [p](const OpContext&) { UnpackStepInputsCpu(p); });
}

}  // namespace kernels
}  // namespace pdworker
