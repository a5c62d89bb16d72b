#include "worker/runtime/testing/test_ops.h"

#include <cstddef>

#include "absl/strings/str_format.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL

#if PDW_HAVE_CUDA
#include "worker/runtime/testing/test_kernels.h"
#endif

namespace pdworker {
namespace test_ops {
namespace {

absl::Status CheckCovers(absl::string_view op, DeviceBuffer input,
                         DeviceBuffer out) {
  if (input.size_bytes() < out.size_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: input of %d bytes is smaller than the %d-byte "
                        "output",
                        op, input.size_bytes(), out.size_bytes()));
  }
  return absl::OkStatus();
}

#if !PDW_HAVE_CUDA
absl::Status NoCuda(absl::string_view op) {
  return absl::UnimplementedError(
      absl::StrFormat("%s: built without the CUDA backend", op));
}
#endif

}  // namespace

absl::Status Fill(Stream& stream, DeviceBuffer data, float value) {
  float* out = data.as<float>();
  const size_t n = data.num_elements<float>();
  if (stream.kind() == DeviceKind::kCpu) {
    return stream.Launch("fill", [out, n, value](const OpContext&) {
      for (size_t i = 0; i < n; ++i) out[i] = value;
    });
  }
#if PDW_HAVE_CUDA
  return stream.Launch("fill", [out, n, value](const OpContext& context) {
    LaunchFillKernel(context.cuda_stream, out, n, value);
  });
#else
  return NoCuda("fill");
#endif
}

absl::Status Axpy(Stream& stream, float a, DeviceBuffer x, DeviceBuffer y) {
  absl::Status covered = CheckCovers("axpy", x, y);
  if (!covered.ok()) return covered;
  const float* in = x.as<const float>();
  float* out = y.as<float>();
  const size_t n = y.num_elements<float>();
  if (stream.kind() == DeviceKind::kCpu) {
    return stream.Launch("axpy", [a, in, out, n](const OpContext&) {
      for (size_t i = 0; i < n; ++i) out[i] = a * in[i] + out[i];
    });
  }
#if PDW_HAVE_CUDA
  return stream.Launch("axpy", [a, in, out, n](const OpContext& context) {
    LaunchAxpyKernel(context.cuda_stream, a, in, out, n);
  });
#else
  return NoCuda("axpy");
#endif
}

absl::Status MulAdd(Stream& stream, DeviceBuffer a, DeviceBuffer b, float c,
                    DeviceBuffer out) {
  absl::Status covered = CheckCovers("mul_add", a, out);
  if (covered.ok()) covered = CheckCovers("mul_add", b, out);
  if (!covered.ok()) return covered;
  const float* lhs = a.as<const float>();
  const float* rhs = b.as<const float>();
  float* result = out.as<float>();
  const size_t n = out.num_elements<float>();
  if (stream.kind() == DeviceKind::kCpu) {
    return stream.Launch("mul_add", [lhs, rhs, c, result, n](const OpContext&) {
      for (size_t i = 0; i < n; ++i) {
        result[i] = lhs[i] * rhs[i] + c;
      }
    });
  }
#if PDW_HAVE_CUDA
  return stream.Launch(
      "mul_add", [lhs, rhs, c, result, n](const OpContext& context) {
        LaunchMulAddKernel(context.cuda_stream, lhs, rhs, c, result, n);
      });
#else
  return NoCuda("mul_add");
#endif
}

}  // namespace test_ops
}  // namespace pdworker
