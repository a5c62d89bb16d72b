#include "worker/kernels/rms_norm.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "absl/strings/str_format.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL
#include "worker/kernels/kernel_checks.h"

#if PDW_HAVE_CUDA
#include "worker/kernels/rms_norm_cuda.h"
#include "worker/runtime/cuda_status.h"
#endif

namespace pdworker {
namespace kernels {
namespace {

// Writes rmsnorm(x) * weight into out; `out` may alias `x`. The sum of
// squares is accumulated in double: it costs nothing next to the row's
// memory traffic and keeps long rows (hidden 8192) accurate.
void NormalizeRow(const float* x, const float* weight, float* out, int hidden,
                  float epsilon) {
  double sum_squares = 0.0;
  for (int i = 0; i < hidden; ++i) {
    sum_squares += static_cast<double>(x[i]) * x[i];
  }
  const float inv_rms =
      static_cast<float>(1.0 / std::sqrt(sum_squares / hidden + epsilon));
  for (int i = 0; i < hidden; ++i) out[i] = x[i] * inv_rms * weight[i];
}

void RmsNormCpu(const RmsNormParams& p) {
  const float* in = p.input.as<const float>();
  const float* weight = p.weight.as<const float>();
  float* out = p.output.as<float>();
  for (int t = 0; t < p.num_tokens; ++t) {
    const int64_t row = static_cast<int64_t>(t) * p.hidden_size;
    NormalizeRow(in + row, weight, out + row, p.hidden_size, p.epsilon);
  }
}

void FusedAddRmsNormCpu(const FusedAddRmsNormParams& p) {
  const float* in = p.input.as<const float>();
  float* residual = p.residual.as<float>();
  const float* weight = p.weight.as<const float>();
  float* out = p.output.as<float>();
  for (int t = 0; t < p.num_tokens; ++t) {
    const int64_t row = static_cast<int64_t>(t) * p.hidden_size;
    float* res = residual + row;
    // The whole input row is consumed here, before the output row (which may
    // be the same memory) is written.
    for (int i = 0; i < p.hidden_size; ++i) res[i] += in[row + i];
    NormalizeRow(res, weight, out + row, p.hidden_size, p.epsilon);
  }
}

absl::Status CheckRowsAndWeight(absl::string_view op, int num_tokens,
                                int hidden_size, float epsilon,
                                const DeviceBuffer& weight, DType dtype) {
  absl::Status status =
      FirstError({CheckPositive(op, "num_tokens", num_tokens),
                  CheckPositive(op, "hidden_size", hidden_size)});
  if (!status.ok()) return status;
  if (!(epsilon >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: epsilon must be >= 0, got %g", op, epsilon));
  }
  return CheckBuffer(op, "weight", weight, hidden_size, DTypeSize(dtype),
                     absl::StrFormat("[hidden_size=%d] %s", hidden_size,
                                     ShortDTypeName(dtype)));
}

std::string ActivationLayout(int num_tokens, int hidden_size, DType dtype) {
  return absl::StrFormat("[num_tokens=%d, hidden_size=%d] %s", num_tokens,
                         hidden_size, ShortDTypeName(dtype));
}

#if PDW_HAVE_CUDA
absl::Status RmsNormOnCuda(Stream& stream, absl::string_view op,
                           const RmsNormCudaParams& c) {
  const std::string name(op);
  return LaunchCudaOp(stream, op, [c, name](const OpContext& ctx) {
    return CudaStatus(
        LaunchRmsNormCuda(c, static_cast<cudaStream_t>(ctx.cuda_stream)), name);
  });
}
#endif

}  // namespace

absl::Status LaunchRmsNorm(Stream& stream, const RmsNormParams& p) {
  constexpr char kOp[] = "rms_norm";
  absl::Status status =
      FirstError({CheckModelDType(stream, kOp, "dtype", p.dtype),
                  CheckRowsAndWeight(kOp, p.num_tokens, p.hidden_size,
                                     p.epsilon, p.weight, p.dtype)});
  if (!status.ok()) return status;
  const int64_t elements = static_cast<int64_t>(p.num_tokens) * p.hidden_size;
  const size_t element = DTypeSize(p.dtype);
  const std::string layout =
      ActivationLayout(p.num_tokens, p.hidden_size, p.dtype);
  status = FirstError(
      {CheckBuffer(kOp, "input", p.input, elements, element, layout),
       CheckBuffer(kOp, "output", p.output, elements, element, layout),
       CheckSameOrDisjoint(kOp, "output", p.output, element * elements, "input",
                           p.input, element * elements),
       CheckBackendImplemented(stream, kOp)});
  if (!status.ok()) return status;
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) {
    RmsNormCudaParams c;
    c.input = p.input.as<const __nv_bfloat16>();
    c.weight = p.weight.as<const __nv_bfloat16>();
    c.output = p.output.as<__nv_bfloat16>();
    c.num_tokens = p.num_tokens;
    c.hidden_size = p.hidden_size;
    c.epsilon = p.epsilon;
    return RmsNormOnCuda(stream, kOp, c);
  }
#endif
  return stream.Launch(kOp, [p](const OpContext&) { RmsNormCpu(p); });
}

absl::Status LaunchFusedAddRmsNorm(Stream& stream,
                                   const FusedAddRmsNormParams& p) {
  constexpr char kOp[] = "fused_add_rms_norm";
  absl::Status status =
      FirstError({CheckModelDType(stream, kOp, "dtype", p.dtype),
                  CheckRowsAndWeight(kOp, p.num_tokens, p.hidden_size,
                                     p.epsilon, p.weight, p.dtype)});
  if (!status.ok()) return status;
  const int64_t elements = static_cast<int64_t>(p.num_tokens) * p.hidden_size;
  const size_t element = DTypeSize(p.dtype);
  const size_t bytes = element * elements;
  const std::string layout =
      ActivationLayout(p.num_tokens, p.hidden_size, p.dtype);
  status = FirstError(
      {CheckBuffer(kOp, "input", p.input, elements, element, layout),
       CheckBuffer(kOp, "residual", p.residual, elements, element, layout),
       CheckBuffer(kOp, "output", p.output, elements, element, layout),
       CheckDisjoint(kOp, "residual", p.residual, bytes, "input", p.input,
                     bytes),
       CheckDisjoint(kOp, "residual", p.residual, bytes, "output", p.output,
                     bytes),
       CheckSameOrDisjoint(kOp, "output", p.output, bytes, "input", p.input,
                           bytes),
       CheckBackendImplemented(stream, kOp)});
  if (!status.ok()) return status;
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) {
    RmsNormCudaParams c;
    c.input = p.input.as<const __nv_bfloat16>();
    c.residual = p.residual.as<__nv_bfloat16>();
    c.weight = p.weight.as<const __nv_bfloat16>();
    c.output = p.output.as<__nv_bfloat16>();
    c.num_tokens = p.num_tokens;
    c.hidden_size = p.hidden_size;
    c.epsilon = p.epsilon;
    return RmsNormOnCuda(stream, kOp, c);
  }
#endif
  return stream.Launch(kOp, [p](const OpContext&) { FusedAddRmsNormCpu(p); });
}

}  // namespace kernels
}  // namespace pdworker
