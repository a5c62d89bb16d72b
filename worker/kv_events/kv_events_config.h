// vLLM's `--kv-events-config` JSON (KVEventsConfig), so a deployment that
// configures vLLM's KV events (llm-d's charts do) configures pdworker's the
// same way:
//   {"enable_kv_cache_events": true, "publisher": "zmq",
//    "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
//    "topic": "kv@10.0.0.7@llama", "buffer_steps": 10000, "hwm": 100000,
//    "max_queue_size": 100000}
// Keys left out take vLLM's defaults (endpoint tcp://*:5557, no replay
// socket, empty topic, and the numbers above); a key vLLM does not define
// is refused, naming it.
#ifndef PDWORKER_WORKER_KV_EVENTS_KV_EVENTS_CONFIG_H_
#define PDWORKER_WORKER_KV_EVENTS_KV_EVENTS_CONFIG_H_

#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/kv_events/kv_event_publisher.h"

namespace pdworker {

// The publisher's options, or none when the config turns events off
// (enable_kv_cache_events false, or publisher "null"). INVALID_ARGUMENT
// naming --kv-events-config and the key otherwise. The payload's `format`
// is not vLLM's to configure and is copied into the options.
absl::StatusOr<std::optional<KvEventPublisherOptions>> ParseKvEventsConfig(
    absl::string_view json, const VllmEventBatchFormat& format = {});

}  // namespace pdworker

#endif  // PDWORKER_WORKER_KV_EVENTS_KV_EVENTS_CONFIG_H_
