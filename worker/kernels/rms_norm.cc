#include "worker/kernels/rms_norm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
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

// Output row t's input row: t, or row_indices[t] when gathering; -1 for a
// zero row (an index outside [0, num_input_rows)).
int64_t InputRow(const DeviceBuffer& row_indices, int num_input_rows, int t) {
  if (row_indices.empty()) return t;
  const int32_t index = row_indices.as<const int32_t>()[t];
  return index >= 0 && index < num_input_rows ? index : -1;
}

void RmsNormCpu(const RmsNormParams& p) {
  const float* in = p.input.as<const float>();
  const float* weight = p.weight.as<const float>();
  float* out = p.output.as<float>();
  for (int t = 0; t < p.num_tokens; ++t) {
    float* out_row = out + static_cast<int64_t>(t) * p.hidden_size;
    const int64_t row = InputRow(p.row_indices, p.num_input_rows, t);
    if (row < 0) {
      std::fill_n(out_row, p.hidden_size, 0.0f);
      continue;
    }
    NormalizeRow(in + row * p.hidden_size, weight, out_row, p.hidden_size,
                 p.epsilon);
  }
}

void FusedAddRmsNormCpu(const FusedAddRmsNormParams& p) {
  const float* in = p.input.as<const float>();
  float* residual = p.residual.as<float>();
  const float* weight = p.weight.as<const float>();
  float* out = p.output.as<float>();
  for (int t = 0; t < p.num_tokens; ++t) {
    float* out_row = out + static_cast<int64_t>(t) * p.hidden_size;
    const int64_t index = InputRow(p.row_indices, p.num_input_rows, t);
    if (index < 0) {
      std::fill_n(out_row, p.hidden_size, 0.0f);
      continue;
    }
    const int64_t row = index * p.hidden_size;
    // Gathering, the updated row is not stored: it is built in the output
    // row (disjoint from input and residual) and normalized in place.
    float* res = p.row_indices.empty() ? residual + row : out_row;
    // The whole input row is consumed here, before the output row (which may
    // be the same memory) is written.
    for (int i = 0; i < p.hidden_size; ++i) {
      res[i] = residual[row + i] + in[row + i];
    }
    NormalizeRow(res, weight, out_row, p.hidden_size, p.epsilon);
  }
}

// The gather's index buffer and the rows it reads, or OK without a gather.
absl::Status CheckGather(absl::string_view op, const DeviceBuffer& row_indices,
                         int num_tokens, int num_input_rows) {
  if (row_indices.empty()) return absl::OkStatus();
  return FirstError(
      {CheckPositive(op, "num_input_rows", num_input_rows),
       CheckBuffer(op, "row_indices", row_indices, num_tokens, sizeof(int32_t),
                   absl::StrFormat("[num_tokens=%d] int32", num_tokens))});
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
  PDW_RETURN_IF_ERROR(
      CheckGather(kOp, p.row_indices, p.num_tokens, p.num_input_rows));
  const bool gather = !p.row_indices.empty();
  const int input_rows = gather ? p.num_input_rows : p.num_tokens;
  const int64_t elements = static_cast<int64_t>(p.num_tokens) * p.hidden_size;
  const int64_t in_elements = static_cast<int64_t>(input_rows) * p.hidden_size;
  const size_t element = DTypeSize(p.dtype);
  const std::string layout =
      ActivationLayout(p.num_tokens, p.hidden_size, p.dtype);
  const size_t out_bytes = element * elements, in_bytes = element * in_elements;
  status = FirstError(
      {CheckBuffer(kOp, "input", p.input, in_elements, element,
                   ActivationLayout(input_rows, p.hidden_size, p.dtype)),
       CheckBuffer(kOp, "output", p.output, elements, element, layout),
       gather ? CheckDisjoint(kOp, "output", p.output, out_bytes, "input",
                              p.input, in_bytes)
              : CheckSameOrDisjoint(kOp, "output", p.output, out_bytes, "input",
                                    p.input, in_bytes),
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
    c.row_indices = gather ? p.row_indices.as<const int32_t>() : nullptr;
    c.num_input_rows = p.num_input_rows;
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
  PDW_RETURN_IF_ERROR(
      CheckGather(kOp, p.row_indices, p.num_tokens, p.num_input_rows));
  const bool gather = !p.row_indices.empty();
  const int input_rows = gather ? p.num_input_rows : p.num_tokens;
  const int64_t elements = static_cast<int64_t>(p.num_tokens) * p.hidden_size;
  const int64_t in_elements = static_cast<int64_t>(input_rows) * p.hidden_size;
  const size_t element = DTypeSize(p.dtype);
  const size_t bytes = element * elements, in_bytes = element * in_elements;
  const std::string layout =
      ActivationLayout(p.num_tokens, p.hidden_size, p.dtype);
  const std::string in_layout =
      ActivationLayout(input_rows, p.hidden_size, p.dtype);
  status = FirstError(
      {CheckBuffer(kOp, "input", p.input, in_elements, element, in_layout),
       CheckBuffer(kOp, "residual", p.residual, in_elements, element,
                   in_layout),
       CheckBuffer(kOp, "output", p.output, elements, element, layout),
       CheckDisjoint(kOp, "residual", p.residual, in_bytes, "input", p.input,
                     in_bytes),
       CheckDisjoint(kOp, "residual", p.residual, in_bytes, "output", p.output,
                     bytes),
       gather ? CheckDisjoint(kOp, "output", p.output, bytes, "input", p.input,
                              in_bytes)
              : CheckSameOrDisjoint(kOp, "output", p.output, bytes, "input",
                                    p.input, in_bytes),
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
    c.row_indices = gather ? p.row_indices.as<const int32_t>() : nullptr;
    c.num_input_rows = p.num_input_rows;
    return RmsNormOnCuda(stream, kOp, c);
  }
#endif
  return stream.Launch(kOp, [p](const OpContext&) { FusedAddRmsNormCpu(p); });
}

}  // namespace kernels
}  // namespace pdworker
