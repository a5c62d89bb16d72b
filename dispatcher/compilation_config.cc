#include "dispatcher/compilation_config.h"

#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace pdworker {
namespace {

using Json = nlohmann::json;

constexpr absl::string_view kPrefix = "compilation_config";
constexpr absl::string_view kModeField = "cudagraph_mode";
constexpr absl::string_view kSizesField = "cudagraph_capture_sizes";
constexpr absl::string_view kMaxField = "max_cudagraph_capture_size";

// Reads a JSON integer that fits in an int; `where` names it in errors.
absl::StatusOr<int> ReadInt(const Json& value, absl::string_view where) {
  if (!value.is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kPrefix, ".", where, " must be an integer, got ",
                     value.type_name(), " ", value.dump()));
  }
  const bool in_range =
      value.is_number_unsigned()
          ? value.get<uint64_t>() <=
                static_cast<uint64_t>(std::numeric_limits<int>::max())
          : (value.get<int64_t>() >= std::numeric_limits<int>::min() &&
             value.get<int64_t>() <= std::numeric_limits<int>::max());
  if (!in_range) {
    return absl::InvalidArgumentError(absl::StrCat(
        kPrefix, ".", where, " = ", value.dump(), " is out of range"));
  }
  return value.get<int>();
}

}  // namespace

absl::StatusOr<CompilationConfig> ParseCompilationConfig(
    absl::string_view json_text) {
  CompilationConfig config;
  if (absl::StripAsciiWhitespace(json_text).empty()) return config;

  // nlohmann reports the position of a syntax error only through its
  // exception; it is caught right here so no exception crosses this API.
  Json root;
  try {
    root = Json::parse(json_text.begin(), json_text.end());
  } catch (const Json::exception& e) {  // syntax, or a number out of range
    return absl::InvalidArgumentError(
        absl::StrCat(kPrefix, " is not valid JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        kPrefix, " must be a JSON object, got ", root.type_name()));
  }

  for (const auto& [name, value] : root.items()) {
    if (value.is_null()) continue;  // vLLM's "None": keep the default.
    if (name == kModeField) {
      if (!value.is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(kPrefix, ".", kModeField, " must be a string, got ",
                         value.type_name()));
      }
      absl::StatusOr<CudaGraphMode> mode =
          ParseCudaGraphMode(value.get<std::string>());
      if (!mode.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            kPrefix, ".", kModeField, ": ", mode.status().message()));
      }
      config.cudagraph_mode = *mode;
    } else if (name == kSizesField) {
      if (!value.is_array()) {
        return absl::InvalidArgumentError(absl::StrCat(
            kPrefix, ".", kSizesField, " must be an array of integers, got ",
            value.type_name()));
      }
      std::vector<int> sizes;
      for (size_t i = 0; i < value.size(); ++i) {
        absl::StatusOr<int> size =
            ReadInt(value[i], absl::StrCat(kSizesField, "[", i, "]"));
        if (!size.ok()) return size.status();
        sizes.push_back(*size);
      }
      config.cudagraph_capture_sizes = std::move(sizes);
    } else if (name == kMaxField) {
      absl::StatusOr<int> max = ReadInt(value, kMaxField);
      if (!max.ok()) return max.status();
      config.max_cudagraph_capture_size = *max;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          kPrefix, ": unknown field '", name, "'; known fields: ",
          absl::StrJoin({kModeField, kSizesField, kMaxField}, ", ")));
    }
  }
  return config;
}

std::string CompilationConfig::ToJson() const {
  Json out = Json::object();
  if (cudagraph_mode.has_value()) {
    out[std::string(kModeField)] = cudagraph_mode->ToString();
  }
  if (cudagraph_capture_sizes.has_value()) {
    out[std::string(kSizesField)] = *cudagraph_capture_sizes;
  }
  if (max_cudagraph_capture_size.has_value()) {
    out[std::string(kMaxField)] = *max_cudagraph_capture_size;
  }
  return out.dump();
}

}  // namespace pdworker
