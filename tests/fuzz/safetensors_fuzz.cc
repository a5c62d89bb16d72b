// Fuzz target: the safetensors reader (worker/model/safetensors.h) on
// arbitrary file contents. Whatever the bytes, Open returns an error, or a
// file whose tensors tile its data section exactly (the format forbids
// holes and overlaps), each of the size its dtype and shape say, and
// readable to the last byte.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "glog/logging.h"
#include "worker/model/safetensors.h"

namespace pdworker {
namespace {

// The input as a file: an in-memory one (memfd), reached by path as the
// reader wants.
std::string WriteInput(const uint8_t* data, size_t size) {
  static const int fd = memfd_create("safetensors_fuzz", 0);
  CHECK_GE(fd, 0);
  CHECK_EQ(ftruncate(fd, 0), 0);
  size_t written = 0;
  while (written < size) {
    const ssize_t n =
        pwrite(fd, data + written, size - written, static_cast<off_t>(written));
    CHECK_GT(n, 0);
    written += static_cast<size_t>(n);
  }
  return "/proc/self/fd/" + std::to_string(fd);
}

}  // namespace
}  // namespace pdworker

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pdworker;
  auto file = SafetensorsFile::Open(WriteInput(data, size));
  if (!file.ok()) {
    CHECK(!file.status().message().empty());
    return 0;
  }
  // Accepted: the first 8 bytes are the header length N, and the tensors
  // tile the remaining size - 8 - N bytes.
  CHECK_GE(size, 8u);
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, data, sizeof(header_bytes));
  CHECK_LE(header_bytes, size - 8);
  const uint64_t data_bytes = size - 8 - header_bytes;

  std::vector<std::pair<const uint8_t*, size_t>> ranges;
  uint64_t total = 0;
  std::vector<float> values;
  for (const auto& [name, info] : (*file)->tensors()) {
    for (const int64_t dim : info.shape) CHECK_GE(dim, 0) << name;
    CHECK_EQ(info.bytes.size(),
             static_cast<size_t>(info.NumElements()) * DTypeSize(info.dtype))
        << name;
    CHECK(file->get()->Find(name) == &info);
    // Every byte, through the reader's own conversion.
    const absl::Status read = (*file)->ReadAsFloat32(name, &values);
    CHECK(read.ok()) << name << ": " << read;
    CHECK_EQ(values.size(), static_cast<size_t>(info.NumElements()));
    if (!info.bytes.empty())
      ranges.push_back({info.bytes.data(), info.bytes.size()});
    total += info.bytes.size();
  }
  CHECK_EQ(total, data_bytes);
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    CHECK(ranges[i - 1].first + ranges[i - 1].second == ranges[i].first)
        << "tensors overlap or leave a hole";
  }
  return 0;
}
