#include "worker/model/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "worker/model/float16.h"

// Tensor bytes are little-endian; we reinterpret them with memcpy.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the safetensors reader assumes a little-endian host");

namespace pdworker {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kHeaderLengthBytes = 8;

// Reads a JSON integer that must be >= 0 (shape dims, offsets).
bool ReadNonNegative(const Json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
    return true;
  }
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(value.get<int64_t>());
    return true;
  }
  return false;
}

struct ByteRange {
  uint64_t begin;
  uint64_t end;
  const std::string* name;
};

}  // namespace

int64_t TensorInfo::NumElements() const {
  int64_t count = 1;
  for (const int64_t dim : shape) count *= dim;
  return count;
}

void ConvertToFloat32(DType dtype, const uint8_t* bytes, int64_t count,
                      float* out) {
  if (count <= 0) return;
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(out, bytes, static_cast<size_t>(count) * sizeof(float));
      return;
    case DType::kBFloat16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, bytes + 2 * i, sizeof(bits));
        out[i] = BFloat16BitsToFloat(bits);
      }
      return;
    case DType::kFloat16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, bytes + 2 * i, sizeof(bits));
        out[i] = Float16BitsToFloat(bits);
      }
      return;
  }
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(
    const std::string& path) {
  auto mapping = MappedFile::Open(path);
  if (!mapping.ok()) return mapping.status();
  std::unique_ptr<SafetensorsFile> file(
      new SafetensorsFile(*std::move(mapping)));
  if (absl::Status status = file->Parse(); !status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat(path, ": ", status.message()));
  }
  return file;
}

absl::Status SafetensorsFile::Parse() {
  const absl::Span<const uint8_t> file = mapping_->bytes();
  if (file.size() < kHeaderLengthBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("file is ", file.size(),
                     " bytes, shorter than the 8-byte header length"));
  }
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | file[i];
  if (header_length > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("header length ", header_length, " exceeds the limit of ",
                     kMaxSafetensorsHeaderBytes, " bytes"));
  }
  const uint64_t available = file.size() - kHeaderLengthBytes;
  if (header_length > available) {
    return absl::InvalidArgumentError(
        absl::StrCat("header length ", header_length, " runs past the end of ",
                     "the file (", available, " bytes after the length)"));
  }
  const char* header_begin =
      reinterpret_cast<const char*>(file.data()) + kHeaderLengthBytes;
  const absl::Span<const uint8_t> data =
      file.subspan(kHeaderLengthBytes + header_length);

  // nlohmann keeps the last of duplicate keys silently; the parse callback
  // sees every key, so duplicates of a tensor name are caught here.
  std::set<std::string> seen_names;
  std::string duplicate;
  const auto on_event = [&](int depth, Json::parse_event_t event,
                            Json& parsed) {
    if (event == Json::parse_event_t::key && depth == 1 && parsed.is_string() &&
        !seen_names.insert(parsed.get<std::string>()).second &&
        duplicate.empty()) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  Json header;
  try {
    header = Json::parse(header_begin, header_begin + header_length, on_event);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("header is not valid JSON: ", e.what()));
  }
  if (!duplicate.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor \"", duplicate, "\" appears more than once"));
  }
  if (!header.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("header must be a JSON object, got ", header.type_name()));
  }

  std::vector<ByteRange> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) {
        return absl::InvalidArgumentError("__metadata__ must be an object");
      }
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat("__metadata__.", key, " must be a string, got ",
                           value.type_name()));
        }
        metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string where = absl::StrCat("tensor \"", name, "\": ");
    if (!entry.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "entry must be an object"));
    }
    TensorInfo info;

    const auto dtype_it = entry.find("dtype");
    if (dtype_it == entry.end() || !dtype_it->is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "dtype missing or not a string"));
    }
    auto dtype = ParseSafetensorsDType(dtype_it->get<std::string>());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, dtype.status().message()));
    }
    info.dtype = *dtype;

    const auto shape_it = entry.find("shape");
    if (shape_it == entry.end() || !shape_it->is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "shape missing or not a list"));
    }
    // numel * dtype size, checked for overflow at every step.
    uint64_t byte_count = DTypeSize(info.dtype);
    for (const Json& dim_json : *shape_it) {
      uint64_t dim = 0;
      if (!ReadNonNegative(dim_json, &dim) ||
          dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, "shape ", shape_it->dump(),
                         " must hold non-negative integers"));
      }
      if (__builtin_mul_overflow(byte_count, dim, &byte_count)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, "shape ", shape_it->dump(), " is too large"));
      }
      info.shape.push_back(static_cast<int64_t>(dim));
    }

    const auto offsets_it = entry.find("data_offsets");
    uint64_t begin = 0;
    uint64_t end = 0;
    if (offsets_it == entry.end() || !offsets_it->is_array() ||
        offsets_it->size() != 2 || !ReadNonNegative((*offsets_it)[0], &begin) ||
        !ReadNonNegative((*offsets_it)[1], &end)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where,
                       "data_offsets must be [begin, end] with non-negative "
                       "integers"));
    }
    if (begin > end || end > data.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "data_offsets [", begin, ", ", end,
          "] are outside the data section of ", data.size(), " bytes"));
    }
    if (end - begin != byte_count) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "data_offsets [", begin, ", ", end, "] span ", end - begin,
          " bytes but shape ", shape_it->dump(), " of ",
          SafetensorsDTypeName(info.dtype), " needs ", byte_count));
    }
    info.bytes = data.subspan(begin, end - begin);
    const auto [it, inserted] = tensors_.emplace(name, std::move(info));
    (void)inserted;  // duplicates were rejected during parsing
    ranges.push_back({begin, end, &it->first});
  }

  // The format requires the data section to be covered exactly: tensors
  // back to back from offset 0 to the end. Sharing bytes means a corrupt (or
  // hostile) header; a gap would hide unindexed bytes (polyglot files).
  // Empty tensors occupy no bytes and are left out of the walk.
  ranges.erase(
      std::remove_if(ranges.begin(), ranges.end(),
                     [](const ByteRange& r) { return r.begin == r.end; }),
      ranges.end());
  std::sort(ranges.begin(), ranges.end(),
            [](const ByteRange& a, const ByteRange& b) {
              return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
            });
  uint64_t covered = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (ranges[i].begin < covered) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensors \"", *ranges[i - 1].name, "\" [", ranges[i - 1].begin, ", ",
          ranges[i - 1].end, ") and \"", *ranges[i].name, "\" [",
          ranges[i].begin, ", ", ranges[i].end, ") overlap"));
    }
    if (ranges[i].begin > covered) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data bytes [", covered, ", ", ranges[i].begin,
          ") belong to no tensor (before \"", *ranges[i].name, "\")"));
    }
    covered = ranges[i].end;
  }
  if (covered != data.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("data bytes [", covered, ", ", data.size(),
                     ") at the end of the file belong to no tensor"));
  }
  return absl::OkStatus();
}

const TensorInfo* SafetensorsFile::Find(const std::string& name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::Status SafetensorsFile::ReadAsFloat32(const std::string& name,
                                            std::vector<float>* out) const {
  const TensorInfo* info = Find(name);
  if (info == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(path(), ": no tensor named \"", name, "\""));
  }
  const int64_t count = info->NumElements();
  out->resize(static_cast<size_t>(count));
  ConvertToFloat32(info->dtype, info->bytes.data(), count, out->data());
  return absl::OkStatus();
}

}  // namespace pdworker
