#include "worker/model/safetensors_writer.h"

#include <algorithm>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "worker/model/float16.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the safetensors writer assumes a little-endian host");

namespace pdworker {
namespace {

using Json = nlohmann::json;

constexpr size_t kAlignment = 8;

size_t RoundUp(size_t value) {
  return (value + kAlignment - 1) / kAlignment * kAlignment;
}

}  // namespace

std::string SerializeSafetensors(absl::string_view header_json,
                                 absl::string_view data) {
  std::string out(8, '\0');
  uint64_t length = header_json.size();
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>(length & 0xff);
    length >>= 8;
  }
  out.append(header_json.data(), header_json.size());
  out.append(data.data(), data.size());
  return out;
}

std::string EncodeFromFloat32(DType dtype, absl::Span<const float> values) {
  std::string bytes(values.size() * DTypeSize(dtype), '\0');
  switch (dtype) {
    case DType::kFloat32:
      if (!values.empty()) {
        std::memcpy(bytes.data(), values.data(), bytes.size());
      }
      break;
    case DType::kBFloat16:
      for (size_t i = 0; i < values.size(); ++i) {
        const uint16_t bits = FloatToBFloat16Bits(values[i]);
        std::memcpy(bytes.data() + 2 * i, &bits, sizeof(bits));
      }
      break;
    case DType::kFloat16:
      for (size_t i = 0; i < values.size(); ++i) {
        const uint16_t bits = FloatToFloat16Bits(values[i]);
        std::memcpy(bytes.data() + 2 * i, &bits, sizeof(bits));
      }
      break;
  }
  return bytes;
}

absl::Status SafetensorsWriter::Add(const std::string& name, DType dtype,
                                    std::vector<int64_t> shape,
                                    absl::Span<const float> values) {
  int64_t count = 1;
  for (const int64_t dim : shape) count *= dim;
  if (count < 0 || static_cast<size_t>(count) != values.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor \"", name, "\": ", values.size(),
                     " values do not fill its shape (", count, " elements)"));
  }
  return AddEncoded(name, dtype, std::move(shape),
                    EncodeFromFloat32(dtype, values));
}

absl::Status SafetensorsWriter::AddEncoded(const std::string& name, DType dtype,
                                           std::vector<int64_t> shape,
                                           std::string bytes) {
  int64_t count = 1;
  for (const int64_t dim : shape) {
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", name, "\": negative dimension ", dim));
    }
    count *= dim;
  }
  if (static_cast<size_t>(count) * DTypeSize(dtype) != bytes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor \"", name, "\": ", bytes.size(),
                     " bytes do not match its shape (", count, " elements)"));
  }
  if (name == "__metadata__") {
    return absl::InvalidArgumentError("\"__metadata__\" is reserved");
  }
  for (const Entry& entry : tensors_) {
    if (entry.name == name) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", name, "\" added twice"));
    }
  }
  tensors_.push_back({name, dtype, std::move(shape), std::move(bytes)});
  return absl::OkStatus();
}

uint64_t SafetensorsWriter::data_bytes() const {
  uint64_t total = 0;
  for (const Entry& entry : tensors_) total += entry.bytes.size();
  return total;
}

std::string SafetensorsWriter::Serialize() const {
  // Like the reference writer: tensors back to back with no holes (readers
  // reject gaps), wider dtypes first so every tensor stays aligned to its
  // element size once the header is padded to a multiple of 8 bytes.
  std::vector<const Entry*> order;
  for (const Entry& entry : tensors_) order.push_back(&entry);
  std::stable_sort(order.begin(), order.end(),
                   [](const Entry* a, const Entry* b) {
                     return DTypeSize(a->dtype) > DTypeSize(b->dtype);
                   });
  Json header = Json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  std::string data;
  for (const Entry* entry : order) {
    const size_t begin = data.size();
    data += entry->bytes;
    header[entry->name] = {
        {"dtype", absl::StrCat(SafetensorsDTypeName(entry->dtype))},
        {"shape", entry->shape},
        {"data_offsets", {begin, data.size()}},
    };
  }
  std::string header_text = header.dump();
  header_text.resize(RoundUp(8 + header_text.size()) - 8, ' ');
  return SerializeSafetensors(header_text, data);
}

absl::Status SafetensorsWriter::WriteToFile(const std::string& path) const {
  return WriteStringToFile(path, Serialize());
}

absl::Status WriteStringToFile(const std::string& path,
                               absl::string_view contents) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot open ", path, " for writing"));
  }
  file.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  file.close();
  if (!file) return absl::DataLossError(absl::StrCat("error writing ", path));
  return absl::OkStatus();
}

}  // namespace pdworker
