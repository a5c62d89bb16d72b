#include "worker/kernels/silu_and_mul.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/str_format.h"
#include "worker/kernels/kernel_checks.h"

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
  status = FirstError(
      {CheckBuffer(
           kOp, "input", p.input, in_elements, sizeof(float),
           absl::StrFormat("[num_tokens=%d, 2 * intermediate_size=%d] fp32",
                           p.num_tokens, 2 * p.intermediate_size)),
       CheckBuffer(kOp, "output", p.output, out_elements, sizeof(float),
                   absl::StrFormat("[num_tokens=%d, intermediate_size=%d] fp32",
                                   p.num_tokens, p.intermediate_size)),
       CheckDisjoint(kOp, "output", p.output, sizeof(float) * out_elements,
                     "input", p.input, sizeof(float) * in_elements),
       CheckBackendImplemented(stream, kOp)});
  if (!status.ok()) return status;
  return stream.Launch(kOp, [p](const OpContext&) { SiluAndMulCpu(p); });
}

}  // namespace kernels
}  // namespace pdworker
