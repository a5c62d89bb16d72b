// RMSNorm (Llama): out = x / sqrt(mean(x^2) + epsilon) * weight, per token
// row, and vLLM's fused residual-add + RMSNorm.
#ifndef PDWORKER_WORKER_KERNELS_RMS_NORM_H_
#define PDWORKER_WORKER_KERNELS_RMS_NORM_H_

#include "absl/status/status.h"
#include "worker/model/dtype.h"
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
};

// output[t] = rmsnorm(input[t]) * weight.
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
};

absl::Status LaunchFusedAddRmsNorm(Stream& stream,
                                   const FusedAddRmsNormParams& p);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_RMS_NORM_H_
