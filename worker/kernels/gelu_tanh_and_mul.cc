#include "worker/kernels/gelu_tanh_and_mul.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/str_format.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA
#include "worker/kernels/kernel_checks.h"

#if PDW_HAVE_CUDA
#include "worker/kernels/silu_and_mul_cuda.h"
#include "worker/runtime/cuda_status.h"
#endif

namespace pdworker {
namespace kernels {
namespace {

constexpr char kOp[] = "gelu_tanh_and_mul";

void GeluTanhAndMulCpu(const GeluTanhAndMulParams& p) {
  const int64_t inter = p.intermediate_size;
  // sqrt(2 / pi), as torch's gelu(approximate="tanh") uses it.
  constexpr float kBeta = 0.7978845608028654f;
  constexpr float kKappa = 0.044715f;
  for (int t = 0; t < p.num_tokens; ++t) {
    const float* gate = p.input.as<const float>() + t * 2 * inter;
    const float* up = gate + inter;
    float* out = p.output.as<float>() + t * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float x = gate[i];
      const float inner = kBeta * (x + kKappa * x * x * x);
      out[i] = 0.5f * x * (1.0f + std::tanh(inner)) * up[i];
    }
  }
}

#if PDW_HAVE_CUDA
// The gated-activation kernel of silu_and_mul.cu with the tanh GELU: written
// without a GPU (LlamaForward runs it only with UnverifiedCudaKernels::
// kAllow).
absl::Status GeluTanhAndMulOnCuda(Stream& stream,
                                  const GeluTanhAndMulParams& p) {
  SiluAndMulCudaParams c;
  c.input = p.input.as<const __nv_bfloat16>();
  c.output = p.output.as<__nv_bfloat16>();
  c.num_tokens = p.num_tokens;
  c.intermediate_size = p.intermediate_size;
  c.activation = GatedActivation::kGeluTanh;
  return LaunchCudaOp(stream, kOp, [c](const OpContext& ctx) {
    return CudaStatus(
        LaunchSiluAndMulCuda(c, static_cast<cudaStream_t>(ctx.cuda_stream)),
        kOp);
  });
}
#endif

}  // namespace

absl::Status LaunchGeluTanhAndMul(Stream& stream,
                                  const GeluTanhAndMulParams& p) {
  absl::Status status = FirstError(
      {CheckPositive(kOp, "num_tokens", p.num_tokens),
       CheckPositive(kOp, "intermediate_size", p.intermediate_size)});
  if (!status.ok()) return status;
  const int64_t in_elements =
      static_cast<int64_t>(p.num_tokens) * 2 * p.intermediate_size;
  const int64_t out_elements =
      static_cast<int64_t>(p.num_tokens) * p.intermediate_size;
  const size_t element = DTypeSize(p.dtype);
  const absl::string_view type = ShortDTypeName(p.dtype);
  status = FirstError(
      {CheckModelDType(stream, kOp, "dtype", p.dtype),
       CheckBuffer(
           kOp, "input", p.input, in_elements, element,
           absl::StrFormat("[num_tokens=%d, 2 * intermediate_size=%d] %s",
                           p.num_tokens, 2 * p.intermediate_size, type)),
       CheckBuffer(kOp, "output", p.output, out_elements, element,
                   absl::StrFormat("[num_tokens=%d, intermediate_size=%d] %s",
                                   p.num_tokens, p.intermediate_size, type)),
       CheckDisjoint(kOp, "output", p.output, element * out_elements, "input",
                     p.input, element * in_elements),
       CheckBackendImplemented(stream, kOp)});
  if (!status.ok()) return status;
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) {
    return GeluTanhAndMulOnCuda(stream, p);
  }
#endif
  return stream.Launch(kOp, [p](const OpContext&) { GeluTanhAndMulCpu(p); });
}

}  // namespace kernels
}  // namespace pdworker
