#include "worker/kv_events/kv_events_config.h"

#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace pdworker {
namespace {

absl::Status Bad(absl::string_view key, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("--kv-events-config: \"", key, "\" ", why));
}

absl::Status ReadInt(const nlohmann::json& value, absl::string_view key,
                     int* out) {
  if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
      value.get<int64_t>() > std::numeric_limits<int>::max()) {
    return Bad(key, "must be a non-negative integer");
  }
  *out = value.get<int>();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::optional<KvEventPublisherOptions>> ParseKvEventsConfig(
    absl::string_view json, const VllmEventBatchFormat& format) {
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(json.begin(), json.end());
  } catch (
      const nlohmann::json::exception& e) {  // syntax, or a number out of range
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-events-config is not valid JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        "--kv-events-config must be a JSON object");
  }
  KvEventPublisherOptions options;
  options.endpoint = "tcp://*:5557";  // vLLM's default
  options.format = format;
  bool enabled = false;
  std::string publisher;  // vLLM: "zmq" when enabled and unset
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& key = it.key();
    const nlohmann::json& value = it.value();
    if (key == "enable_kv_cache_events") {
      if (!value.is_boolean()) return Bad(key, "must be true or false");
      enabled = value.get<bool>();
    } else if (key == "publisher") {
      if (!value.is_null() &&
          (!value.is_string() || (value != "zmq" && value != "null"))) {
        return Bad(key, "must be \"zmq\" or \"null\"");
      }
      if (value.is_string()) publisher = value.get<std::string>();
    } else if (key == "endpoint" || key == "topic") {
      if (!value.is_string()) return Bad(key, "must be a string");
      (key == "endpoint" ? options.endpoint : options.topic) =
          value.get<std::string>();
    } else if (key == "replay_endpoint") {
      if (!value.is_null() && !value.is_string()) {
        return Bad(key, "must be a string or null");
      }
      options.replay_endpoint =
          value.is_string() ? value.get<std::string>() : "";
    } else if (key == "buffer_steps") {
      if (absl::Status s = ReadInt(value, key, &options.buffer_steps);
          !s.ok()) {
        return s;
      }
    } else if (key == "hwm") {
      if (absl::Status s = ReadInt(value, key, &options.hwm); !s.ok()) {
        return s;
      }
    } else if (key == "max_queue_size") {
      if (absl::Status s = ReadInt(value, key, &options.max_queue_size);
          !s.ok()) {
        return s;
      }
    } else {
      return Bad(key,
                 "is not a vLLM KVEventsConfig key (enable_kv_cache_events, "
                 "publisher, endpoint, replay_endpoint, buffer_steps, hwm, "
                 "max_queue_size, topic)");
    }
  }
  if (!enabled || publisher == "null") return std::nullopt;
  return options;
}

}  // namespace pdworker
