#include "worker/model/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace pdworker {
namespace {

absl::Status ErrnoError(int error, absl::string_view what,
                        const std::string& path) {
  const std::string message =
      absl::StrCat(what, " ", path, ": ", std::strerror(error));
  switch (error) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    default:
      return absl::InternalError(message);
  }
}

// Closes a descriptor on every return path of Open.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  ~FdCloser() { ::close(fd_); }

 private:
  int fd_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MappedFile>> MappedFile::Open(
    const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "cannot open", path);
  FdCloser closer(fd);

  struct stat info {};
  if (::fstat(fd, &info) != 0) return ErrnoError(errno, "cannot stat", path);
  if (!S_ISREG(info.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not a regular file"));
  }
  const size_t size = static_cast<size_t>(info.st_size);
  if (size == 0) {
    return std::unique_ptr<MappedFile>(new MappedFile(path, nullptr, 0));
  }
  // The mapping stays valid after the descriptor is closed.
  void* data = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (data == MAP_FAILED) return ErrnoError(errno, "cannot mmap", path);
  return std::unique_ptr<MappedFile>(
      new MappedFile(path, static_cast<const uint8_t*>(data), size));
}

MappedFile::~MappedFile() {
  if (data_ == nullptr) return;
  if (::munmap(const_cast<uint8_t*>(data_), size_) != 0) {
    PLOG(ERROR) << "munmap of " << path_ << " failed";
  }
}

}  // namespace pdworker
