// RMSNorm (Llama): out = x / sqrt(mean(x^2) + epsilon) * weight, per token
// row, and vLLM's fused residual-add + RMSNorm.
#ifndef PDWORKER_WORKER_KERNELS_RMS_NORM_H_
#define PDWORKER_WORKER_KERNELS_RMS_NORM_H_

#include "absl/status/status.h"
#include "common/dtype.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace kernels {

// Tensors are of `dtype`: fp32 on the CPU backend (statistics in double),
// bf16 on CUDA (statistics in fp32, one rounding of the output).
struct RmsNormParams {
  DeviceBuffer input;   // [>= num_tokens, hidden_size]
  DeviceBuffer weight;  // [hidden_size]
  // [>= num_tokens, hidden_size]. May be `input` itself (in place): each row
  // is fully read before it is written.
  DeviceBuffer output;
  int num_tokens = 0;  // padded; padding rows are normalized too (harmless)
  int hidden_size = 0;
  float epsilon = 1e-6f;  // config.json "rms_norm_eps"
  DType dtype = DType::kFloat32;
  // Optional gather (the LM head's rows, so the final norm and the gather
  // are one kernel): output row t normalizes input row row_indices[t]
  // (int32 [>= num_tokens], read on the device); an index outside
  // [0, num_input_rows) gives a zero row. num_tokens then counts output
  // rows, `input` holds num_input_rows rows, and `output` must not overlap
  // it. Each output row has the bits the norm of its input row has without
  // the gather.
  DeviceBuffer row_indices = {};
  int num_input_rows = 0;
};

// output[t] = rmsnorm(input[t]) * weight (input[row_indices[t]] gathering).
absl::Status LaunchRmsNorm(Stream& stream, const RmsNormParams& p);

// The pre-attention / pre-MLP norm of every layer after the first, as
// vLLM's fused_add_rms_norm:
//   residual[t] += input[t]           (the skip connection, kept for later)
//   output[t]    = rmsnorm(residual[t]) * weight
// `output` may be `input` (vLLM writes the result over `input`); `residual`
// must be neither. On CUDA the residual is stored in bf16 and the norm is
// taken of the stored (rounded) residual, as vLLM does.
struct FusedAddRmsNormParams {
  DeviceBuffer input;     // [>= num_tokens, hidden_size]: the sublayer's
                          // output (attention o_proj or MLP down_proj)
  DeviceBuffer residual;  // [>= num_tokens, hidden_size], read-write
  DeviceBuffer weight;    // [hidden_size]
  DeviceBuffer output;    // [>= num_tokens, hidden_size]; may be `input`
  int num_tokens = 0;
  int hidden_size = 0;
  float epsilon = 1e-6f;
  DType dtype = DType::kFloat32;  // of every tensor above
  // Optional gather, as RmsNormParams's (the last layer's add and the final
  // norm of the sampled rows only): output[t] = rmsnorm(residual[i] +
  // input[i]) * weight for i = row_indices[t], with the sum rounded as the
  // stored residual would be, and the residual is not written (nothing reads
  // it after the final norm; rows gathered twice cannot race). `output` must
  // overlap neither input nor residual.
  DeviceBuffer row_indices = {};
  int num_input_rows = 0;
};

absl::Status LaunchFusedAddRmsNorm(Stream& stream,
                                   const FusedAddRmsNormParams& p);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_RMS_NORM_H_
