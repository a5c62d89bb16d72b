// Element types of checkpoint tensors: the three floating-point types
// Llama-family checkpoints are published in. Names follow the two places they
// appear: config.json's "torch_dtype" ("bfloat16") and the safetensors header's
// "dtype" ("BF16").
#ifndef PDWORKER_COMMON_DTYPE_H_
#define PDWORKER_COMMON_DTYPE_H_

#include <cstddef>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pdworker {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// Bytes per element: 4, 2, 2.
size_t DTypeSize(DType dtype);

// "float32", "float16", "bfloat16" (torch names, as in config.json).
absl::string_view DTypeName(DType dtype);

// "F32", "F16", "BF16" (safetensors header names).
absl::string_view SafetensorsDTypeName(DType dtype);

// Parses a torch name ("float32", "float16", "bfloat16"; "float" and "half"
// are accepted as torch's aliases). InvalidArgument lists the supported names.
absl::StatusOr<DType> ParseTorchDType(absl::string_view name);

// Parses a safetensors name ("F32", "F16", "BF16"). Other safetensors dtypes
// (I8, F64, F8_E4M3, ...) are InvalidArgument naming the unsupported one.
absl::StatusOr<DType> ParseSafetensorsDType(absl::string_view name);

}  // namespace pdworker

#endif  // PDWORKER_COMMON_DTYPE_H_
