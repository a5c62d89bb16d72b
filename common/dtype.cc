#include "common/dtype.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace pdworker {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
  }
  LOG(FATAL) << "unknown DType " << static_cast<int>(dtype);
  return 0;
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
  }
  LOG(FATAL) << "unknown DType " << static_cast<int>(dtype);
  return "";
}

absl::string_view SafetensorsDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "F32";
    case DType::kFloat16:
      return "F16";
    case DType::kBFloat16:
      return "BF16";
  }
  LOG(FATAL) << "unknown DType " << static_cast<int>(dtype);
  return "";
}

absl::StatusOr<DType> ParseTorchDType(absl::string_view name) {
  if (name == "float32" || name == "float") return DType::kFloat32;
  if (name == "float16" || name == "half") return DType::kFloat16;
  if (name == "bfloat16") return DType::kBFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype \"", name,
                   "\"; supported: float32, float16, bfloat16"));
}

absl::StatusOr<DType> ParseSafetensorsDType(absl::string_view name) {
  if (name == "F32") return DType::kFloat32;
  if (name == "F16") return DType::kFloat16;
  if (name == "BF16") return DType::kBFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported safetensors dtype \"", name,
                   "\"; supported: F32, F16, BF16"));
}

}  // namespace pdworker
