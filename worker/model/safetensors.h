// Reader for the safetensors format
// (https://github.com/huggingface/safetensors):
//
//   [uint64 little-endian N][N bytes of JSON header][data section]
//
// The header maps tensor names to {"dtype", "shape", "data_offsets": [begin,
// end]}, offsets relative to the data section start; an optional
// "__metadata__" entry maps strings to strings. The file is memory-mapped, and
// every tensor is validated at Open so that later reads never leave the
// mapping: a truncated or malformed file is an InvalidArgument (or DataLoss)
// error, never a crash.
#ifndef PDWORKER_WORKER_MODEL_SAFETENSORS_H_
#define PDWORKER_WORKER_MODEL_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "worker/model/mapped_file.h"

namespace pdworker {

struct TensorInfo {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;  // row-major; {} is a scalar (one element)
  // The tensor's raw little-endian bytes inside the mapping; size ==
  // NumElements() * DTypeSize(dtype). Valid while the SafetensorsFile lives.
  // Not necessarily aligned to the element size.
  absl::Span<const uint8_t> bytes;

  int64_t NumElements() const;
};

// Largest header accepted, as the reference implementation does (100 MB):
// a corrupt length must not make us parse gigabytes of tensor data as JSON.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

class SafetensorsFile {
 public:
  // Maps and validates the file: header length within the file and within
  // kMaxSafetensorsHeaderBytes, header a JSON object, every tensor with a
  // known dtype (F32/F16/BF16), non-negative shape, data_offsets inside the
  // data section with end - begin == numel * dtype size, no two tensors'
  // byte ranges overlapping and no data bytes outside every tensor (the
  // format forbids holes). Errors name the file and the tensor.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(
      const std::string& path);

  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return mapping_->path(); }
  // Tensor name -> info, sorted by name.
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  // The "__metadata__" string map (empty when absent).
  const std::map<std::string, std::string>& metadata() const {
    return metadata_;
  }

  // nullptr when absent.
  const TensorInfo* Find(const std::string& name) const;

  // Converts tensor `name` to float32 into *out (resized to NumElements()).
  // NotFound if there is no such tensor.
  absl::Status ReadAsFloat32(const std::string& name,
                             std::vector<float>* out) const;

 private:
  explicit SafetensorsFile(std::unique_ptr<MappedFile> mapping)
      : mapping_(std::move(mapping)) {}

  absl::Status Parse();

  std::unique_ptr<MappedFile> mapping_;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Converts `count` little-endian elements of `dtype` at `bytes` to float32.
// `bytes` must hold count * DTypeSize(dtype) bytes; `out` must hold `count`.
void ConvertToFloat32(DType dtype, const uint8_t* bytes, int64_t count,
                      float* out);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_MODEL_SAFETENSORS_H_
