#include "worker/transfer/kv_transfer_params.h"

#include <google/protobuf/util/json_util.h>

#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace pdworker {
namespace {

using Json = nlohmann::json;

constexpr char kHandleKey[] = "pdworker_kv_handle";
constexpr char kFirstTokenKey[] = "first_token";

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("kv_transfer_params_json: ", field, " ", what));
}

// JSON has no -inf: logprobs of impossible tokens travel as null.
Json Logprob(float value) {
  return std::isfinite(value) ? Json(value) : Json(nullptr);
}

absl::StatusOr<float> ReadLogprob(const Json& value, absl::string_view field) {
  if (value.is_null()) return -std::numeric_limits<float>::infinity();
  if (!value.is_number()) return Invalid(field, "must be a number or null");
  return value.get<float>();
}

absl::StatusOr<int32_t> ReadTokenId(const Json& value,
                                    absl::string_view field) {
  if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
      value.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
    return Invalid(field, "must be a token id (an integer >= 0)");
  }
  return value.get<int32_t>();
}

}  // namespace

std::string ToKvTransferParamsJson(const KvTransferParams& params) {
  std::string handle;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  const auto printed = google::protobuf::util::MessageToJsonString(
      params.handle, &handle, options);
  // A message always prints; a failure would be a protobuf bug.
  if (!printed.ok()) handle = "{}";
  Json first;
  first["token_id"] = params.first_token.token_id;
  first["logprob"] = Logprob(params.first_token.logprob);
  first["top_logprobs"] = Json::array();
  for (const TopLogprob& t : params.first_token.top_logprobs) {
    first["top_logprobs"].push_back(
        {{"token_id", t.token_id}, {"logprob", Logprob(t.logprob)}});
  }
  Json root;
  root[kHandleKey] = Json::parse(handle);
  root[kFirstTokenKey] = std::move(first);
  return root.dump();
}

absl::StatusOr<KvTransferParams> ParseKvTransferParamsJson(
    absl::string_view json) {
  Json root;
  try {
    root = Json::parse(json);
  } catch (const Json::exception& e) {  // syntax, or a number out of range
    return absl::InvalidArgumentError(
        absl::StrCat("kv_transfer_params_json: not valid JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return Invalid("", "must be a JSON object");
  }
  KvTransferParams params;
  bool has_handle = false, has_first = false;
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& key = it.key();
    if (key == "do_remote_prefill" || key == "do_remote_decode") {
      if (!it.value().is_boolean()) return Invalid(key, "must be a boolean");
      continue;
    }
    if (key == kHandleKey) {
      google::protobuf::util::JsonParseOptions options;
      options.ignore_unknown_fields = false;
      const auto parsed = google::protobuf::util::JsonStringToMessage(
          it.value().dump(), &params.handle, options);
      if (!parsed.ok()) {
        return Invalid(kHandleKey, absl::StrCat("is not a KV handle: ",
                                                std::string(parsed.message())));
      }
      if (params.handle.version() != kKvHandleVersion) {
        return Invalid(
            absl::StrCat(kHandleKey, ".version"),
            absl::StrCat("is ", params.handle.version(),
                         "; this worker reads version ", kKvHandleVersion));
      }
      has_handle = true;
      continue;
    }
    if (key == kFirstTokenKey) {
      const Json& first = it.value();
      if (!first.is_object()) return Invalid(key, "must be an object");
      for (auto f = first.begin(); f != first.end(); ++f) {
        const std::string field = absl::StrCat(key, ".", f.key());
        if (f.key() == "token_id") {
          absl::StatusOr<int32_t> id = ReadTokenId(f.value(), field);
          if (!id.ok()) return id.status();
          params.first_token.token_id = *id;
        } else if (f.key() == "logprob") {
          absl::StatusOr<float> lp = ReadLogprob(f.value(), field);
          if (!lp.ok()) return lp.status();
          params.first_token.logprob = *lp;
        } else if (f.key() == "top_logprobs") {
          if (!f.value().is_array()) return Invalid(field, "must be a list");
          for (size_t i = 0; i < f.value().size(); ++i) {
            const Json& entry = f.value()[i];
            const std::string at = absl::StrCat(field, "[", i, "]");
            if (!entry.is_object() || !entry.contains("token_id") ||
                !entry.contains("logprob") || entry.size() != 2) {
              return Invalid(at, "must be {\"token_id\": id, \"logprob\": x}");
            }
            absl::StatusOr<int32_t> id =
                ReadTokenId(entry["token_id"], at + ".token_id");
            if (!id.ok()) return id.status();
            absl::StatusOr<float> lp =
                ReadLogprob(entry["logprob"], at + ".logprob");
            if (!lp.ok()) return lp.status();
            params.first_token.top_logprobs.push_back({*id, *lp});
          }
        } else {
          return Invalid(field, "is not a field pdworker knows");
        }
      }
      if (params.first_token.token_id < 0) {
        return Invalid(absl::StrCat(key, ".token_id"), "is missing");
      }
      has_first = true;
      continue;
    }
    return Invalid(key, "is not a key pdworker knows (it reads " +
                            std::string(kHandleKey) + " and " + kFirstTokenKey +
                            ")");
  }
  if (!has_handle) return Invalid(kHandleKey, "is missing");
  if (!has_first) return Invalid(kFirstTokenKey, "is missing");
  return params;
}

}  // namespace pdworker
