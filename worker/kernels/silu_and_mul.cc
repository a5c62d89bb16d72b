#include "worker/kernels/silu_and_mul.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/str_format.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL
#include "worker/kernels/kernel_checks.h"

#if PDW_HAVE_CUDA
#include "worker/kernels/silu_and_mul_cuda.h"
#include "worker/runtime/cuda_status.h"
#endif

namespace pdworker {
namespace kernels {
namespace {

constexpr char kOp[] = "silu_and_mul";

void SiluAndMulCpu(const SiluAndMulParams& p) {
  const int64_t inter = p.intermediate_size;
  for (int t = 0; t < p.num_tokens; ++t) {
    const float* gate = p.input.as<const float>() + t * 2 * inter;
    const float* up = gate + inter;
    float* out = p.output.as<float>() + t * inter;
    for (int64_t i = 0; i < inter; ++i) {
      // For gate -> -inf, exp overflows to inf and the quotient is -0: the
      // correct limit, no NaN.
      out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  }
}

#if PDW_HAVE_CUDA
absl::Status SiluAndMulOnCuda(Stream& stream, const SiluAndMulParams& p) {
  SiluAndMulCudaParams c;
  c.input = p.input.as<const __nv_bfloat16>();
  c.output = p.output.as<__nv_bfloat16>();
  c.num_tokens = p.num_tokens;
  c.intermediate_size = p.intermediate_size;
  return LaunchCudaOp(stream, kOp, [c](const OpContext& ctx) {
    return CudaStatus(
        LaunchSiluAndMulCuda(c, static_cast<cudaStream_t>(ctx.cuda_stream)),
        kOp);
  });
}
#endif

}  // namespace

absl::Status LaunchSiluAndMul(Stream& stream, const SiluAndMulParams& p) {
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
  if (stream.kind() == DeviceKind::kCuda) return SiluAndMulOnCuda(stream, p);
#endif
  return stream.Launch(kOp, [p](const OpContext&) { SiluAndMulCpu(p); });
}

}  // namespace kernels
}  // namespace pdworker
