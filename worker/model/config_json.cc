#include "worker/model/config_json.h"

#include <limits>

#include "absl/strings/str_cat.h"

namespace pdworker::config_json {

absl::Status FieldError(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("config.json: ", field, " ", what));
}

std::string Describe(const Json& value) {
  std::string text = value.dump();
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return absl::StrCat(value.type_name(), " ", text);
}

const Json* Find(const Json& object, const std::string& field) {
  const auto it = object.find(field);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::StatusOr<int64_t> AsInt(const Json& value, absl::string_view field) {
  if (!value.is_number_integer()) {
    return FieldError(
        field, absl::StrCat("must be an integer, got ", Describe(value)));
  }
  if (value.is_number_unsigned() &&
      value.get<uint64_t>() >
          static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return FieldError(field, absl::StrCat("is out of range: ", value.dump()));
  }
  return value.get<int64_t>();
}

absl::StatusOr<double> AsNumber(const Json& value, absl::string_view field) {
  if (!value.is_number()) {
    return FieldError(field,
                      absl::StrCat("must be a number, got ", Describe(value)));
  }
  return value.get<double>();
}

absl::StatusOr<int64_t> RequiredInt(const Json& object,
                                    const std::string& field,
                                    absl::string_view path) {
  const std::string name = absl::StrCat(path, field);
  const Json* value = Find(object, field);
  if (value == nullptr) return FieldError(name, "is missing");
  return AsInt(*value, name);
}

absl::StatusOr<double> RequiredNumber(const Json& object,
                                      const std::string& field,
                                      absl::string_view path) {
  const std::string name = absl::StrCat(path, field);
  const Json* value = Find(object, field);
  if (value == nullptr) return FieldError(name, "is missing");
  return AsNumber(*value, name);
}

absl::StatusOr<std::optional<int64_t>> OptionalPositiveInt(
    const Json& object, const std::string& field) {
  const Json* value = Find(object, field);
  if (value == nullptr) return std::nullopt;
  absl::StatusOr<int64_t> parsed = AsInt(*value, field);
  if (!parsed.ok()) return parsed.status();
  if (*parsed <= 0) {
    return FieldError(field, absl::StrCat("must be positive, got ", *parsed));
  }
  return *parsed;
}

absl::StatusOr<bool> OptionalBool(const Json& object, const std::string& field,
                                  bool default_value) {
  const Json* value = Find(object, field);
  if (value == nullptr) return default_value;
  if (!value->is_boolean()) {
    return FieldError(
        field, absl::StrCat("must be a boolean, got ", Describe(*value)));
  }
  return value->get<bool>();
}

}  // namespace pdworker::config_json
