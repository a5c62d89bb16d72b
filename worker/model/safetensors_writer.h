// Writes safetensors files: the tiny-model maker uses it for checkpoints and
// tests use it (and the raw SerializeSafetensors) to build malformed files.
#ifndef PDWORKER_WORKER_MODEL_SAFETENSORS_WRITER_H_
#define PDWORKER_WORKER_MODEL_SAFETENSORS_WRITER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/dtype.h"

namespace pdworker {

// The file bytes for an arbitrary header text and data section:
// [uint64 LE header_json.size()][header_json][data]. No validation at all,
// so tests can write any malformed header.
std::string SerializeSafetensors(absl::string_view header_json,
                                 absl::string_view data);

// Encodes float32 values as little-endian `dtype` elements (round to nearest
// even for float16/bfloat16).
std::string EncodeFromFloat32(DType dtype, absl::Span<const float> values);

// Collects tensors and writes a well-formed file: tensors back to back (the
// format forbids holes), 4-byte dtypes before 2-byte ones, and the header
// padded with spaces to a multiple of 8 bytes, so every tensor is aligned to
// its element size in the file.
class SafetensorsWriter {
 public:
  // Adds a tensor with `values` converted to `dtype`; values.size() must equal
  // the product of `shape`. InvalidArgument on a size mismatch, a negative
  // dim, or a duplicate name.
  absl::Status Add(const std::string& name, DType dtype,
                   std::vector<int64_t> shape, absl::Span<const float> values);
  // Adds a tensor whose little-endian bytes are already encoded.
  absl::Status AddEncoded(const std::string& name, DType dtype,
                          std::vector<int64_t> shape, std::string bytes);

  void SetMetadata(const std::string& key, const std::string& value) {
    metadata_[key] = value;
  }

  // Total bytes of tensor data (the index's "total_size").
  uint64_t data_bytes() const;
  size_t num_tensors() const { return tensors_.size(); }

  std::string Serialize() const;
  // Writes Serialize() to `path` (truncating), then checks the write.
  absl::Status WriteToFile(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::string bytes;
  };
  std::vector<Entry> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes `contents` to `path` (used for config.json and index files too).
absl::Status WriteStringToFile(const std::string& path,
                               absl::string_view contents);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_MODEL_SAFETENSORS_WRITER_H_
