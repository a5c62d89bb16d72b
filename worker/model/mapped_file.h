// A read-only memory mapping of a whole file, owned RAII-style: the mapping
// lives exactly as long as the MappedFile and is unmapped by its destructor.
#ifndef PDWORKER_WORKER_MODEL_MAPPED_FILE_H_
#define PDWORKER_WORKER_MODEL_MAPPED_FILE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace pdworker {

class MappedFile {
 public:
  // Maps `path` read-only (MAP_PRIVATE). An empty file maps to an empty span
  // (mmap refuses length 0). Errors (NotFound, PermissionDenied, Internal)
  // carry the path and strerror.
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(
      const std::string& path);

  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();  // munmap; never throws, logs a failure

  absl::Span<const uint8_t> bytes() const {
    return absl::MakeConstSpan(data_, size_);
  }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}

  std::string path_;
  const uint8_t* data_;  // nullptr when size_ == 0
  size_t size_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_MODEL_MAPPED_FILE_H_
