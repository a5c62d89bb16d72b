// Typed reads of config.json fields for ParseModelConfig and the family files
// (worker/model/families/): every error is INVALID_ARGUMENT and names the
// field, e.g. "config.json: num_key_value_heads must be an integer, got
// string \"2\"".
#ifndef PDWORKER_WORKER_MODEL_CONFIG_JSON_H_
#define PDWORKER_WORKER_MODEL_CONFIG_JSON_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace pdworker::config_json {

using Json = nlohmann::json;

// "config.json: <field> <what>".
absl::Status FieldError(absl::string_view field, absl::string_view what);

// Short rendering of a JSON value for error messages ("string \"2\"").
std::string Describe(const Json& value);

// `object[field]`, or nullptr when absent or null (HF writes null for
// "unset").
const Json* Find(const Json& object, const std::string& field);

absl::StatusOr<int64_t> AsInt(const Json& value, absl::string_view field);
absl::StatusOr<double> AsNumber(const Json& value, absl::string_view field);

// Absent or null is an error naming `path` + `field`.
absl::StatusOr<int64_t> RequiredInt(const Json& object,
                                    const std::string& field,
                                    absl::string_view path = "");
absl::StatusOr<double> RequiredNumber(const Json& object,
                                      const std::string& field,
                                      absl::string_view path = "");

// Absent or null gives nullopt; otherwise a positive integer.
absl::StatusOr<std::optional<int64_t>> OptionalPositiveInt(
    const Json& object, const std::string& field);

// Absent or null gives `default_value`.
absl::StatusOr<bool> OptionalBool(const Json& object, const std::string& field,
                                  bool default_value);

}  // namespace pdworker::config_json

#endif  // PDWORKER_WORKER_MODEL_CONFIG_JSON_H_
