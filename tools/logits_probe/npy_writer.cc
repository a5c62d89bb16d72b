#include "tools/logits_probe/npy_writer.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pdworker {

absl::Status WriteNpyFloat32(const std::string& path,
                             const std::vector<int64_t>& shape,
                             absl::Span<const float> values) {
  int64_t count = 1;
  for (const int64_t dim : shape) {
    if (dim < 0) return absl::InvalidArgumentError("negative dimension");
    count *= dim;
  }
  if (count != static_cast<int64_t>(values.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": shape holds ", count, " values, got ", values.size()));
  }
  // A 1-tuple needs its trailing comma in Python syntax.
  const std::string dims = absl::StrJoin(shape, ", ");
  std::string header =
      absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': (", dims,
                   shape.size() == 1 ? "," : "", "), }");
  // Magic (6) + version (2) + header length (2) + header, padded with spaces
  // and ended by '\n' to a multiple of 64 bytes so the data is aligned.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream file(path, std::ios::binary);
  const char magic[8] = {'\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0};
  file.write(magic, sizeof(magic));
  const uint16_t length = static_cast<uint16_t>(header.size());
  const char length_bytes[2] = {static_cast<char>(length & 0xff),
                                static_cast<char>(length >> 8)};
  file.write(length_bytes, 2);
  file.write(header.data(), static_cast<std::streamsize>(header.size()));
  file.write(reinterpret_cast<const char*>(values.data()),
             static_cast<std::streamsize>(values.size() * sizeof(float)));
  if (!file) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace pdworker
