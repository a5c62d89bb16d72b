// Dense layer: output = input · weightᵀ (+ bias), fp32, via sgemm.
#ifndef PDWORKER_WORKER_KERNELS_LINEAR_H_
#define PDWORKER_WORKER_KERNELS_LINEAR_H_

#include "absl/status/status.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace kernels {

struct LinearParams {
  DeviceBuffer input;  // fp32 [>= num_tokens, in_features]
  // fp32 [out_features, in_features]: the Hugging Face nn.Linear layout, so
  // safetensors weights are used as stored. Fused projections (q|k|v, or
  // gate|up for silu_and_mul) are row blocks concatenated along out_features.
  DeviceBuffer weight;
  DeviceBuffer bias;    // fp32 [out_features], or empty for no bias
  DeviceBuffer output;  // fp32 [>= num_tokens, out_features]; must not overlap
                        // input, weight or bias
  int num_tokens = 0;   // padded rows computed (all of them, padding included)
  int in_features = 0;
  int out_features = 0;
};

// CPU: a row-invariant GEMM (see linear.cc): row t of the output is
// bit-identical whatever num_tokens is, so an eager run at the real token
// count and a graph replayed at the padded count agree bit for bit.
absl::Status LaunchLinear(Stream& stream, const LinearParams& p);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_LINEAR_H_
