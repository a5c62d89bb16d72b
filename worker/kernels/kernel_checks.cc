#include "worker/kernels/kernel_checks.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL

namespace pdworker {
namespace kernels {

absl::Status FirstError(std::initializer_list<absl::Status> statuses) {
  for (const absl::Status& status : statuses) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::Status CheckPositive(absl::string_view op, absl::string_view field,
                           int64_t value) {
  if (value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: %s must be positive, got %d", op, field, value));
}

absl::Status CheckNonNegative(absl::string_view op, absl::string_view field,
                              int64_t value) {
  if (value >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: %s must not be negative, got %d", op, field, value));
}

absl::Status CheckBuffer(absl::string_view op, absl::string_view buffer_name,
                         const DeviceBuffer& buffer, int64_t num_elements,
                         size_t element_bytes, absl::string_view layout) {
  const uint64_t required =
      static_cast<uint64_t>(std::max<int64_t>(num_elements, 0)) * element_bytes;
  if (buffer.size_bytes() < required) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: buffer '%s' holds %d bytes but needs %d (%s)", op,
                        buffer_name, buffer.size_bytes(), required, layout));
  }
  if (required > 0 && buffer.data() == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: buffer '%s' is null but needs %d bytes (%s)", op,
                        buffer_name, required, layout));
  }
  return absl::OkStatus();
}

int64_t StridedElements(int64_t rows, int64_t width, int64_t row_stride) {
  if (rows <= 0) return 0;
  return (rows - 1) * row_stride + width;
}

absl::Status CheckDisjoint(absl::string_view op, absl::string_view a_name,
                           const DeviceBuffer& a, size_t a_bytes,
                           absl::string_view b_name, const DeviceBuffer& b,
                           size_t b_bytes) {
  const auto a_begin = reinterpret_cast<uintptr_t>(a.data());
  const auto b_begin = reinterpret_cast<uintptr_t>(b.data());
  if (a_bytes == 0 || b_bytes == 0) return absl::OkStatus();
  if (a_begin + a_bytes <= b_begin || b_begin + b_bytes <= a_begin) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": buffers '", a_name, "' and '", b_name,
                   "' overlap; this op cannot run in place"));
}

absl::Status CheckSameOrDisjoint(absl::string_view op, absl::string_view a_name,
                                 const DeviceBuffer& a, size_t a_bytes,
                                 absl::string_view b_name,
                                 const DeviceBuffer& b, size_t b_bytes) {
  if (a.data() == b.data()) return absl::OkStatus();
  absl::Status disjoint =
      CheckDisjoint(op, a_name, a, a_bytes, b_name, b, b_bytes);
  if (disjoint.ok()) return disjoint;
  return absl::InvalidArgumentError(absl::StrCat(
      op, ": buffers '", a_name, "' and '", b_name,
      "' partially overlap; they must be the same buffer or disjoint"));
}

absl::string_view ShortDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "fp32";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat16:
      return "fp16";
  }
  return "unknown";
}

DType ModelDTypeFor(DeviceKind kind) {
  return kind == DeviceKind::kCuda ? DType::kBFloat16 : DType::kFloat32;
}

absl::Status CheckModelDType(const Stream& stream, absl::string_view op,
                             absl::string_view field, DType dtype) {
  const DType want = ModelDTypeFor(stream.kind());
  if (dtype == want) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": ", field, " is ", ShortDTypeName(dtype), " but the ",
                   DeviceKindName(stream.kind()), " kernels compute in ",
                   ShortDTypeName(want)));
}

absl::Status CheckBackendImplemented(const Stream& stream,
                                     absl::string_view op) {
  switch (stream.kind()) {
    case DeviceKind::kCpu:
      return absl::OkStatus();
    case DeviceKind::kCuda:
#if PDW_HAVE_CUDA
      return absl::OkStatus();
#else
      return absl::UnimplementedError(
          absl::StrCat(op, ": this binary was built without the CUDA kernels"));
#endif
  }
  return absl::InternalError(absl::StrCat(op, ": unknown device kind"));
}

absl::Status LaunchCudaOp(Stream& stream, absl::string_view name,
                          const CudaOpBody& body) {
  if (stream.kind() != DeviceKind::kCuda) {
    return absl::InternalError(
        absl::StrCat(name, ": LaunchCudaOp on a non-CUDA stream"));
  }
  absl::Status result;
  bool ran = false;
  absl::Status launched =
      stream.Launch(name, [&result, &ran, &body](const OpContext& context) {
        ran = true;
        result = body(context);
      });
  if (!launched.ok()) return launched;
  if (!ran) {
    return absl::InternalError(absl::StrCat(
        name, ": the CUDA stream did not run the op synchronously"));
  }
  return result;
}

}  // namespace kernels
}  // namespace pdworker
